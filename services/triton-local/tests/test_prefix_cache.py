"""The prefix cache (issue 24): a prompt that begins with tokens a slot holds prefills only the rest,
its greedy output is the output without the cache, and cached slots never turn live work away."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sluice_triton_local.engine.prefix_cache import MIN_REUSED_TOKENS, PrefixCache, common_prefix
from sluice_triton_local.engine.step_engine import DecodeRow, PrefillRow, ReleaseRow, RowResult, SamplingParams, StepEngine
from sluice_triton_local.engine.bench import default_gguf_path

SYSTEM = (
    "You are the support assistant of a small bicycle shop in a river town. Answer in one short"
    " sentence, politely, and never invent prices. The shop repairs city bikes, cargo bikes and"
    " children's bikes, sells helmets, locks, lights and inner tubes, and rents tandems on weekends."
    " Opening hours are nine to six on weekdays and ten to four on Saturdays; it is closed on Sundays."
    " If a question is not about bicycles, say that you can only help with bicycles."
)
QUESTIONS = ("Do you repair cargo bikes?", "Can I rent a tandem on Sunday?", "Do you sell lights?")
GREEDY = SamplingParams(max_tokens=12)


def test_common_prefix_counts_leading_equal_tokens() -> None:
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([5], [1]) == 0
    assert common_prefix([], [1]) == 0
    long = list(range(1000))
    assert common_prefix(long, [*long[:777], -1, *long[778:]]) == 777


def test_free_slots_go_empty_first_then_least_recently_cached() -> None:
    cache = PrefixCache(range(3))
    assert [cache.take_any() for _ in range(3)] == [(0, False), (1, False), (2, False)]
    cache.free(2, [7, 8, 9])
    cache.free(0, [7, 8])
    cache.free(1, None)  # cells not to be trusted: an empty slot
    assert len(cache) == 3 and cache.cached_slots == 2
    assert cache.longest([7, 8, 9, 10], limit=3) == (2, 3)
    assert cache.longest([7, 8, 9, 10], limit=2) == (2, 2)
    assert cache.take_any() == (1, False)
    assert cache.take_any() == (2, True)  # cached first: the least recently used goes
    assert cache.tokens(0) == [7, 8] and cache.take(0) == [7, 8] and len(cache) == 0


def test_a_disabled_cache_keeps_nothing() -> None:
    cache = PrefixCache(range(1), enabled=False)
    cache.take_any()
    cache.free(0, [1, 2, 3])
    assert cache.cached_slots == 0 and cache.longest([1, 2, 3], 3) == (None, 0)


@pytest.fixture(scope="module", params=["llamacpp", "numpy"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[StepEngine, StepEngine]]:
    """The engine with its prefix cache, and the same engine without one (the reference)."""
    make = lambda cache: StepEngine(  # noqa: E731
        default_gguf_path(), max_slots=3, max_context=512, engine=request.param, threads=2, prefix_cache=cache
    )
    yield make(True), make(False)


def chat(engine: StepEngine, question: str, system: str = SYSTEM) -> tuple[int, ...]:
    return tuple(engine.encode_chat([("system", system), ("user", question)]))


def run(engine: StepEngine, seq_id: int, prompt: tuple[int, ...], params: SamplingParams = GREEDY) -> list[RowResult]:
    out = engine.step([PrefillRow(seq_id, prompt, params)])
    while not out[-1].finish_reason:
        out += engine.step([DecodeRow(seq_id)])
    return out


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
    assert {r.cached_tokens for r in warm} == {shared}
    assert {r.prompt_tokens for r in warm} == {len(second)}  # the whole prompt, cached tokens included
    assert cached.prefix_hits_total == hits + 1 and cached.cached_tokens_total == reused + shared
    assert tokens(warm) == tokens(run(reference, 2, second))
    assert tokens(cold) == tokens(run(reference, 1, first))


def test_the_same_prompt_again_prefills_only_its_last_token(engines: tuple[StepEngine, StepEngine]) -> None:
    cached, reference = engines
    forget_everything(cached)
    prompt = chat(cached, QUESTIONS[2])
    once = run(cached, 3, prompt)
    again = run(cached, 4, prompt)
    assert again[0].cached_tokens == len(prompt) - 1  # its logits sample the first token
    assert tokens(again) == tokens(once) == tokens(run(reference, 3, prompt))


def test_a_live_sequences_prefix_is_copied_and_both_go_on_unchanged(engines: tuple[StepEngine, StepEngine]) -> None:
    cached, reference = engines
    forget_everything(cached)
    first, second = chat(cached, QUESTIONS[0]), chat(cached, QUESTIONS[1])
    long = SamplingParams(max_tokens=20)
    live = cached.step([PrefillRow(5, first, long)])
    live += cached.step([DecodeRow(5)])
    # The second prefills beside the first's decode, from the first's cells.
    both = cached.step([DecodeRow(5), PrefillRow(6, second, GREEDY)])
    assert both[1].cached_tokens == common_prefix(list(first), list(second))
    live.append(both[0])
    joined = [both[1]]
    while not (live[-1].finish_reason and joined[-1].finish_reason):
        rows = [DecodeRow(s) for s, out in ((5, live), (6, joined)) if not out[-1].finish_reason]
        for row, result in zip(rows, cached.step(rows)):
            (live if row.seq_id == 5 else joined).append(result)
    assert tokens(joined) == tokens(run(reference, 6, second))
    assert tokens(live) == tokens(run(reference, 5, first, long))


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
    admitted = cached.step([PrefillRow(20 + i, prompt, SamplingParams(max_tokens=50)) for i, prompt in enumerate(unrelated)])
    assert [r.finish_reason for r in admitted] == [""] * cached.max_slots
    assert cached.cached_slots == 0 and cached.active_slots == cached.max_slots
    # Only live work makes a prefill busy.
    (busy,) = cached.step([PrefillRow(30, chat(cached, QUESTIONS[0]), GREEDY)])
    assert busy.finish_reason == "busy"
    cached.step([ReleaseRow(20 + i) for i in range(cached.max_slots)])
    # The released sequences' cells are cached too, and an evicted slot prefills cold and right.
    (result,) = cached.step([PrefillRow(31, unrelated[0], SamplingParams(max_tokens=1))])
    assert result.cached_tokens == len(unrelated[0]) - 1
    evicting = run(cached, 32, chat(cached, QUESTIONS[1]))
    assert evicting[0].cached_tokens == 0
    assert tokens(evicting) == tokens(run(reference, 32, chat(reference, QUESTIONS[1])))


def test_a_conversations_next_turn_reuses_the_previous_turn(engines: tuple[StepEngine, StepEngine]) -> None:
    cached, reference = engines
    forget_everything(cached)
    turn = [("system", SYSTEM), ("user", QUESTIONS[0])]
    first = tuple(cached.encode_chat(turn))
    answer = "".join(r.text for r in run(cached, 40, first))
    following = tuple(cached.encode_chat([*turn, ("assistant", answer), ("user", "And children's bikes?")]))
    result = run(cached, 41, following)
    assert result[0].cached_tokens >= len(first)
    assert tokens(result) == tokens(run(reference, 41, following))
