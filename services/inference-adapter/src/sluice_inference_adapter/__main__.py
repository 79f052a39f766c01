"""`python -m sluice_inference_adapter`: the scheduler in front of Triton, served over gRPC."""

from __future__ import annotations

import asyncio
import time

import structlog
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from sluice_common.bootstrap import run_service
from sluice_common.server import create_server, serve_until_signal
from sluice_inference_adapter.config import ENV_PREFIX, AdapterConfig
from sluice_inference_adapter.scheduler import Scheduler, SchedulerLimits
from sluice_inference_adapter.servicer import InferenceServicer
from sluice_inference_adapter.triton_backend import TritonStepBackend

log = structlog.stdlib.get_logger("sluice.adapter")

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name


async def wait_until_ready(backend: TritonStepBackend, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await backend.is_ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"Triton at {backend.url} did not report {backend.model} ready within {timeout_s:.0f}s")
        await asyncio.sleep(0.5)


async def serve(config: AdapterConfig) -> None:
    backend = TritonStepBackend(config.triton_url, config.triton_step_model, config.step_timeout_s)
    scheduler = Scheduler(backend, SchedulerLimits(config.max_batch_size, config.max_waiting))
    model = types_pb2.ModelInfo(
        name=config.model_name,
        kind=types_pb2.MODEL_KIND_GENERATION,
        context_length=config.context_length,
        max_output_tokens=config.max_output_tokens,
    )
    servicer = InferenceServicer(scheduler, backend, model)

    def register(server):  # type: ignore[no-untyped-def]
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    # Health answers NOT_SERVING until Triton has the model ready.
    running = await create_server(config.host, config.port, config.metrics_port, register, serving=False)
    await wait_until_ready(backend, config.backend_wait_s)
    scheduler.start()
    await running.set_serving(True)
    log.info("ready", triton=config.triton_url, model=config.model_name)

    async def on_stop() -> None:
        await scheduler.stop()
        await backend.close()

    await serve_until_signal(running, config.shutdown_grace_s, on_stop)


def main() -> None:
    run_service("inference-adapter", AdapterConfig, ENV_PREFIX, serve)


if __name__ == "__main__":
    main()
