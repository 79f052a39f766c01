"""The check a front makes before it queues a constrained request: llguidance compiles the constraint
(without a vocabulary) and a failure names the keyword or construct at fault."""

from __future__ import annotations

import re

import pytest

from sluice_common.sampling import StructuredOutputs, StructuredOutputsError
from sluice_common.structured_outputs import check, closed_objects, llguidance_grammar


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputs.json_schema({"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}),
        StructuredOutputs.json_object(),
        StructuredOutputs.regex(r"[A-Z][a-z]+"),
        StructuredOutputs.choice(["yes", "no", 'say "maybe"']),
        StructuredOutputs.grammar('start: "(" start ")" | ""'),
    ],
    ids=lambda c: c.kind,
)
def test_what_the_library_supports_passes_the_check(constraint: StructuredOutputs) -> None:
    check(constraint)
    assert llguidance_grammar(constraint)


@pytest.mark.parametrize(
    ("constraint", "named"),
    [
        (StructuredOutputs.json_schema({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}), "if"),
        (StructuredOutputs.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
        (StructuredOutputs.json_schema({"$ref": "#/$defs/missing"}), "missing"),
        (StructuredOutputs.regex("(unclosed"), "unclosed"),
        (StructuredOutputs.grammar('start: item\nitem: "a" | undefined_rule'), "undefined_rule"),
        (StructuredOutputs.choice([]), "non-empty list"),
    ],
)
def test_what_it_cannot_compile_is_refused_naming_the_construct(constraint: StructuredOutputs, named: str) -> None:
    with pytest.raises(StructuredOutputsError, match=re.escape(named)):
        check(constraint)


def test_objects_that_list_their_properties_are_closed_as_vllm_decodes_them() -> None:
    item = {"type": "object", "properties": {"sku": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": item},
            "open": {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
            "any": {"type": "object"},
            "either": {"anyOf": [item, {"type": "null"}]},
            "fixed": {"const": {"properties": {"x": 1}}},  # a value, not a schema: left as it is
        },
        "$defs": {"ref": item},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["items"]["items"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["any"]
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["fixed"] == {"const": {"properties": {"x": 1}}}
    assert closed["$defs"]["ref"]["additionalProperties"] is False
    assert "additionalProperties" not in schema and "additionalProperties" not in item  # the caller's schema is not changed


def test_the_librarys_message_quotes_the_construct_in_part() -> None:
    """llguidance quotes a whole regex or rule (a 60,000-character regex made a 180,000-character
    message, which no gRPC status can carry)."""
    for constraint in (StructuredOutputs.regex("(" + "a" * 60_000), StructuredOutputs.grammar('start: "a" | ' + "b" * 60_000)):
        with pytest.raises(StructuredOutputsError) as caught:
            check(constraint)
        message = str(caught.value)
        assert message.startswith(constraint.kind + ": ") and len(message) <= 300, len(message)
