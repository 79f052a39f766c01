"""The evaluators: each a small module with NAME and `evaluate(event, ctx)` (sync or async),
returning a ScoreResult or None when it does not apply. Add one by writing a module and
listing it here.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Sequence
from types import ModuleType
from typing import Any

from sluice_evaluation_logging.evaluators import (
    empty_output,
    json_validity,
    latency_slo,
    pii,
    repetition,
    similarity,
    stop_sequence,
    truncation,
    ttft_slo,
)
from sluice_evaluation_logging.evaluators.base import CompletionEvent, Deferred, EvalContext, ScoreResult, skipped

EVALUATORS: tuple[ModuleType, ...] = (
    latency_slo,
    ttft_slo,
    truncation,
    empty_output,
    repetition,
    stop_sequence,
    json_validity,
    pii,
    similarity,
)


# What a synchronous evaluator returns; anything else is checked for being awaitable.
_SETTLED = (ScoreResult, Deferred, type(None))


def _failed(evaluator: ModuleType, exc: Exception) -> ScoreResult:
    return skipped(evaluator.NAME, f"skipped: evaluator failed: {type(exc).__name__}: {exc}")


async def _settle(evaluator: ModuleType, pending: Awaitable[Any]) -> ScoreResult | None:
    try:
        return await pending  # type: ignore[no-any-return]
    except Exception as exc:  # noqa: BLE001 - one broken evaluator must not lose the record
        return _failed(evaluator, exc)


async def evaluate_batch(events: Sequence[CompletionEvent], ctx: EvalContext) -> list[list[ScoreResult | Deferred]]:
    """Every applicable evaluator's scores for each event, in EVALUATORS order; one that raises is
    recorded as skipped with the error. The synchronous evaluators run in place; the asynchronous
    ones (similarity: an Embed call to the adapter) of the whole batch are awaited together, so a
    batch waits for one round of embeddings rather than one round trip per sampled event. With
    `ctx.defer_model_calls` (the consumer) similarity answers Deferred instead and nothing waits."""
    results: list[list[Any]] = []
    pending: list[tuple[list[Any], int, Awaitable[ScoreResult | None]]] = []
    for event in events:
        scores: list[Any] = []
        for evaluator in EVALUATORS:
            try:
                result = evaluator.evaluate(event, ctx)
            except Exception as exc:  # noqa: BLE001 - one broken evaluator must not lose the record
                result = _failed(evaluator, exc)
            if type(result) not in _SETTLED and inspect.isawaitable(result):
                pending.append((scores, len(scores), _settle(evaluator, result)))
            scores.append(result)
        results.append(scores)
    if pending:
        settled = await asyncio.gather(*(awaitable for _, _, awaitable in pending))
        for (scores, index, _), result in zip(pending, settled, strict=True):
            scores[index] = result
    return [[score for score in scores if score is not None] for scores in results]


async def evaluate_all(event: CompletionEvent, ctx: EvalContext) -> list[ScoreResult]:
    """Every applicable evaluator's score for one event (see evaluate_batch)."""
    return (await evaluate_batch([event], ctx))[0]
