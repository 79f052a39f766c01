"""The trace of a CompletionEvent on this side of RabbitMQ.

The gateway puts the W3C trace context of the request in the event message's headers
(`traceparent`). Here each message gets a CONSUMER span, in that trace and linked to the gateway's
publish span, from the batch's start until its record is stored and acked (or the batch fails:
`sluice.evallog.stored` false, the span in error); and the record keeps
the trace id (read from the header whether or not this service's own tracing is on, so that
`sluice logs` can point at the trace the gateway exported).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.trace import Link, SpanKind, Status, StatusCode, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sluice_common import tracing

_W3C = TraceContextTextMapPropagator()


def trace_id_of(headers: Mapping[str, Any] | None) -> str:
    """The trace id a message's `traceparent` header names; empty without a valid one."""
    value = (headers or {}).get("traceparent")
    if not value:
        return ""
    return tracing.trace_id_of(get_current_span(_W3C.extract({"traceparent": tracing.header_text(value)})).get_span_context())


def start_process_spans(messages: Sequence[Any], queue: str) -> list[Any] | None:
    """One CONSUMER span per message of a batch (None while tracing is off)."""
    if not tracing.enabled():
        return None
    spans = []
    for message in messages:
        parent = tracing.extract_context(message.headers)
        producer = get_current_span(parent).get_span_context()
        spans.append(
            tracing.tracer().start_span(
                f"process {queue}",
                context=parent,
                kind=SpanKind.CONSUMER,
                links=[Link(producer, {"messaging.operation": "publish"})] if producer.is_valid else [],
                attributes={
                    "messaging.system": "rabbitmq",
                    "messaging.operation": "process",
                    "messaging.destination.name": queue,
                    "messaging.message.id": message.message_id or "",
                },
            )
        )
    return spans


def end_process_spans(spans: list[Any] | None, stored: bool, error: BaseException | None = None) -> None:
    """Ends a batch's spans: `stored` once its records are stored and acked; not, with the `error`
    that stopped it (evaluation, the store, the ack, the session ending), which leaves the messages
    unacked for the broker to deliver again. A span already ended is left as it is."""
    for span in spans or ():
        if not span.is_recording():
            continue
        span.set_attribute("sluice.evallog.stored", stored)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
            span.set_attribute("error.type", type(error).__name__)
        span.end()
