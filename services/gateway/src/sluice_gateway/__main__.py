"""`python -m sluice_gateway`: the public gRPC API, and the OpenAI-compatible HTTP API beside it."""

from __future__ import annotations

import asyncio

import structlog
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from sluice_common.bootstrap import run_service
from sluice_common.loop_lag import monitor_loop_lag
from sluice_common.server import PUBLISHER_FLUSH_S, create_server, serve_until_signal
from sluice_gateway.config import ANY_HTTP_PORT, ENV_PREFIX, GatewayConfig
from sluice_gateway.path.core import GatewayCore
from sluice_gateway.jobs.store import JobStore
from sluice_gateway.jobs.api import JobsApi, job_request_publisher
from sluice_gateway.openai_front.batch_http import BatchFront
from sluice_gateway.openai_front.http import OpenAIFront, RunningHttp, start_http
from sluice_gateway.openai_front.store import OpenAIStore
from sluice_gateway.grpc_front.servicer import GatewayServicer

log = structlog.stdlib.get_logger("sluice.gateway")

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


async def serve(config: GatewayConfig) -> None:
    settings = config.shared
    core = GatewayCore.build(settings, config.port)
    job_store = JobStore.create(settings.jobs_postgres_dsn, settings.jobs_sqlite_path)
    await job_store.open()
    job_publisher = job_request_publisher(settings, config.port)
    jobs = JobsApi(
        job_store,
        core.tenants,
        job_publisher.submit_job if job_publisher.enabled else None,
        settings.jobs_max_rows,
        settings.jobs_completion_window_s,
        max_message_bytes=settings.jobs_max_message_bytes,
    )
    path = core.path
    servicer = GatewayServicer(core.tenants, path, jobs=jobs)

    def register(server):  # type: ignore[no-untyped-def]
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    # One TLS for both fronts: the HTTP port takes the gRPC port's certificate and client CA.
    tls = config.server_tls(ENV_PREFIX)
    running = await create_server(config.host, config.port, config.metrics_port, register, serving=False, tls=tls)
    running.supervisor.start("event-loop-lag", monitor_loop_lag)
    await core.start(settings, running.supervisor)
    job_publisher.start(running.supervisor)
    # The HTTP front on this same loop, over the same InferencePath (0: off).
    http: RunningHttp | None = None
    if config.front.http_port:
        front = OpenAIFront(core.tenants, path)
        # OpenAI's Files and Batch APIs: their tables are in the job store's database.
        batches = BatchFront(front.tenants, OpenAIStore(job_store.db), jobs, core.models, config.front.files_max_bytes, settings.jobs_max_rows)
        http_port = 0 if config.front.http_port == ANY_HTTP_PORT else config.front.http_port
        http = await start_http(front, config.host, http_port, config.front.http_max_body_bytes, config.shutdown_grace_s, batches, tls)
    await running.set_serving(True)
    log.info("ready", adapter=settings.adapter_url, models=[m.name for m in core.models.models], http_port=http.port if http else None)

    async def on_stop() -> None:
        # Side by side, within PUBLISHER_FLUSH_S: one grace each (60 s in the manifests) outlived the pod.
        await asyncio.gather(job_publisher.stop(PUBLISHER_FLUSH_S), core.close(PUBLISHER_FLUSH_S))
        await job_store.close()

    # The HTTP listener drains beside the gRPC port (no new requests from the signal on), not after it.
    await serve_until_signal(running, config.shutdown_grace_s, on_stop, also=http)


def main() -> None:
    run_service("gateway", GatewayConfig, ENV_PREFIX, serve)


if __name__ == "__main__":
    main()
