from __future__ import annotations

from collections.abc import Sequence

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


async def test_stop_sequence_and_json() -> None:
    leaked = make_event(output="Answer: 42\nEND", sampling=types_pb2.SamplingParams(max_tokens=8, stop=["END"]))
    assert not (await scores_of(leaked))["stop_sequence"].passed
    ok = make_event(output='{"a": 1}', response_format=types_pb2.RESPONSE_FORMAT_JSON_OBJECT)
    assert (await scores_of(ok))["json_validity"].passed
    bad = make_event(output='{"a": 1', response_format=types_pb2.RESPONSE_FORMAT_JSON_OBJECT)
    assert not (await scores_of(bad))["json_validity"].passed
    array = make_event(output="[1, 2]", response_format=types_pb2.RESPONSE_FORMAT_JSON_OBJECT)
    assert "list" in (await scores_of(array))["json_validity"].detail


def test_pii_patterns_with_luhn() -> None:
    assert pii.luhn_valid("4111111111111111") and not pii.luhn_valid("4111111111111112")
    found = pii.find_pii("mail bob@example.com or call +1 415-555-0132, card 4111 1111 1111 1111")
    assert found == {"email": 1, "phone": 1, "card": 1}
    assert pii.find_pii("order 4111 1111 1111 1112 shipped in 2024") == {}
    assert pii.find_pii("The answer is 42.") == {}


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
