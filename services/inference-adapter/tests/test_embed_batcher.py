"""The embedding micro-batcher's decisions: what goes into which batch, and when.

`RecordingEmbedBackend` stands in for Triton's embedding model so that each test can see
exactly which texts every batch carried and when it was sent. Its vectors and token counts
are deterministic functions of the text (so order mix-ups show), and it can be told to fail a batch that
contains a given text. The real Triton path (all-MiniLM-L6-v2 in triton-local) is covered
end to end in tests/e2e.
"""

from __future__ import annotations

import asyncio
import time
import zlib

import numpy as np
import pytest
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2

from sluice_common.errors import InvalidArgument, ResourceExhausted, Unavailable
from sluice_inference_adapter import embed_batcher
from sluice_inference_adapter.embed_batcher import EmbedBatcher, Embeddings, InputTooLong
from sluice_inference_adapter.servicer import InferenceServicer
from sluice_inference_adapter.priority import Priority

DIM = 8


def vector_of(text: str) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(text.encode()))
    v = rng.standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def tokens_of(text: str) -> int:
    return len(text.split()) + 2  # words plus [CLS] and [SEP], like a real tokenizer roughly


class RecordingEmbedBackend:
    def __init__(self, delay_s: float = 0.005, fail_on: str | None = None, counts: bool = True, max_tokens: int | None = None) -> None:
        self.batches: list[list[str]] = []
        self.sent_at: list[float] = []
        self.delay = delay_s
        self.fail_on = fail_on
        self.counts = counts  # False: a model without a TOKENS output
        # A model that cuts texts to this many tokens and reports their counts before the cut too.
        self.max_tokens = max_tokens
        self.active = 0
        self.max_active = 0

    async def embed(self, texts: list[str]) -> Embeddings:
        self.batches.append(list(texts))
        self.sent_at.append(time.monotonic())
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.delay)
            if self.fail_on is not None and self.fail_on in texts:
                raise RuntimeError(f"model crashed on {self.fail_on!r}")
            tokens = np.array([tokens_of(t) for t in texts]) if self.counts else None
            if tokens is None or self.max_tokens is None:
                return Embeddings(np.stack([vector_of(t) for t in texts]), tokens)
            return Embeddings(np.stack([vector_of(t) for t in texts]), np.minimum(tokens, self.max_tokens), tokens)
        finally:
            self.active -= 1


def assert_embedded(result: Embeddings, texts: list[str]) -> None:
    """The caller got each of its texts' vector and token count, in its order."""
    np.testing.assert_array_equal(result.vectors, np.stack([vector_of(t) for t in texts]))
    assert result.tokens is not None and result.tokens.tolist() == [tokens_of(t) for t in texts]


@pytest.fixture
async def make():
    batchers: list[EmbedBatcher] = []

    def _make(backend: RecordingEmbedBackend, **kwargs) -> EmbedBatcher:
        options = {"max_batch": 32, "max_delay_s": 0.02, "max_waiting": 256, "dim": DIM, **kwargs}
        batcher = EmbedBatcher(backend, **options)
        batcher.start()
        batchers.append(batcher)
        return batcher

    yield _make
    for batcher in batchers:
        await batcher.stop()


async def test_concurrent_callers_coalesce_into_one_batch(make) -> None:
    backend = RecordingEmbedBackend()
    batcher = make(backend, max_batch=32, max_delay_s=0.05)
    callers = [[f"c{c}-t{i}" for i in range(3)] for c in range(5)]
    results = await asyncio.gather(*(batcher.embed(texts) for texts in callers))
    assert len(backend.batches) == 1
    assert backend.batches[0] == [t for texts in callers for t in texts]
    for texts, result in zip(callers, results):
        assert_embedded(result, texts)


async def test_max_batch_splits_and_a_full_batch_goes_without_waiting(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.0)
    batcher = make(backend, max_batch=4, max_delay_s=5.0)  # only a full batch may go early
    texts = [f"t{i}" for i in range(8)]
    started = time.monotonic()
    result = await asyncio.wait_for(batcher.embed(texts), timeout=2.0)
    assert time.monotonic() - started < 1.0
    assert backend.batches == [texts[:4], texts[4:]]
    assert_embedded(result, texts)


async def test_a_callers_texts_may_be_split_across_batches_shared_with_others(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.0)
    batcher = make(backend, max_batch=4, max_delay_s=0.02)
    a = [f"a{i}" for i in range(3)]
    b = [f"b{i}" for i in range(3)]
    ra, rb = await asyncio.gather(batcher.embed(a), batcher.embed(b))
    assert backend.batches == [["a0", "a1", "a2", "b0"], ["b1", "b2"]]
    assert_embedded(ra, a)
    assert_embedded(rb, b)


async def test_max_delay_bounds_the_wait_of_a_lone_text(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.0)
    batcher = make(backend, max_batch=32, max_delay_s=0.05)
    started = time.monotonic()
    await batcher.embed(["alone"])
    waited = backend.sent_at[0] - started
    assert 0.04 <= waited < 0.5
    assert backend.batches == [["alone"]]


async def test_the_delay_counts_from_the_oldest_waiting_text(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.0)
    batcher = make(backend, max_batch=32, max_delay_s=0.1)
    started = time.monotonic()
    first = asyncio.create_task(batcher.embed(["first"]))
    await asyncio.sleep(0.06)
    second = asyncio.create_task(batcher.embed(["second"]))
    await asyncio.gather(first, second)
    assert backend.batches == [["first", "second"]]
    assert backend.sent_at[0] - started < 0.16  # not 0.06 + 0.1


async def test_zero_delay_sends_at_once(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.0)
    batcher = make(backend, max_batch=32, max_delay_s=0.0)
    result = await asyncio.wait_for(batcher.embed(["x", "y"]), timeout=1.0)
    assert backend.batches == [["x", "y"]]
    assert_embedded(result, ["x", "y"])


async def test_order_is_preserved_for_many_callers_and_batches(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.001)
    batcher = make(backend, max_batch=7, max_delay_s=0.005)

    async def caller(c: int) -> tuple[list[str], Embeddings]:
        await asyncio.sleep(0.001 * (c % 5))
        texts = [f"caller {c} text {i}" for i in range(1 + c % 6)]
        return texts, await batcher.embed(texts)

    for texts, result in await asyncio.gather(*(caller(c) for c in range(40))):
        assert_embedded(result, texts)
    assert max(len(b) for b in backend.batches) <= 7
    assert sum(len(b) for b in backend.batches) == sum(1 + c % 6 for c in range(40))


async def test_while_a_batch_is_at_the_backend_the_next_one_gathers(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.05)
    batcher = make(backend, max_batch=32, max_delay_s=0.0)
    first = asyncio.create_task(batcher.embed(["first"]))
    await asyncio.sleep(0.01)  # "first" is at the backend now
    later = [asyncio.create_task(batcher.embed([f"later{i}"])) for i in range(5)]
    await asyncio.gather(first, *later)
    assert backend.batches == [["first"], [f"later{i}" for i in range(5)]]
    assert backend.max_active == 1


async def test_max_in_flight_allows_concurrent_batches(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.05)
    batcher = make(backend, max_batch=2, max_delay_s=0.0, max_in_flight=3)
    await asyncio.gather(*(batcher.embed([f"t{i}", f"u{i}"]) for i in range(3)))
    assert len(backend.batches) == 3
    assert backend.max_active == 3


async def test_a_backend_failure_fails_exactly_the_callers_in_that_batch(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.0, fail_on="poison")
    batcher = make(backend, max_batch=3, max_delay_s=0.02)
    # Batches: [a0, a1, poison] [b0, b1, c0] -> caller "p" and "a" share the failing batch.
    a = asyncio.create_task(batcher.embed(["a0", "a1"]))
    p = asyncio.create_task(batcher.embed(["poison", "p1"]))  # "p1" would go in batch 2
    b = asyncio.create_task(batcher.embed(["b0", "b1"]))
    results = await asyncio.gather(a, p, b, return_exceptions=True)
    assert isinstance(results[0], Unavailable) and "model crashed" in results[0].message
    assert isinstance(results[1], Unavailable)
    assert_embedded(results[2], ["b0", "b1"])
    assert backend.batches[0] == ["a0", "a1", "poison"]
    # The failed caller's unsent text was dropped, not embedded for nobody.
    assert "p1" not in [t for batch in backend.batches for t in batch]
    # The batcher keeps serving.
    assert_embedded(await batcher.embed(["after"]), ["after"])


async def test_a_malformed_backend_answer_fails_the_batch(make) -> None:
    class ShortBackend(RecordingEmbedBackend):
        async def embed(self, texts: list[str]) -> Embeddings:
            return Embeddings(np.zeros((len(texts) - 1, DIM), np.float32), None)

    class ShortCountsBackend(RecordingEmbedBackend):
        async def embed(self, texts: list[str]) -> Embeddings:
            return Embeddings(np.zeros((len(texts), DIM), np.float32), np.ones(len(texts) - 1))

    for backend in (ShortBackend(), ShortCountsBackend()):
        batcher = make(backend, max_batch=4, max_delay_s=0.0)
        with pytest.raises(Unavailable, match="shape"):
            await batcher.embed(["a", "b"])


class WidthBackend(RecordingEmbedBackend):
    """Answers vectors `width` wide for the batches numbered in `wrong` (0 first), as a replica
    serving another embedding model would; the right width otherwise."""

    def __init__(self, width: int, wrong: set[int]) -> None:
        super().__init__(delay_s=0.0)
        self.width = width
        self.wrong = wrong

    async def embed(self, texts: list[str]) -> Embeddings:
        answer = await super().embed(texts)
        if len(self.batches) - 1 not in self.wrong:
            return answer
        return Embeddings(np.ones((len(texts), self.width), np.float32), answer.tokens)


async def test_a_batch_of_another_width_fails_only_its_callers_and_the_batcher_keeps_serving(make) -> None:
    """A caller split over two batches whose second came back another width: the hand-out raised
    outside any try, the batch's task died, and its callers (another request's too) hung."""
    backend = WidthBackend(width=DIM + 4, wrong={1})
    batcher = make(backend, max_batch=2, max_delay_s=0.02)
    # Batches: [a0, a1] [a2, b0] [b1]: the second, shared by a and b, answers the wrong width.
    a = asyncio.create_task(batcher.embed(["a0", "a1", "a2"]))
    b = asyncio.create_task(batcher.embed(["b0", "b1"]))
    results = await asyncio.wait_for(asyncio.gather(a, b, return_exceptions=True), timeout=2.0)
    for result in results:
        assert isinstance(result, Unavailable) and f"width {DIM + 4}" in result.message and f"dimension is {DIM}" in result.message
    assert backend.batches[:2] == [["a0", "a1"], ["a2", "b0"]]
    assert_embedded(await asyncio.wait_for(batcher.embed(["after"]), timeout=2.0), ["after"])


async def test_a_request_answered_wholly_in_another_width_is_refused(make) -> None:
    """Vectors of another width than the model's dimension went to the caller as if right."""
    batcher = make(WidthBackend(width=DIM * 2, wrong={0}), max_batch=4, max_delay_s=0.0)
    with pytest.raises(Unavailable, match=f"width {DIM * 2}"):
        await asyncio.wait_for(batcher.embed(["a", "b"]), timeout=2.0)


async def test_an_error_while_handing_out_a_batch_fails_its_callers_instead_of_stranding_them(make, monkeypatch) -> None:
    """Whatever goes wrong after the backend answered, no caller of the batch waits for ever. No
    backend answer reaches the hand-out's errors once shapes are checked, so one is injected."""

    def broken_result(vectors: np.ndarray, tokens: np.ndarray | None, truncated: np.ndarray | None = None) -> Embeddings:
        if len(vectors) == 3:
            raise MemoryError("injected")
        return Embeddings(vectors, tokens, truncated=truncated)

    batcher = make(RecordingEmbedBackend(delay_s=0.0), max_batch=8, max_delay_s=0.02)
    monkeypatch.setattr(embed_batcher, "Embeddings", broken_result)
    a = asyncio.create_task(batcher.embed(["a0", "a1", "a2"]))  # settled first in the batch, and fails
    b = asyncio.create_task(batcher.embed(["b0"]))
    ra, rb = await asyncio.wait_for(asyncio.gather(a, b, return_exceptions=True), timeout=2.0)
    assert isinstance(ra, Unavailable) and "injected" in ra.message
    assert isinstance(rb, Unavailable)
    monkeypatch.undo()
    assert_embedded(await asyncio.wait_for(batcher.embed(["after"]), timeout=2.0), ["after"])


async def test_token_counts_sum_per_caller_across_a_shared_batch(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.0)
    batcher = make(backend, max_batch=4, max_delay_s=0.02)
    a = ["one", "two words", "now three words"]
    b = ["a much longer text of eight words here", "short"]
    ra, rb = await asyncio.gather(batcher.embed(a), batcher.embed(b))
    # a shares its batch with b's first text; b's second text went in a batch of its own.
    assert backend.batches == [[*a, b[0]], [b[1]]]
    assert ra.tokens is not None and rb.tokens is not None
    assert ra.tokens.tolist() == [3, 4, 5] and int(ra.tokens.sum()) == 12
    assert rb.tokens.tolist() == [10, 3] and int(rb.tokens.sum()) == 13


async def test_a_model_without_token_counts_gives_none(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.0, counts=False)
    batcher = make(backend, max_batch=4, max_delay_s=0.0)
    result = await batcher.embed(["a", "b"])
    np.testing.assert_array_equal(result.vectors, np.stack([vector_of("a"), vector_of("b")]))
    assert result.tokens is None


async def test_the_queue_bound_rejects_with_resource_exhausted(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.2)
    batcher = make(backend, max_batch=2, max_delay_s=0.0, max_waiting=4, retry_after_s=0.5)
    busy = asyncio.create_task(batcher.embed(["busy0", "busy1"]))
    await asyncio.sleep(0.02)  # at the backend, no longer waiting
    queued = asyncio.create_task(batcher.embed(["q0", "q1", "q2"]))
    await asyncio.sleep(0)
    assert batcher.waiting_count == 3
    with pytest.raises(ResourceExhausted) as info:
        await batcher.embed(["one", "two"])
    assert info.value.retry_after_s == 0.5
    assert info.value.quota_subject == "adapter.embed_queue"
    # One more text still fits.
    fits = asyncio.create_task(batcher.embed(["fits"]))
    await asyncio.gather(busy, queued, fits)
    with pytest.raises(InvalidArgument):
        await batcher.embed([f"x{i}" for i in range(5)])  # could never fit


async def test_interactive_texts_go_before_waiting_bulk_ones(make) -> None:
    """One FIFO for all: an interactive text waited behind every bulk batch queued before it."""
    backend = RecordingEmbedBackend(delay_s=0.05)
    batcher = make(backend, max_batch=2, max_delay_s=0.0)
    busy = asyncio.create_task(batcher.embed(["busy"]))
    await asyncio.sleep(0.01)  # at the backend: what follows waits
    bulk = asyncio.create_task(batcher.embed([f"k{i}" for i in range(4)], Priority.BULK))
    interactive = asyncio.create_task(batcher.embed(["i0", "i1"]))
    await asyncio.wait_for(asyncio.gather(busy, bulk, interactive), timeout=2.0)
    assert backend.batches == [["busy"], ["i0", "i1"], ["k0", "k1"], ["k2", "k3"]]


async def test_bulk_texts_keep_a_share_of_each_batch_while_interactive_ones_keep_coming(make) -> None:
    """Strict priority would starve bulk under steady interactive load: a `bulk_share` of every
    batch formed while bulk texts wait is theirs."""
    backend = RecordingEmbedBackend(delay_s=0.02)
    batcher = make(backend, max_batch=8, max_delay_s=0.0, bulk_share=0.125)  # one slot in 8
    busy = asyncio.create_task(batcher.embed(["busy"]))
    await asyncio.sleep(0.01)
    bulk = asyncio.create_task(batcher.embed(["k0", "k1", "k2"], Priority.BULK))
    interactive = asyncio.create_task(batcher.embed([f"i{i}" for i in range(40)]))  # five full batches
    await asyncio.wait_for(asyncio.gather(busy, bulk, interactive), timeout=5.0)
    bulk_per_batch = [sum(t.startswith("k") for t in batch) for batch in backend.batches[1:]]
    assert bulk_per_batch[:3] == [1, 1, 1]  # done after three batches, not after the interactive 40
    assert all(len(batch) == 8 for batch in backend.batches[1:6])


async def test_a_bulk_backlog_cannot_refuse_interactive_texts(make) -> None:
    """Bulk texts filling `max_waiting` made interactive calls RESOURCE_EXHAUSTED; bulk may hold
    three quarters of it, the rest is kept for interactive texts."""
    backend = RecordingEmbedBackend(delay_s=0.1)
    batcher = make(backend, max_batch=2, max_delay_s=0.0, max_waiting=8)
    busy = asyncio.create_task(batcher.embed(["busy"]))
    await asyncio.sleep(0.01)
    backlog = asyncio.create_task(batcher.embed([f"k{i}" for i in range(6)], Priority.BULK))
    await asyncio.sleep(0)
    with pytest.raises(ResourceExhausted):
        await batcher.embed(["k6"], Priority.BULK)
    with pytest.raises(InvalidArgument, match="at most 6 bulk texts"):
        await batcher.embed([f"x{i}" for i in range(7)], Priority.BULK)  # could never fit
    interactive = asyncio.create_task(batcher.embed(["i0", "i1"]))
    await asyncio.wait_for(asyncio.gather(busy, backlog, interactive), timeout=5.0)
    assert backend.batches[1] == ["i0", "i1"]


async def test_cancelled_caller_texts_are_dropped_before_sending(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.0)
    batcher = make(backend, max_batch=32, max_delay_s=0.05)
    gone = asyncio.create_task(batcher.embed(["gone0", "gone1"]))
    stays = asyncio.create_task(batcher.embed(["stays"]))
    await asyncio.sleep(0.01)
    gone.cancel()
    assert_embedded(await stays, ["stays"])
    assert backend.batches == [["stays"]]
    assert batcher.waiting_count == 0
    with pytest.raises(asyncio.CancelledError):
        await gone


async def test_a_caller_cancelled_after_sending_does_not_disturb_its_batch(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.05)
    batcher = make(backend, max_batch=32, max_delay_s=0.0)
    gone = asyncio.create_task(batcher.embed(["gone"]))
    stays = asyncio.create_task(batcher.embed(["stays"]))
    await asyncio.sleep(0.01)
    gone.cancel()
    assert_embedded(await stays, ["stays"])
    assert backend.batches == [["gone", "stays"]]


async def test_cancelling_the_oldest_text_moves_the_deadline(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.0)
    batcher = make(backend, max_batch=32, max_delay_s=0.1)
    first = asyncio.create_task(batcher.embed(["first"]))
    await asyncio.sleep(0.05)
    second_started = time.monotonic()
    second = asyncio.create_task(batcher.embed(["second"]))
    await asyncio.sleep(0)
    first.cancel()
    await second
    assert backend.batches == [["second"]]
    assert backend.sent_at[0] - second_started >= 0.09  # its own 0.1 s, not first's


async def test_empty_request_and_stop(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.0)
    batcher = make(backend, max_batch=32, max_delay_s=10.0)
    empty = await batcher.embed([])
    assert empty.vectors.shape == (0, DIM) and empty.tokens is not None and empty.tokens.shape == (0,)
    with pytest.raises(TypeError):
        await batcher.embed("not a list")
    pending = asyncio.create_task(batcher.embed(["never sent"]))
    await asyncio.sleep(0.01)
    await batcher.stop()
    with pytest.raises(Unavailable):
        await pending
    with pytest.raises(Unavailable):
        await batcher.embed(["after stop"])
    assert backend.batches == []


async def test_the_servicer_reports_each_requests_own_usage(make) -> None:
    model = types_pb2.ModelInfo(name="gen", kind=types_pb2.MODEL_KIND_GENERATION)
    embedding_model = types_pb2.ModelInfo(name="emb", kind=types_pb2.MODEL_KIND_EMBEDDING, embedding_dimensions=DIM)
    backend = RecordingEmbedBackend(delay_s=0.0)
    servicer = InferenceServicer(model, embedding_model)
    servicer.attach(None, make(backend, max_batch=8, max_delay_s=0.02))  # type: ignore[arg-type]  # Embed needs no pool
    a = inference_pb2.EmbedRequest(model="emb", inputs=["one", "two words"])
    b = inference_pb2.EmbedRequest(model="emb", inputs=["three words here"])
    ra, rb = await asyncio.gather(servicer.Embed(a, None), servicer.Embed(b, None))  # type: ignore[arg-type]
    assert backend.batches == [["one", "two words", "three words here"]]
    assert (ra.usage.prompt_tokens, ra.usage.total_tokens, ra.usage.completion_tokens) == (7, 7, 0)
    assert (rb.usage.prompt_tokens, rb.usage.total_tokens) == (5, 5)
    assert len(ra.embeddings) == 2 and len(rb.embeddings) == 1

    # A model without token counts: no usage at all, rather than a zero that looks real.
    servicer.attach(None, make(RecordingEmbedBackend(delay_s=0.0, counts=False), max_delay_s=0.0))  # type: ignore[arg-type]
    reply = await servicer.Embed(a, None)  # type: ignore[arg-type]
    assert not reply.HasField("usage") and len(reply.embeddings) == 2


async def test_the_servicer_embeds_by_the_requests_priority_class(make) -> None:
    """Embed never read priority_class: a bulk request's texts went ahead of later interactive ones."""
    model = types_pb2.ModelInfo(name="gen", kind=types_pb2.MODEL_KIND_GENERATION)
    embedding_model = types_pb2.ModelInfo(name="emb", kind=types_pb2.MODEL_KIND_EMBEDDING, embedding_dimensions=DIM)
    backend = RecordingEmbedBackend(delay_s=0.05)
    batcher = make(backend, max_batch=2, max_delay_s=0.0)
    servicer = InferenceServicer(model, embedding_model)
    servicer.attach(None, batcher)  # type: ignore[arg-type]  # Embed needs no pool
    busy = asyncio.create_task(batcher.embed(["busy"]))
    await asyncio.sleep(0.01)
    bulk = inference_pb2.EmbedRequest(model="emb", inputs=["k0", "k1"], priority_class=types_pb2.PRIORITY_CLASS_BULK)
    unset = inference_pb2.EmbedRequest(model="emb", inputs=["i0", "i1"])  # no class: interactive, as in Generate
    calls = [servicer.Embed(bulk, None), servicer.Embed(unset, None)]  # type: ignore[arg-type]
    await asyncio.wait_for(asyncio.gather(busy, *calls), timeout=2.0)
    assert backend.batches == [["busy"], ["i0", "i1"], ["k0", "k1"]]


# -- texts over the model's maximum input -------------------------------------------------------

LONG = "one two three four five"  # 7 tokens: over a model cut at 6


async def test_a_text_over_the_models_maximum_fails_its_caller_alone(make) -> None:
    """The model cut such a text to its maximum and the caller got its vector (of part of the text)
    with usage capped at the maximum; OpenAI and vLLM answer 400. The other callers in the batch
    get their vectors."""
    backend = RecordingEmbedBackend(delay_s=0.0, max_tokens=6)
    batcher = make(backend, max_batch=32, max_delay_s=0.05)
    a, b = ["short one", LONG, "and another"], ["b text"]
    ra, rb = await asyncio.gather(batcher.embed(a), batcher.embed(b), return_exceptions=True)
    assert backend.batches == [a + b]  # one batch
    assert isinstance(ra, InputTooLong) and isinstance(ra, InvalidArgument)
    assert (ra.field_name, ra.index, ra.tokens, ra.limit) == ("inputs[1]", 1, 7, 6)
    assert ra.reason == (
        "This model's maximum context length is 6 tokens. However, you requested 7 tokens in the input"
        " for embedding generation. Please reduce the length of the input."
    )
    assert isinstance(rb, Embeddings)
    assert_embedded(rb, b)
    assert_embedded(await batcher.embed(["a", "text at the maximum"]), ["a", "text at the maximum"])  # 6: not cut


async def test_a_refused_callers_texts_still_waiting_are_not_sent(make) -> None:
    backend = RecordingEmbedBackend(delay_s=0.01, max_tokens=6)
    batcher = make(backend, max_batch=2, max_delay_s=0.0)  # one batch in flight at a time
    a = asyncio.ensure_future(batcher.embed(["x", LONG, "y", "z"]))
    await asyncio.sleep(0)
    b = asyncio.ensure_future(batcher.embed(["q"]))
    with pytest.raises(InputTooLong, match=r"inputs\[1\]"):
        await a
    assert_embedded(await b, ["q"])
    assert backend.batches == [["x", LONG], ["q"]]  # y and z were dropped with their caller


async def test_the_servicer_refuses_a_text_over_the_maximum_naming_its_index() -> None:
    """Through the servicer and the cache's front (repeated texts computed once, cached ones not
    sent): the index is the text's in the request, and the gRPC status names it as a bad field."""
    from sluice_common.interceptor import status_for
    from sluice_inference_adapter.embedding_cache import CachedEmbedder, EmbeddingCache

    model = types_pb2.ModelInfo(name="gen", kind=types_pb2.MODEL_KIND_GENERATION)
    embedding_model = types_pb2.ModelInfo(name="emb", kind=types_pb2.MODEL_KIND_EMBEDDING, embedding_dimensions=DIM)
    backend = RecordingEmbedBackend(delay_s=0.0, max_tokens=6)
    batcher = EmbedBatcher(backend, max_batch=32, max_delay_s=0.0, max_waiting=256, dim=DIM)
    batcher.start()
    servicer = InferenceServicer(model, embedding_model)
    servicer.attach(None, CachedEmbedder(batcher, "emb", EmbeddingCache(1 << 20, DIM), 256))  # type: ignore[arg-type]
    try:
        await servicer.Embed(inference_pb2.EmbedRequest(model="emb", inputs=["a"]), None)  # type: ignore[arg-type]  # cached
        request = inference_pb2.EmbedRequest(model="emb", inputs=["a", "b", "b", LONG, "c"])
        with pytest.raises(InvalidArgument) as refused:
            await servicer.Embed(request, None)  # type: ignore[arg-type]
        assert refused.value.field_name == "inputs[3]"
        assert backend.batches[-1] == ["b", LONG, "c"]  # where LONG was the batch's second text
        from google.rpc import error_details_pb2, status_pb2

        status = status_pb2.Status.FromString(dict(status_for(refused.value).trailing_metadata)["grpc-status-details-bin"])
        bad = error_details_pb2.BadRequest()
        assert status.details[0].Unpack(bad) and bad.field_violations[0].field == "inputs[3]"
        assert "maximum context length is 6 tokens" in bad.field_violations[0].description
        # Nothing of the refused request was cached: LONG is computed (and refused) again.
        with pytest.raises(InvalidArgument, match=r"inputs\[0\]"):
            await servicer.Embed(inference_pb2.EmbedRequest(model="emb", inputs=[LONG]), None)  # type: ignore[arg-type]
        assert backend.batches[-1] == [LONG]
        reply = await servicer.Embed(inference_pb2.EmbedRequest(model="emb", inputs=["b", "c"]), None)  # type: ignore[arg-type]
        assert len(reply.embeddings) == 2 and backend.batches[-1] == ["b", "c"]
    finally:
        await batcher.stop()


class MiniLMStandIn:
    """tritonclient's aio client as triton-local's minilm_embed answers (its numpy encoder cuts
    texts at 256 tokens): TOKENS as processed, UNTRUNCATED_TOKENS before the cut; a model of an
    operator's that `declares` only TOKENS is asked for nothing else."""

    def __init__(self, declares: tuple[str, ...] = ("TOKENS", "UNTRUNCATED_TOKENS")) -> None:
        self.declares = declares
        self.asked: list[list[str]] = []

    async def get_model_metadata(self, model: str, as_json: bool = False) -> dict:  # type: ignore[type-arg]
        return {"outputs": [{"name": name} for name in ("EMBEDDING", *self.declares)]}

    async def infer(self, model: str, inputs: list, outputs: list) -> object:  # type: ignore[type-arg]
        from tritonclient.utils import deserialize_bytes_tensor

        texts = [bytes(t).decode() for t in deserialize_bytes_tensor(inputs[0]._raw_content)]
        names = [output.name() for output in outputs]
        self.asked.append(names)
        whole = np.array([len(t.split()) + 2 for t in texts], dtype=np.int32)
        columns = {
            "EMBEDDING": np.stack([vector_of(t) for t in texts]),
            "TOKENS": np.minimum(whole, 256),
            "UNTRUNCATED_TOKENS": whole,
        }

        class Result:
            def as_numpy(self, name: str) -> np.ndarray | None:
                return columns[name] if name in names else None

        return Result()

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("declares", [("TOKENS", "UNTRUNCATED_TOKENS"), ("TOKENS",)], ids=["counts-before-the-cut", "tokens-only"])
async def test_a_text_over_256_tokens_through_the_triton_backend(declares: tuple[str, ...]) -> None:
    """The adapter's Embed end to end but for Triton: TritonEmbedBackend reading a minilm_embed
    stand-in. Counted before the cut, a text over the model's 256 tokens is refused and another
    request in the same micro-batch is answered; a model that reports no such count is served as
    before (usage as the model processed it)."""
    from sluice_inference_adapter.triton_backend import TritonEmbedBackend

    embed_backend = TritonEmbedBackend("127.0.0.1:1", "minilm_embed")
    stand_in = MiniLMStandIn(declares)
    embed_backend._client = stand_in  # type: ignore[assignment]
    batcher = EmbedBatcher(embed_backend, max_batch=32, max_delay_s=0.05, max_waiting=256, dim=DIM)
    batcher.start()
    model = types_pb2.ModelInfo(name="gen", kind=types_pb2.MODEL_KIND_GENERATION)
    servicer = InferenceServicer(model, types_pb2.ModelInfo(name="emb", kind=types_pb2.MODEL_KIND_EMBEDDING, embedding_dimensions=DIM))
    servicer.attach(None, batcher)  # type: ignore[arg-type]
    long = "word " * 300  # 302 tokens
    try:
        over = inference_pb2.EmbedRequest(model="emb", inputs=["a short text", long])
        other = inference_pb2.EmbedRequest(model="emb", inputs=["another request"])
        refused, answered = await asyncio.gather(servicer.Embed(over, None), servicer.Embed(other, None), return_exceptions=True)  # type: ignore[arg-type]
        assert stand_in.asked == [["EMBEDDING", *declares]]  # one micro-batch, the outputs the model declares
        assert isinstance(answered, inference_pb2.EmbedResponse) and answered.usage.prompt_tokens == 4
        if "UNTRUNCATED_TOKENS" in declares:
            assert isinstance(refused, InvalidArgument) and refused.field_name == "inputs[1]"
            assert "maximum context length is 256 tokens. However, you requested 302 tokens" in refused.reason
        else:
            assert isinstance(refused, inference_pb2.EmbedResponse) and refused.usage.prompt_tokens == 5 + 256
    finally:
        await batcher.stop()


# -- truncation asked for (vLLM's truncate_prompt_tokens) ---------------------------------------


async def test_a_caller_that_asks_for_truncation_shares_a_batch_with_one_that_refuses(make) -> None:
    """Per caller: the one that asked gets the cut text's vector, its count the tokens embedded and
    the text marked as cut; the other, in the same batch, is refused that text."""
    backend = RecordingEmbedBackend(delay_s=0.0, max_tokens=6)
    batcher = make(backend, max_batch=32, max_delay_s=0.05)
    a, b = ["short one", LONG], [LONG, "b text"]
    ra, rb = await asyncio.gather(batcher.embed(a, truncate=True), batcher.embed(b), return_exceptions=True)
    assert backend.batches == [a + b]  # one batch
    assert isinstance(ra, Embeddings) and isinstance(rb, InputTooLong) and rb.field_name == "inputs[0]"
    np.testing.assert_array_equal(ra.vectors, np.stack([vector_of(t) for t in a]))
    assert ra.tokens is not None and ra.tokens.tolist() == [tokens_of("short one"), 6]
    assert ra.truncated is not None and ra.truncated.tolist() == [False, True]
    assert (await batcher.embed(["fits"], truncate=True)).truncated is None  # nothing cut: nothing marked


def _servicer_with_minilm(cache: bool = True) -> tuple[InferenceServicer, EmbedBatcher, MiniLMStandIn]:
    """The adapter's Embed as __main__ builds it (the cache's front, the micro-batcher and
    TritonEmbedBackend) over a minilm_embed stand-in that cuts texts at 256 tokens, its ModelInfo
    reporting that maximum as SLUICE_ADAPTER_EMBEDDING_CONTEXT_LENGTH does."""
    from sluice_inference_adapter.embedding_cache import CachedEmbedder, EmbeddingCache
    from sluice_inference_adapter.triton_backend import TritonEmbedBackend

    embed_backend = TritonEmbedBackend("127.0.0.1:1", "minilm_embed")
    stand_in = MiniLMStandIn()
    embed_backend._client = stand_in  # type: ignore[assignment]
    batcher = EmbedBatcher(embed_backend, max_batch=32, max_delay_s=0.05, max_waiting=256, dim=DIM)
    batcher.start()
    model = types_pb2.ModelInfo(name="gen", kind=types_pb2.MODEL_KIND_GENERATION)
    embedding_model = types_pb2.ModelInfo(name="emb", kind=types_pb2.MODEL_KIND_EMBEDDING, embedding_dimensions=DIM, context_length=256)
    servicer = InferenceServicer(model, embedding_model)
    front = CachedEmbedder(batcher, "emb", EmbeddingCache(1 << 20, DIM) if cache else None, 256)
    servicer.attach(None, front)  # type: ignore[arg-type]
    return servicer, batcher, stand_in


@pytest.mark.parametrize("truncate_prompt_tokens", [-1, 256])
async def test_a_400_token_text_is_embedded_cut_for_the_caller_that_asks_and_refused_to_the_other(truncate_prompt_tokens: int) -> None:
    """evaluation-logging's similarity worker sends long prompts and outputs; once the adapter
    refused a text over the model's 256 tokens, its whole call failed and every score in it was
    skipped. A caller that sets truncate_prompt_tokens (-1, or the model's maximum itself) gets the
    vector of the text's first 256 tokens; one that does not, in the same micro-batch, is refused.
    The cut vector is not cached: the refusing caller is refused again later, not answered from it."""
    servicer, batcher, stand_in = _servicer_with_minilm()
    long = " ".join(["word"] * 398)  # 400 tokens with [CLS] and [SEP]
    try:
        asks = inference_pb2.EmbedRequest(model="emb", inputs=["a short text", long], truncate_prompt_tokens=truncate_prompt_tokens)
        refuses = inference_pb2.EmbedRequest(model="emb", inputs=[long, "another request"])
        answered, refused = await asyncio.gather(servicer.Embed(asks, None), servicer.Embed(refuses, None), return_exceptions=True)  # type: ignore[arg-type]
        assert len(stand_in.asked) == 1  # one micro-batch carried both callers' texts
        assert isinstance(answered, inference_pb2.EmbedResponse), answered
        np.testing.assert_allclose([list(e.values) for e in answered.embeddings], [vector_of("a short text"), vector_of(long)], rtol=1e-6)
        assert answered.usage.prompt_tokens == 5 + 256  # the tokens embedded
        assert isinstance(refused, InputTooLong) and refused.field_name == "inputs[0]"
        assert "maximum context length is 256 tokens. However, you requested 400 tokens" in refused.reason
        again = await asyncio.gather(servicer.Embed(inference_pb2.EmbedRequest(model="emb", inputs=[long]), None), return_exceptions=True)  # type: ignore[arg-type]
        assert isinstance(again[0], InputTooLong) and len(stand_in.asked) == 2  # computed (and refused) again
        short = await servicer.Embed(inference_pb2.EmbedRequest(model="emb", inputs=["a short text"]), None)  # type: ignore[arg-type]
        assert len(short.embeddings) == 1 and len(stand_in.asked) == 2  # a text that fits was cached
    finally:
        await batcher.stop()


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (300, r"truncate_prompt_tokens value \(300\) is greater than max_model_len \(256\). Please, select a smaller truncation size."),
        (100, r"emb can cut an input only at its maximum input of 256 tokens, not at 100: send -1"),
        (0, r"emb can cut an input only at its maximum input of 256 tokens, not at 0"),
        (-2, r"must be -1 \(the model's maximum input\) or positive, got -2"),
    ],
)
async def test_a_truncate_prompt_tokens_the_model_cannot_honour_is_refused_naming_it(value: int, says: str) -> None:
    """vLLM cuts at any count up to max_model_len and refuses one over it; this model cuts only at its
    own maximum, so a smaller count is refused too, rather than embedding more than was asked."""
    servicer, batcher, stand_in = _servicer_with_minilm(cache=False)
    try:
        request = inference_pb2.EmbedRequest(model="emb", inputs=["a short text"], truncate_prompt_tokens=value)
        with pytest.raises(InvalidArgument, match=says) as refused:
            await servicer.Embed(request, None)  # type: ignore[arg-type]
        assert refused.value.field_name == "truncate_prompt_tokens" and stand_in.asked == []
    finally:
        await batcher.stop()
