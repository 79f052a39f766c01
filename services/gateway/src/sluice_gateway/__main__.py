"""`python -m sluice_gateway`: the public gRPC API."""

from __future__ import annotations

import tempfile
from pathlib import Path

import structlog
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from sluice.inference.v1 import inference_pb2_grpc
from sluice.ratelimit.v1 import ratelimit_pb2_grpc

from sluice_common.bootstrap import run_service
from sluice_common.channels import open_channel
from sluice_common.server import create_server, serve_until_signal
from sluice_gateway.admission import Admission
from sluice_gateway.completion_events import CompletionEvents
from sluice_gateway.config import ENV_PREFIX, GatewayConfig
from sluice_gateway.model_catalog import ModelCatalog
from sluice_gateway.servicer import GatewayServicer
from sluice_gateway.tenants import TenantDirectory

log = structlog.stdlib.get_logger("sluice.gateway")

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


async def serve(config: GatewayConfig) -> None:
    try:
        tenants = TenantDirectory.from_file(config.tenants_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"gateway: cannot load {ENV_PREFIX}TENANTS_FILE: {exc}") from None
    channel = open_channel(config.adapter_url, config.adapter_channel_tls())
    adapter = inference_pb2_grpc.InferenceServiceStub(channel)
    models = ModelCatalog(adapter)
    spill_file = Path(config.events_spill_file or Path(tempfile.gettempdir()) / f"sluice-gateway-{config.port}-events.spill")
    completion_events = CompletionEvents.create(
        config.amqp_url, config.amqp_prefix, config.events_outbox_size, config.events_max_in_flight, spill_file
    )
    ratelimit_channel = open_channel(config.ratelimit_url) if config.ratelimit_url else None
    admission = Admission(
        ratelimit_pb2_grpc.RateLimitServiceStub(ratelimit_channel) if ratelimit_channel else None,
        config.ratelimit_policy,
        config.ratelimit_timeout_s,
    )
    servicer = GatewayServicer(tenants, models, adapter, completion_events=completion_events, admission=admission)

    def register(server):  # type: ignore[no-untyped-def]
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    running = await create_server(
        config.host, config.port, config.metrics_port, register, serving=False, tls=config.server_tls(ENV_PREFIX)
    )
    await models.wait_first_load(config.adapter_wait_s)
    models.start_refreshing(config.models_refresh_s)
    completion_events.start()
    await running.set_serving(True)
    log.info("ready", adapter=config.adapter_url, models=[m.name for m in models.models])

    async def on_stop() -> None:
        await completion_events.stop(config.shutdown_grace_s)
        await admission.drain()
        if ratelimit_channel is not None:
            await ratelimit_channel.close()
        await models.stop()
        await channel.close()

    await serve_until_signal(running, config.shutdown_grace_s, on_stop)


def main() -> None:
    run_service("gateway", GatewayConfig, ENV_PREFIX, serve)


if __name__ == "__main__":
    main()
