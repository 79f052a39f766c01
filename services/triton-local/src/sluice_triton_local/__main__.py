"""`python -m sluice_triton_local`: load SmolLM2, warm it up, serve it from a real Triton."""

from __future__ import annotations

import signal
import sys
import threading
import time

import structlog
from prometheus_client import start_http_server

from sluice_common.config import ConfigError, load_config
from sluice_common.log import configure_logging
from sluice_triton_local.config import ENV_PREFIX, TritonLocalConfig
from sluice_triton_local.model_files import smollm2_gguf
from sluice_triton_local.server import (
    bind_step_model,
    fix_python_backend_library_path,
    triton_config,
    warm_up,
)

log = structlog.stdlib.get_logger("sluice.triton_local")


def main() -> None:
    try:
        config = load_config(TritonLocalConfig, ENV_PREFIX)
    except ConfigError as exc:
        print(f"triton-local: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging("triton-local", config.log_level, config.log_json)
    fix_python_backend_library_path()
    # Imported late: the engine pulls numpy, whose BLAS reads its thread settings at import.
    from pytriton.triton import Triton

    from sluice_triton_local.engine.step_engine import StepEngine

    started = time.perf_counter()
    gguf_path = config.gguf_path or str(smollm2_gguf())
    engine = StepEngine(gguf_path, max_slots=config.max_slots, max_context=config.max_context)
    answer = warm_up(engine)
    log.info("model_loaded", gguf=gguf_path, seconds=round(time.perf_counter() - started, 1), warmup_answer=answer)
    start_http_server(config.metrics_port, addr=config.host)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with Triton(config=triton_config(config)) as triton:
        bind_step_model(triton, config.step_model_name, engine)
        triton.run()
        log.info(
            "ready",
            grpc=f"{config.host}:{config.grpc_port}",
            model=config.step_model_name,
            metrics_port=config.metrics_port,
            seconds=round(time.perf_counter() - started, 1),
        )
        stop.wait()
        log.info("shutting_down")
    log.info("stopped")


if __name__ == "__main__":
    main()
