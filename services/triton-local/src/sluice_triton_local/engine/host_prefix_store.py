"""Evicted prefixes kept in host memory, for a later prompt to restore instead of prefilling.

A cached slot (prefix_cache.py) is given up the moment a new sequence needs it, and with every slot
busy the slot that frees first is taken by the next arrival whatever it held: under a full batch a
prompt sent again soon finds its prefix gone. llama-server keeps such prompts in host memory
(`--cache-ram`, 8 GiB by default); so does this store, up to a byte budget, least recently used
first out. An entry is a sequence's KV state as the model serialized it (llama.cpp's
llama_state_seq_get_data, about 23 KB a token for SmolLM2-135M, a millisecond or two to save or
restore) and the Cells it holds. No I/O and no model: the engine saves and restores.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count

from .prefix_cache import Cells, common_prefix


class HostPrefixStore:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self._entries: OrderedDict[int, tuple[Cells, bytes]] = OrderedDict()
        self._ids = count()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def put(self, cells: Cells, state: bytes) -> None:
        """Keeps an evicted slot's state, dropping the least recently used entries to fit; a
        state larger than the whole budget is not kept."""
        if len(state) > self.capacity_bytes:
            return
        while self.bytes + len(state) > self.capacity_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= len(dropped)
        self._entries[next(self._ids)] = (cells, state)
        self.bytes += len(state)

    def longest(self, prompt: list[int], limit: int) -> tuple[int | None, int]:
        """The entry sharing the most leading tokens with `prompt` (at most `limit`), and how many."""
        best_entry, best = None, 0
        for entry, (cells, _) in self._entries.items():
            shared = min(common_prefix(cells.tokens, prompt), limit)
            if shared > best:
                best_entry, best = entry, shared
        return best_entry, best

    def cells(self, entry: int) -> Cells:
        return self._entries[entry][0]

    def take(self, entry: int) -> tuple[Cells, bytes]:
        """Removes an entry to restore it into a slot (the slot holds it from then on)."""
        cells, state = self._entries.pop(entry)
        self.bytes -= len(state)
        return cells, state

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
