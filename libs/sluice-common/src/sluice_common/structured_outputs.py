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
from sluice_common.errors import clip

# JSON is generated in the spacing models write it in (", " and ": ") and with no other whitespace:
# flexible whitespace lets a small model fill max_tokens with newlines inside a valid object.
_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,  # an unsupported keyword is an error, not silently ignored
}
# llguidance's errors quote the construct at fault, a whole regex or rule included (a 60 KB regex
# made a 180 KB message): kept to their start, which says what and where.
_MESSAGE_CHARS = 256


def llguidance_grammar(constraint: StructuredOutputs) -> str:
    """The constraint as an llguidance grammar (not yet validated). Raises StructuredOutputsError
    for a malformed value."""
    reason = constraint.problem()
    if reason is not None:
        raise StructuredOutputsError(reason)
    kind, value = constraint.kind, constraint.value
    try:
        if kind in ("json", "json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema(closed_objects(constraint.schema()), overrides=cast(Any, _JSON_OPTIONS))
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(str(value))
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(v) for v in value))
        return llguidance.grammar_from("grammar", str(value))
    except (ValueError, TypeError) as exc:
        raise StructuredOutputsError(clip(f"{kind}: {exc}", _MESSAGE_CHARS)) from None


# Where a JSON Schema holds subschemas: one, a list of them, or a map of names to them. Only these
# are walked, so that a const, an enum or a default that happens to hold "properties" is left as is.
_SUBSCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others (additionalProperties
    false) unless it says otherwise, as vLLM decodes it: xgrammar, its default backend, does so, and
    its llguidance backend likewise (disable_additional_properties). JSON Schema leaves such objects
    open, and a small model then fills max_tokens with keys nobody asked for; OpenAI's strict mode
    requires them closed. {"type": "object"} alone (json_object) stays any object."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(closed.get(key), dict):
            closed[key] = closed_objects(closed[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(item) for item in closed[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(sub) for name, sub in closed[key].items()}
    if "additionalProperties" not in closed and ("properties" in closed or "patternProperties" in closed):
        closed["additionalProperties"] = False
    return closed


def raise_if_invalid(constraint: StructuredOutputs, grammar: str, tokenizer: llguidance.LLTokenizer | None = None) -> None:
    problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if problem:
        # llguidance names the construct, e.g. 'Unimplemented keys: ["if"]'.
        raise StructuredOutputsError(clip(f"{constraint.kind}: {problem}", _MESSAGE_CHARS))


def check(constraint: StructuredOutputs) -> None:
    """Compiles the constraint without a vocabulary. Raises StructuredOutputsError naming what the
    library cannot compile."""
    raise_if_invalid(constraint, llguidance_grammar(constraint))
