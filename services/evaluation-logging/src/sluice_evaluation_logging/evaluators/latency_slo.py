"""Total latency within the SLO (SLUICE_EVALLOG_LATENCY_SLO_MS); value in milliseconds."""

from __future__ import annotations

from sluice_evaluation_logging.evaluators.base import CompletionEvent, EvalContext, ScoreResult, finished

NAME = "latency_slo"


def evaluate(event: CompletionEvent, ctx: EvalContext) -> ScoreResult | None:
    if not finished(event):
        return None
    total = event.timings.total_time_ms
    slo = ctx.settings.latency_slo_ms
    return ScoreResult(NAME, total, total <= slo, f"{total:.0f} ms vs SLO {slo:.0f} ms")
