"""Prompt-to-answer semantic similarity (cosine of the adapter's embeddings), on a sample of events.

Sampling is decided by the event id, so a redelivered event gets the same decision. When the
adapter does not serve embeddings the score is recorded as skipped: no similarity is made up.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Awaitable

from sluice_evaluation_logging.evaluators.base import (
    CompletionEvent,
    EmbeddingsUnavailable,
    EvalContext,
    ScoreResult,
    finished,
    has_text,
    prompt_text,
    skipped,
)

NAME = "similarity"


def sampled(event_id: str, rate: float) -> bool:
    if rate <= 0:
        return False
    if rate >= 1:
        return True
    bucket = int.from_bytes(hashlib.sha256(event_id.encode()).digest()[:8], "big") / 2**64
    return bucket < rate


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def evaluate(event: CompletionEvent, ctx: EvalContext) -> ScoreResult | Awaitable[ScoreResult] | None:
    """None when it does not apply or the event is not sampled (decided here, synchronously, so the
    events that are not sampled cost no coroutine); otherwise the awaitable embedding comparison."""
    if not has_text(event) or not finished(event) or not event.output.strip():
        return None
    if not sampled(event.event_id, ctx.settings.similarity_sample_rate):
        return None
    if ctx.embedder is None:
        return skipped(NAME, "skipped: embeddings unavailable")
    return _compare(event, ctx)


async def _compare(event: CompletionEvent, ctx: EvalContext) -> ScoreResult:
    assert ctx.embedder is not None
    try:
        vectors = await ctx.embedder.embed([prompt_text(event), event.output])
    except EmbeddingsUnavailable as exc:
        return skipped(NAME, f"skipped: embeddings unavailable ({exc})" if str(exc) else "skipped: embeddings unavailable")
    value = cosine(vectors[0], vectors[1])
    return ScoreResult(NAME, value, value >= ctx.settings.similarity_min, f"cosine vs min {ctx.settings.similarity_min}")
