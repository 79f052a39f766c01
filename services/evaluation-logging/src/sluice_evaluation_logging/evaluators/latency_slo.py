"""Total latency within the SLO (SLUICE_EVALLOG_LATENCY_SLO_MS); value in milliseconds."""

from __future__ import annotations

from sluice_evaluation_logging.evaluators.base import CompletionEvent, EvalContext, ScoreResult, finished

NAME = "latency_slo"
# For comparisons (`sluice eval`): which way is better.
HIGHER_IS_BETTER = False


def evaluate(event: CompletionEvent, ctx: EvalContext) -> ScoreResult | None:
    # Scored completions from a bulk job carry no timings: nothing to judge, rather than 0 ms.
    if not finished(event) or not event.HasField("timings"):
        return None
    total = event.timings.total_time_ms
    slo = ctx.settings.latency_slo_ms
    return ScoreResult(NAME, total, total <= slo, f"{total:.0f} ms vs SLO {slo:.0f} ms")
