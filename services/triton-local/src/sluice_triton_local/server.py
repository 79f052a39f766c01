"""Starts the real Triton server bundled in nvidia-pytriton and binds the step model to it."""

from __future__ import annotations

import os
import sysconfig
from typing import Any

import numpy as np
import structlog

from sluice_triton_local.config import TritonLocalConfig
from sluice_triton_local.shared_engine import SharedEngine
from sluice_triton_local.step_protocol import INPUTS, OUTPUTS, run_step

log = structlog.stdlib.get_logger("sluice.triton_local")


def fix_python_backend_library_path() -> None:
    """Triton's Python backend stub links a system libpython3.11; point it at this interpreter's.

    Without this, models fail to load with
    "'_thread.RLock' object has no attribute '_recursion_count'".
    """
    libdir = sysconfig.get_config_var("LIBDIR")
    current = os.environ.get("LD_LIBRARY_PATH", "")
    if libdir and libdir not in current.split(":"):
        os.environ["LD_LIBRARY_PATH"] = f"{libdir}:{current}" if current else libdir


class StepModel:
    """The inference callable PyTriton calls; one engine step per Triton request."""

    def __init__(self, engine: SharedEngine) -> None:
        self._engine = engine

    def __call__(self, requests: list[Any]) -> list[dict[str, np.ndarray]]:
        return [run_step(self._engine, request.data) for request in requests]


def triton_config(config: TritonLocalConfig) -> Any:
    from pytriton.triton import TritonConfig

    return TritonConfig(
        grpc_address=config.host,
        http_address=config.host,
        metrics_address=config.host,
        grpc_port=config.grpc_port,
        http_port=config.http_port,
        metrics_port=config.triton_metrics_port,
        log_verbose=0,
        log_file=config.triton_log_file or None,
        exit_timeout_secs=5,
    )


def bind_step_model(triton: Any, name: str, engine: SharedEngine) -> None:
    from pytriton.model_config import ModelConfig, Tensor

    triton.bind(
        model_name=name,
        infer_func=StepModel(engine),
        inputs=[Tensor(name=n, dtype=t, shape=(-1,)) for n, t in INPUTS],
        outputs=[Tensor(name=n, dtype=t, shape=(-1,)) for n, t in OUTPUTS],
        # The adapter does the batching: every request already is a whole batch of rows.
        config=ModelConfig(batching=False, max_batch_size=0),
        strict=True,
    )
