"""The stream record: one account of a gateway stream (one clock, its tokens, text and final chunk),
which the rate-limit commit, the CompletionEvent and the default deadline all read."""

from __future__ import annotations

from typing import Any

from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import events_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.inference.v1 import inference_pb2
from sluice.ratelimit.v1 import ratelimit_pb2

from sluice_common.amqp import EventTopology
from sluice_common.tenants import Tenant
from sluice_gateway.path.admission import Admission, prompt_estimate
from sluice_gateway.path.completion_events import CompletionEvents
from sluice_gateway.path.inference_path import InferencePath
from sluice_gateway.path.model_catalog import ModelCatalog
from sluice_gateway.path.stream_record import StreamRecord

USAGE = types_pb2.Usage(prompt_tokens=3, completion_tokens=5, total_tokens=8)


def chunk(text: str = "", tokens: int | None = None, **fields: Any) -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(text=text, token_count=(1 if text else 0) if tokens is None else tokens, **fields)


def test_the_first_token_time_is_set_by_the_first_chunk_with_text_or_a_token() -> None:
    record = StreamRecord(arrived_at=10.0)
    record.observe(chunk(), now=10.5)  # nothing in it (a role-only delta): the last chunk, no first token
    assert (record.first_token_at, record.last_chunk_at) == (None, 10.5)
    record.observe(chunk(tokens=1), now=11.0)  # a token without text yet (half a UTF-8 character)
    record.observe(chunk("a"), now=12.0)
    assert (record.first_token_at, record.last_chunk_at) == (11.0, 12.0)
    assert record.timing() == (1.0, 2, 2.0)
    record = StreamRecord(arrived_at=10.0)
    record.observe(chunk("b", tokens=0), now=10.25)  # text alone is a first token too
    assert record.first_token_at == 10.25


def test_a_stream_cut_off_or_silent_is_timed_to_now() -> None:
    record = StreamRecord(arrived_at=10.0)
    assert record.timing(now=13.0) == (None, 0, 3.0)  # nothing came: censored at now
    record.observe(chunk("a"), now=11.0)
    assert record.timing(now=13.0) == (1.0, 1, 1.0)  # a stream that ended: its last chunk
    assert record.timing(cut=True, now=13.0) == (1.0, 1, 3.0)  # cut off: it ran until now


def test_tokens_from_the_reported_usage_win_over_the_counted_ones() -> None:
    record = StreamRecord()
    record.observe(chunk("a"))
    record.observe(chunk("bcd", tokens=3))  # a chunk carrying several steps' tokens counts them all
    assert (record.completion_tokens, record.tokens, record.used_tokens(100)) == (4, 4, 104)
    record.observe(chunk(".", finish_reason=types_pb2.FINISH_REASON_STOP, usage=USAGE))
    assert record.completion_tokens == 5  # still counted
    assert (record.tokens, record.used_tokens(100)) == (5, 8)  # but the adapter's account is the one read
    assert record.final is not None and record.final.finish_reason == types_pb2.FINISH_REASON_STOP


def test_the_commit_rule_an_empty_or_partial_usage() -> None:
    record = StreamRecord()
    record.observe(chunk("a", finish_reason=types_pb2.FINISH_REASON_STOP, usage=types_pb2.Usage()))
    assert record.used_tokens(100) == 101  # an adapter that does not count: the estimate, never 0
    record.usage = types_pb2.Usage(prompt_tokens=7, completion_tokens=2)  # no total: their sum
    assert record.used_tokens(100) == 9


def test_text_is_kept_only_when_asked_and_only_what_the_event_records() -> None:
    private = StreamRecord(keep_text=False)
    private.observe(chunk("secret"))
    private.observe(chunk(" answer", finish_reason=types_pb2.FINISH_REASON_STOP))
    assert private.parts == [] and private.final is not None
    logged = StreamRecord(keep_text=True)
    logged.observe(chunk("The"))
    logged.observe(chunk(" other choice"), text="")  # n > 1: another choice's text is not the event's
    logged.observe(chunk(" end", finish_reason=types_pb2.FINISH_REASON_STOP), done=False)  # a choice ended, not the request
    assert logged.parts == ["The", " end"] and logged.final is None
    logged.observe(chunk(finish_reason=types_pb2.FINISH_REASON_LENGTH), done=True)
    assert logged.final is not None and logged.final.finish_reason == types_pb2.FINISH_REASON_LENGTH


# The path: the commit, the event and the deadline read the one record the stream updated.

MODEL = types_pb2.ModelInfo(name="g", kind=types_pb2.MODEL_KIND_GENERATION, context_length=2048, max_output_tokens=1024)


class _Call:
    def __init__(self, chunks: list[inference_pb2.GenerateResponse]) -> None:
        self.chunks = chunks

    def __aiter__(self):  # type: ignore[no-untyped-def]
        async def run():  # type: ignore[no-untyped-def]
            for one in self.chunks:
                yield one

        return run()

    def cancel(self) -> None:
        pass


class _Adapter:
    def __init__(self, chunks: list[inference_pb2.GenerateResponse]) -> None:
        self.chunks = chunks

    async def ListModels(self, request, timeout=None):  # noqa: N802 - the stub's name
        return inference_pb2.ListModelsResponse(models=[MODEL])

    def Generate(self, request, timeout=None, metadata=None):  # noqa: N802
        return _Call(self.chunks)


class _RateLimit:
    def __init__(self) -> None:
        self.committed: list[int] = []

    async def Acquire(self, request, timeout=None, metadata=None):  # noqa: N802
        return ratelimit_pb2.AcquireResponse(allowed=True, lease_id="l1")

    async def Commit(self, request, timeout=None, metadata=None):  # noqa: N802
        self.committed.append(request.used_tokens)
        return ratelimit_pb2.CommitResponse()


class _Publisher:
    def __init__(self) -> None:
        self.events: list[events_pb2.CompletionEvent] = []

    def submit(self, message) -> None:  # type: ignore[no-untyped-def]
        self.events.append(events_pb2.CompletionEvent.FromString(message.body))


async def _run(chunks: list[inference_pb2.GenerateResponse]) -> tuple[list[int], events_pb2.CompletionEvent, int]:
    """One stream through the path: what it committed, its event, and the request's input estimate."""
    adapter, ratelimit, publisher = _Adapter(chunks), _RateLimit(), _Publisher()
    catalog = ModelCatalog(adapter)  # type: ignore[arg-type]
    await catalog.refresh()
    admission = Admission(ratelimit)  # type: ignore[arg-type]
    path = InferencePath(adapter, catalog, admission, CompletionEvents(publisher, EventTopology("t")))  # type: ignore[arg-type]
    request = gateway_pb2.GenerateRequest(
        model="g", messages=[types_pb2.ChatMessage(role="user", content="Hello")], sampling=types_pb2.SamplingParams(max_tokens=16)
    )
    estimate = prompt_estimate(request)
    async with path.generate(Tenant("acme", text_logging=True), request, "r1", 10.0) as stream:
        async for _ in stream:
            pass
    await admission.drain()
    (event,) = publisher.events
    return ratelimit.committed, event, estimate


async def test_a_finished_stream_commits_and_logs_the_adapters_usage() -> None:
    committed, event, _ = await _run([chunk("Hi"), chunk("!", finish_reason=types_pb2.FINISH_REASON_STOP, usage=USAGE)])
    assert committed == [8]
    assert (event.output, event.usage.total_tokens, event.finish_reason) == ("Hi!", 8, types_pb2.FINISH_REASON_STOP)


async def test_a_stream_without_usage_commits_and_logs_the_same_counted_tokens() -> None:
    committed, event, estimate = await _run([chunk("Hi"), chunk(" there you", tokens=3)])  # it ends without a final chunk
    assert committed == [estimate + 4]
    assert event.usage.completion_tokens == 4 and event.output == "Hi there you"
    assert event.finish_reason == types_pb2.FINISH_REASON_ERROR
    assert event.timings.total_time_ms >= event.timings.time_to_first_token_ms > 0


class _Choices(_Adapter):
    """n = 2: each Generate call is one choice, answered in turn."""

    def __init__(self, *choices: list[inference_pb2.GenerateResponse]) -> None:
        super().__init__([])
        self.choices = list(choices)

    def Generate(self, request, timeout=None, metadata=None):  # noqa: N802
        return _Call(self.choices.pop(0))


async def test_choice_0s_last_text_is_logged_when_another_choice_ends_the_request() -> None:
    """The event records choice 0's text, all of it: its final chunk's too, though the request
    ends only with the other choice's."""
    adapter, publisher = _Choices([chunk("A"), chunk(" end", finish_reason=types_pb2.FINISH_REASON_STOP, usage=USAGE)],
                                  [chunk("B"), chunk(".", finish_reason=types_pb2.FINISH_REASON_STOP, usage=USAGE)]), _Publisher()  # fmt: skip
    catalog = ModelCatalog(adapter)  # type: ignore[arg-type]
    await catalog.refresh()
    path = InferencePath(adapter, catalog, Admission(None), CompletionEvents(publisher, EventTopology("t")))  # type: ignore[arg-type]
    request = gateway_pb2.GenerateRequest(
        model="g", messages=[types_pb2.ChatMessage(role="user", content="Hello")], sampling=types_pb2.SamplingParams(max_tokens=16, n=2)
    )
    async with path.generate(Tenant("acme", text_logging=True), request, "r1", 10.0) as stream:
        seen = [(stream.index, one.text) async for one in stream]
    assert seen == [(0, "A"), (0, " end"), (1, "B"), (1, ".")]
    (event,) = publisher.events
    assert event.output == "A end"  # choice 0's, not choice 1's
    assert event.usage.completion_tokens == 10  # both choices' (the request's usage)
