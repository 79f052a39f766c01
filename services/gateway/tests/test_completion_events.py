"""The completion-event tracker's domain logic: which event a finished, cancelled or failed stream
becomes, and what a tenant without text logging publishes. The broker path is covered end to end."""

from __future__ import annotations

from typing import Any

import grpc
from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import events_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.inference.v1 import inference_pb2

from sluice_common.amqp import EventTopology

from sluice_common.amqp_publisher import OutgoingMessage
from sluice_gateway.path.completion_events import EVENT_TYPE, CompletionEvents, CompletionTracker
from sluice_gateway.path.stream_record import StreamRecord
from sluice_common.tenants import Tenant

LOGGED = Tenant("acme", text_logging=True)
PRIVATE = Tenant("hush", text_logging=False)


def request(**extra: Any) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model="smollm2-135m-instruct",
        messages=[types_pb2.ChatMessage(role="user", content="What is the capital of France?")],
        sampling=types_pb2.SamplingParams(max_tokens=16, stop=["\n\n"]),
        client_request_id="client-7",
        **extra,
    )


def chunk(text: str = "", **final: Any) -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(text=text, token_count=1 if text else 0, **final)


def final_chunk(text: str = "") -> inference_pb2.GenerateResponse:
    return chunk(
        text,
        finish_reason=types_pb2.FINISH_REASON_STOP,
        usage=types_pb2.Usage(prompt_tokens=12, completion_tokens=3, total_tokens=15),
        timings=types_pb2.Timings(queue_time_ms=1.5, time_to_first_token_ms=40, mean_inter_token_ms=9, total_time_ms=70),
    )


class FakePublisher:
    def __init__(self) -> None:
        self.submitted: list[OutgoingMessage] = []

    def submit(self, message: OutgoingMessage) -> None:
        self.submitted.append(message)


def record(tenant: Tenant) -> StreamRecord:
    """The stream's record, as the path makes it for a tenant (its text kept only when logged)."""
    return StreamRecord(keep_text=tenant.text_logging)


def tracker(tenant: Tenant = LOGGED, **extra: Any) -> CompletionTracker:
    return CompletionTracker(CompletionEvents(None, EventTopology("t")), tenant, request(**extra), "req-1", record(tenant))


def test_a_finished_stream_carries_text_usage_timings_and_ids() -> None:
    t = tracker(response_format=types_pb2.RESPONSE_FORMAT_JSON_OBJECT)
    for piece in ("The", " capital", " is"):
        t.record.observe(chunk(piece))
    t.record.observe(final_chunk(" Paris."))
    t.job_id, t.custom_id = "job-1", "row-9"
    event = t.build()
    assert event.event_id and len(event.event_id) == 32
    assert (event.request_id, event.client_request_id, event.tenant) == ("req-1", "client-7", "acme")
    assert event.model == "smollm2-135m-instruct"
    assert event.priority_class == types_pb2.PRIORITY_CLASS_INTERACTIVE
    assert event.text_logged
    assert event.output == "The capital is Paris."
    assert [m.content for m in event.messages] == ["What is the capital of France?"]
    assert event.sampling.max_tokens == 16 and list(event.sampling.stop) == ["\n\n"]
    assert event.response_format == types_pb2.RESPONSE_FORMAT_JSON_OBJECT
    assert event.finish_reason == types_pb2.FINISH_REASON_STOP
    assert not event.error_code
    # The adapter's own account, from its final message.
    assert (event.usage.prompt_tokens, event.usage.completion_tokens) == (12, 3)
    assert (event.timings.queue_time_ms, event.timings.time_to_first_token_ms, event.timings.total_time_ms) == (1.5, 40, 70)
    assert (event.job_id, event.custom_id) == ("job-1", "row-9")
    assert event.started_at.ToNanoseconds() <= event.finished_at.ToNanoseconds()
    assert tracker().build().event_id != event.event_id


def test_a_cancelled_stream_is_cancelled_with_the_gateways_own_timings() -> None:
    t = tracker()
    t.record.observe(chunk("The"))
    t.record.observe(chunk(" capital"))
    event = t.build(grpc.StatusCode.CANCELLED, cancelled=True)
    assert event.finish_reason == types_pb2.FINISH_REASON_CANCELLED
    assert not event.error_code
    assert event.output == "The capital"
    # No final message from the adapter: tokens counted and timed at the gateway.
    assert event.usage.completion_tokens == 2
    assert event.timings.time_to_first_token_ms > 0
    assert event.timings.total_time_ms >= event.timings.time_to_first_token_ms
    assert event.timings.mean_inter_token_ms >= 0


def test_a_deadline_is_a_cancellation_with_its_code() -> None:
    event = tracker().build(grpc.StatusCode.DEADLINE_EXCEEDED)
    assert event.finish_reason == types_pb2.FINISH_REASON_CANCELLED
    assert event.error_code == "DEADLINE_EXCEEDED"
    assert event.usage.completion_tokens == 0
    assert event.timings.time_to_first_token_ms == 0


def test_a_failed_stream_is_an_error_with_its_status_code() -> None:
    t = tracker()
    t.record.observe(chunk("The"))
    event = t.build(grpc.StatusCode.UNAVAILABLE)
    assert event.finish_reason == types_pb2.FINISH_REASON_ERROR
    assert event.error_code == "UNAVAILABLE"
    assert event.usage.completion_tokens == 1
    assert event.output == "The"
    # A call that ended without any status at all (and no final message) is still an error.
    unknown = tracker().build(None)
    assert unknown.finish_reason == types_pb2.FINISH_REASON_ERROR and unknown.error_code == "UNKNOWN"


def test_text_is_left_out_for_a_tenant_without_text_logging() -> None:
    t = tracker(PRIVATE, prompt="a raw prompt with a secret")
    t.record.observe(chunk("secret"))
    t.record.observe(final_chunk(" answer"))
    event = t.build()
    assert event.tenant == "hush" and not event.text_logged
    assert event.output == "" and event.prompt == "" and len(event.messages) == 0
    assert b"secret" not in event.SerializeToString()
    # Metadata still goes: usage, timings, finish reason, sampling.
    assert event.finish_reason == types_pb2.FINISH_REASON_STOP
    assert event.usage.completion_tokens == 3 and event.timings.total_time_ms == 70
    assert event.sampling.max_tokens == 16
    # The output is not even accumulated.
    assert t.record.parts == []


def test_the_event_is_submitted_only_when_published() -> None:
    """The path publishes a stream's tracker once the stream has closed (the front's done-callback);
    nothing goes out before, whatever the chunks."""
    publisher = FakePublisher()
    events = CompletionEvents(publisher, EventTopology("t"))  # type: ignore[arg-type]
    t = CompletionTracker(events, LOGGED, request(), "req-1", record(LOGGED))
    t.record.observe(chunk("Paris"))
    t.record.observe(final_chunk("."))
    assert publisher.submitted == []
    t.publish()
    (message,) = publisher.submitted
    assert message.routing_key == EventTopology("t").completion_routing_key
    assert message.type == EVENT_TYPE and message.request_id == "req-1"
    assert message.headers == {"x-sluice-tenant": "acme"}
    event = events_pb2.CompletionEvent.FromString(message.body)
    assert event.output == "Paris." and message.message_id == event.event_id


def test_a_cancelled_call_is_reported_as_cancelled() -> None:
    publisher = FakePublisher()
    events = CompletionEvents(publisher, EventTopology("t"))  # type: ignore[arg-type]
    t = CompletionTracker(events, PRIVATE, request(), "req-2", record(PRIVATE))
    t.record.observe(chunk("half"))
    t.publish(grpc.StatusCode.CANCELLED, cancelled=True)
    event = events_pb2.CompletionEvent.FromString(publisher.submitted[0].body)
    assert event.finish_reason == types_pb2.FINISH_REASON_CANCELLED and not event.text_logged and not event.output


def test_publishing_never_raises() -> None:
    class Broken(FakePublisher):
        def submit(self, message: OutgoingMessage) -> None:
            raise RuntimeError("outbox exploded")

    events = CompletionEvents(Broken(), EventTopology("t"))  # type: ignore[arg-type]
    CompletionTracker(events, LOGGED, request(), "req-3", record(LOGGED)).publish()  # logged, not raised


def test_nothing_is_published_when_logging_is_off() -> None:
    events = CompletionEvents(None, EventTopology("t"))
    assert not events.enabled  # the path then makes no tracker at all
    CompletionTracker(events, LOGGED, request(), "req-4", record(LOGGED)).publish()  # and a stray one sends nothing
