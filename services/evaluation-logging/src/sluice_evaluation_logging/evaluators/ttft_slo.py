"""Time to first token within the SLO (SLUICE_EVALLOG_TTFT_SLO_MS); value in milliseconds."""

from __future__ import annotations

from sluice_evaluation_logging.evaluators.base import CompletionEvent, EvalContext, ScoreResult

NAME = "ttft_slo"
# For comparisons (`sluice eval`): which way is better.
HIGHER_IS_BETTER = False


def evaluate(event: CompletionEvent, ctx: EvalContext) -> ScoreResult | None:
    if event.usage.completion_tokens <= 0 or event.timings.time_to_first_token_ms <= 0:
        return None
    ttft = event.timings.time_to_first_token_ms
    slo = ctx.settings.ttft_slo_ms
    return ScoreResult(NAME, ttft, ttft <= slo, f"{ttft:.0f} ms vs SLO {slo:.0f} ms")
