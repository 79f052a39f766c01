"""Empty or whitespace-only output. Value 1 = empty."""

from __future__ import annotations

from sluice_evaluation_logging.evaluators.base import CompletionEvent, EvalContext, ScoreResult, finished, has_text

NAME = "empty_output"
# For comparisons (`sluice eval`): which way is better.
HIGHER_IS_BETTER = False


def evaluate(event: CompletionEvent, ctx: EvalContext) -> ScoreResult | None:
    if not finished(event):
        return None
    if has_text(event):
        empty = not event.output.strip()
    else:
        # Without text, the token count still tells an empty answer apart.
        empty = event.usage.completion_tokens == 0
    return ScoreResult(NAME, 1.0 if empty else 0.0, not empty, "no visible output" if empty else "")
