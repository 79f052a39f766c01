"""JSON validity when the request asked for a JSON object. Value 1 = the output parses as a JSON object
(strict JSON: NaN and Infinity are not values)."""

from __future__ import annotations

import json

from sluice.common.v1 import types_pb2

from sluice_evaluation_logging.evaluators.base import CompletionEvent, EvalContext, ScoreResult, finished, has_text

NAME = "json_validity"
# For comparisons (`sluice eval`): which way is better.
HIGHER_IS_BETTER = True
# json.loads of the whole output when it applies: ~30 us per KB here.
CPU_HEAVY = True


def _refuse_constant(name: str) -> None:
    # json.loads takes NaN, Infinity and -Infinity by default; strict JSON (RFC 8259) has none.
    raise ValueError(f"{name} is not a JSON value")


def evaluate(event: CompletionEvent, ctx: EvalContext) -> ScoreResult | None:
    if event.response_format != types_pb2.RESPONSE_FORMAT_JSON_OBJECT or not has_text(event) or not finished(event):
        return None
    try:
        parsed = json.loads(event.output, parse_constant=_refuse_constant)
    except ValueError as exc:
        return ScoreResult(NAME, 0.0, False, f"not JSON: {exc}")
    except RecursionError:  # arrays or objects nested ~1000 deep: the parser's limit, a verdict all the same
        return ScoreResult(NAME, 0.0, False, "not JSON: nested too deep")
    if not isinstance(parsed, dict):
        return ScoreResult(NAME, 0.0, False, f"JSON but a {type(parsed).__name__}, not an object")
    return ScoreResult(NAME, 1.0, True)
