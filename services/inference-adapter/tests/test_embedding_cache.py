"""The embedding cache: LRU by bytes over one numpy arena, its budget, and the front that
answers cached texts without the micro-batcher.

The micro-batcher under `CachedEmbedder` is the real `EmbedBatcher` over the recording backend
of test_embed_batcher.py, so each test sees exactly which texts reached the "model".
"""

from __future__ import annotations

import gc
import sys
import tracemalloc

import numpy as np
import pytest
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2

from sluice_common.errors import InvalidArgument
from sluice_inference_adapter.embed_batcher import EmbedBatcher
from sluice_inference_adapter.embedding_cache import (
    ENTRY_OVERHEAD,
    CachedEmbedder,
    EmbeddingCache,
    cache_budget,
)
from sluice_inference_adapter.servicer import InferenceServicer

from test_embed_batcher import DIM, RecordingEmbedBackend, tokens_of, vector_of

MODEL = "emb"


def put(cache: EmbeddingCache, texts: list[str], model: str = MODEL) -> None:
    cache.put_many(model, texts, np.stack([vector_of(t) for t in texts]), np.array([tokens_of(t) for t in texts]))


def held(cache: EmbeddingCache, texts: list[str], model: str = MODEL) -> list[str]:
    """Which of `texts` the cache holds (a lookup, so it refreshes their recency too)."""
    lookup = cache.get_many(model, texts)
    return [texts[i] for i in lookup.hit_indexes]


def room_for(entries: int, text: str = "t000") -> int:
    """A budget of exactly `entries` entries of texts as long as `text`."""
    return entries * EmbeddingCache(1 << 20, DIM).entry_bytes(text)


def test_a_hit_returns_the_vector_and_count_that_were_stored() -> None:
    cache = EmbeddingCache(1 << 20, DIM)
    texts = ["a river", "the sea", "mountains at dawn"]
    put(cache, texts)
    lookup = cache.get_many(MODEL, ["the sea", "unknown", "a river", "mountains at dawn"])
    assert lookup.misses == [1]
    assert lookup.hit_indexes.tolist() == [0, 2, 3]
    for row, text in zip(lookup.vectors, ["the sea", "a river", "mountains at dawn"], strict=True):
        assert np.array_equal(row, vector_of(text))  # bit for bit
        assert row.dtype == np.float32
    assert lookup.tokens.tolist() == [tokens_of("the sea"), tokens_of("a river"), tokens_of("mountains at dawn")]
    assert (cache.hits, cache.misses) == (3, 1)


def test_an_unknown_token_count_is_stored_as_unknown() -> None:
    cache = EmbeddingCache(1 << 20, DIM)
    cache.put_many(MODEL, ["x"], vector_of("x")[None, :], None)
    assert cache.get_many(MODEL, ["x"]).tokens.tolist() == [-1]


def test_returned_vectors_are_copies_that_a_later_eviction_cannot_overwrite() -> None:
    cache = EmbeddingCache(room_for(2), DIM)
    put(cache, ["t000", "t001"])
    lookup = cache.get_many(MODEL, ["t000"])
    put(cache, ["t002", "t003", "t004"])  # evicts both and reuses their rows
    assert held(cache, ["t000", "t001"]) == []
    assert np.array_equal(lookup.vectors[0], vector_of("t000"))


def test_the_least_recently_used_entry_goes_first() -> None:
    cache = EmbeddingCache(room_for(3), DIM)
    put(cache, ["t000", "t001", "t002"])
    assert held(cache, ["t000"]) == ["t000"]  # t000 is now the most recently used
    put(cache, ["t003"])  # evicts t001, the least recently used
    assert held(cache, ["t000", "t001", "t002", "t003"]) == ["t000", "t002", "t003"]
    put(cache, ["t004"])  # the lookup above refreshed t000, t002, t003 in that order
    assert held(cache, ["t000", "t002", "t003", "t004"]) == ["t002", "t003", "t004"]
    assert cache.evictions == 2


def test_storing_a_held_text_again_refreshes_it_without_charging_twice() -> None:
    cache = EmbeddingCache(room_for(2), DIM)
    put(cache, ["t000", "t001"])
    used = cache.bytes_used
    put(cache, ["t000"])
    assert cache.bytes_used == used and len(cache) == 2
    put(cache, ["t002"])  # t001 is now the oldest
    assert held(cache, ["t000", "t001", "t002"]) == ["t000", "t002"]


def test_eviction_is_by_bytes_so_a_long_text_evicts_more() -> None:
    short = [f"t{i:03d}" for i in range(10)]
    cache = EmbeddingCache(room_for(10), DIM)
    put(cache, short)
    assert len(cache) == 10 and cache.evictions == 0
    long_text = "a long document " * 80  # its key costs as much as several short entries
    assert cache.entry_bytes(long_text) > 3 * cache.entry_bytes(short[0])
    put(cache, [long_text])
    evicted = cache.evictions
    assert evicted >= 4
    assert held(cache, short) == short[evicted:]  # the oldest ones, as many as its bytes needed
    assert held(cache, [long_text]) == [long_text]
    assert cache.bytes_used <= cache.budget_bytes
    # A short text that arrives next evicts one short entry, not the long one's worth.
    before = cache.evictions
    put(cache, ["s999"])
    assert cache.evictions - before <= 1


def test_bytes_used_is_what_the_entries_are_charged() -> None:
    cache = EmbeddingCache(1 << 20, DIM)
    texts = ["a", "bb" * 50, "naïve café ☕"]  # non-ASCII texts take more bytes per character
    put(cache, texts)
    assert cache.bytes_used == sum(cache.row_bytes + sys.getsizeof(t) + ENTRY_OVERHEAD for t in texts)
    assert cache.row_bytes == DIM * 4 + 8


def test_a_text_larger_than_the_whole_budget_is_not_stored() -> None:
    cache = EmbeddingCache(room_for(4), DIM)
    put(cache, ["t000", "t001"])
    put(cache, ["x" * cache.budget_bytes])
    assert len(cache) == 2 and cache.evictions == 0


def test_the_same_text_under_two_models_is_two_entries() -> None:
    cache = EmbeddingCache(1 << 20, DIM)
    cache.put_many("model-a", ["same text"], np.ones((1, DIM), np.float32), np.array([3]))
    assert cache.get_many("model-b", ["same text"]).misses == [0]
    cache.put_many("model-b", ["same text"], np.full((1, DIM), 2, np.float32), np.array([5]))
    a, b = cache.get_many("model-a", ["same text"]), cache.get_many("model-b", ["same text"])
    assert a.vectors[0, 0] == 1 and b.vectors[0, 0] == 2
    assert (a.tokens[0], b.tokens[0]) == (3, 5)
    assert len(cache) == 2


def test_a_vector_of_the_wrong_size_is_refused() -> None:
    cache = EmbeddingCache(1 << 20, DIM)
    with pytest.raises(ValueError):
        cache.put_many(MODEL, ["x"], np.ones((1, DIM + 1), np.float32), None)


def test_a_budget_too_small_for_one_entry_is_refused() -> None:
    with pytest.raises(ValueError):
        EmbeddingCache(100, DIM)


def test_many_puts_never_grow_the_arena_or_the_heap_beyond_the_budget() -> None:
    dim = 384
    budget = 2 << 20
    cache = EmbeddingCache(budget, dim)
    arena = cache._vectors  # noqa: SLF001 - the test is about this array staying the one
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((64, dim)).astype(np.float32)
    gc.collect()
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        for round_ in range(400):  # 25,600 distinct texts: ~20x what fits
            texts = [f"sentence {round_}-{i} about rivers and the sea" for i in range(64)]
            cache.put_many(MODEL, texts, vectors, None)
        gc.collect()
        grown, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert cache._vectors is arena and arena.shape == (cache.capacity_rows, dim)  # noqa: SLF001
    assert cache.bytes_used <= budget
    assert cache.evictions > 20_000
    # The index's heap (keys, nodes, table) is what the entries are charged for beyond their rows:
    # what tracemalloc saw grow stays within the charged bytes minus the preallocated rows.
    index_charged = cache.bytes_used - len(cache) * cache.row_bytes
    assert grown - start <= index_charged, (grown - start, index_charged)


# -- the budget ----------------------------------------------------------------------------


def test_the_budget_is_the_smaller_of_bytes_and_the_share() -> None:
    gigabyte = lambda: 1 << 30  # noqa: E731
    assert cache_budget(64 << 20, 0.0, gigabyte)[0] == 64 << 20  # no share: the bytes
    assert cache_budget(512 << 20, 0.1, gigabyte)[0] == int(0.1 * (1 << 30))  # the share is smaller
    assert cache_budget(64 << 20, 0.5, gigabyte)[0] == 64 << 20  # the bytes are smaller
    assert cache_budget(0, 0.5, gigabyte)[0] == 0  # 0 bytes: off, whatever the share


def test_a_share_without_a_memory_limit_falls_back_to_the_bytes() -> None:
    budget, source = cache_budget(64 << 20, 0.1, lambda: None)
    assert budget == 64 << 20 and "no container memory limit" in source


# -- the front: CachedEmbedder over the real micro-batcher -----------------------------------


@pytest.fixture
async def front():
    made: list[EmbedBatcher] = []

    def _make(backend: RecordingEmbedBackend, cache: EmbeddingCache | None, max_waiting: int = 256) -> CachedEmbedder:
        batcher = EmbedBatcher(backend, max_batch=32, max_delay_s=0.0, max_waiting=max_waiting, dim=DIM)
        batcher.start()
        made.append(batcher)
        return CachedEmbedder(batcher, MODEL, cache, batcher.max_texts_per_request)

    yield _make
    for batcher in made:
        await batcher.stop()


def expected(texts: list[str]) -> np.ndarray:
    return np.stack([vector_of(t) for t in texts])


async def test_cached_texts_never_reach_the_backend_and_order_is_kept(front) -> None:
    backend = RecordingEmbedBackend(delay_s=0.0)
    embedder = front(backend, EmbeddingCache(1 << 20, DIM))
    first = await embedder.embed(["a", "b", "c"])
    assert backend.batches == [["a", "b", "c"]]
    second = await embedder.embed(["d", "b", "a", "e"])
    assert backend.batches[1:] == [["d", "e"]]  # only the misses were batched
    assert np.array_equal(first.vectors, expected(["a", "b", "c"]))
    assert np.array_equal(second.vectors, expected(["d", "b", "a", "e"]))
    assert second.tokens is not None and second.tokens.tolist() == [tokens_of(t) for t in ["d", "b", "a", "e"]]
    third = await embedder.embed(["c", "a"])
    assert len(backend.batches) == 2  # all hits: no batch at all
    assert np.array_equal(third.vectors, expected(["c", "a"]))


async def test_repeated_texts_in_one_request_are_computed_once(front) -> None:
    for cache in (None, EmbeddingCache(1 << 20, DIM)):
        backend = RecordingEmbedBackend(delay_s=0.0)
        embedder = front(backend, cache)
        texts = ["x", "y", "x", "x", "z", "y"]
        result = await embedder.embed(texts)
        assert backend.batches == [["x", "y", "z"]]
        assert np.array_equal(result.vectors, expected(texts))
        assert result.tokens is not None and result.tokens.tolist() == [tokens_of(t) for t in texts]


async def test_without_counts_from_the_model_hits_report_none_either(front) -> None:
    backend = RecordingEmbedBackend(delay_s=0.0, counts=False)
    embedder = front(backend, EmbeddingCache(1 << 20, DIM))
    assert (await embedder.embed(["a"])).tokens is None
    assert (await embedder.embed(["a"])).tokens is None  # a hit stored without a count


async def test_the_request_limit_holds_whatever_the_cache_holds(front) -> None:
    embedder = front(RecordingEmbedBackend(delay_s=0.0), EmbeddingCache(1 << 20, DIM), max_waiting=4)
    await embedder.embed(["a"])
    with pytest.raises(InvalidArgument):
        await embedder.embed(["a"] * 5)


async def test_the_servicer_answers_hits_with_their_usage(front) -> None:
    model = types_pb2.ModelInfo(name="gen", kind=types_pb2.MODEL_KIND_GENERATION)
    embedding_model = types_pb2.ModelInfo(name=MODEL, kind=types_pb2.MODEL_KIND_EMBEDDING, embedding_dimensions=DIM)
    backend = RecordingEmbedBackend(delay_s=0.0)
    servicer = InferenceServicer(model, embedding_model)
    servicer.attach(None, front(backend, EmbeddingCache(1 << 20, DIM)))  # type: ignore[arg-type]  # Embed needs no pool
    request = inference_pb2.EmbedRequest(model=MODEL, inputs=["one", "two words"])
    cold = await servicer.Embed(request, None)  # type: ignore[arg-type]
    warm = await servicer.Embed(request, None)  # type: ignore[arg-type]
    assert len(backend.batches) == 1
    assert warm == cold
    assert warm.usage.prompt_tokens == tokens_of("one") + tokens_of("two words")


async def test_a_model_answering_another_size_is_served_but_not_cached(front) -> None:
    backend = RecordingEmbedBackend(delay_s=0.0)
    cache = EmbeddingCache(1 << 20, DIM * 2)  # EMBEDDING_DIMENSIONS set wrong
    cache.put_many(MODEL, ["old"], np.ones((1, DIM * 2), np.float32), None)  # held from an earlier model
    embedder = front(backend, cache)
    result = await embedder.embed(["new", "old", "new"])
    assert np.array_equal(result.vectors, expected(["new", "old", "new"]))  # "old" computed again
    assert backend.batches == [["new"], ["new", "old"]]
    assert cache.get_many(MODEL, ["new"]).misses == [0]


async def test_a_text_over_the_models_maximum_is_refused_under_its_index_in_the_request(front) -> None:
    """The batcher sees each distinct text once, and only the misses: its index is not the request's."""
    from sluice_inference_adapter.embed_batcher import InputTooLong
    from test_embed_batcher import LONG

    for cache in (None, EmbeddingCache(1 << 20, DIM)):
        backend = RecordingEmbedBackend(delay_s=0.0, max_tokens=6)
        embedder = front(backend, cache)
        await embedder.embed(["y"])
        with pytest.raises(InputTooLong) as refused:
            await embedder.embed(["x", "y", "x", LONG, LONG])
        assert refused.value.field_name == "inputs[3]"  # the batcher's second (cached) or third (no cache) text
        assert backend.batches[-1] == (["x", LONG] if cache is not None else ["x", "y", LONG])
        if cache is not None:
            assert cache.get_many(MODEL, ["x", LONG]).misses == [0, 1]  # nothing of the refused request stored
