from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
from sluice.common.v1 import types_pb2

from conftest import make_event
from sluice_evaluation_logging.evaluators import EVALUATORS, evaluate_all, pii, repetition, similarity
from sluice_evaluation_logging.evaluators.base import EmbeddingsUnavailable, EvalContext, EvalSettings

SETTINGS = EvalSettings(latency_slo_ms=1000, ttft_slo_ms=200, similarity_sample_rate=1.0, similarity_min=0.5)


async def scores_of(event, embedder=None) -> dict:  # type: ignore[no-untyped-def]
    return {s.name: s for s in await evaluate_all(event, EvalContext(SETTINGS, embedder))}


def test_every_evaluator_is_a_module_with_a_name_and_evaluate() -> None:
    names = [module.NAME for module in EVALUATORS]
    assert len(names) == len(set(names)) == 9
    assert all(callable(module.evaluate) for module in EVALUATORS)


async def test_a_good_answer_passes_everything_that_applies() -> None:
    scores = await scores_of(make_event())
    assert {"latency_slo", "ttft_slo", "truncation", "empty_output", "repetition", "pii"} <= set(scores)
    assert "json_validity" not in scores and "stop_sequence" not in scores
    assert all(s.passed for n, s in scores.items() if n != "similarity")
    assert scores["similarity"].skipped and scores["similarity"].detail == "skipped: embeddings unavailable"


async def test_slos_truncation_and_empty_output() -> None:
    slow = make_event(
        output="   \n",
        finish_reason=types_pb2.FINISH_REASON_LENGTH,
        timings=types_pb2.Timings(time_to_first_token_ms=500, total_time_ms=5000),
    )
    scores = await scores_of(slow)
    assert not scores["latency_slo"].passed and scores["latency_slo"].value == 5000
    assert not scores["ttft_slo"].passed
    assert scores["truncation"].value == 1.0 and not scores["truncation"].passed
    assert scores["empty_output"].value == 1.0


async def test_cancelled_or_failed_streams_get_no_completion_scores() -> None:
    cancelled = make_event(finish_reason=types_pb2.FINISH_REASON_CANCELLED)
    scores = await scores_of(cancelled)
    assert "latency_slo" not in scores and "truncation" not in scores and "similarity" not in scores


def test_repetition_ratio() -> None:
    assert repetition.repeated_ngram_ratio("one two three four five six seven", 3)[0] == 0.0
    ratio, detail = repetition.repeated_ngram_ratio("the cat sat " * 10, 3)
    assert ratio > 0.8 and "the cat sat" in detail


def test_repetition_counts_the_characters_of_scripts_without_spaces() -> None:
    for looping in ("重复" * 500, "同じことを繰り返す。" * 50, "ซ้ำซ้ำ" * 200):
        assert repetition.repeated_ngram_ratio(looping, 4)[0] > 0.8, looping[:10]
    assert repetition.repeated_ngram_ratio("巴黎是法国的首都，也是最大的城市。", 4)[0] == 0.0


def test_repetition_detail_is_bounded_whatever_the_repeated_word() -> None:
    ratio, detail = repetition.repeated_ngram_ratio(("x" * 60_000 + " ") * 5, 2)
    assert ratio == 0.75 and len(detail) < 2 * repetition.DETAIL_CHARS and detail.endswith("x4")


async def test_stop_sequence_and_json() -> None:
    leaked = make_event(output="Answer: 42\nEND", sampling=types_pb2.SamplingParams(max_tokens=8, stop=["END"]))
    assert not (await scores_of(leaked))["stop_sequence"].passed
    ok = make_event(output='{"a": 1}', response_format=types_pb2.RESPONSE_FORMAT_JSON_OBJECT)
    assert (await scores_of(ok))["json_validity"].passed
    bad = make_event(output='{"a": 1', response_format=types_pb2.RESPONSE_FORMAT_JSON_OBJECT)
    assert not (await scores_of(bad))["json_validity"].passed
    array = make_event(output="[1, 2]", response_format=types_pb2.RESPONSE_FORMAT_JSON_OBJECT)
    assert "list" in (await scores_of(array))["json_validity"].detail


async def test_json_nested_too_deep_or_with_non_standard_constants_fails_rather_than_skips() -> None:
    for output, detail in (
        ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deep"),
        ('{"a": NaN}', "NaN is not a JSON value"),
        ('{"a": -Infinity}', "-Infinity is not a JSON value"),
    ):
        score = (await scores_of(make_event(output=output, response_format=types_pb2.RESPONSE_FORMAT_JSON_OBJECT)))["json_validity"]
        assert not score.skipped and not score.passed and score.value == 0.0 and detail in score.detail


def test_pii_patterns_with_luhn() -> None:
    assert pii.luhn_valid("4111111111111111") and not pii.luhn_valid("4111111111111112")
    found = pii.find_pii("mail bob@example.com or call +1 415-555-0132, card 4111 1111 1111 1111")
    assert found == {"email": 1, "phone": 1, "card": 1}
    assert pii.find_pii("order 4111 1111 1111 1112 shipped in 2024") == {}
    assert pii.find_pii("The answer is 42.") == {}


@pytest.mark.parametrize(
    "text",
    [
        "the server at 192.168.100.200 answered, then 10.250.120.130",
        "logged at 2024-01-15 10:30:45 and again at 2024-01-15T10:30:45+05:30",
        "upgrade to 2024.10.15.1234, not 1.415.555.0132",
        "build 2024.10.15.1234-rc1 on 2024/01/15",
        "ids 1234567890 and 9876543210",  # bare 10-digit runs: no separators, no phone number
    ],
)
def test_pii_takes_no_address_date_time_or_version_for_a_phone_number(text: str) -> None:
    assert pii.find_pii(text) == {}


@pytest.mark.parametrize(
    "text",
    [
        "call +1 415-555-0132",
        "call +14155550132",
        "call +44 20 7946 0958",
        "call +33 1 23 45 67 89",
        "call +49 (30) 1234 5678",
        "call (415) 555-0132",
        "call (415)555-0132",
        "call 415-555-0132.",
        "call 415.555.0132 today",
        "call 415 555 0132",
    ],
)
def test_pii_finds_international_and_10_digit_national_phone_numbers(text: str) -> None:
    assert pii.find_pii(text) == {"phone": 1}


def test_the_pii_scan_of_an_adversarial_output_stays_linear() -> None:
    # The email pattern's unbounded local part made these quadratic: 40 KB took over a second,
    # 400 KB minutes. A generous bound: the scan is well under a second here.
    for adversarial in ("a." * 200_000 + "@", "x@" + "a-." * 133_000, ("a." * 40 + "@" + "b." * 20) * 4_000):
        started = time.perf_counter()
        assert pii.find_pii(adversarial) == {}
        assert time.perf_counter() - started < 2.0, adversarial[:20]
    # Still finds real addresses, subdomains, tags and long top-level domains included.
    text = "write to first.last+tag@mail.example.co.uk, bob@example.com or ops@sluice.technology."
    assert pii.find_pii(text) == {"email": 3}


async def test_text_logging_off_runs_metadata_evaluators_only() -> None:
    private = make_event(output="", text_logged=False, messages=[])
    scores = await scores_of(private)
    assert "pii" not in scores and "repetition" not in scores and "similarity" not in scores
    assert scores["empty_output"].passed  # judged from the token count


class FixedEmbedder:
    def __init__(self, vectors: Sequence[list[float]]) -> None:
        self.vectors = vectors
        self.calls = 0

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls += 1
        return list(self.vectors)


class NoEmbeddings:
    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        raise EmbeddingsUnavailable("UNIMPLEMENTED")


async def test_similarity_uses_embeddings_and_never_fakes_them() -> None:
    close = FixedEmbedder([[1.0, 0.0], [0.8, 0.6]])
    scores = await scores_of(make_event(), close)
    assert abs(scores["similarity"].value - 0.8) < 1e-9 and scores["similarity"].passed and not scores["similarity"].skipped
    skipped = (await scores_of(make_event(), NoEmbeddings()))["similarity"]
    assert skipped.skipped and skipped.detail.startswith("skipped: embeddings unavailable")


async def test_similarity_does_not_apply_without_a_prompt_to_compare_with() -> None:
    embedder = FixedEmbedder([[1.0, 0.0], [0.8, 0.6]])
    system_only = make_event(prompt="")
    del system_only.messages[:]
    system_only.messages.add(role="system", content="You are terse.")
    assert "similarity" not in await scores_of(system_only, embedder)
    blank_user = make_event()
    blank_user.messages[0].content = " \n"
    assert "similarity" not in await scores_of(blank_user, embedder)
    assert embedder.calls == 0
    assert "similarity" in await scores_of(make_event(), embedder)  # a user message: compared


def test_similarity_sampling_is_by_event_id_and_follows_the_rate() -> None:
    ids = [f"event-{i}" for i in range(4000)]
    picked = [i for i in ids if similarity.sampled(i, 0.25)]
    assert 800 < len(picked) < 1200
    assert picked == [i for i in ids if similarity.sampled(i, 0.25)]
    assert not similarity.sampled("x", 0.0) and similarity.sampled("x", 1.0)


async def test_a_broken_evaluator_is_recorded_as_skipped(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def boom(event, ctx):  # type: ignore[no-untyped-def]
        raise RuntimeError("bug")

    monkeypatch.setattr(pii, "evaluate", boom)
    scores = await scores_of(make_event())
    assert scores["pii"].skipped and "RuntimeError: bug" in scores["pii"].detail


def _errors(name: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("sluice_evallog_evaluator_errors_total", {"evaluator": name}) or 0.0


def test_every_evaluator_has_its_error_count_from_the_start() -> None:
    """At 0 before any failure: increase() does not see the first failure of a series born above 0."""
    from prometheus_client import REGISTRY

    from sluice_evaluation_logging.evaluators import REFERENCE_EVALUATORS

    for module in (*EVALUATORS, *REFERENCE_EVALUATORS):
        assert REGISTRY.get_sample_value("sluice_evallog_evaluator_errors_total", {"evaluator": module.NAME}) is not None, module.NAME


async def test_a_broken_evaluator_is_counted_and_logged_with_its_traceback_once_a_minute(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """It was turned into a skipped score with no log line, and skipped scores count in no metric:
    an evaluator that raised on every event was invisible. Each failure counts; a warning with the
    traceback is logged at most once per FAILURE_LOG_INTERVAL_S per evaluator, the next one saying how
    many were not logged."""
    from structlog.testing import capture_logs

    from sluice_evaluation_logging import evaluators

    def boom(event, ctx):  # type: ignore[no-untyped-def]
        raise RuntimeError("bug")

    monkeypatch.setattr(pii, "evaluate", boom)
    monkeypatch.setattr(evaluators, "_last_logged", {})
    before = _errors("pii"), _errors("repetition")
    ctx = EvalContext(SETTINGS)
    with capture_logs() as logs:
        scored = await evaluators.evaluate_batch([make_event() for _ in range(3)], ctx)
        assert all(any(s.name == "pii" and s.skipped for s in scores) for scores in scored)  # the records are kept
        monkeypatch.setattr(evaluators, "FAILURE_LOG_INTERVAL_S", 0.0)
        await evaluators.evaluate_batch([make_event()], ctx)
    assert (_errors("pii") - before[0], _errors("repetition") - before[1]) == (4, 0)
    lines = [e for e in logs if e["event"] == "evaluator_failed"]
    assert [(e["log_level"], e["evaluator"], e["unlogged_since_last"]) for e in lines] == [("warning", "pii", 0), ("warning", "pii", 2)]
    assert lines[0]["exception"].startswith("Traceback") and "in boom" in lines[0]["exception"]
    assert lines[0]["exception"].endswith("RuntimeError: bug") and lines[0]["error"] == "skipped: evaluator failed: RuntimeError: bug"


async def test_a_pool_workers_evaluator_failure_is_logged_and_counted_here(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A CPU-heavy evaluator raises in a worker process, whose logs and metrics are not the service's:
    the traceback comes back with the (pickled) result and is reported in this process."""
    import pickle

    from structlog.testing import capture_logs

    from sluice_evaluation_logging import evaluators

    def boom(event, ctx):  # type: ignore[no-untyped-def]
        raise ValueError("regex blew up")

    async def in_a_worker(serialized, settings):  # type: ignore[no-untyped-def]
        return pickle.loads(pickle.dumps(evaluators.evaluate_heavy_chunk(serialized, settings)))

    monkeypatch.setattr(repetition, "evaluate", boom)
    monkeypatch.setattr(evaluators, "_last_logged", {})
    before = _errors("repetition")
    with capture_logs() as logs:
        (scores,) = await evaluators.evaluate_batch([make_event()], EvalContext(SETTINGS), in_a_worker)
    assert {s.name: s.skipped for s in scores}["repetition"] and _errors("repetition") - before == 1
    (line,) = [e for e in logs if e["event"] == "evaluator_failed"]
    assert line["evaluator"] == "repetition" and "ValueError: regex blew up" in line["exception"] and "in boom" in line["exception"]
