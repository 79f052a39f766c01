"""Prefix-aware routing: send a prompt to the replica most likely to hold its longest prefix in its
KV cache, unless that replica is loaded well beyond the least loaded one.

The engines keep a finished sequence's KV cells until live work needs the slot (triton-local's
prefix cache; vLLM's automatic prefix caching), so a prompt that begins like one a replica served
recently prefills only the rest there. Routing by load alone spreads a shared system prompt over
every replica and prefills it on each; routing by cache alone piles a hot prefix onto one replica
(production-stack's finding). This module weighs the two.

What a replica holds is estimated, not asked: the adapter remembers, per replica, the prompts it
sent there, as chained hashes of fixed-size blocks of a canonical serialization of the prompt
(the adapter has no token ids before the engine tokenizes). Block i's hash covers the whole prefix
up to the end of block i, so a match of block i implies blocks 0..i match, and the match length of
a new prompt is the longest run of its leading block hashes a replica's record holds. A record is
bounded (about the replica's slots times a few prompts, since that is all the engine's KV can hold),
oldest prompt forgotten first; a replica that failed, was removed or was added again starts empty.

The choice (`PrefixRouter.choose`): among the candidates whose load is within `load_bound`
sequences of the least loaded one (and that have a free slot, unless none has), the longest match
wins, ties to the less loaded, then to the highest rendezvous hash of the prompt's first block with
the replica's name. The last rule makes several adapters, each learning only from its own traffic,
send a cold prefix to the same replica when loads are equal, so the cache converges without the
adapters talking to each other. No match anywhere: the least loaded (rendezvous among equals).

Plain data and hashing: no grpc, no asyncio.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Characters per hashed block: about 30 tokens of English for a BPE tokenizer, a few times the
# engine's least reusable prefix (triton-local: 8 tokens), so one matched block is worth a route.
BLOCK_CHARS = 128
# Blocks hashed per prompt at most (64k characters, beyond any context this adapter serves).
MAX_BLOCKS = 512
# Prompts remembered per engine slot: the engine holds at most one sequence's cells per slot, but
# which ones it evicted is not known here; a few per slot keeps what it most likely still holds.
PROMPTS_PER_SLOT = 4

# Separators that cannot be confused with text in a prompt (ASCII record/unit separators and a kind
# marker): a chat and a raw prompt never share a prefix (the engine templates one, not the other),
# and messages in order are the prefix of a longer conversation.
_CHAT = "\x02chat\x1d"
_RAW = "\x02raw\x1d"


def canonical_text(messages: Sequence[tuple[str, str]], prompt: str) -> str:
    """The prompt as one string whose prefixes follow the engine's: a chat's messages in order
    (role, content), or the raw prompt."""
    if messages:
        return _CHAT + "".join(f"{role}\x1f{content}\x1e" for role, content in messages)
    return _RAW + prompt


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


@dataclass(frozen=True)
class PromptKey:
    """A prompt's chained block hashes (full blocks only) and its rendezvous affinity: the first
    block's hash, or the whole text's for a prompt shorter than a block. Deterministic across
    processes (blake2b, not Python's salted hash), so adapters agree on it."""

    blocks: tuple[bytes, ...]
    affinity: bytes
    chars: int

    @classmethod
    def of(cls, messages: Sequence[tuple[str, str]], prompt: str, block_chars: int = BLOCK_CHARS) -> PromptKey:
        text = canonical_text(messages, prompt)
        blocks: list[bytes] = []
        previous = b""
        for start in range(0, min(len(text) // block_chars, MAX_BLOCKS) * block_chars, block_chars):
            previous = _digest(previous + text[start : start + block_chars].encode("utf-8", "surrogatepass"))
            blocks.append(previous)
        affinity = blocks[0] if blocks else _digest(text.encode("utf-8", "surrogatepass"))
        return cls(tuple(blocks), affinity, len(text))


def rendezvous(name: str, affinity: bytes) -> int:
    """Highest-random-weight hashing: every adapter ranks replicas alike for one prompt."""
    return int.from_bytes(hashlib.blake2b(affinity + name.encode(), digest_size=8).digest(), "big")


class PrefixRecord:
    """The prompts sent to one replica, as block hashes: at most `capacity` prompts, least
    recently sent forgotten first. A hash stays while any remembered prompt has it."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a prefix record holds at least one prompt, got capacity {capacity}")
        self.capacity = capacity
        # Keyed by the last block's hash, which (chained) identifies every block before it.
        self._prompts: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()
        self._counts: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def blocks(self) -> int:
        """Distinct block hashes held."""
        return len(self._counts)

    def add(self, blocks: tuple[bytes, ...]) -> None:
        if not blocks:
            return
        key = blocks[-1]
        if key in self._prompts:
            self._prompts.move_to_end(key)
            return
        self._prompts[key] = blocks
        for block in blocks:
            self._counts[block] = self._counts.get(block, 0) + 1
        while len(self._prompts) > self.capacity:
            _, oldest = self._prompts.popitem(last=False)
            for block in oldest:
                left = self._counts[block] - 1
                if left:
                    self._counts[block] = left
                else:
                    del self._counts[block]

    def match(self, blocks: tuple[bytes, ...]) -> int:
        """How many leading blocks of `blocks` this replica was sent. Presence is monotone (a held
        hash's prompt holds every hash before it), so a binary search finds the longest run."""
        low, high = 0, len(blocks)
        while low < high:
            middle = (low + high + 1) // 2
            if blocks[middle - 1] in self._counts:
                low = middle
            else:
                high = middle - 1
        return low


@dataclass(frozen=True)
class Candidate:
    name: str
    load: int


@dataclass(frozen=True)
class Choice:
    name: str
    # "prefix": the longest match among replicas within the load bound; "load_bound": a longer
    # match was on a replica loaded beyond the bound, so a shorter one (or the least loaded) was
    # taken; "load": no replica matched, the least loaded (rendezvous among equals); "only_replica".
    reason: str
    matched_blocks: int


class PrefixRouter:
    """Per-replica prefix records and the choice between match and load.

    `slots`: sequences one replica runs at once (its batch or streams in flight); a record keeps
    `slots * prompts_per_slot` prompts, and a replica whose load has reached `slots` (a new
    sequence would wait there) is passed over while another has a free slot. `load_bound`: how many
    more waiting plus running sequences than the least loaded replica a matching one may have."""

    def __init__(self, slots: int, load_bound: int, prompts_per_slot: int = PROMPTS_PER_SLOT, block_chars: int = BLOCK_CHARS) -> None:
        if slots < 1 or load_bound < 0 or prompts_per_slot < 1 or block_chars < 1:
            raise ValueError("slots, prompts_per_slot and block_chars must be >= 1 and load_bound >= 0")
        self.slots = slots
        self.load_bound = load_bound
        self.block_chars = block_chars
        self.capacity = slots * prompts_per_slot
        self._records: dict[str, PrefixRecord] = {}

    def key(self, messages: Sequence[tuple[str, str]], prompt: str) -> PromptKey:
        return PromptKey.of(messages, prompt, self.block_chars)

    def match(self, name: str, key: PromptKey) -> int:
        record = self._records.get(name)
        return record.match(key.blocks) if record is not None else 0

    def record(self, name: str, key: PromptKey) -> None:
        """`key`'s prompt was sent to replica `name`."""
        if not key.blocks:
            return
        record = self._records.get(name)
        if record is None:
            record = self._records[name] = PrefixRecord(self.capacity)
        record.add(key.blocks)

    def forget(self, name: str) -> None:
        """The replica failed, restarted, left or came back: assume its cache is empty."""
        self._records.pop(name, None)

    def remembered(self, name: str) -> int:
        """Prompts remembered for replica `name`."""
        record = self._records.get(name)
        return len(record) if record is not None else 0

    def names(self) -> Iterable[str]:
        return self._records.keys()

    def choose(self, candidates: Sequence[Candidate], key: PromptKey) -> Choice:
        if not candidates:
            raise ValueError("no candidate replica")
        if len(candidates) == 1:
            only = candidates[0]
            return Choice(only.name, "only_replica", self.match(only.name, key))
        least = min(c.load for c in candidates)
        # A replica whose batch is full queues the request: worse than prefilling a prefix again,
        # as long as some replica has a free slot.
        free = least < self.slots
        eligible = [c for c in candidates if c.load <= least + self.load_bound and (c.load < self.slots or not free)]
        matches = {c.name: self.match(c.name, key) for c in candidates}
        chosen = max(eligible, key=lambda c: (matches[c.name], -c.load, rendezvous(c.name, key.affinity)))
        best = max(matches.values())
        matched = matches[chosen.name]
        reason = "load_bound" if best > matched else "prefix" if matched else "load"
        return Choice(chosen.name, reason, matched)
