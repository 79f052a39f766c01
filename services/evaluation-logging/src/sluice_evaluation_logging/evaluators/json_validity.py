"""JSON validity when the request asked for a JSON object. Value 1 = the output parses as a JSON object."""

from __future__ import annotations

import json

from sluice.common.v1 import types_pb2

from sluice_evaluation_logging.evaluators.base import CompletionEvent, EvalContext, ScoreResult, finished, has_text

NAME = "json_validity"
# For comparisons (`sluice eval`): which way is better.
HIGHER_IS_BETTER = True
# json.loads of the whole output when it applies: ~30 us per KB here.
CPU_HEAVY = True


def evaluate(event: CompletionEvent, ctx: EvalContext) -> ScoreResult | None:
    if event.response_format != types_pb2.RESPONSE_FORMAT_JSON_OBJECT or not has_text(event) or not finished(event):
        return None
    try:
        parsed = json.loads(event.output)
    except ValueError as exc:
        return ScoreResult(NAME, 0.0, False, f"not JSON: {exc}")
    if not isinstance(parsed, dict):
        return ScoreResult(NAME, 0.0, False, f"JSON but a {type(parsed).__name__}, not an object")
    return ScoreResult(NAME, 1.0, True)
