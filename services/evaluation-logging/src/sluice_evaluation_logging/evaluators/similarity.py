"""Prompt-to-answer semantic similarity (cosine of the adapter's embeddings), on a sample of events
with a prompt (or user messages) and an output.

Sampling is decided by the event id, so a redelivered event gets the same decision. When the
adapter does not serve embeddings the score is recorded as skipped: no similarity is made up.

On the consume path (`ctx.defer_model_calls`) a sampled event answers `Deferred`: the store keeps
a durable pending marker with the record, and similarity_worker.py computes the score later in
large batches (`texts` and `score` below), so storing and acking never wait on the model.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Awaitable, Sequence

from sluice_evaluation_logging.evaluators.base import (
    CompletionEvent,
    Deferred,
    EmbeddingsUnavailable,
    EvalContext,
    EvalSettings,
    ScoreResult,
    finished,
    has_text,
    prompt_text,
    skipped,
)

NAME = "similarity"
# For comparisons (`sluice eval`): which way is better.
HIGHER_IS_BETTER = True
UNAVAILABLE_DETAIL = "skipped: embeddings unavailable"
# A NaN or infinite component (a degenerate embedding) makes the cosine NaN: SQLite stores NaN as
# NULL, which scores.value refuses (the whole claim failed, for ever), and PostgreSQL keeps a NaN
# that every mean over it turns into. No similarity is made up either.
NOT_FINITE_DETAIL = "skipped: embedding not finite"


def sampled(event_id: str, rate: float) -> bool:
    if rate <= 0:
        return False
    if rate >= 1:
        return True
    bucket = int.from_bytes(hashlib.sha256(event_id.encode()).digest()[:8], "big") / 2**64
    return bucket < rate


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def applies(event: CompletionEvent) -> bool:
    # Both texts must say something: an output compared with the embedding of an empty prompt (a
    # conversation of system messages only, say) would be a number that means nothing.
    return has_text(event) and finished(event) and bool(event.output.strip()) and bool(prompt_text(event).strip())


def texts(event: CompletionEvent) -> tuple[str, str]:
    """What is embedded for one event: its prompt and its output."""
    return prompt_text(event), event.output


def score(prompt_vector: Sequence[float], output_vector: Sequence[float], settings: EvalSettings) -> ScoreResult:
    value = cosine(prompt_vector, output_vector)
    if not math.isfinite(value):
        return skipped(NAME, NOT_FINITE_DETAIL)
    return ScoreResult(NAME, value, value >= settings.similarity_min, f"cosine vs min {settings.similarity_min}")


def unavailable(exc: EmbeddingsUnavailable | None = None) -> ScoreResult:
    return skipped(NAME, f"{UNAVAILABLE_DETAIL} ({exc})" if exc is not None and str(exc) else UNAVAILABLE_DETAIL)


def evaluate(event: CompletionEvent, ctx: EvalContext) -> ScoreResult | Deferred | Awaitable[ScoreResult] | None:
    """None when it does not apply or the event is not sampled (decided here, synchronously, so the
    events that are not sampled cost nothing more); Deferred on the consume path; otherwise the
    awaitable embedding comparison."""
    if not applies(event):
        return None
    if not sampled(event.event_id, ctx.settings.similarity_sample_rate):
        return None
    if ctx.embedder is None:
        return unavailable()
    if ctx.defer_model_calls:
        return Deferred(NAME)
    return _compare(event, ctx)


async def _compare(event: CompletionEvent, ctx: EvalContext) -> ScoreResult:
    assert ctx.embedder is not None
    try:
        vectors = await ctx.embedder.embed(list(texts(event)))
    except EmbeddingsUnavailable as exc:
        return unavailable(exc)
    return score(vectors[0], vectors[1], ctx.settings)
