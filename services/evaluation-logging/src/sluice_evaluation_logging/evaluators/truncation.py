"""Truncated output: generation stopped at max_tokens or the context (finish reason length). Value 1 = truncated."""

from __future__ import annotations

from sluice.common.v1 import types_pb2

from sluice_evaluation_logging.evaluators.base import CompletionEvent, EvalContext, ScoreResult, finished

NAME = "truncation"
# For comparisons (`sluice eval`): which way is better.
HIGHER_IS_BETTER = False


def evaluate(event: CompletionEvent, ctx: EvalContext) -> ScoreResult | None:
    if not finished(event):
        return None
    truncated = event.finish_reason == types_pb2.FINISH_REASON_LENGTH
    detail = f"stopped at max_tokens={event.sampling.max_tokens}" if truncated else ""
    return ScoreResult(NAME, 1.0 if truncated else 0.0, not truncated, detail)
