"""Starts the real Triton server bundled in nvidia-pytriton and binds the step model to it."""

from __future__ import annotations

import asyncio
import os
import sys
import sysconfig
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from sluice_triton_local.config import ENV_PREFIX, TritonLocalConfig
from sluice_triton_local.shared_engine import SharedEngine
from sluice_triton_local.step_protocol import INPUTS, OPTIONAL_INPUTS, OUTPUTS, start_round

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
    """PyTriton's decoupled inference callable: one round of engine steps per request, one
    response per step as it is made. Async, so that a release request reaches the engine while
    another request's round runs (step_protocol)."""

    def __init__(self, engine: SharedEngine) -> None:
        self._engine = engine

    async def __call__(self, requests: list[Any]) -> AsyncIterator[list[dict[str, np.ndarray]]]:
        # Without dynamic batching Triton hands a decoupled model one request per call.
        (request,) = requests
        loop = asyncio.get_running_loop()
        # A response and whether it is the last; None: the round failed before its last.
        responses: asyncio.Queue[tuple[dict[str, np.ndarray], bool] | None] = asyncio.Queue()
        done = start_round(self._engine, request.data, lambda response, last: loop.call_soon_threadsafe(responses.put_nowait, (response, last)))
        done.add_done_callback(lambda f: f.exception() is not None and loop.call_soon_threadsafe(responses.put_nowait, None))
        while (item := await responses.get()) is not None:
            response, last = item
            yield [response]
            if last:
                return
        await asyncio.wrap_future(done)  # raises the round's failure: the request fails with it


def exit_when_tritonserver_exits(triton: Any, stopping: threading.Event, triton_log: str) -> None:
    """Ends this process (exit status 1) when tritonserver exits while it is not stopping: a port
    taken between its probe and its bind, a crash. PyTriton alone would wait a minute on its
    readiness check for a server that is gone, then keep this process up serving nothing; a process
    that exits is restarted by whoever runs it (the launcher on other ports, an orchestrator).
    Call it before tritonserver starts (`Triton.run()`, as __main__ has PyTriton keep a local model store)."""

    def watch() -> None:
        while not stopping.wait(0.25):
            # Polled through PyTriton's internals (its version is locked): it has no public handle on
            # its server process, and its exit callbacks skip the one registered after its own (its
            # own unregisters itself while the list is being iterated). The process is asked of the
            # OS: sh's is_alive() answers True while another thread holds its wait lock, as PyTriton's
            # exit callback does while it waits for the readiness check to give up.
            server = getattr(triton, "_triton_server", None)
            command = server._tritonserver_running_cmd if server is not None else None
            if command is None or not _exited(command.pid) or stopping.is_set():
                continue
            log.error(
                "tritonserver_exited",
                hint=f"Triton's own log says why: {triton_log or 'stderr'} ({ENV_PREFIX}TRITON_LOG_FILE); this process exits so that it is restarted",
            )
            # PyTriton's proxies and workspace, where it can: its stop waits on a lock its start
            # holds while it waits for the server, so not for long.
            cleanup = threading.Thread(target=triton.stop, name="pytriton-stop", daemon=True)
            cleanup.start()
            cleanup.join(timeout=5)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    threading.Thread(target=watch, name="tritonserver-watch", daemon=True).start()


def _exited(pid: int) -> bool:
    """Whether a child process has ended: gone, or a zombie not yet reaped (Linux's /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


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
        inputs=[Tensor(name=n, dtype=t, shape=(-1,)) for n, t in INPUTS]
        + [Tensor(name=n, dtype=t, shape=(-1,), optional=True) for n, t in OPTIONAL_INPUTS],
        outputs=[Tensor(name=n, dtype=t, shape=(-1,)) for n, t in OUTPUTS],
        # The adapter does the batching: every request already is a whole batch of rows.
        config=ModelConfig(batching=False, max_batch_size=0, decoupled=True),
        strict=True,
    )
