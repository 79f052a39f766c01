"""Output-to-reference semantic similarity: the cosine of the adapter's embeddings of the output
and of the reference (SLUICE_EVALLOG_REFERENCE_SIMILARITY_MIN passes). Reference-based: only for
scored completions (`ScoreCompletions`, `sluice eval`) that carry a reference.

An empty output scores 0 and fails (it says nothing of the reference) rather than being skipped;
when the adapter serves no embeddings the score is skipped: no similarity is made up."""

from __future__ import annotations

import math
from collections.abc import Awaitable

from sluice_evaluation_logging.evaluators.base import (
    CompletionEvent,
    EmbeddingsUnavailable,
    EvalContext,
    ScoreResult,
    has_text,
    skipped,
)
from sluice_evaluation_logging.evaluators.similarity import NOT_FINITE_DETAIL, UNAVAILABLE_DETAIL, cosine

NAME = "reference_similarity"
# For comparisons (`sluice eval`): which way is better.
HIGHER_IS_BETTER = True


def score(output_vector: list[float], reference_vector: list[float], minimum: float) -> ScoreResult:
    value = cosine(output_vector, reference_vector)
    if not math.isfinite(value):
        return skipped(NAME, NOT_FINITE_DETAIL)
    return ScoreResult(NAME, value, value >= minimum, f"cosine to the reference vs min {minimum}")


def evaluate(event: CompletionEvent, reference: str, ctx: EvalContext) -> ScoreResult | Awaitable[ScoreResult] | None:
    if not reference or not has_text(event):
        return None
    if not event.output.strip():
        return ScoreResult(NAME, 0.0, False, "empty output")
    if ctx.embedder is None:
        return skipped(NAME, UNAVAILABLE_DETAIL)
    return _compare(event.output, reference, ctx)


async def _compare(output: str, reference: str, ctx: EvalContext) -> ScoreResult:
    assert ctx.embedder is not None
    try:
        output_vector, reference_vector = await ctx.embedder.embed([output, reference])
    except EmbeddingsUnavailable as exc:
        return skipped(NAME, f"{UNAVAILABLE_DETAIL} ({exc})" if str(exc) else UNAVAILABLE_DETAIL)
    return score(output_vector, reference_vector, ctx.settings.reference_similarity_min)
