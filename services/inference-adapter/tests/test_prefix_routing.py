"""Prefix-aware routing (prefix_routing.py): match lengths of chained block hashes, the bounded
record, the load bound against the match, the deterministic cold choice, forgetting a replica."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sluice_inference_adapter.prefix_routing import (
    BLOCK_CHARS,
    Candidate,
    PrefixRecord,
    PrefixRouter,
    PromptKey,
    canonical_text,
)

SYSTEM = "You are the assistant of a kayak shop. " * 20  # ~780 characters: six full blocks
QUESTION = "Can I return a paddle I bought two weeks ago? " * 4  # more than a block past the system prompt


def chat(system: str, user: str) -> PromptKey:
    return PromptKey.of((("system", system), ("user", user)), "")


def raw(text: str) -> PromptKey:
    return PromptKey.of((), text)


def test_blocks_are_full_blocks_of_the_canonical_text_chained() -> None:
    text = "x" * (3 * BLOCK_CHARS + 5)
    key = raw(text)
    assert len(key.blocks) == len(canonical_text((), text)) // BLOCK_CHARS == 3
    assert key.chars == len(canonical_text((), text))
    # Chained: the same block content at another position hashes differently.
    assert len(set(key.blocks)) == 3
    # A prompt shorter than a block has no blocks, but an affinity of its own.
    short = raw("hello")
    assert short.blocks == () and short.affinity != raw("hullo").affinity


def test_a_chat_and_a_raw_prompt_of_the_same_words_share_no_block() -> None:
    as_chat = PromptKey.of((("user", "y" * 600),), "")
    as_raw = raw("user" + "y" * 600)
    assert not set(as_chat.blocks) & set(as_raw.blocks)


def test_match_is_the_shared_leading_blocks() -> None:
    record = PrefixRecord(capacity=8)
    first = chat(SYSTEM, QUESTION)
    record.add(first.blocks)
    assert record.match(first.blocks) == len(first.blocks)
    # Another question after the same system prompt: every block inside the system prompt matches,
    # the block where the questions differ does not.
    other = chat(SYSTEM, "When do guided trips leave? " * 10)
    shared = len(canonical_text((("system", SYSTEM),), "")) // BLOCK_CHARS
    assert record.match(other.blocks) == shared
    # A different system prompt: nothing, even though later text is the same.
    assert record.match(chat("Another shop entirely. " + SYSTEM, QUESTION).blocks) == 0
    # One changed character early on breaks the chain from its block on.
    changed = SYSTEM[:200] + "Y" + SYSTEM[201:]
    assert record.match(chat(changed, QUESTION).blocks) == (len(_CHAT_HEAD) + 200) // BLOCK_CHARS


_CHAT_HEAD = canonical_text((("system", ""),), "")[: -len("\x1e")]


def test_conversation_turns_extend_the_prefix() -> None:
    record = PrefixRecord(capacity=8)
    turn1 = (("system", SYSTEM), ("user", "Hi there, I have a question about kayaks."))
    record.add(PromptKey.of(turn1, "").blocks)
    turn2 = turn1 + (("assistant", "Sure, ask away. " * 5), ("user", "Which one is best for a beginner?"))
    key = PromptKey.of(turn2, "")
    assert record.match(key.blocks) == len(canonical_text(turn1, "")) // BLOCK_CHARS
    assert 0 < record.match(key.blocks) < len(key.blocks)


def test_the_record_forgets_the_oldest_prompt_first_and_keeps_shared_blocks() -> None:
    record = PrefixRecord(capacity=2)
    a, b, c = (raw(letter * 4 * BLOCK_CHARS) for letter in "abc")
    record.add(a.blocks)
    record.add(b.blocks)
    record.add(a.blocks)  # sent again: a is now the most recent
    record.add(c.blocks)  # over capacity: b, the least recently sent, goes
    assert len(record) == 2
    assert record.match(a.blocks) == 4 and record.match(c.blocks) == 4 and record.match(b.blocks) == 0
    # A hot shared prefix survives while any remembered prompt still has it.
    shared = "s" * 2 * BLOCK_CHARS
    record.add(raw(shared + "1" * BLOCK_CHARS).blocks)
    record.add(raw(shared + "2" * BLOCK_CHARS).blocks)  # evicts a and c; the first shared prompt stays
    assert record.match(raw(shared + "3" * BLOCK_CHARS).blocks) == 2
    record.add(raw("d" * BLOCK_CHARS).blocks)
    record.add(raw("e" * BLOCK_CHARS).blocks)
    assert record.match(raw(shared + "3" * BLOCK_CHARS).blocks) == 0
    assert record.blocks == 2  # no hash leaked from the evicted prompts


def test_capacity_follows_the_slots() -> None:
    router = PrefixRouter(slots=2, load_bound=4, prompts_per_slot=3)
    for i in range(20):
        router.record("a", raw(f"{i:04d}" * BLOCK_CHARS))
    assert router.remembered("a") == router.capacity == 6


def test_the_longest_match_wins_within_the_load_bound() -> None:
    router = PrefixRouter(slots=32, load_bound=4)
    key = chat(SYSTEM, QUESTION)
    router.record("b", chat(SYSTEM, "Something else entirely, a long question. " * 4))
    choice = router.choose([Candidate("a", 0), Candidate("b", 4)], key)
    assert (choice.name, choice.reason) == ("b", "prefix") and choice.matched_blocks > 0
    # A longer match beats a shorter one.
    router.record("a", key)
    assert router.choose([Candidate("a", 1), Candidate("b", 0)], key).name == "a"


def test_the_load_bound_overrides_the_match() -> None:
    router = PrefixRouter(slots=32, load_bound=4)
    key = chat(SYSTEM, QUESTION)
    router.record("b", key)
    choice = router.choose([Candidate("a", 0), Candidate("b", 5)], key)
    assert (choice.name, choice.reason, choice.matched_blocks) == ("a", "load_bound", 0)
    # A shorter match within the bound is taken over the least loaded replica with none.
    router.record("c", chat(SYSTEM, "Other question " * 30))
    choice = router.choose([Candidate("a", 0), Candidate("b", 5), Candidate("c", 3)], key)
    assert (choice.name, choice.reason) == ("c", "load_bound") and 0 < choice.matched_blocks < router.match("b", key)


def test_a_full_replica_is_passed_over_while_another_has_a_free_slot() -> None:
    router = PrefixRouter(slots=4, load_bound=8)
    key = chat(SYSTEM, QUESTION)
    router.record("b", key)
    assert router.choose([Candidate("a", 0), Candidate("b", 3)], key).name == "b"
    assert router.choose([Candidate("a", 0), Candidate("b", 4)], key).name == "a"  # b would queue it
    # Every replica full: the match decides again (within the bound).
    assert router.choose([Candidate("a", 4), Candidate("b", 6)], key).name == "b"


def test_no_match_goes_to_the_least_loaded() -> None:
    router = PrefixRouter(slots=32, load_bound=4)
    choice = router.choose([Candidate("a", 3), Candidate("b", 1), Candidate("c", 2)], chat(SYSTEM, "q"))
    assert (choice.name, choice.reason, choice.matched_blocks) == ("b", "load", 0)
    assert router.choose([Candidate("a", 3)], chat(SYSTEM, "q")).reason == "only_replica"


def test_a_cold_prefix_goes_to_the_same_replica_from_any_adapter_and_spreads_over_prefixes() -> None:
    names = [f"10.0.0.{i}:8001" for i in range(1, 5)]
    candidates = [Candidate(n, 0) for n in names]
    # Two adapters that learned nothing yet (or different things about other prompts), candidates
    # in any order: the same prompt's first block picks the same replica.
    one, two = PrefixRouter(slots=8, load_bound=2), PrefixRouter(slots=8, load_bound=2)
    two.record(names[0], raw("unrelated " * 100))
    picks = set()
    for i in range(40):
        key = chat(f"System prompt number {i}. " + SYSTEM, "q")
        first = one.choose(candidates, key).name
        assert two.choose(list(reversed(candidates)), key).name == first
        # The first block decides: the rest of the prompt does not move a cold choice.
        assert one.choose(candidates, chat(f"System prompt number {i}. " + SYSTEM, "another question")).name == first
        picks.add(first)
    assert picks == set(names)  # different prefixes spread over the replicas


def test_the_cold_choice_is_the_same_in_another_process() -> None:
    """Python salts str hashes per process; the rendezvous hash must not depend on that."""
    code = (
        "from sluice_inference_adapter.prefix_routing import *\n"
        "k = PromptKey.of((('system', 'S' * 300), ('user', 'q')), '')\n"
        "print(PrefixRouter(8, 2).choose([Candidate(n, 0) for n in 'abcdefgh'], k).name)"
    )
    names = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout for _ in range(3)}
    key = PromptKey.of((("system", "S" * 300), ("user", "q")), "")
    assert names == {PrefixRouter(8, 2).choose([Candidate(n, 0) for n in "abcdefgh"], key).name + "\n"}


def test_forgetting_a_replica_empties_its_record() -> None:
    router = PrefixRouter(slots=8, load_bound=4)
    key = chat(SYSTEM, "q")
    router.record("a", key)
    router.record("b", raw("other " * 100))
    assert router.match("a", key) > 0
    router.forget("a")
    assert router.match("a", key) == 0 and router.remembered("a") == 0 and router.remembered("b") == 1


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        PrefixRouter(slots=0, load_bound=1)
    with pytest.raises(ValueError):
        PrefixRouter(slots=4, load_bound=-1)
    with pytest.raises(ValueError):
        PrefixRecord(capacity=0)
