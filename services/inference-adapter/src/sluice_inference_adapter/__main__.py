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
from sluice_inference_adapter.replica_pool import ReplicaPool
from sluice_inference_adapter.scheduler import SchedulerLimits
from sluice_inference_adapter.servicer import InferenceServicer
from sluice_inference_adapter.triton_backend import TritonStepBackend

log = structlog.stdlib.get_logger("sluice.adapter")

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name


async def wait_for_a_ready_replica(backends: list[TritonStepBackend], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(await asyncio.gather(*(b.is_ready() for b in backends))):
        if time.monotonic() > deadline:
            urls = ", ".join(b.url for b in backends)
            raise SystemExit(f"no Triton replica ({urls}) reported {backends[0].model} ready within {timeout_s:.0f}s")
        await asyncio.sleep(0.5)


def scheduler_limits(config: AdapterConfig) -> SchedulerLimits:
    return SchedulerLimits(
        max_batch_size=config.max_batch_size,
        max_batch_tokens=config.max_batch_tokens,
        max_waiting=config.max_waiting,
        min_prefill_rows=config.min_prefill_rows,
        max_waiting_steps=config.max_waiting_steps,
    )


async def serve(config: AdapterConfig) -> None:
    backends = [TritonStepBackend(url, config.triton_step_model, config.step_timeout_s) for url in config.triton_urls]
    pool = ReplicaPool(backends, scheduler_limits(config), config.replica_failure_threshold, config.probe_interval_s)
    model = types_pb2.ModelInfo(
        name=config.model_name,
        kind=types_pb2.MODEL_KIND_GENERATION,
        context_length=config.context_length,
        max_output_tokens=config.max_output_tokens,
    )
    servicer = InferenceServicer(pool, model)

    def register(server):  # type: ignore[no-untyped-def]
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    # Health answers NOT_SERVING until a Triton replica has the model ready.
    running = await create_server(config.host, config.port, config.metrics_port, register, serving=False)
    await wait_for_a_ready_replica(backends, config.backend_wait_s)
    await pool.probe_once()
    pool.start()
    await running.set_serving(True)
    log.info("ready", replicas=list(config.triton_urls), model=config.model_name)

    async def on_stop() -> None:
        await pool.stop()
        await asyncio.gather(*(b.close() for b in backends))

    await serve_until_signal(running, config.shutdown_grace_s, on_stop)


def main() -> None:
    run_service("inference-adapter", AdapterConfig, ENV_PREFIX, serve)


if __name__ == "__main__":
    main()
