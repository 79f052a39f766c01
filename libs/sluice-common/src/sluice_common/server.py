"""The grpc.aio server every Sluice service runs: health, reflection, metrics, shutdown.

`create_server` binds (port 0 in tests) and returns the bound port; `serve_until_signal`
runs until SIGTERM or SIGINT, then marks every service NOT_SERVING (so load balancers
drain it) before `stop(grace)` lets in-flight calls finish.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as reflection_v1alpha_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer
from prometheus_client import start_http_server

from sluice_common.config import ConnectionAge, ServerTLS
from sluice_common.health import HealthServicer
from sluice_common.interceptor import SluiceServerInterceptor
from sluice_common.log import PORTS_LOGGER
from sluice_common.supervision import Supervisor, fault_injection_from_env

log = structlog.stdlib.get_logger("sluice.server")
ports_log = structlog.stdlib.get_logger(PORTS_LOGGER)

REFLECTION_V1_SERVICE = "grpc.reflection.v1.ServerReflection"
# The largest request a service's gRPC port takes (gRPC's own default is 4 MiB, and a larger request
# got RESOURCE_EXHAUSTED from gRPC itself): above every limit of a service's own (a SubmitJob up to
# SLUICE_GATEWAY_JOBS_MAX_MESSAGE_BYTES, at most 16 MiB), so that the service's own bound answers a
# request over it, with INVALID_ARGUMENT naming that bound.
MAX_REQUEST_BYTES = 32 * 1024 * 1024
# gRPC's "unlimited" for its millisecond settings (INT_MAX).
_UNLIMITED_MS = 2**31 - 1


def _register_reflection_v1_descriptor() -> None:
    """grpc.reflection.v1's file in the default pool, so that reflection can describe itself.
    v1 is v1alpha's messages under another package (the same field numbers: the same wire)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(REFLECTION_V1_SERVICE)
        return
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto()
    reflection_v1alpha_pb2.DESCRIPTOR.CopyToProto(file)
    file.name = "grpc/reflection/v1/reflection.proto"
    file.package = "grpc.reflection.v1"
    for message in file.message_type:
        for message_field in message.field:
            if message_field.type_name:
                message_field.type_name = message_field.type_name.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
    for method in file.service[0].method:
        method.input_type = method.input_type.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
        method.output_type = method.output_type.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
    file.options.Clear()
    pool.Add(file)


def _enable_reflection(service_names: tuple[str, ...], server: grpc.aio.Server) -> None:
    """Server reflection as both grpc.reflection.v1 (what grpcurl and current clients ask first)
    and v1alpha (older clients). grpcio-reflection ships only v1alpha; v1 has the same messages
    and field numbers, so one servicer answers both, v1's requests parsed as v1alpha's."""
    _register_reflection_v1_descriptor()
    servicer = ReflectionServicer((*service_names, REFLECTION_V1_SERVICE))
    messages = reflection_v1alpha_pb2
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=messages.ServerReflectionRequest.FromString,
        response_serializer=messages.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        tuple(
            grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}) for name in (reflection.SERVICE_NAME, REFLECTION_V1_SERVICE)
        )
    )


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# The health service name for liveness probes (Kubernetes' grpc probe `service`): SERVING while the
# process can serve at all, whatever its readiness ("" and the service's own names) says.
LIVENESS_SERVICE = "liveness"
# The problems a Supervisor reports for its owner tasks are named "task:<name>".
TASK_PROBLEM = "task:"


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    metrics_port: int
    health: HealthServicer
    service_names: tuple[str, ...]
    # Sources that report a problem now (the service itself, its replicas, a dead owner task):
    # health is SERVING only while there is none.
    problems: set[str] = field(default_factory=set)
    # The service's owner tasks start here: a dead one is reported to this server's health.
    supervisor: Supervisor = field(init=False)

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(self.report, fault_injection=fault_injection_from_env())

    async def set_serving(self, serving: bool) -> None:
        """The service's own say (starting, draining); other sources report through `report`."""
        await self.report("service", serving)

    async def report(self, source: str, ok: bool) -> None:
        if ok:
            self.problems.discard(source)
        else:
            self.problems.add(source)
        status = NOT_SERVING if self.problems else SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)
        # Only what a restart of this process could mend: an owner task down. Not its starting or
        # draining, nor a dependency (no Triton replica): a liveness probe that followed those would
        # restart every replica while Triton is away, and each restart waits for it again.
        alive = not any(problem.startswith(TASK_PROBLEM) for problem in self.problems)
        await self.health.set(LIVENESS_SERVICE, SERVING if alive else NOT_SERVING)

    async def shutdown(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def create_server(
    host: str,
    port: int,
    metrics_port: int,
    register: Callable[[grpc.aio.Server], Iterable[str]],
    serving: bool = True,
    tls: ServerTLS | None = None,
    quiet_methods: Iterable[str] = (),
    connection_age: ConnectionAge | None = None,
) -> RunningServer:
    """Builds and starts the server. `register` adds the servicers and returns their full names.

    With `tls` the port speaks TLS only (mutual TLS when `tls.client_ca_file` is set).
    `quiet_methods` (full names, "/package.Service/Method"): high-rate methods whose successful
    calls are counted in the metrics but logged at debug only.
    `connection_age`: SLUICE_MAX_CONNECTION_AGE_S from the environment unless given (tests).
    """
    age = connection_age if connection_age is not None else ConnectionAge.from_environ()
    server = grpc.aio.server(
        interceptors=[SluiceServerInterceptor(quiet_methods)],
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            # Clients ping every 30 s during calls (channels.py); a long stream may carry no data for
            # longer, and the default 5 min floor answered such pings with GOAWAY "too_many_pings".
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            *connection_age_options(age),
        ],
    )
    service_names = tuple(register(server))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    _enable_reflection((*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    bound_port = server.add_insecure_port(address) if tls is None else server.add_secure_port(address, server_credentials(tls))
    if bound_port == 0:
        raise OSError(f"could not bind the gRPC port {host}:{port}")
    bound_metrics_port = _start_metrics(host, metrics_port)
    await server.start()
    running = RunningServer(server, bound_port, bound_metrics_port, health, service_names)
    await running.set_serving(serving)
    log.info(
        "server_started",
        port=bound_port,
        metrics_port=bound_metrics_port,
        services=list(service_names),
        tls="off" if tls is None else ("mutual" if tls.client_ca_file else "server"),
    )
    ports_log.info("ports_bound", grpc=bound_port, **({"metrics": bound_metrics_port} if bound_metrics_port > 0 else {}))
    return running


def connection_age_options(age: ConnectionAge) -> list[tuple[str, int]]:
    """Clients dial headless names round robin and resolve them again only when a connection
    ends; keepalives hold connections for ever, so replicas added later got no calls from clients
    already connected. Past its age (gRPC adds +-10% jitter) a connection gets GOAWAY: the client
    resolves again and opens new calls on new connections, to every replica. The calls in flight
    finish on the old one however long they take (the grace is unlimited): a generation stream, a
    job row's (up to its 25 min ceiling), a client's own long deadline is never cut by the age, and
    the drain's `stop(grace)` still bounds them all at shutdown."""
    if age.max_connection_age_s <= 0:
        return []
    return [
        ("grpc.max_connection_age_ms", max(1, round(age.max_connection_age_s * 1000))),
        ("grpc.max_connection_age_grace_ms", _UNLIMITED_MS),
    ]


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def server_credentials(tls: ServerTLS) -> grpc.ServerCredentials:
    """Credentials from PEM files, re-read on the next handshake after any of them changes.

    So a renewed certificate (cert-manager, a mounted Secret) is served without a restart; a
    half-written file (key and cert out of step) keeps the previous pair until both parse.
    """
    paths = [p for p in (tls.cert_file, tls.key_file, tls.client_ca_file) if p]

    def stamp() -> tuple[float, ...]:
        return tuple(os.stat(p).st_mtime_ns for p in paths)

    def load() -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(_read(tls.key_file), _read(tls.cert_file))],
            root_certificates=_read(tls.client_ca_file) if tls.client_ca_file else None,
        )

    state = {"stamp": stamp()}
    initial = load()

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        try:
            current = stamp()
            if current == state["stamp"]:
                return None
            config = load()
        except (OSError, ValueError) as exc:
            log.warning("tls_reload_failed", error=str(exc))
            return None
        state["stamp"] = current
        log.info("tls_reloaded", cert_file=tls.cert_file)
        return config

    return grpc.dynamic_ssl_server_credentials(initial, fetch, require_client_authentication=bool(tls.client_ca_file))


def _start_metrics(host: str, port: int) -> int:
    if port < 0:
        return -1
    http_server, _thread = start_http_server(port, addr=host)
    return int(http_server.server_port)


# Between NOT_SERVING and closing the port: clients that watch health (client-side health
# checking, the launcher) move new calls to another replica before this one refuses them.
NOT_SERVING_NOTICE_S = 0.5
# After the drain, how long a service's publishers wait for the broker in all before they spill
# what is still owed (run side by side, not one grace each): the manifests give a pod 10 s after
# its drain grace to flush, and the launcher kills at the grace plus 15 s.
PUBLISHER_FLUSH_S = 6.0


async def drain(
    running: RunningServer,
    grace_s: float,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    notice_s: float = NOT_SERVING_NOTICE_S,
    also_drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """A rolling restart's exit: NOT_SERVING, no new calls, accepted calls finish within
    `grace_s` (then they are cancelled), then `on_stop` flushes what the service owes.
    `also_drain`: another listener of the service (the gateway's HTTP front), drained at the same
    time as the gRPC port, within the same grace."""
    started = time.monotonic()
    await running.health.enter_graceful_shutdown()
    await asyncio.sleep(min(notice_s, grace_s))
    await asyncio.gather(running.server.stop(grace_s), *([also_drain()] if also_drain is not None else []))
    log.info("drained", seconds=round(time.monotonic() - started, 3), grace_s=grace_s)
    if on_stop is not None:
        flushing = time.monotonic()
        await on_stop()
        log.info("flushed", seconds=round(time.monotonic() - flushing, 3))


class Listener(Protocol):
    """Another listener of a service beside its gRPC port (the gateway's HTTP front)."""

    async def stop(self) -> None:
        """Takes no new requests; lets those in flight finish within the service's grace."""

    async def stop_now(self) -> None:
        """Cuts the requests still in flight (a second signal during the drain)."""


async def serve_until_signal(
    running: RunningServer,
    grace_s: float,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    also: Listener | None = None,
) -> None:
    """Blocks until SIGTERM/SIGINT, then drains (see `drain`) the gRPC port and `also` together;
    a second signal cuts both short: what is still in flight is cancelled, then `on_stop` flushes.

    With SLUICE_FAULT_INJECTION set, SIGUSR1 fails the owner tasks it names (failure tests)."""
    signals = asyncio.Queue[int]()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    if running.supervisor.fault_injection:
        loop.add_signal_handler(signal.SIGUSR1, running.supervisor.inject_faults)
    await signals.get()
    log.info("shutting_down", grace_s=grace_s)
    draining = asyncio.create_task(drain(running, grace_s, on_stop, also_drain=also.stop if also is not None else None))
    second = asyncio.create_task(signals.get())
    await asyncio.wait({draining, second}, return_when=asyncio.FIRST_COMPLETED)
    if second.done():
        log.warning("shutting_down_now", reason="a second signal during the drain")
        await asyncio.gather(running.server.stop(0), *([also.stop_now()] if also is not None else []))
    else:
        second.cancel()
    await draining
    log.info("stopped")
