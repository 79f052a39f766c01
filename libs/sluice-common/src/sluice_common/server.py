"""The grpc.aio server every Sluice service runs: health, reflection, metrics, shutdown.

`create_server` binds (port 0 in tests) and returns the bound port; `serve_until_signal`
runs until SIGTERM or SIGINT, then marks every service NOT_SERVING (so load balancers
drain it) before `stop(grace)` lets in-flight calls finish.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from sluice_common.interceptor import SluiceServerInterceptor

log = structlog.stdlib.get_logger("sluice.server")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    metrics_port: int
    health: HealthServicer
    service_names: tuple[str, ...]

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def shutdown(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def create_server(
    host: str,
    port: int,
    metrics_port: int,
    register: Callable[[grpc.aio.Server], Iterable[str]],
    serving: bool = True,
) -> RunningServer:
    """Builds and starts the server. `register` adds the servicers and returns their full names."""
    server = grpc.aio.server(
        interceptors=[SluiceServerInterceptor()],
        options=[("grpc.so_reuseport", 0)],
    )
    service_names = tuple(register(server))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    bound_port = server.add_insecure_port(f"{host}:{port}")
    if bound_port == 0:
        raise OSError(f"could not bind the gRPC port {host}:{port}")
    bound_metrics_port = _start_metrics(host, metrics_port)
    await server.start()
    running = RunningServer(server, bound_port, bound_metrics_port, health, service_names)
    await running.set_serving(serving)
    log.info("server_started", port=bound_port, metrics_port=bound_metrics_port, services=list(service_names))
    return running


def _start_metrics(host: str, port: int) -> int:
    if port < 0:
        return -1
    http_server, _thread = start_http_server(port, addr=host)
    return int(http_server.server_port)


async def serve_until_signal(
    running: RunningServer,
    grace_s: float,
    on_stop: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Blocks until SIGTERM/SIGINT, then drains: NOT_SERVING, stop(grace), then `on_stop`."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting_down", grace_s=grace_s)
    await running.shutdown(grace_s)
    if on_stop is not None:
        await on_stop()
    log.info("stopped")
