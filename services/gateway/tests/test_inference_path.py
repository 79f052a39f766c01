"""Embed through the shared inference path: a lease first, the reply's usage committed after."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.inference.v1 import inference_pb2
from sluice.ratelimit.v1 import ratelimit_pb2

from sluice_common.errors import ResourceExhausted
from sluice_common.tenants import Tenant
from sluice_gateway.path.admission import Admission
from sluice_gateway.path.inference_path import InferencePath
from sluice_gateway.path.model_catalog import ModelCatalog

EMBEDDING = types_pb2.ModelInfo(name="e", kind=types_pb2.MODEL_KIND_EMBEDDING)
HEADERS = [ratelimit_pb2.BudgetStatus(budget=ratelimit_pb2.BUDGET_REQUESTS_PER_MINUTE, limit=60, remaining=59)]


class _Adapter:
    def __init__(self, usage: types_pb2.Usage | None = None, fail: bool = False) -> None:
        self.usage = usage
        self.fail = fail
        self.calls = 0

    async def ListModels(self, request, timeout=None):  # noqa: N802 - the stub's name
        return inference_pb2.ListModelsResponse(models=[EMBEDDING])

    async def Embed(self, request, timeout=None, metadata=None):  # noqa: N802
        self.calls += 1
        if self.fail:
            raise RuntimeError("the adapter failed")
        return inference_pb2.EmbedResponse(embeddings=[types_pb2.Embedding(values=[1.0])], usage=self.usage)


class _RateLimit:
    def __init__(self, allowed: bool = True) -> None:
        self.allowed = allowed
        self.acquired: list[ratelimit_pb2.AcquireRequest] = []
        self.committed: list[int] = []

    async def Acquire(self, request, timeout=None, metadata=None):  # noqa: N802
        self.acquired.append(request)
        if not self.allowed:
            return ratelimit_pb2.AcquireResponse(allowed=False, denied_by=ratelimit_pb2.BUDGET_REQUESTS_PER_MINUTE)
        return ratelimit_pb2.AcquireResponse(allowed=True, lease_id="l1", budgets=HEADERS)

    async def Commit(self, request, timeout=None, metadata=None):  # noqa: N802
        self.committed.append(request.used_tokens)
        return ratelimit_pb2.CommitResponse()


async def _path(adapter: _Adapter, ratelimit: _RateLimit) -> tuple[InferencePath, Admission]:
    catalog = ModelCatalog(adapter)  # type: ignore[arg-type]
    await catalog.refresh()
    admission = Admission(ratelimit, "closed")  # type: ignore[arg-type]
    return InferencePath(adapter, catalog, admission), admission  # type: ignore[arg-type]


def _request() -> gateway_pb2.EmbedRequest:
    return gateway_pb2.EmbedRequest(model="e", inputs=["abcdef", "abc"])  # estimate (2 + 2) + (1 + 2) = 7


async def test_embed_takes_a_lease_and_commits_the_replys_usage() -> None:
    adapter, ratelimit = _Adapter(types_pb2.Usage(prompt_tokens=5, total_tokens=5)), _RateLimit()
    path, admission = await _path(adapter, ratelimit)
    reply, ticket = await path.embed_with_ticket(Tenant("t"), _request(), "r1", 10.0)
    await admission.drain()
    assert reply.usage.total_tokens == 5 and len(reply.embeddings) == 1
    assert [(a.model, a.requests, a.reserved_tokens) for a in ratelimit.acquired] == [("e", 1, 7)]
    assert ratelimit.committed == [5]
    assert dict(ticket.metadata)["x-ratelimit-remaining-requests"] == "59"
    assert ticket.requests_per_minute == 60


async def test_a_denied_embed_never_reaches_the_adapter() -> None:
    adapter = _Adapter()
    path, _ = await _path(adapter, _RateLimit(allowed=False))
    with pytest.raises(ResourceExhausted):
        await path.embed_with_ticket(Tenant("t"), _request(), "r1", 10.0)
    assert adapter.calls == 0


async def test_a_failed_or_uncounted_embed_commits_the_estimate() -> None:
    for adapter in (_Adapter(fail=True), _Adapter(usage=None)):
        ratelimit = _RateLimit()
        path, admission = await _path(adapter, ratelimit)
        with contextlib.suppress(RuntimeError):
            await path.embed_with_ticket(Tenant("t"), _request(), "r1", 10.0)
        await admission.drain()
        assert ratelimit.committed == [7]


async def test_an_uncounted_embed_answers_no_usage_not_zero_tokens() -> None:
    """The adapter leaves usage out when the model counted nothing; copied as it was, the unset
    field was present in the gateway's answer and read as 0 tokens (OpenAI's usage then 0, not null)."""
    path, _ = await _path(_Adapter(usage=None), _RateLimit())
    reply, _ticket = await path.embed_with_ticket(Tenant("t"), _request(), "r1", 10.0)
    assert not reply.HasField("usage") and len(reply.embeddings) == 1


GENERATION = types_pb2.ModelInfo(name="g", kind=types_pb2.MODEL_KIND_GENERATION, context_length=2048, max_output_tokens=1024)


class _CountingAdapter(_Adapter):
    def __init__(self, prompt_tokens: int | None) -> None:
        super().__init__()
        self.prompt_tokens = prompt_tokens
        self.counted = 0

    async def ListModels(self, request, timeout=None):  # noqa: N802
        return inference_pb2.ListModelsResponse(models=[GENERATION])

    async def CountTokens(self, request, timeout=None, metadata=None):  # noqa: N802
        import grpc

        self.counted += 1
        if self.prompt_tokens is None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "cannot count")
        return inference_pb2.CountTokensResponse(prompt_tokens=self.prompt_tokens, context_length=2048)

    def Generate(self, request, timeout=None, metadata=None):  # noqa: N802
        self.generated = request
        return _EmptyCall()


class _EmptyCall:
    def cancel(self) -> None:
        pass

    def __aiter__(self):  # type: ignore[no-untyped-def]
        return self

    async def __anext__(self):  # type: ignore[no-untyped-def]
        raise StopAsyncIteration


def _generate(content: str, max_tokens: int = 100) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model="g", messages=[types_pb2.ChatMessage(role="user", content=content)], sampling=types_pb2.SamplingParams(max_tokens=max_tokens)
    )


async def test_a_prompt_beyond_the_context_is_refused_before_any_lease() -> None:
    from sluice_common.errors import ContextLengthExceeded

    adapter, ratelimit = _CountingAdapter(prompt_tokens=1_000_000), _RateLimit()
    path, _ = await _path(adapter, ratelimit)
    with pytest.raises(ContextLengthExceeded) as caught:
        async with path.generate(Tenant("t"), _generate("1" * 1_000_000), "rid", 10.0):
            pass
    # OpenAI's wording (and vLLM's), which clients match to trim a conversation.
    assert caught.value.reason == (
        "This model's maximum context length is 2048 tokens. However, you requested 1000100 tokens"
        " (1000000 in the messages, 100 in the completion). Please reduce the length of the messages or completion."
    )
    assert caught.value.field_name == "messages" and caught.value.prompt_tokens == 1_000_000
    assert ratelimit.acquired == [] and adapter.counted == 1


async def test_a_short_prompt_is_not_counted_and_a_long_one_that_fits_goes_on() -> None:
    adapter = _CountingAdapter(prompt_tokens=1500)
    path, _ = await _path(adapter, _RateLimit())
    await path.check_context(_generate("Hello"), 10.0)
    assert adapter.counted == 0  # the estimate fits: no round trip
    await path.check_context(_generate("word " * 1500), 10.0)  # estimated over, counted under
    assert adapter.counted == 1


async def test_a_model_that_cannot_count_leaves_the_decision_to_the_backend() -> None:
    path, _ = await _path(_CountingAdapter(prompt_tokens=None), _RateLimit())
    await path.check_context(_generate("1" * 10_000), 10.0)


async def _defaulting_path(adapter: _CountingAdapter, default_max_tokens: int) -> InferencePath:
    catalog = ModelCatalog(adapter)  # type: ignore[arg-type]
    await catalog.refresh()
    return InferencePath(adapter, catalog, Admission(None), default_max_tokens=default_max_tokens)  # type: ignore[arg-type]


async def test_max_tokens_omitted_defaults_to_the_remaining_context_capped_by_the_configured_default() -> None:
    adapter = _CountingAdapter(prompt_tokens=1500)
    path = await _defaulting_path(adapter, default_max_tokens=700)
    short = _generate("Hello", max_tokens=0)
    await path.apply_defaults(short, 10.0)
    assert short.sampling.max_tokens == 700 and adapter.counted == 0  # the cap fits: no round trip
    long = _generate("word " * 1500, max_tokens=0)
    await path.apply_defaults(long, 10.0)
    assert long.sampling.max_tokens == 2048 - 1500 and adapter.counted == 1
    given = _generate("Hello", max_tokens=5)
    await path.apply_defaults(given, 10.0)
    assert given.sampling.max_tokens == 5


async def test_a_long_prompt_without_max_tokens_is_counted_once_for_its_default_and_its_fit() -> None:
    adapter = _CountingAdapter(prompt_tokens=1500)
    path, _ = await _path(adapter, _RateLimit())
    async with path.generate(Tenant("t"), _generate("word " * 1500, max_tokens=0), "rid", 10.0):
        pass
    assert adapter.generated.sampling.max_tokens == 2048 - 1500 and adapter.counted == 1


async def test_max_tokens_omitted_is_capped_by_the_models_limit_and_a_full_prompt_is_refused() -> None:
    from sluice_common.errors import InvalidArgument

    adapter = _CountingAdapter(prompt_tokens=2048)
    path = await _defaulting_path(adapter, default_max_tokens=100_000)
    short = _generate("Hello", max_tokens=0)
    await path.apply_defaults(short, 10.0)
    assert short.sampling.max_tokens == 1024  # GENERATION's max_output_tokens
    with pytest.raises(InvalidArgument) as caught:
        await path.apply_defaults(_generate("word " * 2000, max_tokens=0), 10.0)
    assert caught.value.field_name == "messages" and caught.value.reason == (
        "This model's maximum context length is 2048 tokens. However, your messages resulted in 2048 tokens,"
        " which leaves no room for the completion. Please reduce the length of the messages."
    )


class _UncountingAdapter(_CountingAdapter):
    """CountTokens fails with `code`: a model that cannot count (UNIMPLEMENTED), or a transient failure."""

    def __init__(self, code: object) -> None:
        super().__init__(prompt_tokens=None)
        self.code = code

    async def CountTokens(self, request, timeout=None, metadata=None):  # noqa: N802
        import grpc

        self.counted += 1
        raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), "no count")  # type: ignore[arg-type]


@pytest.mark.parametrize("code", ["UNIMPLEMENTED", "UNAVAILABLE", "DEADLINE_EXCEEDED"])
async def test_max_tokens_omitted_without_a_count_is_the_cap_never_a_refusal_or_a_cut_on_the_estimate(code: str) -> None:
    """The estimate (bytes / 3) stood in for a count it never was: a prompt it guessed over the context
    was refused quoting the guess as its length, and one near it had max_tokens cut, even when the
    count had failed only for now. Without a count the backend decides, as check_context lets it."""
    import grpc

    adapter = _UncountingAdapter(getattr(grpc.StatusCode, code))
    path = await _defaulting_path(adapter, default_max_tokens=700)
    beyond = _generate("word " * 10_000, max_tokens=0)  # estimated ~16,700 tokens, the context 2,048
    assert await path.apply_defaults(beyond, 10.0) is None
    assert beyond.sampling.max_tokens == 700 and adapter.counted == 1
    near = _generate("word " * 1000, max_tokens=0)  # estimated ~1,700: 700 was cut to ~350
    await path.apply_defaults(near, 10.0)
    assert near.sampling.max_tokens == 700
    async with path.generate(Tenant("t"), _generate("word " * 10_000, max_tokens=0), "rid", 10.0):
        pass
    assert adapter.generated.sampling.max_tokens == 700  # the backend decides


# Digits take a token each (SmolLM2 splits them): 1,500 of them are 1,500 tokens and more, while
# the 3-bytes-a-token estimate reads about 540 with the template.
DIGITS = "7" * 1500
DIGITS_COUNTED = 1530  # what the engine prefills for that chat, its template included


async def test_a_prompt_the_estimate_under_counts_is_counted_for_its_default_max_tokens() -> None:
    adapter = _CountingAdapter(prompt_tokens=DIGITS_COUNTED)
    path = await _defaulting_path(adapter, default_max_tokens=1024)
    request = _generate(DIGITS, max_tokens=0)
    assert await path.apply_defaults(request, 10.0) == DIGITS_COUNTED
    # The default fits what the engine prefills (the estimate's 1,024 would not: the engine refuses it).
    assert request.sampling.max_tokens == 2048 - DIGITS_COUNTED and adapter.counted == 1


async def test_a_prompt_the_estimate_under_counts_is_counted_against_the_context_and_reserved_as_counted() -> None:
    from sluice_common.errors import InvalidArgument

    adapter, ratelimit = _CountingAdapter(prompt_tokens=DIGITS_COUNTED), _RateLimit()
    path, _ = await _path(adapter, ratelimit)
    with pytest.raises(InvalidArgument, match=r"you requested 2530 tokens \(1530 in the messages, 1000 in the completion\)"):
        await path.check_context(_generate(DIGITS, max_tokens=1000), 10.0)
    # 512 fits the engine's count (2,042 of 2,048) but not the bound (2,052): it is counted.
    async with path.generate(Tenant("t"), _generate(DIGITS, max_tokens=512), "rid", 10.0):
        pass
    assert adapter.counted == 2
    # The lease reserves the engine's count, not the estimate.
    assert [a.reserved_tokens for a in ratelimit.acquired] == [DIGITS_COUNTED + 512]


class _Call:
    """An adapter Generate call: iterable chunks, cancellable."""

    def __init__(self, chunks: list[inference_pb2.GenerateResponse]) -> None:
        self.chunks = chunks
        self.cancelled = False

    def __aiter__(self):  # type: ignore[no-untyped-def]
        async def run():  # type: ignore[no-untyped-def]
            for chunk in self.chunks:
                yield chunk

        return run()

    def cancel(self) -> None:
        self.cancelled = True


class _GeneratingAdapter(_CountingAdapter):
    def __init__(self) -> None:
        super().__init__(prompt_tokens=10)
        self.requests: list[inference_pb2.GenerateRequest] = []

    def Generate(self, request, timeout=None, metadata=None):  # noqa: N802
        self.requests.append(request)
        usage = types_pb2.Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
        return _Call(
            [
                inference_pb2.GenerateResponse(text="Hi", token_count=1),
                inference_pb2.GenerateResponse(text="!", token_count=1, finish_reason=types_pb2.FINISH_REASON_STOP, usage=usage),
            ]
        )


class _Publisher:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def submit(self, message) -> None:  # type: ignore[no-untyped-def]
        self.bodies.append(message.body)


async def _tracking_path() -> tuple[InferencePath, _GeneratingAdapter, _Publisher]:
    from sluice_common.amqp import EventTopology
    from sluice_gateway.path.completion_events import CompletionEvents

    adapter, publisher = _GeneratingAdapter(), _Publisher()
    catalog = ModelCatalog(adapter)  # type: ignore[arg-type]
    await catalog.refresh()
    events = CompletionEvents(publisher, EventTopology("t"))  # type: ignore[arg-type]
    return InferencePath(adapter, catalog, Admission(None), events, default_max_tokens=64), adapter, publisher  # type: ignore[arg-type]


def _events(publisher: _Publisher) -> list:  # type: ignore[type-arg]
    from sluice.evallog.v1 import events_pb2

    return [events_pb2.CompletionEvent.FromString(body) for body in publisher.bodies]


async def test_the_path_tracks_every_front_the_same_way() -> None:
    from sluice_common.errors import InvalidArgument

    # A front without a close hook (HTTP): published when the `async with` ends, with the defaults applied.
    path, adapter, publisher = await _tracking_path()
    async with path.generate(Tenant("acme"), _generate("Hello", max_tokens=0), "r1", 10.0) as stream:
        assert "".join([chunk.text async for chunk in stream]) == "Hi!"
    [event] = _events(publisher)
    assert (event.tenant, event.output, event.finish_reason, event.usage.total_tokens) == ("acme", "Hi!", types_pb2.FINISH_REASON_STOP, 5)
    assert event.sampling.max_tokens == 64 and adapter.requests[0].sampling.max_tokens == 64
    # A refused request is an event too.
    with pytest.raises(InvalidArgument):
        async with path.generate(Tenant("acme"), _generate("Hello", max_tokens=-1), "r2", 10.0):
            pass
    assert _events(publisher)[1].error_code == "INVALID_ARGUMENT"
    # gRPC: published when the front says its stream has closed, not before.
    closers: list = []  # type: ignore[type-arg]
    async with path.generate(Tenant("acme"), _generate("Hello"), "r3", 10.0, when_closed=closers.append) as stream:
        [chunk async for chunk in stream]
    assert len(publisher.bodies) == 2
    closers[0](None, False)
    assert _events(publisher)[2].request_id == "r3"
    # A bulk row: published at its final chunk, with its job and custom ids.
    async with path.generate(Tenant("acme"), _generate("Hello"), "r4", 10.0, row=("job-1", "row-1")) as stream:
        [chunk async for chunk in stream]
    assert (_events(publisher)[3].job_id, _events(publisher)[3].custom_id) == ("job-1", "row-1")
    assert len(publisher.bodies) == 4


class _ReconnectingChannel:
    """An adapter channel with no replica to call yet (between one adapter's restart and the next)."""

    def get_state(self, try_to_connect: bool = False):  # type: ignore[no-untyped-def]
        import grpc

        return grpc.ChannelConnectivity.TRANSIENT_FAILURE

    async def wait_for_state_change(self, state) -> None:  # type: ignore[no-untyped-def]
        await asyncio.Event().wait()  # no change until the call is cancelled


async def test_a_generate_cancelled_while_it_waits_for_a_replica_settles_its_lease() -> None:
    adapter, ratelimit = _GeneratingAdapter(), _RateLimit()
    catalog = ModelCatalog(adapter)  # type: ignore[arg-type]
    await catalog.refresh()
    admission = Admission(ratelimit, "closed")  # type: ignore[arg-type]
    path = InferencePath(adapter, catalog, admission, adapter_channel=_ReconnectingChannel())  # type: ignore[arg-type]

    async def generate() -> None:
        async with path.generate(Tenant("t"), _generate("Hello"), "r1", 3.0) as stream:
            [chunk async for chunk in stream]

    call = asyncio.create_task(generate())
    while not ratelimit.acquired:  # admitted, then waiting for the channel
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    call.cancel()  # the client's deadline or its going away
    with contextlib.suppress(asyncio.CancelledError):
        await call
    await admission.drain()
    assert adapter.requests == [] and len(ratelimit.committed) == 1


async def test_the_adapter_is_given_what_is_left_of_the_clients_deadline() -> None:
    """Admission (and counting, and a wait for a replica) spend the client's time: the adapter's
    deadline is what is left of it, not the whole again."""

    class SlowRateLimit(_RateLimit):
        async def Acquire(self, request, timeout=None, metadata=None):  # noqa: N802
            await asyncio.sleep(0.3)
            return await super().Acquire(request, timeout, metadata)

    class RecordingAdapter(_GeneratingAdapter):
        timeouts: list[float] = []

        def Generate(self, request, timeout=None, metadata=None):  # noqa: N802
            self.timeouts.append(timeout)
            return super().Generate(request, timeout, metadata)

    adapter = RecordingAdapter()
    catalog = ModelCatalog(adapter)  # type: ignore[arg-type]
    await catalog.refresh()
    path = InferencePath(adapter, catalog, Admission(SlowRateLimit(), "closed", timeout_s=2.0))  # type: ignore[arg-type]
    async with path.generate(Tenant("t"), _generate("Hello"), "r1", 5.0) as stream:
        [chunk async for chunk in stream]
    [given] = adapter.timeouts
    assert 0 < given <= 4.7 + 1e-6  # the 0.3 s admission took is not given again
