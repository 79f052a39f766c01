"""grpc.health.v1 Health for every Sluice server: grpcio-health-checking's async servicer, mended.

Upstream's (grpc_health.v1._async, 1.81) shares one asyncio.Condition among the watchers of a
service and deletes it when any one Watch ends: every other watcher then waits on a condition no
`set` reaches again, so a client whose health check outlived another client's never hears
NOT_SERVING or SERVING again (a gateway kept away from an adapter that had come back). And a Watch
never ends by itself, so `server.stop(grace)` waited the whole grace for every open one.

Here each Watch has its own event, and `enter_graceful_shutdown` ends every open Watch once it has
sent NOT_SERVING. Otherwise the semantics are upstream's: "" is SERVING until set, Check of an
unknown service is NOT_FOUND, a Watch of one is SERVICE_UNKNOWN until it is set, a Watch sends the
current status first and then each change (a status set twice is sent once), and `set` is ignored
once shutting down.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Check, Watch, `set` and `enter_graceful_shutdown`, as grpc_health.v1._async.HealthServicer."""

    def __init__(self) -> None:
        self._status: dict[str, health_pb2.HealthCheckResponse.ServingStatus.ValueType] = {"": SERVING}
        # One event per open Watch, by service: `set` wakes each; a Watch that ends removes its own.
        self._watchers: dict[str, set[asyncio.Event]] = {}
        self._shutting_down = False

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        if self._shutting_down:
            # Refused without a message: gRPC's client-side health checking restarts at once a Watch
            # that ended after a response (a loop of ~2,000 calls a second per client until the port
            # closes), and only after a backoff one that failed without any.
            await context.abort(grpc.StatusCode.UNAVAILABLE, "shutting down")
        changed = asyncio.Event()
        watchers = self._watchers.setdefault(request.service, set())
        watchers.add(changed)
        try:
            await self._stream(request.service, changed, context)
        finally:
            watchers.discard(changed)
            if not watchers and self._watchers.get(request.service) is watchers:
                del self._watchers[request.service]

    async def _stream(self, service: str, changed: asyncio.Event, context: grpc.aio.ServicerContext) -> None:
        """The current status, then each change; returns once shutting down, NOT_SERVING sent."""
        sent = None
        while True:
            changed.clear()  # before reading: a `set` during the write below wakes the next wait
            status = self._status.get(service, SERVICE_UNKNOWN)
            if status != sent:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                sent = status
            if self._shutting_down:
                return
            await changed.wait()

    def _set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        self._status[service] = status
        for changed in self._watchers.get(service, ()):
            changed.set()

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        """Sets the status of `service`; ignored once shutting down (NOT_SERVING stays)."""
        if not self._shutting_down:
            self._set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good; every open Watch sends it and ends (so that
        `server.stop(grace)` does not wait for them), and a Watch started later is refused."""
        if self._shutting_down:
            return
        self._shutting_down = True
        for service in list(self._status):
            self._set(service, NOT_SERVING)
        for watchers in self._watchers.values():  # those of services never set too: they end as well
            for changed in watchers:
                changed.set()
