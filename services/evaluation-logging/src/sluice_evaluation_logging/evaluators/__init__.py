"""The evaluators: each a small module with NAME and `evaluate(event, ctx)` (sync or async),
returning a ScoreResult or None when it does not apply. Add one by writing a module and
listing it here.
"""

from __future__ import annotations

import inspect
from types import ModuleType

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
from sluice_evaluation_logging.evaluators.base import CompletionEvent, EvalContext, ScoreResult, skipped

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


async def evaluate_all(event: CompletionEvent, ctx: EvalContext) -> list[ScoreResult]:
    """Every applicable evaluator's score; one that raises is recorded as skipped with the error."""
    scores: list[ScoreResult] = []
    for evaluator in EVALUATORS:
        try:
            result = evaluator.evaluate(event, ctx)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:  # noqa: BLE001 - one broken evaluator must not lose the record
            result = skipped(evaluator.NAME, f"skipped: evaluator failed: {type(exc).__name__}: {exc}")
        if result is not None:
            scores.append(result)
    return scores
