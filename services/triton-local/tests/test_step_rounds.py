"""The step protocol's multi-step rounds (step_protocol.start_round over SharedEngine.round) on the
real SmolLM2 GGUF through llama.cpp: what each response carries, greedy text equal at every round
length, and what a release or end-round request does to a round in flight."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from types import SimpleNamespace
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

from sluice_common.sampling import Sampling
from sluice_triton_local.engine.rows import PrefillRow, ReleaseRow
from sluice_triton_local.model_files import gguf_path
from sluice_triton_local.engine.step_engine import StepEngine
from sluice_triton_local import step_protocol
from sluice_triton_local.shared_engine import SharedEngine
from sluice_triton_local.step_protocol import (
    COUNT,
    DECODE,
    END_ROUND,
    MAX_ROUND_STEPS,
    MAX_STREAM_INTERVAL_MS,
    PREFILL,
    RELEASE,
    RoundRejected,
    start_round,
)

QUESTION = [["user", "Write a short poem about rivers."]]


@pytest.fixture(scope="module")
def shared() -> Iterator[SharedEngine]:
    yield SharedEngine(StepEngine(gguf_path(), max_slots=4, threads=2))


def _inputs(
    rows: list[tuple[int, int, dict[str, Any] | None]], steps: int | None = None, interval_ms: int | None = None, follows: int | None = None
) -> dict[str, np.ndarray]:
    inputs = {
        "ACTION": np.array([a for a, _, _ in rows], dtype=np.int32),
        "SEQ_ID": np.array([s for _, s, _ in rows], dtype=np.int64),
        "REQUEST": np.array([json.dumps(r).encode() if r is not None else b"" for _, _, r in rows], dtype=np.object_),
    }
    if steps is not None:
        inputs["STEPS"] = np.array([steps], dtype=np.int32)
    if interval_ms is not None:
        inputs["STREAM_INTERVAL_MS"] = np.array([interval_ms], dtype=np.int32)
    if follows is not None:
        inputs["FOLLOWS_ROUND"] = np.array([follows], dtype=np.int32)
    return inputs


def _round(
    shared: SharedEngine, rows: list[tuple[int, int, dict[str, Any] | None]], steps: int, on_each: Any = None, interval_ms: int | None = None
) -> list[dict[str, np.ndarray]]:
    responses: list[dict[str, np.ndarray]] = []

    def on_response(response: dict[str, np.ndarray], last: bool) -> None:
        responses.append(response)
        assert bool(response["ROUND_END"][0]) is last
        if on_each is not None:
            on_each(len(responses))

    start_round(shared, _inputs(rows, steps, interval_ms), on_response).result(timeout=60)
    return responses


def _generate(shared: SharedEngine, seq_id: int, steps: int, max_tokens: int = 40) -> tuple[str, int]:
    """A sequence driven as the adapter drives it, `steps` engine steps a round: its text, and the
    round trips it took."""
    rows: list[tuple[int, int, dict[str, Any] | None]] = [(PREFILL, seq_id, {"messages": QUESTION, "max_tokens": max_tokens})]
    text, trips = "", 0
    while True:
        trips += 1
        for response in _round(shared, rows, steps):
            assert list(response["ROW_SEQ_ID"]) == [seq_id]
            text += bytes(response["TEXT"][0]).decode()
            if response["FINISH"][0]:
                assert response["FINISH"][0] in (b"stop", b"length")
                return text, trips
        rows = [(DECODE, seq_id, None)]


# What _parse_row asks of the engine for a prefill row: no model needed to read a REQUEST.
_TOKENIZING = SimpleNamespace(encode=lambda text: [1] * len(text), encode_chat=lambda messages: [1, 2, 3], vocab_size=100, context_length=2048)


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        pytest.param({"request_id": "req-9"}, "req-9", id="named"),
        pytest.param({}, "", id="absent: an older adapter"),
        pytest.param({"request_id": 7}, "", id="not a string: ignored, the row still prefills"),
        pytest.param({"request_id": "x" * 100}, "x" * step_protocol.MAX_REQUEST_ID, id="cut"),
    ],
)
def test_a_prefill_carries_its_request_id_for_the_engines_log_lines(given: dict[str, Any], kept: str) -> None:
    row = step_protocol._parse_row(_TOKENIZING, PREFILL, 9, json.dumps({"prompt": "hello", "max_tokens": 4, **given}).encode())  # type: ignore[arg-type]
    assert isinstance(row, PrefillRow) and row.request_id == kept and row.params.max_tokens == 4


def test_a_key_the_engine_does_not_know_is_ignored() -> None:
    """A newer adapter's key (as request_id was to an older engine) must not fail its row: the
    request's other keys are read as before (the deployed step model parses with this module)."""
    row = step_protocol._parse_row(_TOKENIZING, PREFILL, 9, json.dumps({"prompt": "hello", "max_tokens": 4, "a_future_key": {"x": 1}}).encode())  # type: ignore[arg-type]
    assert isinstance(row, PrefillRow) and row.prompt == (1,) * 5 and row.params.max_tokens == 4


def test_greedy_text_is_the_same_at_every_round_length(shared: SharedEngine) -> None:
    one, trips_one = _generate(shared, 11, steps=1)
    assert one and trips_one > 20
    for steps in (4, 16, MAX_ROUND_STEPS):
        text, trips = _generate(shared, 12 + steps, steps=steps)
        assert text == one, steps
        assert trips == -(-trips_one // steps), (steps, trips, trips_one)
    assert shared.active_slots == 0


def test_the_first_response_answers_every_row_in_order_and_later_ones_the_running(shared: SharedEngine) -> None:
    rows = [
        (COUNT, 21, {"messages": QUESTION}),
        (PREFILL, 22, {"messages": QUESTION, "max_tokens": 3}),
        (PREFILL, 23, {"messages": QUESTION, "max_tokens": 6}),
        (9, 24, None),
    ]
    responses = _round(shared, rows, steps=10)
    first = responses[0]
    assert list(first["ROW_SEQ_ID"]) == [21, 22, 23, 24]
    assert first["PROMPT_TOKENS"][0] > 0 and first["TOKEN_ID"][0] == -1  # counted, not run
    assert first["FINISH"][3] == b"invalid" and b"unknown ACTION" in first["ERROR"][3]
    assert all(t >= 0 for t in first["TOKEN_ID"][1:3])
    # 22 ends at its 3rd token, 23 at its 6th: the round stops then, short of its 10 steps.
    assert [list(r["ROW_SEQ_ID"]) for r in responses[1:]] == [[22, 23], [22, 23], [23], [23], [23]]
    assert responses[2]["FINISH"][0] == b"length" and responses[-1]["FINISH"][0] == b"length"
    assert shared.active_slots == 0


@pytest.mark.parametrize("request_json", [[1], 1, "text", None])
def test_a_request_that_is_json_but_no_object_fails_its_row_alone(shared: SharedEngine, request_json: Any) -> None:
    """It raised AttributeError out of the round: the whole request failed, and the adapter took
    the replica for broken."""
    inputs = _inputs([(PREFILL, 41, {"messages": QUESTION, "max_tokens": 1}), (PREFILL, 42, None)], 1)
    inputs["REQUEST"][1] = json.dumps(request_json).encode()
    responses: list[dict[str, np.ndarray]] = []
    start_round(shared, inputs, lambda response, _last: responses.append(response)).result(timeout=60)
    first = responses[0]
    assert first["FINISH"][1] == b"invalid" and b"an object expected" in first["ERROR"][1]
    assert first["FINISH"][0] == b"length" and first["TOKEN_ID"][0] >= 0


@pytest.mark.parametrize(
    "body",
    [
        b'{"messages": [["user", "Hi"]], "max_tokens": 1e999}',
        b'{"messages": [["user", "Hi"]], "max_tokens": 4, "seed": 1e999}',
        b'{"messages": [["user", "Hi"]], "max_tokens": 4, "logprobs": 1e999}',
        b'{"messages": [["user", "Hi"]], "max_tokens": 4, "prefill_chunk": 1e999}',
        b'{"prompt_token_ids": [1, 1e999], "max_tokens": 4}',
        b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
    ids=["max_tokens", "seed", "logprobs", "prefill_chunk", "prompt_token_ids", "nested"],
)
def test_a_number_out_of_integer_range_or_json_nested_too_deep_fails_its_row_alone(shared: SharedEngine, body: bytes) -> None:
    """1e999 is inf, and int(inf) raised OverflowError; JSON nested deeper than the parser recurses
    raised RecursionError: either escaped start_round and failed every row of the request."""
    inputs = _inputs([(PREFILL, 43, {"messages": QUESTION, "max_tokens": 1}), (PREFILL, 44, None)], 1)
    inputs["REQUEST"][1] = body
    responses: list[dict[str, np.ndarray]] = []
    start_round(shared, inputs, lambda response, _last: responses.append(response)).result(timeout=60)
    first = responses[0]
    assert first["FINISH"][1] == b"invalid" and first["ERROR"][1].startswith(b"malformed REQUEST JSON: "), first["ERROR"][1]
    assert first["FINISH"][0] == b"length" and first["TOKEN_ID"][0] >= 0
    assert shared.active_slots == 0


@pytest.mark.parametrize("request_json", [{"prompt": ""}, {"messages": []}, {"prompt_token_ids": []}, {}])
def test_an_empty_prompt_is_invalid_not_an_engine_error(shared: SharedEngine, request_json: dict[str, Any]) -> None:
    """It reached the engine with no token and finished "error", the replica's fault, not the caller's."""
    [response] = _round(shared, [(PREFILL, 45, {**request_json, "max_tokens": 4})], 1)
    assert response["FINISH"][0] == b"invalid" and b"prompt is empty" in response["ERROR"][0]
    [count] = _round(shared, [(COUNT, 46, request_json)], 1)  # counting it is no error: 0 tokens
    assert count["FINISH"][0] == b"" and count["PROMPT_TOKENS"][0] == 0
    assert shared.active_slots == 0


def test_prompts_a_step_leaves_to_its_prefill_budget_answer_their_first_tokens_later_in_the_round() -> None:
    # A budget of one token: each step computes its first prompt only, the round's later steps the rest.
    budgeted = SharedEngine(StepEngine(gguf_path(), max_slots=4, threads=2, prefix_cache=False, prefill_tokens_per_step=1))
    deferred = _metric("sluice_triton_local_prefills_deferred_total")
    questions = ("Name a river.", "Name a mountain.", "Name a lake.")
    rows = [(PREFILL, 81 + i, {"messages": [["user", q]], "max_tokens": 3}) for i, q in enumerate(questions)]
    responses = _round(budgeted, rows, steps=5)
    first_token_step = {seq_id: next(n for n, r in enumerate(responses) if seq_id in _made(r)) for seq_id in (81, 82, 83)}
    assert first_token_step == {81: 0, 82: 1, 83: 2}
    assert _metric("sluice_triton_local_prefills_deferred_total") == deferred + 3  # 82 and 83 at step 0, 83 at step 1
    finished = {int(s) for r in responses for s, f in zip(r["ROW_SEQ_ID"], r["FINISH"]) if f}
    assert finished == {81, 82, 83}
    assert budgeted.active_slots == 0


def _made(response: dict[str, np.ndarray]) -> set[int]:
    """The sequences a response carries a token for."""
    return {int(s) for s, t in zip(response["ROW_SEQ_ID"], response["TOKEN_ID"]) if t >= 0}


def test_a_release_request_mid_round_releases_at_the_next_step(shared: SharedEngine) -> None:
    released = threading.Event()

    def release_at_third(count: int) -> None:
        if count == 3:  # a second request, while the round runs (the engine's thread is busy with it)
            start_round(shared, _inputs([(RELEASE, 31, None)]), lambda *_: released.set())

    responses = _round(shared, [(PREFILL, 31, {"messages": QUESTION, "max_tokens": 200})], steps=32, on_each=release_at_third)
    # The release came with the third step's answer, while the fourth (planned already) ran; the
    # fifth released it: no token, and the round ended there.
    assert len(responses) == 5, [list(r["TOKEN_ID"]) for r in responses]
    assert responses[3]["TOKEN_ID"][0] >= 0
    assert responses[4]["TOKEN_ID"][0] == -1 and responses[4]["FINISH"][0] == b""
    assert released.wait(10)
    prefill = _round(shared, [(PREFILL, 31, {"messages": QUESTION, "max_tokens": 2})], steps=1)
    assert prefill[0]["TOKEN_ID"][0] >= 0, "the slot and the id are free again"
    _round(shared, [(RELEASE, 31, None)], steps=1)


def test_an_end_round_request_ends_the_round_after_its_current_step(shared: SharedEngine) -> None:
    def end_at_second(count: int) -> None:
        if count == 2:
            start_round(shared, _inputs([(END_ROUND, 0, None)]), lambda *_: None)

    responses = _round(shared, [(PREFILL, 41, {"messages": QUESTION, "max_tokens": 200})], steps=32, on_each=end_at_second)
    # Asked with the second step's answer, while the third (planned already) ran: it ended there.
    assert len(responses) == 3
    assert responses[-1]["FINISH"][0] == b"" and responses[-1]["TOKEN_ID"][0] >= 0
    # The sequence runs on in the next round.
    assert _round(shared, [(DECODE, 41, None)], steps=2)[-1]["TOKEN_ID"][0] >= 0
    _round(shared, [(RELEASE, 41, None)], steps=1)


def test_a_stream_interval_lets_later_steps_share_a_response_with_the_same_text(shared: SharedEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """STREAM_INTERVAL_MS: the first token and the finish are answered at once, the steps between
    share responses (a sequence's rows in token order), and the text is the same as step by step."""
    prefill = (PREFILL, 61, {"messages": QUESTION, "max_tokens": 24})
    apart = _round(shared, [prefill], steps=24)
    # The interval's clock stands still: however slow a busy box makes the steps, none crosses it.
    monkeypatch.setattr(step_protocol, "time", SimpleNamespace(perf_counter=lambda: 0.0))
    shared_ = _round(shared, [(PREFILL, 62, {"messages": QUESTION, "max_tokens": 24})], steps=24, interval_ms=MAX_STREAM_INTERVAL_MS)
    assert len(apart) == 24 and all(len(r["ROW_SEQ_ID"]) == 1 for r in apart)
    # The first token at once; 22 steps held; the last (a finish, and the round's end) answered
    # with them.
    assert [len(r["ROW_SEQ_ID"]) for r in shared_] == [1, 23]
    assert list(shared_[1]["ROW_SEQ_ID"]) == [62] * 23
    assert list(shared_[1]["COMPLETION_TOKENS"]) == list(range(2, 25))
    assert shared_[1]["FINISH"][-1] == b"length" and not any(shared_[1]["FINISH"][:-1])
    text = lambda responses: "".join(bytes(t).decode() for r in responses for t in r["TEXT"])  # noqa: E731
    assert text(shared_) == text(apart)
    assert shared.active_slots == 0


def test_an_interval_of_zero_answers_every_step(shared: SharedEngine) -> None:
    responses = _round(shared, [(PREFILL, 63, {"messages": QUESTION, "max_tokens": 5})], steps=5, interval_ms=0)
    assert [list(r["COMPLETION_TOKENS"]) for r in responses] == [[1], [2], [3], [4], [5]]


@pytest.mark.parametrize("interval", [-1, MAX_STREAM_INTERVAL_MS + 1])
def test_a_stream_interval_out_of_range_rejects_the_request(shared: SharedEngine, interval: int) -> None:
    with pytest.raises(RoundRejected, match=f"STREAM_INTERVAL_MS must be between 0 and {MAX_STREAM_INTERVAL_MS}, got {interval}"):
        start_round(shared, _inputs([(DECODE, 1, None)], 4, interval), lambda *_: None)


@pytest.mark.parametrize("steps", [0, -1, MAX_ROUND_STEPS + 1])
def test_steps_out_of_range_reject_the_request(shared: SharedEngine, steps: int) -> None:
    with pytest.raises(RoundRejected, match=f"STEPS must be between 1 and {MAX_ROUND_STEPS}, got {steps}"):
        start_round(shared, _inputs([(DECODE, 1, None)], steps), lambda *_: None)


def test_a_round_ends_after_its_current_step_when_another_request_waits_for_the_engine(shared: SharedEngine) -> None:
    """Another adapter's request (or the generate model's step) waits one step, not a whole round."""
    second: list[dict[str, np.ndarray]] = []
    queued: list[Future[None]] = []

    def another_at_second(count: int) -> None:
        if count == 2:  # queued for the engine's thread while the round runs
            request = [(PREFILL, 52, {"messages": QUESTION, "max_tokens": 3})]
            queued.append(start_round(shared, _inputs(request, 8), lambda response, _last: second.append(response)))

    first = _round(shared, [(PREFILL, 51, {"messages": QUESTION, "max_tokens": 200})], steps=32, on_each=another_at_second)
    # The other request was queued while the third step ran (planned already): the round ended there.
    assert len(first) == 3 and first[-1]["FINISH"][0] == b""
    queued[0].result(timeout=60)
    assert second[-1]["FINISH"][0] == b"length" and len(second) == 3
    _round(shared, [(RELEASE, 51, None)], steps=1)


def _follow(shared: SharedEngine, rows: list[tuple[int, int, dict[str, Any] | None]], steps: int, into: list[dict[str, np.ndarray]]) -> Future[None]:
    """Queues a caller's next round behind the one in flight (FOLLOWS_ROUND), its responses into `into`."""
    return start_round(shared, _inputs(rows, steps, follows=1), lambda response, _last: into.append(response))


def test_a_following_round_waits_for_the_round_in_flight_and_starts_where_it_ended(shared: SharedEngine) -> None:
    """The next round sent ahead does not end the one in flight (as another request would): the
    round runs its steps, and the following one decodes on from its last token."""
    following: list[dict[str, np.ndarray]] = []
    queued: list[Future[None]] = []

    def next_round_at_second(count: int) -> None:
        if count == 2:
            queued.append(_follow(shared, [(DECODE, 91, None)], 3, following))

    first = _round(shared, [(PREFILL, 91, {"messages": QUESTION, "max_tokens": 200})], steps=6, on_each=next_round_at_second)
    queued[0].result(timeout=60)
    assert [int(r["COMPLETION_TOKENS"][0]) for r in first] == [1, 2, 3, 4, 5, 6]
    assert [int(r["COMPLETION_TOKENS"][0]) for r in following] == [7, 8, 9]
    _round(shared, [(RELEASE, 91, None)], steps=1)
    assert shared.active_slots == 0


def test_an_end_round_ask_ends_the_following_round_after_its_first_step_too(shared: SharedEngine) -> None:
    """An arrival's end-round ask came while the caller's next round waited behind the one in
    flight: that round was planned without the arrival, so it ends after one step as well; the
    caller's next preempting round is not ended by the old ask."""
    following: list[dict[str, np.ndarray]] = []
    queued: list[Future[None]] = []

    def next_round_then_end_at_second(count: int) -> None:
        if count == 2:
            queued.append(_follow(shared, [(DECODE, 92, None)], 8, following))
            start_round(shared, _inputs([(END_ROUND, 0, None)]), lambda *_: None)

    first = _round(shared, [(PREFILL, 92, {"messages": QUESTION, "max_tokens": 200})], steps=32, on_each=next_round_then_end_at_second)
    queued[0].result(timeout=60)
    assert len(first) == 3
    assert [int(r["COMPLETION_TOKENS"][0]) for r in following] == [4]
    assert [int(r["COMPLETION_TOKENS"][0]) for r in _round(shared, [(DECODE, 92, None)], steps=3)] == [5, 6, 7]
    _round(shared, [(RELEASE, 92, None)], steps=1)


def test_a_round_sent_after_an_end_round_ask_runs_its_steps(shared: SharedEngine) -> None:
    """An ask ends the rounds sent before it, not a following round sent after it (the caller's next,
    planned with what the ask was for): else every following round after it would end at its first
    step, one round trip per token, until a preempting round came."""
    following: list[dict[str, np.ndarray]] = []
    queued: list[Future[None]] = []

    def end_then_follow(count: int) -> None:
        if count == 1:  # the second step is planned already: the round ends after it
            start_round(shared, _inputs([(END_ROUND, 0, None)]), lambda *_: None)
        if count == 2:
            queued.append(_follow(shared, [(DECODE, 94, None)], 4, following))

    first = _round(shared, [(PREFILL, 94, {"messages": QUESTION, "max_tokens": 200})], steps=32, on_each=end_then_follow)
    queued[0].result(timeout=60)
    assert len(first) == 2
    assert [int(r["COMPLETION_TOKENS"][0]) for r in following] == [3, 4, 5, 6]
    _round(shared, [(RELEASE, 94, None)], steps=1)


def test_a_following_rounds_decode_row_of_a_sequence_released_meanwhile_releases_it(shared: SharedEngine) -> None:
    """A stream cancelled after its caller sent the next round ahead stops within one step: the
    round in flight ended before it could apply the release, so the following round does."""
    following: list[dict[str, np.ndarray]] = []
    queued: list[Future[None]] = []

    def next_round_then_release_at_first(count: int) -> None:
        if count == 1:  # the round's second and last step is planned already
            queued.append(_follow(shared, [(DECODE, 93, None)], 4, following))
            start_round(shared, _inputs([(RELEASE, 93, None)]), lambda *_: None)

    first = _round(shared, [(PREFILL, 93, {"messages": QUESTION, "max_tokens": 200})], steps=2, on_each=next_round_then_release_at_first)
    queued[0].result(timeout=60)
    assert [int(r["TOKEN_ID"][0]) >= 0 for r in first] == [True, True]
    assert len(following) == 1 and following[0]["TOKEN_ID"][0] == -1 and following[0]["FINISH"][0] == b""
    assert shared.active_slots == 0


@pytest.mark.parametrize("follows", [-1, 2])
def test_follows_round_out_of_range_rejects_the_request(shared: SharedEngine, follows: int) -> None:
    with pytest.raises(RoundRejected, match=f"FOLLOWS_ROUND must be between 0 and 1, got {follows}"):
        start_round(shared, _inputs([(DECODE, 1, None)], 4, follows=follows), lambda *_: None)


def _metric(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_a_prompt_seen_before_reports_its_cached_tokens_and_the_metrics_count_them(shared: SharedEngine) -> None:
    request = {"messages": [["system", "You are a lighthouse keeper who answers in rhymes."], ["user", "How is the sea?"]], "max_tokens": 4}
    hits, misses = (
        _metric("sluice_triton_local_prefix_cache_lookups_total", {"result": "hit"}),
        _metric("sluice_triton_local_prefix_cache_lookups_total", {"result": "miss"}),
    )
    reused = _metric("sluice_triton_local_prefix_cache_reused_tokens_total")
    (cold,) = _round(shared, [(PREFILL, 61, request)], steps=1)
    assert int(cold["CACHED_TOKENS"][0]) == 0
    _round(shared, [(RELEASE, 61, None)], steps=1)
    assert _metric("sluice_triton_local_prefix_cache_slots") >= 1
    (warm,) = _round(shared, [(PREFILL, 62, request)], steps=1)
    prompt = int(warm["PROMPT_TOKENS"][0])
    assert int(warm["CACHED_TOKENS"][0]) == prompt - 1 and warm["TOKEN_ID"][0] == cold["TOKEN_ID"][0]
    (released,) = _round(shared, [(RELEASE, 62, None)], steps=1)
    assert int(released["CACHED_TOKENS"][0]) == prompt - 1
    assert _metric("sluice_triton_local_prefix_cache_lookups_total", {"result": "hit"}) == hits + 1
    assert _metric("sluice_triton_local_prefix_cache_lookups_total", {"result": "miss"}) == misses + 1
    assert _metric("sluice_triton_local_prefix_cache_reused_tokens_total") == reused + prompt - 1


def test_a_step_request_carries_its_constraint_and_one_that_cannot_compile_is_invalid_naming_it(shared: SharedEngine) -> None:
    """The step protocol's structured_outputs (vLLM's StructuredOutputsParams) is enforced; a malformed
    or uncompilable one answers "invalid" with the field named, before any token."""
    choice = {"messages": [["user", "Pick a fruit."]], "max_tokens": 16, "structured_outputs": {"choice": ["banana", "cherry"]}}
    text = ""
    rows: list[tuple[int, int, dict[str, Any] | None]] = [(PREFILL, 71, choice)]
    finished = b""
    while not finished:
        for response in _round(shared, rows, 8):
            text += bytes(response["TEXT"][0]).decode()
            finished = response["FINISH"][0]
        rows = [(DECODE, 71, None)]
    assert finished == b"stop" and text in ("banana", "cherry")
    for bad, named in (
        ({"regex": "(unclosed"}, "unclosed"),
        ({"json": {"type": "object", "if": {}}}, "if"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ):
        [response] = _round(shared, [(PREFILL, 72, {"prompt": "x", "max_tokens": 4, "structured_outputs": bad})], 1)
        assert response["FINISH"][0] == b"invalid", bad
        error = bytes(response["ERROR"][0]).decode()
        assert error.startswith("sampling.structured_outputs: ") and named in error, error
        assert response["COMPLETION_TOKENS"][0] == 0


def _run(shared: SharedEngine, seq_id: int, request: dict[str, Any]) -> tuple[str, int]:
    """A sequence's greedy text and its PROMPT_TOKENS, driven to its end 8 steps a round."""
    rows: list[tuple[int, int, dict[str, Any] | None]] = [(PREFILL, seq_id, request)]
    text, prompt_tokens, finished = "", 0, b""
    while not finished:
        for response in _round(shared, rows, 8):
            assert response["FINISH"][0] != b"invalid", response["ERROR"][0]
            text += bytes(response["TEXT"][0]).decode()
            prompt_tokens = int(response["PROMPT_TOKENS"][0]) or prompt_tokens
            finished = response["FINISH"][0]
        rows = [(DECODE, seq_id, None)]
    return text, prompt_tokens


def test_a_token_id_prompt_prefills_exactly_those_ids(shared: SharedEngine) -> None:
    """vLLM's prompt_token_ids: no template, no tokenization. The ids of a text prompt give its
    greedy text; ids that are not any text's tokenization (a control token's id alone, the text's
    ids twice) are prefilled as given, their count exactly their length."""
    text = "The capital of France is"
    ids = shared.encode(text)
    greedy = {"max_tokens": 12, "temperature": 0.0}
    as_text = _run(shared, 81, {"prompt": text, **greedy})
    as_ids = _run(shared, 82, {"prompt_token_ids": ids, **greedy})
    assert as_ids == as_text and as_ids[1] == len(ids)
    doubled = ids + ids
    _, prompt_tokens = _run(shared, 83, {"prompt_token_ids": doubled, **greedy})
    assert prompt_tokens == len(doubled)
    [count] = _round(shared, [(COUNT, 84, {"prompt_token_ids": [0, 1, 2]})], 1)
    assert count["PROMPT_TOKENS"][0] == 3 and count["FINISH"][0] == b""
    assert shared.active_slots == 0


@pytest.mark.parametrize("outside", [-1, 49152, 1 << 30])
def test_a_token_id_outside_the_vocabulary_is_invalid_naming_the_field(shared: SharedEngine, outside: int) -> None:
    for action in (PREFILL, COUNT):
        [response] = _round(shared, [(action, 85, {"prompt_token_ids": [1, outside], "max_tokens": 4})], 1)
        assert response["FINISH"][0] == b"invalid"
        error = bytes(response["ERROR"][0]).decode()
        assert error.startswith("prompt_token_ids: ") and str(outside) in error and "49152" in error, error
    assert shared.active_slots == 0


def test_close_runs_the_work_queued_then_frees_the_model_and_refuses_more() -> None:
    """SharedEngine.close (the Triton step model's finalize): a round queued before it runs to its
    end; then llama.cpp's context is freed and a step fails rather than reaching freed memory. A
    variant closes its own model and leaves the main engine's thread running."""
    main = SharedEngine(StepEngine(gguf_path(), max_slots=1, max_context=256, threads=1, prefix_cache=False))
    variant = SharedEngine(StepEngine(gguf_path(), max_slots=1, max_context=256, threads=1, prefix_cache=False), variant_of=main)
    question = main.apply_chat_template([("user", "Write a short poem about rivers.")])
    steps: list[bool] = []
    queued = variant.round([PrefillRow(1, question, Sampling(max_tokens=40))], 4, lambda _results, last: steps.append(last))
    variant.close()
    assert queued.done() and steps == [False, False, False, True]
    assert variant._engine._model._ctx is None  # noqa: SLF001
    with pytest.raises(RuntimeError, match="closed"):
        variant.step([ReleaseRow(1)])
    queued = main.round([PrefillRow(2, question, Sampling(max_tokens=40))], 4, lambda _results, last: steps.append(last))
    main.close()
    assert queued.done() and steps[4:] == [False, False, False, True]
    assert main._engine._model._ctx is None  # noqa: SLF001
    with pytest.raises(RuntimeError):
        main.step([ReleaseRow(2)])
    main.close()  # twice: nothing more to do
