"""ScoreCompletions' domain: the registered evaluators plus the reference-based ones, on request."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from sluice.common.v1 import types_pb2

from conftest import make_event
from sluice_common.errors import InvalidArgument
from sluice_evaluation_logging.evaluators import EVALUATORS, REFERENCE_EVALUATORS, exact_match, reference_similarity
from sluice_evaluation_logging.evaluators.base import EmbeddingsUnavailable, EvalContext, EvalSettings
from sluice_evaluation_logging.records import PoisonMessage, decode_event
from sluice_evaluation_logging.scoring import MAX_ITEMS, MAX_TEXT_CHARS, ScoreInput, evaluator_infos, score_items

SETTINGS = EvalSettings(similarity_sample_rate=0.0, reference_similarity_min=0.9)


class LetterCounts:
    """A real (if crude) embedding: letter frequencies, so equal texts are cosine 1 and unrelated ones lower."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        return [[float(t.lower().count(c)) for c in "abcdefghijklmnopqrstuvwxyz"] for t in texts]


class NoEmbeddings:
    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        raise EmbeddingsUnavailable("UNAVAILABLE", retryable=True)


def by_name(scores):  # type: ignore[no-untyped-def]
    return {s.name: s for s in scores}


def test_exact_match_normalizes_case_space_quotes_and_final_punctuation() -> None:
    assert exact_match.normalize('  "Paris."\n') == "paris"
    assert exact_match.normalize("The  capital\tis Paris!") == "the capital is paris"
    assert exact_match.normalize("Paris is big") != exact_match.normalize("Paris")


async def test_reference_evaluators_score_against_the_reference() -> None:
    embedder = LetterCounts()
    ctx = EvalContext(SETTINGS, embedder)
    same, other, none = await score_items(
        [
            ScoreInput(make_event(output="Paris."), reference="paris"),
            ScoreInput(make_event(output="Berlin, of course"), reference="Paris"),
            ScoreInput(make_event(output="Paris."), reference=""),
        ],
        ctx,
    )
    same, other, none = by_name(same), by_name(other), by_name(none)
    assert same["exact_match"].value == 1.0 and same["exact_match"].passed
    assert math.isclose(same["reference_similarity"].value, 1.0) and same["reference_similarity"].passed
    assert other["exact_match"].value == 0.0 and "expected 'paris'" in other["exact_match"].detail
    assert other["reference_similarity"].value < 0.9 and not other["reference_similarity"].passed
    assert "exact_match" not in none and "reference_similarity" not in none  # no reference: does not apply


async def test_similarity_runs_on_every_item_whatever_the_sample_rate() -> None:
    embedder = LetterCounts()
    scored = await score_items([ScoreInput(make_event(event_id=f"e{i}")) for i in range(5)], EvalContext(SETTINGS, embedder))
    assert all("similarity" in by_name(s) and not by_name(s)["similarity"].skipped for s in scored)


async def test_empty_output_fails_reference_similarity_and_missing_embeddings_skip_it() -> None:
    empty = by_name((await score_items([ScoreInput(make_event(output=" "), reference="Paris")], EvalContext(SETTINGS, LetterCounts())))[0])
    assert empty["reference_similarity"].value == 0.0 and not empty["reference_similarity"].passed
    down = by_name((await score_items([ScoreInput(make_event(output="Paris"), reference="Paris")], EvalContext(SETTINGS, NoEmbeddings())))[0])
    assert down["reference_similarity"].skipped and "embeddings unavailable" in down["reference_similarity"].detail
    assert down["exact_match"].passed  # the other evaluators still score


async def test_a_completion_without_timings_gets_no_latency_scores() -> None:
    event = make_event()
    event.ClearField("timings")
    scores = by_name((await score_items([ScoreInput(event, "x")], EvalContext(SETTINGS, LetterCounts())))[0])
    assert "latency_slo" not in scores and "ttft_slo" not in scores
    assert {"truncation", "empty_output", "repetition", "exact_match", "reference_similarity"} <= set(scores)


async def test_bounds_and_text_logging_are_checked() -> None:
    ctx = EvalContext(SETTINGS, LetterCounts())
    with pytest.raises(InvalidArgument, match="no completions"):
        await score_items([], ctx)
    with pytest.raises(InvalidArgument, match=f"at most {MAX_ITEMS}"):
        await score_items([ScoreInput(make_event())] * (MAX_ITEMS + 1), ctx)
    with pytest.raises(InvalidArgument, match="text_logged"):
        await score_items([ScoreInput(make_event(text_logged=False))], ctx)


async def test_an_item_text_over_the_limit_is_refused_before_any_evaluator_runs() -> None:
    """The CPU-heavy evaluators share the consumer's pool: one call's huge output must not hold it."""
    ctx = EvalContext(SETTINGS, LetterCounts())
    huge = "a." * (MAX_TEXT_CHARS // 2 + 1)
    ok = ScoreInput(make_event())
    cases = {
        "items[1].event.output": ScoreInput(make_event(output=huge)),
        "items[1].reference": ScoreInput(make_event(), reference=huge),
        "items[1].event.prompt": ScoreInput(make_event(prompt=huge)),
        "items[1].event.messages[1].content": ScoreInput(make_event(messages=[types_pb2.ChatMessage(role="user", content=huge)])),
    }
    for field, item in cases.items():
        with pytest.raises(InvalidArgument) as refused:
            await score_items([ok, item], ctx)
        assert refused.value.field_name == field and f"at most {MAX_TEXT_CHARS}" in refused.value.reason
    (scores,) = await score_items([ScoreInput(make_event(output="b" * MAX_TEXT_CHARS))], ctx)  # at the limit: scored
    assert "pii" in by_name(scores)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
async def test_a_non_finite_timing_is_refused_naming_the_field_as_the_consumer_refuses_it(value: float) -> None:
    """The consumer dead-letters such an event; ScoreCompletions scored it (a NaN latency score)."""
    ctx = EvalContext(SETTINGS, LetterCounts())
    for field in ("queue_time_ms", "time_to_first_token_ms", "mean_inter_token_ms", "total_time_ms"):
        event = make_event()
        setattr(event.timings, field, value)
        with pytest.raises(InvalidArgument) as refused:
            await score_items([ScoreInput(make_event()), ScoreInput(event)], ctx)
        assert refused.value.field_name == f"items[1].event.timings.{field}" and "not a finite number" in refused.value.reason
        with pytest.raises(PoisonMessage, match=f"timings.{field} is not a finite number"):
            decode_event(event.SerializeToString(), "application/x-protobuf")


def test_every_evaluator_says_which_way_is_better() -> None:
    infos = {i.name: i for i in evaluator_infos()}
    assert list(infos) == [m.NAME for m in (*EVALUATORS, *REFERENCE_EVALUATORS)]
    assert infos["exact_match"].higher_is_better and infos["reference_similarity"].higher_is_better
    assert not infos["repetition"].higher_is_better and not infos["latency_slo"].higher_is_better
    assert all(i.description for i in infos.values())


async def test_truncated_answers_fail_truncation_in_a_comparison() -> None:
    cut = make_event(output="The", finish_reason=types_pb2.FINISH_REASON_LENGTH, sampling=types_pb2.SamplingParams(max_tokens=1))
    scores = by_name((await score_items([ScoreInput(cut, "The capital of France is Paris.")], EvalContext(SETTINGS, LetterCounts())))[0])
    assert not scores["truncation"].passed and not scores["exact_match"].passed and not scores["reference_similarity"].passed
    assert reference_similarity.NAME == "reference_similarity"
