"""Stop-sequence compliance: no requested stop string appears in the returned output. Value 1 = compliant."""

from __future__ import annotations

from sluice_evaluation_logging.evaluators.base import CompletionEvent, EvalContext, ScoreResult, has_text

NAME = "stop_sequence"
# For comparisons (`sluice eval`): which way is better.
HIGHER_IS_BETTER = True


def evaluate(event: CompletionEvent, ctx: EvalContext) -> ScoreResult | None:
    stops = [stop for stop in event.sampling.stop if stop]
    if not stops or not has_text(event):
        return None
    leaked = [stop for stop in stops if stop in event.output]
    if leaked:
        return ScoreResult(NAME, 0.0, False, f"output contains stop sequence(s) {leaked!r}")
    return ScoreResult(NAME, 1.0, True)
