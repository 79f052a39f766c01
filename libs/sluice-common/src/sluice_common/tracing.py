"""OpenTelemetry traces, set up once per process from the standard `OTEL_*` variables.

Off unless `OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`): then the SDK's
TracerProvider is installed with the sampler of `OTEL_TRACES_SAMPLER`/`OTEL_TRACES_SAMPLER_ARG`
(the SDK reads them; default parentbased_always_on), a BatchSpanProcessor (`OTEL_BSP_*`) and the
exporter, which reads its own `OTEL_EXPORTER_OTLP_*` (endpoint, headers, timeout). The resource is
`OTEL_SERVICE_NAME`/`OTEL_RESOURCE_ATTRIBUTES`, with the service's own name when none is given.
`otlp` speaks OTLP/HTTP (protobuf), the exporter Sluice ships; `OTEL_EXPORTER_OTLP_PROTOCOL=grpc`
is refused at start rather than silently exporting nothing.

While off, `enabled()` is False and every helper here returns at once (no span objects, no
interceptors): the request path pays one boolean test per hook.

What the helpers cover that no maintained instrumentation does for Sluice:
- `server_span`: the gRPC server span, opened inside sluice_common.interceptor's call record. The
  instrumentation's aio server interceptor iterates a streaming handler without closing it when
  the call ends at a yield (the client went away), which the interceptor depends on (see there);
  the span is the one it would make (name, kind, rpc.* attributes, W3C `traceparent` from the
  metadata through the global propagator).
- `inject_headers`/`extract_context`: W3C trace context in AMQP message headers. The publishers
  (sluice_common.amqp_publisher.ConfirmingPublisher) publish from a background task, out of an outbox that
  may even be spilled to disk and replayed by another process, so aio-pika's instrumentation,
  which takes the context current at `publish`, would see the wrong one (none): the context is
  captured when the message is made and carried in its headers.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode

_enabled = False
TRACER_NAME = "sluice"
# OTLP/HTTP, the exporter in Sluice's dependencies (the SDK's own default for "otlp" is gRPC).
_OTLP_PROTOCOLS = {"http/protobuf": "otlp_proto_http"}


class TracingConfigError(ValueError):
    """An OTEL_* setting that cannot work; the service refuses to start with it."""


def enabled() -> bool:
    return _enabled


def exporter_names(env: Mapping[str, str] = os.environ) -> list[str]:
    """The exporters OTEL_TRACES_EXPORTER asks for; empty (tracing off) when unset or `none`."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [name.strip().lower() for name in env.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()]
    return [] if names in ([], ["none"]) else names


def _entry_point_name(name: str, env: Mapping[str, str]) -> str:
    if name != "otlp":
        return name
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
    if protocol not in _OTLP_PROTOCOLS:
        raise TracingConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: Sluice exports OTLP over HTTP only (http/protobuf);"
            " point OTEL_EXPORTER_OTLP_ENDPOINT at the receiver's HTTP port (4318)"
        )
    return _OTLP_PROTOCOLS[protocol]


def configure_tracing(service: str, env: Mapping[str, str] = os.environ) -> bool:
    """Installs the SDK's tracer provider when OTEL_TRACES_EXPORTER asks for one; returns whether
    tracing is on. Raises TracingConfigError for an exporter that does not exist here."""
    global _enabled
    names = exporter_names(env)
    if not names or _enabled:
        return _enabled
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.util._importlib_metadata import entry_points

    exporters = []
    for name in names:
        found = list(entry_points(group="opentelemetry_traces_exporter", name=_entry_point_name(name, env)))
        if not found:
            raise TracingConfigError(f"OTEL_TRACES_EXPORTER: no trace exporter named {name!r} is installed (otlp, console)")
        exporters.append(found[0].load()())
    resource = Resource.create({} if _names_the_service(env) else {SERVICE_NAME: service})
    provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER, read by the SDK
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _enabled = True
    return True


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def shutdown() -> None:
    """Flushes what the batch processor holds (the SDK also does at exit)."""
    provider = trace.get_tracer_provider()
    if _enabled and hasattr(provider, "shutdown"):
        provider.shutdown()


# -- gRPC ------------------------------------------------------------------------------------------


def client_interceptors() -> list[Any]:
    """The maintained instrumentation's grpc.aio client interceptors (a CLIENT span per call, the
    trace context injected into its metadata); none while tracing is off."""
    if not _enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors
    from opentelemetry.instrumentation.grpc.filters import health_check, negate

    return list(aio_client_interceptors(filter_=negate(health_check())))


class _MetadataGetter(Getter[Any]):
    """The propagator's view of grpc.aio invocation metadata (a tuple of key/value pairs)."""

    def get(self, carrier: Any, key: str) -> list[str] | None:
        values = [str(value) for k, value in carrier or () if k == key]
        return values or None

    def keys(self, carrier: Any) -> list[str]:
        return [k for k, _ in carrier or ()]


_METADATA = _MetadataGetter()


def _names_the_service(env: Mapping[str, str]) -> bool:
    """Whether the environment names the service (OTEL_SERVICE_NAME, or service.name in
    OTEL_RESOURCE_ATTRIBUTES): then it wins over the default, as the specification has it."""
    if env.get("OTEL_SERVICE_NAME"):
        return True
    pairs = env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    return any(pair.partition("=")[0].strip() == "service.name" for pair in pairs)


def peer_attributes(peer: str) -> dict[str, Any]:
    """gRPC's peer ("ipv4:10.0.0.5:43512", "ipv6:[::1]:43512", "unix:/path") as the semantic
    conventions' network.peer.address and network.peer.port."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return {"network.peer.address": rest or peer} if peer else {}
    address, _, port = rest.rpartition(":")
    attributes: dict[str, Any] = {"network.peer.address": address.strip("[]")}
    if port.isdigit():
        attributes["network.peer.port"] = int(port)
    return attributes


def server_span(method: str, metadata: Any, peer: str) -> Span | None:
    """A SERVER span for one incoming RPC, child of the caller's `traceparent` (a new trace when
    none came), made current for the rest of the call's task (one task per RPC: nothing to undo).
    None while tracing is off."""
    if not _enabled:
        return None
    parent = propagate.extract(metadata, getter=_METADATA)
    service, _, name = method.lstrip("/").rpartition("/")
    span = tracer().start_span(
        method.lstrip("/"),
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name, **peer_attributes(peer)},
    )
    otel_context.attach(trace.set_span_in_context(span, parent))
    return span


_GRPC_CODES = {
    "OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8, "FAILED_PRECONDITION": 9,
    "ABORTED": 10, "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12, "INTERNAL": 13, "UNAVAILABLE": 14,
    "DATA_LOSS": 15, "UNAUTHENTICATED": 16,
}  # fmt: skip
# The codes that are the server's fault (OpenTelemetry's RPC conventions for a server span).
_SERVER_ERRORS = {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}


def end_server_span(span: Span | None, code: str) -> None:
    if span is None:
        return
    span.set_attribute("rpc.grpc.status_code", _GRPC_CODES.get(code, 2))
    if code in _SERVER_ERRORS:
        span.set_status(Status(StatusCode.ERROR, code))
    span.end()


# -- spans of Sluice's own work ------------------------------------------------------------------


@contextlib.contextmanager
def span(name: str, attributes: Mapping[str, Any] | None = None, kind: SpanKind = SpanKind.INTERNAL) -> Iterator[Span | None]:
    """A child span of the current one around a block; a no-op (yields None) while tracing is off."""
    if not _enabled:
        yield None
        return
    with tracer().start_as_current_span(name, kind=kind, attributes=attributes) as current:
        yield current


class AttachedSpan:
    """A span made current now and ended (its context detached) later by `end`, from the same
    task: for work that starts and ends in different places of one coroutine (an async context
    manager's body)."""

    __slots__ = ("span", "_token")

    def __init__(self, name: str, attributes: Mapping[str, Any], kind: SpanKind = SpanKind.INTERNAL) -> None:
        self.span = tracer().start_span(name, kind=kind, attributes=attributes)
        self._token = otel_context.attach(trace.set_span_in_context(self.span))

    def end(self, error: BaseException | None = None) -> None:
        if error is not None and not isinstance(error, GeneratorExit):
            self.span.set_status(Status(StatusCode.ERROR, type(error).__name__))
            self.span.set_attribute("error.type", type(error).__name__)
        self.span.end()
        try:
            otel_context.detach(self._token)
        except ValueError:  # ended from another context (a generator finalized elsewhere): nothing to undo
            pass


def current_context() -> otel_context.Context | None:
    """The current trace context, to carry into work done later elsewhere (None while off)."""
    return otel_context.get_current() if _enabled else None


@contextlib.contextmanager
def producer_span(name: str, parent: otel_context.Context | None, attributes: Mapping[str, Any] | None = None) -> Iterator[Span | None]:
    """A PRODUCER span (a message handed to the broker), child of `parent` (None: the current
    context), current inside the block so that `inject_headers` there carries it."""
    if not _enabled:
        yield None
        return
    with tracer().start_as_current_span(name, context=parent, kind=SpanKind.PRODUCER, attributes=attributes) as current:
        yield current


def current_ids() -> tuple[str, str]:
    """(trace id, span id) of the current span in W3C hex; ("", "") when there is none."""
    if not _enabled:
        return "", ""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return "", ""
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


def trace_id_of(span_context: SpanContext | None) -> str:
    return format(span_context.trace_id, "032x") if span_context is not None and span_context.is_valid else ""


# -- AMQP headers ------------------------------------------------------------------------------------


def inject_headers(headers: dict[str, Any], context: otel_context.Context | None = None) -> dict[str, Any]:
    """Adds the W3C trace context (`traceparent`, `tracestate`) of `context` (the current one when
    None) to AMQP message headers; unchanged while tracing is off."""
    if _enabled:
        propagate.inject(headers, context=context)
    return headers


def extract_context(headers: Mapping[str, Any] | None) -> otel_context.Context | None:
    """The trace context a message's headers carry (None while tracing is off)."""
    if not _enabled:
        return None
    carrier = {str(k): header_text(v) for k, v in (headers or {}).items() if isinstance(v, (str, bytes))}
    return propagate.extract(carrier)


def header_text(value: str | bytes) -> str:
    """A message header's value as text. The AMQP client hands a value that is not UTF-8 over as
    bytes: decoded with replacement characters, it is an invalid trace context (a new trace), not an
    error that would fail its message on every delivery."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


@contextlib.contextmanager
def consumer_span(name: str, headers: Mapping[str, Any] | None, attributes: Mapping[str, Any] | None = None) -> Iterator[Span | None]:
    """A CONSUMER span for one message: in the producer's trace (its child), with a link to the
    producer's span too, so that a backend that draws the broker hop as a link shows it either way.
    A message without a trace context starts a new trace."""
    if not _enabled:
        yield None
        return
    parent = extract_context(headers)
    producer = trace.get_current_span(parent).get_span_context()
    links = [Link(producer, {"messaging.operation": "publish"})] if producer.is_valid else []
    with tracer().start_as_current_span(name, context=parent, kind=SpanKind.CONSUMER, attributes=attributes, links=links) as current:
        yield current


def context_of_span_context(span_context: SpanContext) -> otel_context.Context:
    return trace.set_span_in_context(NonRecordingSpan(span_context))


def wall_ns(monotonic_s: float, now_monotonic: float | None = None) -> int:
    """A monotonic clock reading as wall-clock nanoseconds (span start/end times)."""
    now = time.monotonic() if now_monotonic is None else now_monotonic
    return time.time_ns() - int((now - monotonic_s) * 1e9)


# -- logs --------------------------------------------------------------------------------------------


def add_trace_ids(_logger: object, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: `trace_id` and `span_id` of the current span on every line."""
    if _enabled and "trace_id" not in event:
        trace_id, span_id = current_ids()
        if trace_id:
            event["trace_id"] = trace_id
            event["span_id"] = span_id
    return event
