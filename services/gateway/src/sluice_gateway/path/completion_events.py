"""CompletionEvents: built from a stream's record, published only after the stream has ended.

For each generation (when events are on) the InferencePath makes a `CompletionTracker` over the
stream's StreamRecord (stream_record.py: the one account of its timings, token counts, text and
final chunk, which its GenerateStream updates as the chunks come) and publishes it when the stream
is over, however its front learns that (inference_path.InferencePath.generate):

- gRPC: when the front reports that the client's stream has closed (the call's done-callback, which
  the servicer hands the path as `when_closed`), with the status it closed with;
- a bulk row: when the row's final chunk arrives (a failed attempt publishes nothing: the worker
  retries it);
- HTTP: when the path's `async with` ends, with the status of the exception that ended it;
- a request refused before its stream (validation, admission): at once, as an error.

The event is built and handed to the background publisher only then, after the stream has finished,
been cancelled or failed: logging never delays a token or the stream's end, and the publisher is
never awaited on the request path (sluice_common.amqp_publisher.ConfirmingPublisher: pipelined confirms,
bounded outbox, retry until confirmed, spill file, drop counter).

A tenant with `text_logging = false` gets only metadata published: no prompt, messages or output
ever leave the gateway (and the output is not even kept: its record keeps no text).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import structlog
from google.protobuf import timestamp_pb2
from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import events_pb2
from sluice.gateway.v1 import gateway_pb2

from sluice_common import tracing
from sluice_common.amqp import EventTopology
from sluice_common.amqp_publisher import ConfirmingPublisher, OutgoingMessage, PublisherMetrics
from sluice_common.errors import clip
from sluice_common.supervision import Supervisor
from sluice_common.tenants import Tenant
from sluice_common.validation import MAX_MODEL_NAME
from sluice_gateway.path.stream_record import StreamRecord

log = structlog.stdlib.get_logger("sluice.gateway.events")

EVENT_TYPE = events_pb2.CompletionEvent.DESCRIPTOR.full_name


def _timestamp(epoch_s: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(epoch_s * 1e9))
    return stamp


class CompletionTracker:
    """One Generate call's event: the request, and the record its stream keeps (read at `build`)."""

    __slots__ = ("_events", "_tenant", "_request", "_request_id", "record", "job_id", "custom_id", "_trace_context")

    def __init__(self, events: CompletionEvents, tenant: Tenant, request: gateway_pb2.GenerateRequest, request_id: str, record: StreamRecord) -> None:
        self._events = events
        self._tenant = tenant
        self._request = request
        self._request_id = request_id
        self.record = record
        self.job_id = ""
        self.custom_id = ""
        # The request's trace context, for the event's message: the event is published from a
        # done-callback, where the request's context is no longer current.
        self._trace_context = tracing.current_context()

    def publish(self, code: grpc.StatusCode | None = None, cancelled: bool = False) -> None:
        """Builds the event for the call as it ended and hands it to the publisher. Never raises."""
        try:
            self._events.submit(self.build(code, cancelled), self._trace_context)
        except Exception:  # noqa: BLE001 - never let logging break the server
            log.exception("completion_event_failed", request_id=self._request_id)

    def build(self, code: grpc.StatusCode | None = None, cancelled: bool = False) -> events_pb2.CompletionEvent:
        """The event for the call as it ended: `code` is the status the call closed with (None or OK
        when it finished) and `cancelled` whether the client cancelled it. Plain domain logic: no I/O."""
        request, record = self._request, self.record
        final = record.final
        finished_wall = time.time()
        event = events_pb2.CompletionEvent(
            event_id=uuid.uuid4().hex,
            request_id=self._request_id,
            client_request_id=request.client_request_id,
            tenant=self._tenant.name,
            model=clip(request.model, MAX_MODEL_NAME),  # a refused request's may be longer: recorded in part
            priority_class=request.priority_class or types_pb2.PRIORITY_CLASS_INTERACTIVE,
            text_logged=self._tenant.text_logging,
            sampling=request.sampling,
            response_format=request.response_format,
            started_at=_timestamp(record.started_wall),
            finished_at=_timestamp(finished_wall),
            job_id=self.job_id,
            custom_id=self.custom_id,
            user=request.user,
            metadata=request.metadata,
        )
        if self._tenant.text_logging:
            event.messages.extend(request.messages)
            event.prompt = request.prompt
            event.output = "".join(record.parts)
        if final is not None:
            event.finish_reason = final.finish_reason
            event.usage.CopyFrom(final.usage)
            event.timings.CopyFrom(final.timings)
            if final.finish_reason == types_pb2.FINISH_REASON_ERROR and isinstance(code, grpc.StatusCode):
                event.error_code = code.name  # the status the adapter ended the failed stream with
        else:
            if cancelled or code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                event.finish_reason = types_pb2.FINISH_REASON_CANCELLED
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    event.error_code = code.name
            else:
                event.finish_reason = types_pb2.FINISH_REASON_ERROR
                event.error_code = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
            # Without the adapter's final message, the gateway's own account: the record's clock
            # (from arrival) and the tokens the chunks carried.
            first_s, tokens, total_s = record.timing()
            event.usage.completion_tokens = tokens
            event.timings.total_time_ms = total_s * 1000
            if first_s is not None:
                event.timings.time_to_first_token_ms = first_s * 1000
                if tokens > 1:
                    event.timings.mean_inter_token_ms = (total_s - first_s) * 1000 / (tokens - 1)
        return event


class CompletionEvents:
    """The gateway's completion-event publisher; `None`-safe no-op when AMQP is not configured."""

    def __init__(self, publisher: ConfirmingPublisher | None, topology: EventTopology) -> None:
        self._publisher = publisher
        self._topology = topology

    @classmethod
    def create(
        cls,
        amqp_url: str,
        prefix: str,
        outbox_max: int,
        max_in_flight: int,
        spill_file: Path | None,
    ) -> CompletionEvents:
        topology = EventTopology(prefix)
        if not amqp_url:
            return cls(None, topology)
        publisher = ConfirmingPublisher(
            amqp_url,
            topology.events_exchange,
            topology.declare,
            PublisherMetrics.get("sluice_gateway_completion_events", "CompletionEvents"),
            outbox_max=outbox_max,
            max_in_flight=max_in_flight,
            spill_path=spill_file,
        )
        return cls(publisher, topology)

    @property
    def enabled(self) -> bool:
        return self._publisher is not None

    @property
    def publisher(self) -> ConfirmingPublisher | None:
        return self._publisher

    def start(self, supervisor: Supervisor | None = None) -> None:
        if self._publisher is not None:
            self._publisher.start(supervisor)

    async def stop(self, timeout_s: float) -> None:
        if self._publisher is not None:
            await self._publisher.stop(timeout_s)

    def submit(self, event: events_pb2.CompletionEvent, trace_context: Any = None) -> None:
        """`trace_context`: the request's (None: the current one), carried in the message's headers."""
        if self._publisher is None:
            return
        headers = {"x-sluice-tenant": event.tenant}
        with tracing.producer_span(
            f"publish {self._topology.events_exchange}",
            trace_context,
            {
                "messaging.system": "rabbitmq",
                "messaging.operation": "publish",
                "messaging.destination.name": self._topology.events_exchange,
                "messaging.message.id": event.event_id,
            },
        ):
            tracing.inject_headers(headers)
        self._publisher.submit(
            OutgoingMessage(
                body=event.SerializeToString(),
                routing_key=self._topology.completion_routing_key,
                message_id=event.event_id,
                request_id=event.request_id,
                type=EVENT_TYPE,
                headers=headers,
            )
        )
