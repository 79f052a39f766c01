"""Interrupting a bulk step midway (llama.cpp's abort callback), on the real SmolLM2 GGUF: the step
answers no token, every sequence it carried is as before it (KV cells, a prompt chunk it was
caching) or, for a prefill, admitted with nothing cached, greedy text is the same as without the
interrupt, and only an interruptible step that prefills no siblings can be stopped."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from prometheus_client import REGISTRY

from sluice_triton_local.engine import DecodeRow, PrefillRow, ReleaseRow, RowResult, Sampling, StepEngine, llamacpp_model
from sluice_triton_local.model_files import gguf_path
from sluice_triton_local.shared_engine import SharedEngine
from sluice_triton_local.step_protocol import DECODE, INTERRUPT, PREFILL, RELEASE, round_inputs, start_round

STORY = "The quick brown fox jumps over the lazy dog. " * 30
# A chunk this long makes a decode step that caches it last long enough (~0.1-0.5 s on 2 cores)
# for a thread that polls `interrupt()` to catch it well before its end.
CHUNK = 256


@pytest.fixture(scope="module")
def engine() -> Iterator[StepEngine]:
    yield StepEngine(gguf_path(), max_slots=4, threads=2, prefix_cache=False)


def _prompt(engine: StepEngine) -> str:
    return engine.apply_chat_template([("user", STORY + "\nWhat animal jumps?")])


def _greedy(engine: StepEngine, seq_id: int, prompt: str, max_tokens: int) -> list[int]:
    out = engine.step([PrefillRow(seq_id, prompt, Sampling(max_tokens=max_tokens))])
    while not out[-1].finish_reason:
        out += engine.step([DecodeRow(seq_id)])
    return [r.token_id for r in out]


def _in_thread(work: Callable[[], list[RowResult]]) -> tuple[threading.Thread, list[list[RowResult]]]:
    done: list[list[RowResult]] = []
    thread = threading.Thread(target=lambda: done.append(work()))
    thread.start()
    return thread, done


def _interrupt_while(thread: threading.Thread, interrupt: Callable[[], bool]) -> bool:
    """Calls `interrupt` until it stops a step or the thread ends; whether it stopped one."""
    while thread.is_alive():
        if interrupt():
            return True
        time.sleep(0.0005)
    return False


def test_an_interrupted_decode_step_makes_no_token_and_changes_nothing(engine: StepEngine) -> None:
    prompt = _prompt(engine)
    short = engine.apply_chat_template([("user", "Name three colors.")])
    reference_long, reference_short = _greedy(engine, 1, prompt, 8), _greedy(engine, 2, short, 8)

    # One sequence caching its prompt chunk by chunk, one decoding beside it.
    opened = engine.step([PrefillRow(11, prompt, Sampling(max_tokens=8), chunk=CHUNK), PrefillRow(12, short, Sampling(max_tokens=8))])
    thread, done = _in_thread(lambda: engine.step([DecodeRow(11), DecodeRow(12)], interruptible=True))
    stopped = _interrupt_while(thread, engine.interrupt)
    thread.join()
    assert stopped, "the step ended before an interrupt could reach it"
    chunk_row, decode_row = done[0]
    assert (chunk_row.token_id, chunk_row.finish_reason, chunk_row.completion_tokens) == (-1, "", 0)
    assert (decode_row.token_id, decode_row.finish_reason, decode_row.completion_tokens) == (-1, "", 1)
    assert engine.steps_interrupted_total == 1

    # Both go on from where they were: the same greedy tokens as without the interrupt.
    made = {r.seq_id: [r.token_id] if r.token_id >= 0 else [] for r in opened}
    running = {r.seq_id for r in opened if not r.finish_reason}
    while running:
        for result in engine.step([DecodeRow(s) for s in sorted(running)]):
            if result.token_id >= 0:
                made[result.seq_id].append(result.token_id)
            if result.finish_reason:
                running.discard(result.seq_id)
    assert made == {11: reference_long, 12: reference_short}
    assert engine.active_slots == 0


def test_a_prefill_stopped_midway_is_admitted_and_its_next_decode_caches_the_whole_prompt(engine: StepEngine) -> None:
    prompt = _prompt(engine)
    reference = _greedy(engine, 3, prompt, 6)
    thread, done = _in_thread(lambda: engine.step([PrefillRow(21, prompt, Sampling(max_tokens=6))], interruptible=True))
    assert _interrupt_while(thread, engine.interrupt), "the step ended before an interrupt could reach it"
    thread.join()
    (stopped,) = done[0]
    assert (stopped.token_id, stopped.finish_reason, stopped.completion_tokens) == (-1, "", 0)
    assert engine.active_slots == 1, "admitted"
    made = engine.step([DecodeRow(21)])
    assert made[0].token_id == reference[0], "the whole prompt cached in one step, and the first token sampled"
    while not made[-1].finish_reason:
        made += engine.step([DecodeRow(21)])
    assert [r.token_id for r in made] == reference


def test_a_step_that_is_not_interruptible_or_prefills_siblings_is_never_stopped() -> None:
    engine = StepEngine(gguf_path(), max_slots=4, threads=2, prefix_cache=True)
    prompt = _prompt(engine)
    engine.step([PrefillRow(21, prompt, Sampling(max_tokens=4), chunk=CHUNK)])
    thread, _ = _in_thread(lambda: engine.step([DecodeRow(21)]))
    assert not _interrupt_while(thread, engine.interrupt)
    thread.join()
    # n siblings: one prompt prefilled once, its cells copied to the others after the pass.
    siblings = [PrefillRow(22 + i, prompt, Sampling(max_tokens=4)) for i in range(2)]
    thread, done = _in_thread(lambda: engine.step(siblings, interruptible=True))
    assert not _interrupt_while(thread, engine.interrupt)
    thread.join()
    assert all(r.token_id >= 0 for r in done[0]), "the prefills made their first tokens"
    assert engine.steps_interrupted_total == 0


def _interrupted_total() -> float:
    return REGISTRY.get_sample_value("sluice_triton_local_steps_interrupted_total") or 0.0


@pytest.mark.parametrize("interruptible", [True, False])
def test_an_interrupt_request_stops_only_an_interruptible_rounds_step(interruptible: bool) -> None:
    shared = SharedEngine(StepEngine(gguf_path(), max_slots=2, threads=2, prefix_cache=False))
    prompt_request = json.dumps({"messages": [["user", STORY]], "max_tokens": 4, "prefill_chunk": CHUNK}).encode()
    start_round(shared, round_inputs(PREFILL, [31], [prompt_request]), lambda *_: None).result(timeout=60)
    before = _interrupted_total()
    responses: list[dict[str, np.ndarray]] = []
    decode = round_inputs(DECODE, [31], [b""], steps=8, interruptible=interruptible)
    round_done = start_round(shared, decode, lambda response, _last: responses.append(response))
    # Asked again and again while the round runs: the first that finds its step in progress stops it.
    while not round_done.done():
        start_round(shared, round_inputs(INTERRUPT, [0], [b""]), lambda *_: None)
        time.sleep(0.002)
    round_done.result()
    if interruptible:
        assert _interrupted_total() == before + 1
        assert len(responses) == 1 and bool(responses[0]["ROUND_END"][0])
        assert (responses[0]["TOKEN_ID"][0], responses[0]["FINISH"][0]) == (-1, b"")
    else:
        assert _interrupted_total() == before
    start_round(shared, round_inputs(RELEASE, [31], [b""]), lambda *_: None).result(timeout=60)


def test_an_ask_that_finds_no_step_computing_stops_the_next_interruptible_step_before_it_computes(
    engine: StepEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ask can reach the engine before the round it is for (two requests through Triton): kept,
    it stops that round's step before it computes; a step that cannot be interrupted forgets it."""
    # Kept well past any stall of a busy box between the ask and the step (expiry: the test below).
    monkeypatch.setattr(llamacpp_model, "ASK_KEPT_S", 60.0)
    short = engine.apply_chat_template([("user", "Name three colors.")])
    reference = _greedy(engine, 4, short, 6)
    made = [r.token_id for r in engine.step([PrefillRow(41, short, Sampling(max_tokens=6))])]
    before = engine.steps_interrupted_total

    assert not engine.interrupt(keep=True), "no step was computing"
    (stopped,) = engine.step([DecodeRow(41)], interruptible=True)
    assert (stopped.token_id, stopped.finish_reason) == (-1, "")
    assert engine.steps_interrupted_total == before + 1
    (next_one,) = engine.step([DecodeRow(41)], interruptible=True)
    assert next_one.token_id >= 0, "the kept ask stopped one step, not every one after it"
    made.append(next_one.token_id)

    engine.interrupt(keep=True)
    made.append(engine.step([DecodeRow(41)])[0].token_id)  # not interruptible: computes, forgets the ask
    made.append(engine.step([DecodeRow(41)], interruptible=True)[0].token_id)
    engine.interrupt()  # without keep: an ask that finds nothing is dropped
    made.append(engine.step([DecodeRow(41)], interruptible=True)[0].token_id)
    assert engine.steps_interrupted_total == before + 1
    while True:
        (result,) = engine.step([DecodeRow(41)])
        made.append(result.token_id)
        if result.finish_reason:
            break
    assert made == reference, "the stopped step changed nothing: the same greedy tokens"


def test_a_kept_ask_expires(engine: StepEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llamacpp_model, "ASK_KEPT_S", 0.05)
    short = engine.apply_chat_template([("user", "Name three colors.")])
    engine.step([PrefillRow(51, short, Sampling(max_tokens=6))])
    before = engine.steps_interrupted_total
    engine.interrupt(keep=True)
    time.sleep(0.1)
    (result,) = engine.step([DecodeRow(51)], interruptible=True)
    assert result.token_id >= 0 and engine.steps_interrupted_total == before
    engine.step([ReleaseRow(51)])


def test_an_interrupt_that_reaches_the_engine_before_its_round_stops_the_rounds_first_step_and_ends_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(llamacpp_model, "ASK_KEPT_S", 60.0)  # as above: no stall may expire the ask
    shared = SharedEngine(StepEngine(gguf_path(), max_slots=2, threads=2, prefix_cache=False))
    prompt_request = json.dumps({"messages": [["user", "Name three colors."]], "max_tokens": 8}).encode()
    start_round(shared, round_inputs(PREFILL, [61], [prompt_request]), lambda *_: None).result(timeout=60)
    before = _interrupted_total()
    start_round(shared, round_inputs(INTERRUPT, [0], [b""]), lambda *_: None).result(timeout=60)
    responses: list[dict[str, np.ndarray]] = []
    decode = round_inputs(DECODE, [61], [b""], steps=4, interruptible=True)
    start_round(shared, decode, lambda response, _last: responses.append(response)).result(timeout=60)
    assert _interrupted_total() == before + 1
    assert len(responses) == 1 and bool(responses[0]["ROUND_END"][0]), "the stopped step ended its round"
    assert (responses[0]["TOKEN_ID"][0], responses[0]["FINISH"][0]) == (-1, b"")
    # The next round decodes as if nothing had happened.
    responses.clear()
    start_round(shared, round_inputs(DECODE, [61], [b""], steps=1, interruptible=True), lambda response, _last: responses.append(response)).result(
        timeout=60
    )
    assert responses[0]["TOKEN_ID"][0] >= 0
    start_round(shared, round_inputs(RELEASE, [61], [b""]), lambda *_: None).result(timeout=60)


def _fact(i: int) -> list[tuple[str, str]]:
    """test_jobs_interactive's greedy questions: ~40-token prompts that share all but their last
    tokens, so that each reuses the one before it from the prefix cache."""
    return [("user", f"Tell me a fact about the number {i}.")]


@pytest.fixture(scope="module")
def cached_engine() -> Iterator[StepEngine]:
    yield StepEngine(gguf_path(), max_slots=4, threads=2, prefix_cache=True)


def _finish(engine: StepEngine, made: dict[int, list[int]], running: set[int]) -> dict[int, list[int]]:
    while running:
        for result in engine.step([DecodeRow(s) for s in sorted(running)]):
            if result.token_id >= 0:
                made[result.seq_id].append(result.token_id)
            if result.finish_reason:
                running.discard(result.seq_id)
    return made


# Two of the eight combinations (all eight pass; each costs ~20 s on 2 cores): the same prompt again
# (one token left to prefill) stopped in its prefill step midway, and a sibling prompt (a few tokens
# left, in 16-token bulk chunks) stopped in its next step before that computes.
@pytest.mark.parametrize(
    ("question", "stopped_step", "how"), [(1, 0, "midway"), (2, 1, "before-it-computes")], ids=["same-prompt-midway", "sibling-prompt-kept-ask"]
)
def test_a_prefill_that_reuses_a_cached_prefix_keeps_its_greedy_output_through_an_interrupted_step(
    engine: StepEngine, cached_engine: StepEngine, question: int, stopped_step: int, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The combination the engine's other interrupt tests leave out, and test_jobs_interactive's
    setting (one greedy mismatch seen there, once): a bulk prefill in short chunks whose prompt
    reuses a cached prefix, one of its steps stopped, beside a long prefill that makes the step
    long enough to stop midway. Its tokens equal a cold whole-prompt prefill's on an engine
    without a prefix cache."""
    monkeypatch.setattr(llamacpp_model, "ASK_KEPT_S", 60.0)
    cached_engine.clear_prefix_cache()
    warm, asked = cached_engine.apply_chat_template(_fact(1)), cached_engine.apply_chat_template(_fact(question))
    long = engine.apply_chat_template([("user", STORY * 2 + "\nWhat animal jumps?")])
    reference = _greedy(engine, 1, asked, 12)
    reference_long = _greedy(engine, 2, long, 4)
    _greedy(cached_engine, 70, warm, 12)  # finished: its cells stay cached
    hits = cached_engine.prefix_hits_total

    rows: list[DecodeRow | PrefillRow] = [
        PrefillRow(71, asked, Sampling(max_tokens=12), chunk=16),
        PrefillRow(72, long, Sampling(max_tokens=4), chunk=CHUNK),
    ]
    made: dict[int, list[int]] = {71: [], 72: []}
    running = {71, 72}
    for step in range(stopped_step + 1):
        interrupted = step == stopped_step
        if interrupted and how == "before-it-computes":
            assert not cached_engine.interrupt(keep=True)
            results = cached_engine.step(rows, interruptible=True)
        elif interrupted:
            thread, done = _in_thread(lambda: cached_engine.step(rows, interruptible=True))
            assert _interrupt_while(thread, cached_engine.interrupt), "the step ended before an interrupt could reach it"
            thread.join()
            results = done[0]
        else:
            results = cached_engine.step(rows)
        if interrupted:
            assert all(r.token_id == -1 and not r.finish_reason for r in results), results
        for result in results:
            if result.token_id >= 0:
                made[result.seq_id].append(result.token_id)
            if result.finish_reason:
                running.discard(result.seq_id)
        rows = [DecodeRow(s) for s in sorted(running)]
    assert cached_engine.prefix_hits_total == hits + 1, "the prompt reused the cached prefix"
    assert _finish(cached_engine, made, running) == {71: reference, 72: reference_long}
    assert cached_engine.active_slots == 0
