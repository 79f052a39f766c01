"""The check a front makes before it queues a constrained request: llguidance compiles the constraint
(without a vocabulary) and a failure names the keyword or construct at fault."""

from __future__ import annotations

import re

import pytest

from sluice_common.sampling import StructuredOutputs, StructuredOutputsError
from sluice_common.structured_outputs import check, llguidance_grammar


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
