"""StructuredOutputs as llguidance grammars, and the check a front makes before it queues a request.

The engine (triton-local's engine/constraints.py) compiles the same grammar against its model's
vocabulary to mask tokens; the gateway checks it here without a vocabulary, so that a schema the
library cannot compile is a 400 / INVALID_ARGUMENT naming the keyword before a lease is taken or a
token generated. One translation for both, so they never disagree on what is supported.
"""

from __future__ import annotations

import json
from typing import Any, cast

import llguidance

from sluice_common.sampling import StructuredOutputs, StructuredOutputsError

# JSON is generated in the spacing models write it in (", " and ": ") and with no other whitespace:
# flexible whitespace lets a small model fill max_tokens with newlines inside a valid object.
_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,  # an unsupported keyword is an error, not silently ignored
}


def llguidance_grammar(constraint: StructuredOutputs) -> str:
    """The constraint as an llguidance grammar (not yet validated). Raises StructuredOutputsError
    for a malformed value."""
    reason = constraint.problem()
    if reason is not None:
        raise StructuredOutputsError(reason)
    kind, value = constraint.kind, constraint.value
    try:
        if kind in ("json", "json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema(constraint.schema(), overrides=cast(Any, _JSON_OPTIONS))
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(str(value))
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(v) for v in value))
        return llguidance.grammar_from("grammar", str(value))
    except (ValueError, TypeError) as exc:
        raise StructuredOutputsError(f"{kind}: {exc}") from None


def raise_if_invalid(constraint: StructuredOutputs, grammar: str, tokenizer: llguidance.LLTokenizer | None = None) -> None:
    problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if problem:
        # llguidance names the construct, e.g. 'Unimplemented keys: ["if"]'.
        raise StructuredOutputsError(f"{constraint.kind}: {problem}")


def check(constraint: StructuredOutputs) -> None:
    """Compiles the constraint without a vocabulary. Raises StructuredOutputsError naming what the
    library cannot compile."""
    raise_if_invalid(constraint, llguidance_grammar(constraint))
