"""Which free KV slots still hold a finished sequence's tokens, for a new prompt to start from.

A finished sequence's slot keeps its KV cells: the slot is free (a new sequence may take it at
any time, so a cached prefix never makes the engine answer "busy"), and until then a prompt that
begins with the same tokens continues from them and prefills only the rest. Free slots are taken
empty ones first, then the least recently used cached one. No I/O and no model: the engine asks
where a prompt should start and tells the model which cells to keep.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# The fewest prompt tokens worth reusing. From a live sequence's slot, llama.cpp copies the whole
# KV stream (max_context positions): measured here (SmolLM2-135M, 2,048 positions, 2 threads), a
# prefill from a copied slot took 9.5 ms for 16 shared tokens and 16 ms for 1,000, against 40 ms
# and 2,650 ms cold, so a copy pays from about 4 tokens on. A cached slot reused in place costs
# nothing, but a few tokens (a chat template's opening) are not worth giving up its longer prefix for.
MIN_REUSED_TOKENS = 8


def common_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading tokens `a` and `b` share (lists both: a list never equals a tuple)."""
    # A binary search over slice comparisons, which run in C: a thousand-token system prompt is
    # compared against every slot at each prefill.
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


@dataclass
class Cells:
    """What a slot's KV cells hold: the token at each position, and whether its attention was
    computed by the tiled kernel (see exact_reuse; the forward pass says which were: its
    `last_tiled`)."""

    tokens: list[int] = field(default_factory=list)
    tiled: list[bool] = field(default_factory=list)

    def append(self, tokens: list[int], tiled: bool | Sequence[bool]) -> None:
        """`tiled`: one flag for every token, or each token's."""
        self.tokens.extend(tokens)
        if isinstance(tiled, bool):
            self.tiled.extend([tiled] * len(tokens))
        else:
            if len(tiled) != len(tokens):
                raise ValueError(f"{len(tokens)} tokens and {len(tiled)} tiled flags")
            self.tiled.extend(tiled)

    def prefix(self, length: int) -> Cells:
        return Cells(self.tokens[:length], self.tiled[:length])


def exact_reuse(shared: int, cells: Cells, prompt_len: int, tile_rows: int | None) -> int:
    """How many of the `shared` leading tokens a new prompt can take from `cells` and still get,
    bit for bit, the logits a cold prefill of it whole, alone in its step, would give it.

    llama.cpp's CPU flash attention computes a sequence's query rows with a tiled kernel when a
    ubatch carries `tile_rows` (64) or more of them, and row by row below that; the two round
    differently, enough to flip a near tie between two greedy tokens. A cold prefill of a prompt
    whole, alone, computes it tiled throughout when it has `tile_rows` or more tokens (llamacpp_model
    cuts none of a prompt longer than a ubatch under `tile_rows`) and row by row when shorter. So
    every reused position must have been computed by that kernel (the cells say which were), and so
    must every position prefilled now: a prompt of `tile_rows` or more prefills at least its last
    `tile_rows` tokens again. A prompt prefilled in chunks of fewer than `tile_rows` tokens (the
    adapter's bulk rows: 16) ran row by row, so a whole prompt of `tile_rows` or more reuses none of
    its cells past position 0. Such a chunked prompt has no guarantee of its own: cold or warm, once
    it has `tile_rows` or more tokens its logits may differ in the last bits from its whole
    prefill's. Position 0 attends to itself alone, which both kernels compute alike (its value row,
    exactly). `tile_rows` None: the forward pass has no such kernel (numpy, whose reuse is not
    bit-exact either: LlamaModel.reuse_bit_exact), or nothing this rule could keep exact (llama.cpp
    with layers on a GPU, whose kernels depend on the whole batch): the exactness is a CPU
    guarantee."""
    if tile_rows is None:
        return shared
    tiled = prompt_len >= tile_rows
    reuse = max(min(shared, prompt_len - tile_rows) if tiled else shared, 0)
    for position in range(1, reuse):
        if cells.tiled[position] != tiled:
            return position
    return reuse


class PrefixCache:
    """Free slots: empty ones, and cached ones (holding a finished sequence's tokens) in LRU order."""

    def __init__(self, slots: Iterable[int], enabled: bool = True) -> None:
        self.enabled = enabled
        self._empty = sorted(slots, reverse=True)  # pop() hands out the lowest slot first
        self._cached: OrderedDict[int, Cells] = OrderedDict()

    def __len__(self) -> int:
        """Free slots, cached or not: every one can be given to a new sequence."""
        return len(self._empty) + len(self._cached)

    @property
    def cached_slots(self) -> int:
        return len(self._cached)

    @property
    def has_empty(self) -> bool:
        return bool(self._empty)

    def is_free(self, slot: int) -> bool:
        return slot in self._cached or slot in self._empty

    def cells(self, slot: int) -> Cells:
        """What a cached slot holds."""
        return self._cached[slot]

    def worth_keeping(self, cells: Cells) -> bool:
        """Whether a finished sequence's cells could ever be reused: fewer than MIN_REUSED_TOKENS
        never are, and kept they would take the place of a prefix that can (a health probe's
        one-word prompt, every few seconds, evicted a cached prompt each time)."""
        return self.enabled and len(cells.tokens) >= MIN_REUSED_TOKENS

    def free(self, slot: int, cells: Cells | None) -> None:
        """A slot whose sequence ended, and what its KV cells hold (None: forgotten, and cleared by
        the caller). Cells not worth keeping must be cleared by the caller too."""
        if cells is not None and self.worth_keeping(cells):
            self._cached[slot] = cells
        else:
            self._empty.append(slot)

    def longest(self, prompt: list[int], limit: int) -> tuple[int | None, int]:
        """The cached slot sharing the most leading tokens with `prompt` (at most `limit`), and how many."""
        best_slot, best = None, 0
        for slot, cells in self._cached.items():
            shared = min(common_prefix(cells.tokens, prompt), limit)
            if shared > best:
                best_slot, best = slot, shared
        return best_slot, best

    def used(self, slot: int) -> Cells:
        """What a cached slot holds, for a prompt that copies from it: it becomes the most recently
        used (a system prompt's slot that prompts only copy from is the one to keep longest)."""
        self._cached.move_to_end(slot)
        return self._cached[slot]

    def take(self, slot: int) -> Cells:
        """Takes a cached slot for a sequence that continues from its cells; returns them."""
        return self._cached.pop(slot)

    def take_any(self) -> tuple[int, Cells | None]:
        """A free slot for a new sequence, empty first; and the cached prefix it held (evicted), if any."""
        if self._empty:
            return self._empty.pop(), None
        return self._cached.popitem(last=False)

    def clear(self) -> list[int]:
        """Forgets every cached prefix; returns the slots whose cells must be cleared."""
        slots = list(self._cached)
        self._empty.extend(slots)
        self._cached.clear()
        return slots
