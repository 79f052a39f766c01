"""The prefix cache (issue 24): a prompt that begins with tokens a slot holds prefills only the rest,
its greedy output is the output without the cache, and cached slots never turn live work away."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from conftest import recorded_logits

from sluice_triton_local.engine.host_prefix_store import HostPrefixStore
from sluice_triton_local.engine.prefix_cache import MIN_REUSED_TOKENS, Cells, PrefixCache, common_prefix, exact_reuse
from sluice_common.sampling import Sampling
from sluice_triton_local.engine.step_engine import StepEngine
from sluice_triton_local.engine.rows import DecodeRow, PrefillRow, ReleaseRow, RowResult
from sluice_triton_local.model_files import gguf_path

SYSTEM = (
    "You are the support assistant of a small bicycle shop in a river town. Answer in one short"
    " sentence, politely, and never invent prices. The shop repairs city bikes, cargo bikes and"
    " children's bikes, sells helmets, locks, lights and inner tubes, and rents tandems on weekends."
    " Opening hours are nine to six on weekdays and ten to four on Saturdays; it is closed on Sundays."
    " If a question is not about bicycles, say that you can only help with bicycles."
)
QUESTIONS = ("Do you repair cargo bikes?", "Can I rent a tandem on Sunday?", "Do you sell lights?")
GREEDY = Sampling(max_tokens=12)


def test_common_prefix_counts_leading_equal_tokens() -> None:
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([5], [1]) == 0
    assert common_prefix([], [1]) == 0
    long = list(range(1000))
    assert common_prefix(long, [*long[:777], -1, *long[778:]]) == 777


def cells(tokens: list[int], tiled: bool = False) -> Cells:
    held = Cells()
    held.append(tokens, tiled)
    return held


def test_reuse_stops_where_a_cold_prefill_would_compute_attention_otherwise() -> None:
    """llama.cpp's CPU attention: a tiled kernel for 64+ rows of a sequence a step, row by row below."""
    tiled_prompt = Cells()
    tiled_prompt.append(list(range(100)), tiled=True)  # a 100-token prompt prefilled whole
    tiled_prompt.append([7, 8], tiled=False)  # and two decoded tokens
    # A whole 150-token prompt sharing 90 tokens: its last 64 are prefilled again (the tiled kernel).
    assert exact_reuse(90, tiled_prompt, 150, 64) == 150 - 64
    assert exact_reuse(40, tiled_prompt, 150, 64) == 40
    # A short prompt is prefilled row by row when cold: cells computed tiled are not the same (but
    # position 0, attending to itself alone, is computed alike by both kernels).
    assert exact_reuse(50, tiled_prompt, 60, 64) == 1
    short = cells(list(range(30)))
    assert exact_reuse(29, short, 30, 64) == 29
    # Decoded cells (row by row) are never what a cold prefill of 64+ tokens computes.
    assert exact_reuse(101, tiled_prompt, 200, 64) == 100
    # A prompt prefilled beside other rows, split into ubatches of fewer than 64 of its rows
    # (llamacpp_model.ubatch_rows): only its positions that ran tiled are reused for a long prompt.
    beside = Cells()
    beside.append(list(range(100)), [False] * 1 + [True] * 39 + [False] * 60)
    assert exact_reuse(90, beside, 200, 64) == 40
    # No batch-dependent kernel: every shared token.
    assert exact_reuse(90, tiled_prompt, 150, None) == 90


def test_free_slots_go_empty_first_then_least_recently_cached() -> None:
    cache = PrefixCache(range(3))
    assert [cache.take_any() for _ in range(3)] == [(0, None), (1, None), (2, None)]
    long, short = list(range(7, 17)), list(range(7, 16))
    cache.free(2, cells(long))
    cache.free(0, cells(short))
    cache.free(1, None)  # cells not to be trusted: an empty slot
    assert len(cache) == 3 and cache.cached_slots == 2
    assert cache.longest(long + [99], limit=10) == (2, 10)
    assert cache.longest(long + [99], limit=9) == (2, 9)
    assert cache.take_any() == (1, None)
    slot, evicted = cache.take_any()  # cached next: the least recently used goes
    assert slot == 2 and evicted is not None and evicted.tokens == long
    assert cache.cells(0).tokens == short and cache.take(0).tokens == short and len(cache) == 0
    cache.free(0, cells(short))
    cache.free(1, cells(long))
    assert cache.used(0).tokens == short  # a prompt copies from it: now the most recently used
    assert cache.take_any()[0] == 1


def test_cells_too_short_to_be_reused_leave_their_slot_empty() -> None:
    """A health probe's one-word prompt every few seconds took the least recently used cached
    prefix each time, and cached its own few tokens, which no prompt can reuse."""
    cache = PrefixCache(range(2))
    cache.take_any(), cache.take_any()
    cache.free(0, cells(list(range(MIN_REUSED_TOKENS))))
    cache.free(1, cells(list(range(MIN_REUSED_TOKENS - 1))))
    assert cache.cached_slots == 1 and cache.has_empty
    for _ in range(5):  # probe after probe takes the empty slot and gives it back empty
        assert cache.take_any() == (1, None)
        cache.free(1, cells([3, 4]))
    assert cache.cached_slots == 1 and cache.longest(list(range(MIN_REUSED_TOKENS)) + [9], MIN_REUSED_TOKENS) == (0, MIN_REUSED_TOKENS)


def test_a_disabled_cache_keeps_nothing() -> None:
    cache = PrefixCache(range(1), enabled=False)
    cache.take_any()
    cache.free(0, cells([1, 2, 3]))
    assert cache.cached_slots == 0 and cache.longest([1, 2, 3], 3) == (None, 0)


@pytest.fixture(scope="module", params=["llamacpp", "numpy"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[StepEngine, StepEngine]]:
    """The engine with its prefix cache, and the same engine without one (the reference)."""
    make = lambda cache: StepEngine(  # noqa: E731
        gguf_path(), max_slots=3, max_context=512, engine=request.param, threads=2, prefix_cache=cache
    )
    yield make(True), make(False)


def chat(engine: StepEngine, question: str, system: str = SYSTEM) -> tuple[int, ...]:
    return tuple(engine.encode_chat([("system", system), ("user", question)]))


def run(engine: StepEngine, seq_id: int, prompt: tuple[int, ...], params: Sampling = GREEDY) -> list[RowResult]:
    out = engine.step([PrefillRow(seq_id, prompt, params)])
    while not out[-1].finish_reason:
        out += engine.step([DecodeRow(seq_id)])
    return out


def reusable(engine: StepEngine, shared: int, prompt: tuple[int, ...]) -> int:
    """What a whole-prompt prefill may reuse of `shared` tokens a prefill of 64+ tokens computed."""
    rows = engine._model.tiled_attention_rows  # noqa: SLF001
    return shared if rows is None or len(prompt) < rows else min(shared, len(prompt) - rows)


def tokens(results: list[RowResult]) -> list[int]:
    return [r.token_id for r in results if r.token_id >= 0]


def forget_everything(engine: StepEngine) -> None:
    """The next test starts cold."""
    engine.clear_prefix_cache()
    assert engine.cached_slots == 0 and engine.active_slots == 0


def test_a_finished_sequences_prefix_is_reused_with_the_same_greedy_output(engines: tuple[StepEngine, StepEngine]) -> None:
    cached, reference = engines
    forget_everything(cached)
    first, second = chat(cached, QUESTIONS[0]), chat(cached, QUESTIONS[1])
    shared = common_prefix(list(first), list(second))
    assert shared >= 100  # the system prompt and the template around it

    cold = run(cached, 1, first)
    assert all(r.cached_tokens == 0 for r in cold)
    assert cached.cached_slots == 1
    hits, reused = cached.prefix_hits_total, cached.cached_tokens_total

    warm = run(cached, 2, second)
    expected = reusable(cached, shared, second)
    assert expected >= 40
    assert {r.cached_tokens for r in warm} == {expected}
    assert {r.prompt_tokens for r in warm} == {len(second)}  # the whole prompt, cached tokens included
    assert cached.prefix_hits_total == hits + 1 and cached.cached_tokens_total == reused + expected
    assert tokens(warm) == tokens(run(reference, 2, second))
    assert tokens(cold) == tokens(run(reference, 1, first))


def test_the_same_prompt_again_prefills_only_its_last_token(engines: tuple[StepEngine, StepEngine]) -> None:
    cached, reference = engines
    forget_everything(cached)
    prompt = chat(cached, QUESTIONS[2])
    once = run(cached, 3, prompt)
    again = run(cached, 4, prompt)
    assert again[0].cached_tokens == reusable(cached, len(prompt) - 1, prompt)  # its last token samples the first
    assert tokens(again) == tokens(once) == tokens(run(reference, 3, prompt))


def test_a_live_sequences_prefix_is_copied_and_both_go_on_unchanged(engines: tuple[StepEngine, StepEngine]) -> None:
    cached, reference = engines
    forget_everything(cached)
    first, second = chat(cached, QUESTIONS[0]), chat(cached, QUESTIONS[1])

    def drive(engine: StepEngine) -> tuple[list[int], list[int], int]:
        """The second prefills while the first is live (with the cache: from the first's cells,
        copied), in a step of its own: a prefill beside another sequence's decode is split by
        llama.cpp into row groups that depend on that neighbour, and rounds differently whatever
        the cache does. Then both decode together, the same steps on either engine."""
        live = engine.step([PrefillRow(5, first, Sampling(max_tokens=20))])
        live += engine.step([DecodeRow(5)])
        joined = engine.step([PrefillRow(6, second, GREEDY)])
        while not (live[-1].finish_reason and joined[-1].finish_reason):
            rows = [DecodeRow(s) for s, out in ((5, live), (6, joined)) if not out[-1].finish_reason]
            for row, result in zip(rows, engine.step(rows)):
                (live if row.seq_id == 5 else joined).append(result)
        return tokens(live), tokens(joined), joined[0].cached_tokens

    live, joined, reused = drive(cached)
    assert reused == reusable(cached, common_prefix(list(first), list(second)), second) > 0
    assert drive(reference) == (live, joined, 0)


def test_a_prompt_no_longer_than_its_chunk_reuses_a_cached_prefix(engines: tuple[StepEngine, StepEngine]) -> None:
    """The reuse was rounded down to a multiple of the row's chunk even when the whole prompt fits
    in one chunk: 14 // 16 * 16 = 0, so such a prompt never took a cached prefix."""
    cached, reference = engines
    forget_everything(cached)
    prompt = chat(cached, QUESTIONS[0])[:15]
    run(cached, 60, prompt[:14], Sampling(max_tokens=1))  # its slot caches those 14 tokens

    def chunked(engine: StepEngine) -> list[RowResult]:
        out = engine.step([PrefillRow(61, prompt, GREEDY, chunk=16)])
        while not out[-1].finish_reason:
            out += engine.step([DecodeRow(61)])
        return out

    warm = chunked(cached)
    assert {r.cached_tokens for r in warm} == {14}
    assert tokens(warm) == tokens(chunked(reference))


def test_a_cache_hit_gives_a_cold_prefills_logits_bit_for_bit_where_the_engine_says_so(
    engines: tuple[StepEngine, StepEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp on the CPU: exact_reuse keeps a hit's logits those of the cold prefill. The numpy
    model's matrix products round by the step's token count (Linear's gemv or OpenBLAS's sgemm,
    whose blocking depends on the rows), so its hits may differ in the last bits (here they happen
    not to), and the engine says so (prefix_reuse_bit_exact) rather than claim it."""
    cached, reference = engines
    forget_everything(cached)
    first, second = chat(cached, QUESTIONS[0]), chat(cached, QUESTIONS[1])
    run(cached, 70, first, Sampling(max_tokens=1))
    warm_logits, cold_logits = recorded_logits(cached, monkeypatch), recorded_logits(reference, monkeypatch)
    (warm,) = cached.step([PrefillRow(71, second, Sampling(max_tokens=1))])
    (cold,) = reference.step([PrefillRow(71, second, Sampling(max_tokens=1))])
    assert warm.cached_tokens > 0 and cold.cached_tokens == 0
    assert cached.prefix_reuse_bit_exact == (cached.engine == "llamacpp")
    if cached.prefix_reuse_bit_exact:
        assert np.array_equal(warm_logits[-1], cold_logits[-1])


def test_cells_a_prompt_computed_beside_other_rows_row_by_row_are_not_reused_as_tiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 64-token prompt prefilled beside a decode row runs as 1 + 63 rows a ubatch (row by row),
    where alone it runs tiled: its cells were recorded as tiled all the same, and a longer prompt
    reused 10 of them, its logits then not those of its cold prefill."""
    engine = StepEngine(gguf_path(), max_slots=3, max_context=512, threads=2, prefix_cache=True)
    reference = StepEngine(gguf_path(), max_slots=3, max_context=512, threads=2, prefix_cache=False)
    rng = np.random.default_rng(8)
    prompt = tuple(int(t) for t in rng.integers(200, 40000, 64))
    longer = prompt + tuple(int(t) for t in rng.integers(200, 40000, 10))
    engine.step([PrefillRow(1, chat(engine, QUESTIONS[0]), Sampling(max_tokens=20))])  # slot 0, decoding
    beside = engine.step([DecodeRow(1), PrefillRow(2, prompt, Sampling(max_tokens=1))])  # slot 1, then cached
    assert beside[1].finish_reason == "length" and engine.cached_slots == 1
    warm_logits, cold_logits = recorded_logits(engine, monkeypatch), recorded_logits(reference, monkeypatch)
    (warm,) = engine.step([PrefillRow(3, longer, Sampling(max_tokens=1))])
    reference.step([PrefillRow(3, longer, Sampling(max_tokens=1))])
    assert warm.cached_tokens == 0
    assert np.array_equal(warm_logits[-1], cold_logits[-1])
    # Prefilled alone, the same prompt's cells are reused.
    run(engine, 4, prompt, Sampling(max_tokens=1))
    (again,) = engine.step([PrefillRow(5, longer, Sampling(max_tokens=1))])
    assert again.cached_tokens == len(longer) - 64 and np.array_equal(warm_logits[-1], cold_logits[-1])


def test_a_whole_prompt_reuses_no_cells_a_prefill_in_short_chunks_computed_row_by_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 100-token prompt prefilled in chunks of 16 (as the adapter's bulk rows are) runs attention
    row by row, where the same prompt prefilled whole runs it tiled: the cells say so, and the whole
    prompt reuses none of them past position 0 (too few to reuse), its logits those of its cold
    whole prefill, bit for bit. A 40-token prompt runs row by row either way: chunked or whole, the
    same logits."""
    engine = StepEngine(gguf_path(), max_slots=3, max_context=512, threads=2, prefix_cache=True)
    reference = StepEngine(gguf_path(), max_slots=3, max_context=512, threads=2, prefix_cache=False)
    rng = np.random.default_rng(9)
    prompt = tuple(int(t) for t in rng.integers(200, 40000, 100))
    chunked = engine.step([PrefillRow(1, prompt, Sampling(max_tokens=1), chunk=16)])
    while not chunked[-1].finish_reason:
        chunked += engine.step([DecodeRow(1)])
    assert len(chunked) == -(-100 // 16) and engine.cached_slots == 1  # 16 a step, the last 4 answer
    slot, shared = engine._slots.longest(list(prompt), 99)  # noqa: SLF001
    assert slot is not None and shared == 99
    held = engine._slots.cells(slot)  # noqa: SLF001
    assert held.tiled[:100] == [False] * 100
    assert exact_reuse(shared, held, len(prompt), 64) == 1  # where the flags differ from a whole prefill's
    warm_logits, cold_logits = recorded_logits(engine, monkeypatch), recorded_logits(reference, monkeypatch)
    (whole,) = engine.step([PrefillRow(2, prompt, Sampling(max_tokens=1))])
    (cold,) = reference.step([PrefillRow(2, prompt, Sampling(max_tokens=1))])
    assert whole.cached_tokens == 0 and cold.cached_tokens == 0
    assert np.array_equal(warm_logits[-1], cold_logits[-1])
    assert whole.token_id == cold.token_id
    # Under 64 tokens: chunks of 16 compute what the whole prompt does (row by row).
    short = prompt[:40]
    reference.step([PrefillRow(3, short, Sampling(max_tokens=1))])
    whole_short = cold_logits[-1]
    out = reference.step([PrefillRow(4, short, Sampling(max_tokens=1), chunk=16)])
    while not out[-1].finish_reason:
        out += reference.step([DecodeRow(4)])
    assert len(out) == 3
    assert np.array_equal(cold_logits[-1], whole_short)


def test_a_short_shared_prefix_is_not_reused(engines: tuple[StepEngine, StepEngine]) -> None:
    cached, _ = engines
    forget_everything(cached)
    run(cached, 7, chat(cached, QUESTIONS[0]))
    other = chat(cached, QUESTIONS[0], system="Be brief.")
    assert common_prefix(list(chat(cached, QUESTIONS[0])), list(other)) < MIN_REUSED_TOKENS
    assert run(cached, 8, other)[0].cached_tokens == 0


def test_cached_slots_give_way_to_live_work_and_never_answer_busy(engines: tuple[StepEngine, StepEngine]) -> None:
    cached, reference = engines
    forget_everything(cached)
    for i in range(cached.max_slots):
        run(cached, 10 + i, chat(cached, QUESTIONS[i], system=f"{i} is your number. {SYSTEM}"))
    assert cached.cached_slots == cached.max_slots and cached.active_slots == 0
    # Every slot holds a cached prefix; unrelated live work takes them all.
    unrelated = [chat(cached, f"Question {i}?", system=f"Persona number {i}.") for i in range(cached.max_slots)]
    admitted = cached.step([PrefillRow(20 + i, prompt, Sampling(max_tokens=50)) for i, prompt in enumerate(unrelated)])
    assert [r.finish_reason for r in admitted] == [""] * cached.max_slots
    assert cached.cached_slots == 0 and cached.active_slots == cached.max_slots
    # Only live work makes a prefill busy.
    (busy,) = cached.step([PrefillRow(30, chat(cached, QUESTIONS[0]), GREEDY)])
    assert busy.finish_reason == "busy"
    cached.step([ReleaseRow(20 + i) for i in range(cached.max_slots)])
    # The released sequences' cells are cached too, and an evicted slot prefills cold and right.
    (result,) = cached.step([PrefillRow(31, unrelated[0], Sampling(max_tokens=1))])
    assert result.cached_tokens == reusable(cached, len(unrelated[0]) - 1, unrelated[0])
    evicting = run(cached, 32, chat(cached, QUESTIONS[1]))
    assert evicting[0].cached_tokens == 0
    assert tokens(evicting) == tokens(run(reference, 32, chat(reference, QUESTIONS[1])))


def test_health_probes_evict_one_cached_prefix_not_one_each(engines: tuple[StepEngine, StepEngine]) -> None:
    cached, reference = engines
    forget_everything(cached)
    for i in range(cached.max_slots):
        run(cached, 10 + i, chat(cached, QUESTIONS[i], system=f"{i} is your number. {SYSTEM}"))
    assert cached.cached_slots == cached.max_slots
    ping = tuple(cached.encode("ping"))  # the adapter's probe: a one-word prompt, one token
    for i in range(5):
        run(cached, 40 + i, ping, Sampling(max_tokens=1))
    assert cached.cached_slots == cached.max_slots - 1
    # The slot the probes used was cleared: a cold prompt there generates what it does without a cache.
    cold = chat(cached, "Name a river.", system="Unrelated persona.")
    assert tokens(run(cached, 50, cold)) == tokens(run(reference, 50, cold))


def test_the_host_store_keeps_evicted_prefixes_least_recently_used_first_out() -> None:
    store = HostPrefixStore(capacity_bytes=10)
    store.put(cells(list(range(10))), b"aaaa")
    store.put(cells(list(range(5, 15))), b"bbbb")
    assert store.longest(list(range(12)), limit=11) == (0, 10)
    store.put(cells(list(range(20, 30))), b"cccc")  # 12 bytes > 10: the oldest goes
    assert len(store) == 2 and store.bytes == 8 and store.longest(list(range(12)), 11) == (None, 0)
    entry, shared = store.longest(list(range(20, 40)), 19)
    assert shared == 10
    taken_cells, state = store.take(entry)
    assert taken_cells.tokens == list(range(20, 30)) and state == b"cccc" and store.bytes == 4
    store.put(cells([1]), b"x" * 11)  # larger than the whole budget: not kept, nothing dropped for it
    assert len(store) == 1 and store.bytes == 4


def test_a_prefix_evicted_under_a_full_batch_is_restored_from_host_memory(engines: tuple[StepEngine, StepEngine]) -> None:
    """Under a full batch the slot that frees first goes to the next arrival, whatever prefix it
    held: kept in host memory, that prefix serves its prompt's next request without a prefill."""
    _, reference = engines
    cached = StepEngine(gguf_path(), max_slots=3, max_context=512, threads=2, prefix_cache=True, host_prefix_bytes=64 * 2**20)
    assert cached.host_store_capacity_bytes == 64 * 2**20
    first = chat(cached, QUESTIONS[0], system=f"Zero is your number. {SYSTEM}")
    run(cached, 10, first)
    others = [chat(cached, f"Question {i}?", system=f"Persona number {i}.") for i in range(cached.max_slots)]
    cached.step([PrefillRow(20 + i, prompt, Sampling(max_tokens=50)) for i, prompt in enumerate(others)])  # takes every slot
    assert cached.cached_slots == 0 and cached.host_prefix_bytes > 0
    cached.step([ReleaseRow(20 + i) for i in range(cached.max_slots)])
    again = run(cached, 30, first)
    assert again[0].cached_tokens == reusable(cached, len(first) - 1, first) and cached.host_restores_total == 1
    assert tokens(again) == tokens(run(reference, 30, first))
    cached.clear_prefix_cache()
    assert cached.host_prefix_bytes == 0


def test_the_numpy_model_keeps_no_host_store() -> None:
    """Its cells cannot be serialized: the setting is a no-op there, not an error at the first eviction."""
    engine = StepEngine(gguf_path(), max_slots=1, max_context=64, engine="numpy", prefix_cache=True, host_prefix_bytes=2**20)
    for seq_id, question in enumerate(QUESTIONS[:2]):
        run(engine, seq_id, chat(engine, question), Sampling(max_tokens=2))
    assert engine.host_prefix_bytes == 0 and engine.host_store_capacity_bytes == 0  # what triton-local's start log reports


def test_a_conversations_next_turn_reuses_the_previous_turn(engines: tuple[StepEngine, StepEngine]) -> None:
    cached, reference = engines
    forget_everything(cached)
    turn = [("system", SYSTEM), ("user", QUESTIONS[0])]
    first = tuple(cached.encode_chat(turn))
    answer = "".join(r.text for r in run(cached, 40, first))
    following = tuple(cached.encode_chat([*turn, ("assistant", answer), ("user", "And children's bikes?")]))
    result = run(cached, 41, following)
    rows = cached._model.tiled_attention_rows  # noqa: SLF001
    if rows is None:  # the answer's cells too
        assert result[0].cached_tokens >= len(first)
    else:  # the first turn's prompt was prefilled whole; its answer was decoded row by row
        assert result[0].cached_tokens == min(len(first), len(following) - rows) > 0
    assert tokens(result) == tokens(run(reference, 41, following))


FERRY = (
    "You answer questions for a ferry company that sails between two islands and the mainland."
    " Crossings leave every hour from six in the morning to ten at night, take forty minutes, and"
    " carry cars, bicycles and dogs on a lead. Tickets are sold at the harbour and on board."
)


def host_engine(slots: int) -> StepEngine:
    return StepEngine(gguf_path(), max_slots=slots, max_context=512, threads=2, prefix_cache=True, host_prefix_bytes=64 * 2**20)


def finish(engine: StepEngine, results: dict[int, list[RowResult]]) -> dict[int, list[int]]:
    """Decodes the given sequences together to their end; their tokens."""
    while live := [DecodeRow(s) for s, out in results.items() if not out[-1].finish_reason]:
        for result in engine.step(live):
            results[result.seq_id].append(result)
    return {seq_id: tokens(out) for seq_id, out in results.items()}


def test_a_copy_queued_in_a_step_is_applied_before_its_source_is_evicted_to_host_memory() -> None:
    """llama.cpp queues a copy between slots (llama_memory_seq_cp: the cells' positions at once, their
    data at the next llama_decode), while saving and restoring a slot's state is immediate. A prompt
    copying a cached slot's prefix into the empty slot, then a prompt restored from host memory into
    that cached slot, in one step: the copy must carry the cached prefix, not the restored one."""
    cached, reference = host_engine(3), StepEngine(gguf_path(), max_slots=3, max_context=512, threads=2, prefix_cache=False)
    restored = chat(cached, "Can I take my dog?", system=FERRY)
    # A live sequence in slot 0 (not between the step's two prefills: a gap between slots is filled
    # with a throwaway token, and llama.cpp then splits both prefills in row groups that round
    # otherwise than a cold prefill, whatever the cache does).
    cached.step([PrefillRow(1, chat(cached, "Question 1?", system="Persona number 1."), Sampling(max_tokens=50))])
    run(cached, 2, restored)  # slot 1, cached
    conversation = tuple(
        cached.encode_chat(
            [("system", SYSTEM), ("user", QUESTIONS[0]), ("assistant", "Yes, we repair cargo bikes of every make."), ("user", QUESTIONS[1])]
        )
    )
    run(cached, 3, conversation)  # slot 2, cached
    run(cached, 4, tuple(cached.encode("ping")), Sampling(max_tokens=1))  # evicts slot 1 to host memory, leaves it empty
    assert (cached.cached_slots, cached.active_slots) == (1, 1) and cached.host_prefix_bytes > 0

    copying = chat(cached, QUESTIONS[2])  # shares the system prompt with the conversation in slot 2
    first = cached.step([PrefillRow(5, copying, GREEDY), PrefillRow(6, restored, GREEDY)])
    assert first[0].cached_tokens == reusable(cached, common_prefix(list(conversation), list(copying)), copying) > 0
    assert first[1].cached_tokens > 0 and cached.host_restores_total == 1
    got = finish(cached, {5: [first[0]], 6: [first[1]]})
    assert got == {5: tokens(run(reference, 5, copying)), 6: tokens(run(reference, 6, restored))}


def test_a_siblings_copy_is_applied_before_its_leaders_slot_is_evicted_to_host_memory() -> None:
    """A sibling's copy of its leader's cells is queued after the step's forward pass, and waits for
    the next step's: evicting the leader's slot (saved to host memory, then restored into) before
    it must leave the sibling's slot holding the leader's prefix."""
    cached, reference = host_engine(2), StepEngine(gguf_path(), max_slots=2, max_context=512, threads=2, prefix_cache=False)
    restored, shared = chat(cached, "Can I take my dog?", system=FERRY), chat(cached, QUESTIONS[2])
    run(cached, 1, restored)  # slot 0, cached
    once = Sampling(max_tokens=1)
    cached.step([PrefillRow(2, shared, once), PrefillRow(3, shared, once)])  # leader in slot 1, sibling evicts slot 0
    assert cached.cached_slots == 2 and cached.host_prefix_bytes > 0
    assert tokens(run(cached, 4, restored)) == tokens(run(reference, 4, restored))  # restored into the leader's slot
    again = run(cached, 5, shared)  # from the sibling's slot
    assert again[0].cached_tokens > 0 and tokens(again) == tokens(run(reference, 5, shared))


def test_a_restore_that_fails_fails_its_row_alone_and_loses_no_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The slot a restore took must come back, and the rows admitted before it in the step go on."""
    engine = host_engine(3)
    restored = chat(engine, "Can I take my dog?", system=FERRY)
    expected = tokens(run(engine, 1, restored))  # slot 0, cached
    others = [chat(engine, f"Question {i}?", system=f"Persona number {i}.") for i in range(3)]
    engine.step([PrefillRow(10 + i, prompt, Sampling(max_tokens=50)) for i, prompt in enumerate(others)])  # evicts slot 0 to host memory
    engine.step([ReleaseRow(10), ReleaseRow(11)])

    def broken(slot: int, state: bytes) -> None:
        raise RuntimeError("llama_state_seq_set_data could not restore")

    monkeypatch.setattr(engine._model, "restore_state", broken)  # noqa: SLF001
    admitted, failed = engine.step([PrefillRow(2, others[0], GREEDY), PrefillRow(3, restored, GREEDY)])
    assert admitted.token_id >= 0 and not admitted.finish_reason
    assert failed.finish_reason == "error" and "could not restore" in failed.error
    assert engine.active_slots + len(engine._slots) == engine.max_slots  # noqa: SLF001
    monkeypatch.undo()
    assert tokens(run(engine, 4, restored)) == expected  # in the slot the failed restore had taken
    engine.step([ReleaseRow(2), ReleaseRow(12)])
    assert engine.active_slots == 0 and len(engine._slots) == engine.max_slots  # noqa: SLF001


def test_a_cached_prefix_copied_from_is_the_last_to_be_evicted() -> None:
    """A system prompt's slot that prompts copy from (never reused in place: it holds a longer
    conversation) is the hottest cached slot, not the least recently used one."""
    engine = StepEngine(gguf_path(), max_slots=3, max_context=512, threads=2, prefix_cache=True)
    turn = [("system", SYSTEM), ("user", QUESTIONS[0]), ("assistant", "Yes, we repair cargo bikes of every make."), ("user", QUESTIONS[1])]
    conversation = tuple(engine.encode_chat(turn))
    run(engine, 1, conversation)  # slot 0, cached
    run(engine, 2, chat(engine, "Question 2?", system="Persona number 2."))  # slot 1, cached after it
    copying = chat(engine, QUESTIONS[2])
    (copied,) = engine.step([PrefillRow(3, copying, Sampling(max_tokens=50))])  # copies slot 0 into slot 2
    assert copied.cached_tokens > 0 and engine.cached_slots == 2
    engine.step([PrefillRow(4, chat(engine, "Question 4?", system="Persona number 4."), Sampling(max_tokens=50))])  # evicts one
    # A next turn long enough that the last 64 tokens prefilled again (exact_reuse) leave the whole conversation.
    question = "My daughter's bike has a flat tyre, a loose chain and squeaky brakes. " * 4 + "Can you fix it this week?"
    following = tuple(engine.encode_chat([*turn, ("assistant", "No, we are closed on Sundays."), ("user", question)]))
    (next_turn,) = engine.step([PrefillRow(5, following, Sampling(max_tokens=1))])
    assert next_turn.cached_tokens >= len(conversation) > common_prefix(list(copying), list(following))  # not the live copy's system prompt


def test_llamacpp_on_a_gpu_has_no_tiled_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact reuse is a CPU guarantee: with layers on a GPU, CUDA's kernels depend on the whole
    step's tokens, and the rule would only prefill tokens again. llama.cpp answers as a CUDA build
    does (this build keeps the layers on the CPU: only the attribute is checked here)."""
    from sluice_triton_local.engine import llamacpp_model

    monkeypatch.setattr(llamacpp_model.lc, "llama_supports_gpu_offload", lambda: True)
    on_gpu = llamacpp_model.LlamaCppModel(gguf_path(), max_slots=1, max_context=64, threads=1, gpu_layers=-1)
    on_cpu = llamacpp_model.LlamaCppModel(gguf_path(), max_slots=1, max_context=64, threads=1)
    try:
        assert on_gpu.tiled_attention_rows is None and on_cpu.tiled_attention_rows == 64
        assert exact_reuse(90, cells(list(range(90)), tiled=True), 150, on_gpu.tiled_attention_rows) == 90
        assert not on_gpu.reuse_bit_exact and on_cpu.reuse_bit_exact
    finally:
        on_gpu.close()
        on_cpu.close()
