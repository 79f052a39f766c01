"""The one server interceptor: request id, error mapping, a summary log line and RPC metrics.

The metrics are one hop's Little's law, for every service alike (`sluice diagnose` reads them):
`sluice_rpc_in_flight` (L, calls being handled now, a stream until it ends) beside
`sluice_rpc_duration_seconds` (its count's rate is the completions per second, lambda; its sum over
its count the time a call spends in the service, W).

Domain code raises `SluiceError` subclasses; here each becomes its gRPC status with
the rich details a client can act on (google.rpc.BadRequest for a bad field,
RetryInfo and QuotaFailure for exhausted capacity). Anything else is logged with
its traceback and answered INTERNAL without leaking internals to the client.

A request whose bytes protobuf refuses to parse (a string field that is not UTF-8, or no message
at all) is the client's fault: grpc's own answer is UNKNOWN ("Unexpected DecodeError"), here it is
INVALID_ARGUMENT naming the field (sluice_common.utf8).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, cast

import grpc
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status
from prometheus_client import Counter, Gauge, Histogram

from sluice_common.errors import InvalidArgument, ResourceExhausted, SluiceError, Unavailable
from sluice_common import tracing
from sluice_common.request_context import bind_request_id, new_request_id, request_id_from_metadata
from sluice_common.errors import clip
from sluice_common.utf8 import invalid_wire_text

log = structlog.stdlib.get_logger("sluice.rpc")
# The stdlib logger under `log`, asked whether debug lines would be written at all.
_level = logging.getLogger("sluice.rpc")

RPC_REQUESTS = Counter("sluice_rpc_requests_total", "RPCs handled, by method and status code.", ["method", "code"])
RPC_DURATION = Histogram(
    "sluice_rpc_duration_seconds",
    "Time from an RPC's start to its end (the whole stream for streaming RPCs).",
    ["method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)

RPC_IN_FLIGHT = Gauge("sluice_rpc_in_flight", "RPCs being handled now, by method (a streaming RPC until its stream ends).", ["method"])

# Health and reflection calls are frequent and uninteresting: when they succeed they are counted
# and logged at debug. A service adds its own high-rate internal methods (rate-limit's Acquire
# and Commit, thousands a second, each already in the caller's log line) through `quiet_methods`.
_QUIET_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def quiet_prefix(method: str) -> bool:
    return method.startswith(_QUIET_PREFIXES)


# The most of a SluiceError's message (and of a BadRequest's field and description) a status carries:
# they travel as trailing metadata, which grpc refuses beyond its limit (16 KiB: the client then hears
# RESOURCE_EXHAUSTED, not the error). Every client value a message quotes is clipped where it is
# written; this keeps one missed from turning the answer into another.
MAX_STATUS_TEXT = 512


def status_for(error: SluiceError) -> grpc.Status:
    """The grpc.Status (with google.rpc details) that a SluiceError maps to."""
    code = getattr(code_pb2, error.code, code_pb2.INTERNAL)
    status = status_pb2.Status(code=code, message=clip(error.message, MAX_STATUS_TEXT))
    if isinstance(error, InvalidArgument):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=clip(error.field_name, MAX_STATUS_TEXT), description=clip(error.reason, MAX_STATUS_TEXT)
        )
        _pack(status, error_details_pb2.BadRequest(field_violations=[violation]))
    if isinstance(error, (ResourceExhausted, Unavailable)) and error.retry_after_s is not None:
        _pack(status, error_details_pb2.RetryInfo(retry_delay=_duration(error.retry_after_s)))
    if isinstance(error, ResourceExhausted):
        if error.quota_subject:
            quota = error_details_pb2.QuotaFailure.Violation(subject=error.quota_subject, description=status.message)
            _pack(status, error_details_pb2.QuotaFailure(violations=[quota]))
    return rpc_status.to_status(status)


def _pack(status: status_pb2.Status, detail: Any) -> None:
    packed = any_pb2.Any()
    packed.Pack(detail)
    status.details.append(packed)


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(int(max(seconds, 0.0) * 1e9))
    return duration


class _Undecodable:
    """Stands for a request that could not be parsed; the handler's wrapper raises its error, so
    that the call is answered, counted and logged as any refused call is."""

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserializer` (a generated `Message.FromString`), answering bytes it refuses with an
    `_Undecodable` instead of raising where no handler can turn the error into a status."""
    if deserializer is None:
        return None
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError, or whatever a custom one raises
            return _Undecodable(_decode_error(descriptor, data))

    return deserialize


def _decode_error(descriptor: Any, data: bytes) -> InvalidArgument:
    field = invalid_wire_text(descriptor, data) if descriptor is not None else None
    if field is not None:
        return InvalidArgument(field, "is not valid UTF-8 text")
    what = f"a serialized {descriptor.full_name}" if descriptor is not None else "a valid message"
    return InvalidArgument("request", f"the request's bytes are not {what}")


def _check_decoded(request: Any) -> None:
    if isinstance(request, _Undecodable):
        raise request.error


class _InFlight:
    """A method's calls in flight: a plain count that sluice_rpc_in_flight reads when it is scraped
    (set_function), so a call pays an increment and a decrement of an int instead of two locked
    gauge updates. Every call of a grpc.aio server runs on its event loop's thread, the only writer.
    One per method for the whole process, as the gauge's child is (several servers in one process
    add up)."""

    __slots__ = ("value",)

    def __init__(self, method: str) -> None:
        self.value = 0
        RPC_IN_FLIGHT.labels(method).set_function(self.get)

    def get(self) -> float:
        return self.value


_in_flight: dict[str, _InFlight] = {}


def _in_flight_of(method: str) -> _InFlight:
    found = _in_flight.get(method)
    if found is None:
        found = _in_flight[method] = _InFlight(method)
    return found


class _MethodMetrics:
    """One method's metrics, looked up once when its handler is wrapped: labels() validates and
    locks, and rate-limit handles thousands of RPCs a second, each of which would pay it per metric."""

    __slots__ = ("in_flight", "duration", "_method", "_counts")

    def __init__(self, method: str) -> None:
        self._method = method
        self.in_flight = _in_flight_of(method)
        self.duration = RPC_DURATION.labels(method)
        self._counts: dict[str, Any] = {}

    def count(self, code: str) -> None:
        child = self._counts.get(code)
        if child is None:
            child = self._counts[code] = RPC_REQUESTS.labels(self._method, code)
        child.inc()


class _CallRecord:
    """Bookkeeping for one RPC: request id, outcome and the summary line."""

    def __init__(self, method: str, context: grpc.aio.ServicerContext, quiet: bool, metrics: _MethodMetrics) -> None:
        self.method = method
        self.quiet = quiet
        self.context = context
        self.metrics = metrics
        self.code = "OK"
        self.started = time.perf_counter()
        # Read now: once a cancelled stream has ended, grpc.aio's context.peer() reads a freed call
        # and crashes the process (SIGSEGV in cygrpc, seen at a bidirectional stream's end).
        self.peer = context.peer()
        structlog.contextvars.clear_contextvars()
        metadata = context.invocation_metadata()
        self.request_id = request_id_from_metadata(metadata) or new_request_id()
        bind_request_id(self.request_id, rpc=method)
        # The SERVER span (while tracing is on; not for health and reflection), current for the call.
        self.span = tracing.server_span(method, metadata, self.peer) if tracing.enabled() and not quiet_prefix(method) else None
        # Last, after everything that can raise: `finish` (which takes it back) runs only once
        # this constructor has returned.
        metrics.in_flight.value += 1

    async def fail(self, error: BaseException) -> None:
        if isinstance(error, SluiceError):
            self.code = error.code
            status = status_for(error)
            await self.context.abort(status.code, status.details, tuple(status.trailing_metadata) + error.metadata)
        if isinstance(error, asyncio.CancelledError):
            # grpc cancels the handler both when the client goes away and when its deadline passes.
            self.code = self.gone_code()
            raise error
        if isinstance(error, grpc.aio.AioRpcError):
            # A downstream service's status passes through unchanged, rich details included.
            self.code = error.code().name
            details = tuple((k, v) for k, v in error.trailing_metadata() or () if k == "grpc-status-details-bin")
            await self.context.abort(error.code(), error.details() or "", details)
        if isinstance(error, grpc.aio.AbortError):
            code = self.context.code()
            self.code = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
            raise error
        self.code = "INTERNAL"
        log.exception("rpc_failed")
        await self.context.abort(grpc.StatusCode.INTERNAL, f"internal error (request_id={self.request_id})")

    def gone_code(self) -> str:
        """A call that ended without a status (its handler cancelled, or closed at a yield): what
        ended it, told by its deadline (time_remaining is None without one, <= 0 once it passed)."""
        remaining = self.context.time_remaining()
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"

    def finish(self) -> None:
        elapsed = time.perf_counter() - self.started
        metrics = self.metrics
        metrics.in_flight.value -= 1
        metrics.count(self.code)
        metrics.duration.observe(elapsed)
        tracing.end_server_span(self.span, self.code)
        # A health watch ends CANCELLED whenever its client closes: that is its normal end.
        if self.quiet and self.code in ("OK", "CANCELLED"):
            # structlog renders an event before the stdlib level drops it: skip the call instead.
            if _level.isEnabledFor(logging.DEBUG):
                log.debug("rpc", code=self.code, duration_ms=round(elapsed * 1000, 2), peer=self.peer)
            return
        log.info("rpc", code=self.code, duration_ms=round(elapsed * 1000, 2), peer=self.peer)


def _wrap_unary(method: str, behavior: Callable[..., Awaitable[Any]], quiet: bool) -> Callable[..., Awaitable[Any]]:
    metrics = _MethodMetrics(method)

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        record = _CallRecord(method, context, quiet, metrics)
        try:
            _check_decoded(request)
            return await behavior(request, context)
        except BaseException as error:  # noqa: BLE001 - mapped, then re-raised as a status
            await record.fail(error)
        finally:
            record.finish()

    return handle


def _wrap_stream(method: str, behavior: Callable[..., AsyncIterator[Any]], quiet: bool) -> Callable[..., AsyncIterator[Any]]:
    metrics = _MethodMetrics(method)

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        record = _CallRecord(method, context, quiet, metrics)
        try:
            _check_decoded(request)
            # aclosing: when the call ends while the handler waits at a yield (the client went
            # away), the handler is closed here, while the call still exists, not later by the
            # garbage collector (a handler of a client stream still holds grpc's request iterator).
            async with contextlib.aclosing(cast(AsyncGenerator[Any, None], behavior(request, context))) as responses:
                async for response in responses:
                    yield response
        except BaseException as error:  # noqa: BLE001 - mapped, then re-raised as a status
            if isinstance(error, GeneratorExit):
                # Closed at a yield: grpc was blocked sending (a client that does not read) when the
                # client cancelled or its deadline passed.
                record.code = record.gone_code()
                raise
            await record.fail(error)
        finally:
            record.finish()

    return handle


def _wrap_streaming(method: str, behavior: Callable[..., Any], quiet: bool) -> Callable[..., Any]:
    """A streaming handler is an async generator (it yields), or a coroutine that writes with
    `context.write` (grpc_health's Watch, which clients' health checking calls): wrap each as it is."""
    if inspect.isasyncgenfunction(behavior):
        return _wrap_stream(method, behavior, quiet)
    return _wrap_unary(method, behavior, quiet)


class SluiceServerInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, quiet_methods: Iterable[str] = ()) -> None:
        self._quiet_methods = frozenset(quiet_methods)
        # A method's handler and its wrapped form, built on its first call (a servicer's handlers
        # never change; a different handler for the method is wrapped anew).
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[method] = (handler, self._wrap(method, handler))
        return cached[1]

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        quiet = method in self._quiet_methods or method.startswith(_QUIET_PREFIXES)
        common = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        # A single request is parsed before the handler runs: the tolerant parser lets the
        # wrapper refuse it. A stream's messages (reflection's) keep grpc's own handling.
        single = {**common, "request_deserializer": _tolerant(handler.request_deserializer)}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(method, handler.unary_unary, quiet), **single)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_streaming(method, handler.unary_stream, quiet), **single)
        if handler.stream_stream:
            # One record (request id, summary line, metrics) for the whole stream: a stream that
            # multiplexes many requests counts and logs those itself.
            return grpc.stream_stream_rpc_method_handler(_wrap_streaming(method, handler.stream_stream, quiet), **common)
        # Client-streaming RPCs are not part of Sluice's API; pass them through untouched.
        return handler
