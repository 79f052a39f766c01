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
from sluice_inference_adapter.embed_batcher import EmbedBatcher, Embeddings
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
    def __init__(self, delay_s: float = 0.005, fail_on: str | None = None, counts: bool = True) -> None:
        self.batches: list[list[str]] = []
        self.sent_at: list[float] = []
        self.delay = delay_s
        self.fail_on = fail_on
        self.counts = counts  # False: a model without a TOKENS output
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
            return Embeddings(np.stack([vector_of(t) for t in texts]), tokens)
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

    def broken_result(vectors: np.ndarray, tokens: np.ndarray | None) -> Embeddings:
        if len(vectors) == 3:
            raise MemoryError("injected")
        return Embeddings(vectors, tokens)

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
