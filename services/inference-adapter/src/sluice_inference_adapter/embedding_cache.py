"""A bounded embedding cache in front of the micro-batcher: repeated texts never reach Triton.

`EmbeddingCache` maps (model, text) to one row of a preallocated float32 arena
[capacity_rows, dim] (plus an int32 token count per row, -1 when the model reported none).
There are no per-entry numpy arrays or Python lists of floats: an entry is one key tuple, one
index slot and one row number. Entries are evicted least recently used first, by bytes: each
entry is charged

    row bytes (dim * 4 vector + 4 token count + 4 free-list slot)
    + sys.getsizeof(text)          (the text is kept in the key: a hash alone could collide)
    + ENTRY_OVERHEAD               (key tuple, row int, OrderedDict node and slot; measured,
                                    tests/test_embedding_cache.py checks it with tracemalloc)

and the sum never exceeds the budget, so a long text evicts more than a short one. The arena
has room for the most entries the budget could ever hold (all of them empty texts); rows are
handed out from a LIFO free list, so the rows ever touched (and so resident) are at most the
entries held at once, never more than the budget.

Lookups copy: `get_many` gathers the hit rows into a new array before it returns, so a later
`put_many` that evicts and reuses those rows cannot change what a caller holds (the servicer
turns them into protobuf right after, but an await in between would otherwise be a hazard).

`CachedEmbedder` is the front the servicer calls: it computes each distinct text of a request
once, answers the cached ones from the cache, sends only the misses to the micro-batcher, stores
what comes back, and puts the vectors back in the request's order. A text the batcher refuses as
longer than the model's maximum input (embed_batcher.InputTooLong) is refused under its index in
the request; nothing of that request is stored. A request that asked for truncation gets such a
text's vector (of its first tokens), which is not stored either: the cache answers every caller,
and one that did not ask for truncation must be refused that text, never answered from the cache.

No transport import here (no grpc, no tritonclient).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import structlog

from sluice_common.cgroup import memory_limit
from sluice_common.errors import InvalidArgument
from sluice_inference_adapter import metrics
from sluice_inference_adapter.embed_batcher import Embeddings, InputTooLong
from sluice_inference_adapter.priority import Priority

log = structlog.stdlib.get_logger("sluice.embedding_cache")

# Index cost of one entry besides its text: the (model id, text) tuple (56 bytes), the row int
# (28), the OrderedDict's node (~48 with malloc's header) and its hash-table slot (24 bytes of
# entry plus index, over-allocated up to 3x right after the table grows). Measured ~190 bytes per
# entry on CPython 3.11; 256 leaves room for the table's growth steps.
ENTRY_OVERHEAD = 256
_NO_TOKENS = -1


@dataclass(frozen=True, eq=False)
class Lookup:
    """What the cache held for some texts: `vectors[k]` and `tokens[k]` belong to
    `texts[hit_indexes[k]]`; `misses` are the indexes of the texts it did not hold."""

    hit_indexes: np.ndarray  # intp [hits]
    vectors: np.ndarray  # float32 [hits, dim], a copy: later evictions cannot change it
    tokens: np.ndarray  # int64 [hits], -1 where the model reported no count
    misses: list[int]


class EmbeddingCache:
    """LRU by bytes over one numpy arena; see the module docstring for what is charged."""

    def __init__(self, budget_bytes: int, dim: int) -> None:
        if dim < 1:
            raise ValueError("dim must be at least 1")
        self.dim = dim
        self.row_bytes = dim * 4 + 4 + 4  # vector, token count, free-list slot
        smallest_entry = self.row_bytes + sys.getsizeof("") + ENTRY_OVERHEAD
        if budget_bytes < smallest_entry:
            raise ValueError(f"a budget of {budget_bytes} bytes holds no entry (one costs at least {smallest_entry})")
        self.budget_bytes = budget_bytes
        self.capacity_rows = budget_bytes // smallest_entry
        # np.empty: pages are only resident once a row is written (rows are reused LIFO).
        self._vectors = np.empty((self.capacity_rows, dim), dtype=np.float32)
        self._tokens = np.empty(self.capacity_rows, dtype=np.int32)
        self._free = np.arange(self.capacity_rows - 1, -1, -1, dtype=np.int32)  # a stack; row 0 on top
        self._free_top = self.capacity_rows
        self._index: OrderedDict[tuple[int, str], int] = OrderedDict()  # least recently used first
        self._models: dict[str, int] = {}
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        metrics.EMBED_CACHE_CAPACITY_BYTES.set(budget_bytes)
        metrics.EMBED_CACHE_BYTES.set(0)

    def __len__(self) -> int:
        return len(self._index)

    def entry_bytes(self, text: str) -> int:
        """What one entry holding `text` is charged."""
        return self.row_bytes + sys.getsizeof(text) + ENTRY_OVERHEAD

    def _model_id(self, model: str) -> int:
        return self._models.setdefault(model, len(self._models))

    def get_many(self, model: str, texts: Sequence[str]) -> Lookup:
        """The cached vectors of `texts` (copied out), marking each hit most recently used."""
        model_id = self._model_id(model)
        hit_indexes: list[int] = []
        rows: list[int] = []
        misses: list[int] = []
        index = self._index
        for i, text in enumerate(texts):
            key = (model_id, text)
            row = index.get(key)
            if row is None:
                misses.append(i)
            else:
                index.move_to_end(key)
                hit_indexes.append(i)
                rows.append(row)
        self.hits += len(rows)
        self.misses += len(misses)
        metrics.EMBED_CACHE_HITS.inc(len(rows))
        metrics.EMBED_CACHE_MISSES.inc(len(misses))
        taken = np.asarray(rows, dtype=np.intp)
        return Lookup(
            hit_indexes=np.asarray(hit_indexes, dtype=np.intp),
            vectors=self._vectors[taken],  # fancy indexing copies
            tokens=self._tokens[taken].astype(np.int64),
            misses=misses,
        )

    def put_many(self, model: str, texts: Sequence[str], vectors: np.ndarray, tokens: np.ndarray | None) -> None:
        """Stores `vectors[i]` (and `tokens[i]`; None: the model reports no counts) for each text,
        evicting least recently used entries until each fits. A text whose entry alone exceeds
        the budget is not stored."""
        vectors = np.asarray(vectors)
        if vectors.ndim != 2 or vectors.shape != (len(texts), self.dim):
            raise ValueError(f"expected vectors of shape ({len(texts)}, {self.dim}), got {vectors.shape}")
        model_id = self._model_id(model)
        index = self._index
        for i, text in enumerate(texts):
            key = (model_id, text)
            row = index.get(key)
            if row is None:
                cost = self.entry_bytes(text)
                if cost > self.budget_bytes:
                    continue
                while self.bytes_used + cost > self.budget_bytes or self._free_top == 0:
                    self._evict_oldest()
                self._free_top -= 1
                row = int(self._free[self._free_top])
                index[key] = row
                self.bytes_used += cost
            else:
                index.move_to_end(key)  # computed again by a request that missed meanwhile
            self._vectors[row] = vectors[i]
            self._tokens[row] = _NO_TOKENS if tokens is None else int(tokens[i])
        metrics.EMBED_CACHE_BYTES.set(self.bytes_used)

    def _evict_oldest(self) -> None:
        (_, text), row = self._index.popitem(last=False)
        self._free[self._free_top] = row
        self._free_top += 1
        self.bytes_used -= self.entry_bytes(text)
        self.evictions += 1
        metrics.EMBED_CACHE_EVICTIONS.inc()

    def clear(self) -> None:
        self._index.clear()
        self._free = np.arange(self.capacity_rows - 1, -1, -1, dtype=np.int32)
        self._free_top = self.capacity_rows
        self.bytes_used = 0
        metrics.EMBED_CACHE_BYTES.set(0)


# -- the budget -----------------------------------------------------------------------------


def cache_budget(budget_bytes: int, memory_share: float, read_memory_limit: Callable[[], int | None] = memory_limit) -> tuple[int, str]:
    """(the cache's budget in bytes, 0 for no cache; how it was chosen).

    `budget_bytes` (0: off) is the ceiling; a `memory_share` > 0 of the container's memory limit
    (sluice_common.cgroup) lowers it when that is smaller. With no limit found, `budget_bytes` holds."""
    if budget_bytes <= 0:
        return 0, "off (EMBED_CACHE_BYTES=0)"
    if memory_share <= 0:
        return budget_bytes, "EMBED_CACHE_BYTES"
    limit = read_memory_limit()
    if limit is None:
        return budget_bytes, "EMBED_CACHE_BYTES (no container memory limit found for EMBED_CACHE_MEMORY_SHARE)"
    share = int(limit * memory_share)
    if share < budget_bytes:
        return share, f"EMBED_CACHE_MEMORY_SHARE {memory_share} of the memory limit {limit}"
    return budget_bytes, f"EMBED_CACHE_BYTES (smaller than {memory_share} of the memory limit {limit})"


# -- the front the servicer calls -----------------------------------------------------------


class TextEmbedder(Protocol):
    async def embed(self, texts: Sequence[str], priority: Priority = Priority.INTERACTIVE, truncate: bool = False) -> Embeddings: ...


class CachedEmbedder:
    """Embeds a request's texts: each distinct text once, cached ones from `cache` (None: no
    cache), the rest through `batcher`; vectors come back in the request's order."""

    def __init__(self, batcher: TextEmbedder, model: str, cache: EmbeddingCache | None, max_texts: int) -> None:
        self._batcher = batcher
        self._model = model
        self._cache = cache
        self._max_texts = max_texts
        self._warned = False

    @property
    def cache(self) -> EmbeddingCache | None:
        return self._cache

    async def embed(self, texts: Sequence[str], priority: Priority = Priority.INTERACTIVE, truncate: bool = False) -> Embeddings:
        """`texts`' vectors in order; `truncate`: a text over the model's maximum input is embedded
        cut (and not cached) rather than refused (embed_batcher.InputTooLong)."""
        if isinstance(texts, str):
            raise TypeError("embed takes a list of texts, not one string")
        # The limit holds for the request as sent, whatever the cache holds at the moment.
        if len(texts) > self._max_texts:
            raise InvalidArgument("texts", f"at most {self._max_texts} texts per request, got {len(texts)}")
        positions: dict[str, int] = {}
        inverse = [positions.setdefault(text, len(positions)) for text in texts]
        distinct = list(positions)
        repeated = len(distinct) < len(texts)
        cache = self._cache
        if cache is None and not repeated:
            return await self._batcher.embed(texts, priority, truncate)
        if cache is None:
            return _expand(await self._computed(distinct, texts, priority, truncate), inverse)
        lookup = cache.get_many(self._model, distinct)
        miss_texts = [distinct[i] for i in lookup.misses]
        computed = await self._computed(miss_texts, texts, priority, truncate) if miss_texts else None
        dim = cache.dim if computed is None else computed.vectors.shape[1]
        if dim != cache.dim:
            # The model answers another size than EMBEDDING_DIMENSIONS: nothing can be cached.
            if not self._warned:
                self._warned = True
                log.warning("embedding_not_cached", reason="dimension mismatch", backend_dim=dim, cache_dim=cache.dim)
            if len(lookup.hit_indexes):  # held from before the model changed: compute them again
                computed = await self._computed(distinct, texts, priority, truncate)
                return _expand(computed, inverse if repeated else None)
        vectors = np.empty((len(distinct), dim), dtype=np.float32)
        tokens = np.zeros(len(distinct), dtype=np.int64)
        counted = True
        truncated: np.ndarray | None = None
        if len(lookup.hit_indexes):
            vectors[lookup.hit_indexes] = lookup.vectors
            tokens[lookup.hit_indexes] = lookup.tokens
            counted = bool((lookup.tokens >= 0).all())
        if computed is not None:
            vectors[lookup.misses] = computed.vectors
            if computed.tokens is None:
                counted = False
            else:
                tokens[lookup.misses] = computed.tokens
            if computed.truncated is not None:
                truncated = np.zeros(len(distinct), dtype=np.bool_)
                truncated[lookup.misses] = computed.truncated
            if dim == cache.dim:
                _store(cache, self._model, miss_texts, computed)
        return _expand(Embeddings(vectors, tokens if counted else None, truncated=truncated), inverse if repeated else None)

    async def _computed(self, some: list[str], texts: Sequence[str], priority: Priority, truncate: bool) -> Embeddings:
        """`some` of the request's `texts` through the batcher; a text it refuses as too long is
        named by its first index in the request, not in `some`."""
        try:
            return await self._batcher.embed(some, priority, truncate)
        except InputTooLong as exc:
            raise exc.at(list(texts).index(some[exc.index])) from None


def _store(cache: EmbeddingCache, model: str, texts: list[str], computed: Embeddings) -> None:
    """Caches the computed rows but those of texts the model cut (asked for truncation)."""
    if computed.truncated is None:
        cache.put_many(model, texts, computed.vectors, computed.tokens)
        return
    kept = np.flatnonzero(~computed.truncated)
    tokens = None if computed.tokens is None else computed.tokens[kept]
    cache.put_many(model, [texts[i] for i in kept], computed.vectors[kept], tokens)


def _expand(result: Embeddings, inverse: list[int] | None) -> Embeddings:
    """Rows of the distinct texts put back at every position of the request."""
    if inverse is None:
        return result
    order = np.asarray(inverse, dtype=np.intp)
    return Embeddings(
        result.vectors[order],
        None if result.tokens is None else result.tokens[order],
        truncated=None if result.truncated is None else result.truncated[order],
    )
