"""Constrained decoding on the real SmolLM2 GGUF: what the step engine generates under a constraint
parses and validates, a constraint the library cannot compile is refused before any token naming what
it cannot compile, and the rows without a constraint in the same batch are not affected."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from sluice_common.sampling import StructuredOutputs, StructuredOutputsError
from sluice_common.structured_outputs import check
from sluice_triton_local.engine import DecodeRow, PrefillRow, RowResult, Sampling, StepEngine
from sluice_triton_local.model_files import gguf_path
from sluice_triton_local.engine.constraints import apply_masks

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "contact": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "pets", "home", "contact", "score"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ("red", "green", "blue")
GRAMMAR = 'start: "The answer is " NUM "."\nNUM: /[1-9][0-9]{0,5}/'
GRAMMAR_TEXT = re.compile(r"The answer is [1-9][0-9]{0,5}\.")

# Bounded constraints (every output they allow fits in MAX_TOKENS), so each must finish "stop".
BOUNDED = {
    "json": (StructuredOutputs.json_schema(PERSON), "Describe a person as JSON."),
    "regex": (StructuredOutputs.regex(PHONE), "Make up a phone number."),
    "choice": (StructuredOutputs.choice(CHOICES), "Name a color."),
    "grammar": (StructuredOutputs.grammar(GRAMMAR), "What is 6 times 7?"),
}
MAX_TOKENS = 120
SAMPLED = [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)]


@pytest.fixture(scope="module")
def engine() -> StepEngine:
    return StepEngine(gguf_path(), max_slots=8, max_context=1024, threads=2, prefix_cache=False)


def run_batch(engine: StepEngine, rows: list[PrefillRow]) -> dict[int, list[RowResult]]:
    """Prefills the rows in one step and decodes them together until each finishes."""
    results: dict[int, list[RowResult]] = {row.seq_id: [] for row in rows}
    step = engine.step(list(rows))
    while True:
        for r in step:
            results[r.seq_id].append(r)
        live = [sid for sid, rs in results.items() if not rs[-1].finish_reason]
        if not live:
            return results
        step = engine.step([DecodeRow(sid) for sid in live])


def text(results: list[RowResult]) -> str:
    return "".join(r.text for r in results)


def assert_valid(kind: str, output: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(output), PERSON)
    elif kind == "json_object":
        assert isinstance(json.loads(output), dict)
    elif kind == "regex":
        assert re.fullmatch(PHONE, output)
    elif kind == "choice":
        assert output in CHOICES
    else:
        assert GRAMMAR_TEXT.fullmatch(output)


# -- compile errors -------------------------------------------------------


@pytest.mark.parametrize(
    ("constraint", "named", "without_vocabulary"),
    [
        (StructuredOutputs.json_schema({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}), "if", True),
        (StructuredOutputs.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}), "strin", True),
        (StructuredOutputs.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "missing", True),
        (StructuredOutputs.regex("(unclosed"), "unclosed", True),
        (StructuredOutputs.grammar('start: item\nitem: "a" | undefined_rule'), "undefined_rule", True),
        # Only the vocabulary tells these apart from good grammars: no front without it can refuse them.
        (StructuredOutputs.grammar("start: <|no_such_token|>"), "no_such_token", False),
        (StructuredOutputs.grammar("start: <[60000]>"), "60000", False),
    ],
)
def test_a_constraint_the_library_cannot_compile_is_refused_naming_what(
    engine: StepEngine, constraint: StructuredOutputs, named: str, without_vocabulary: bool
) -> None:
    with pytest.raises(StructuredOutputsError, match=re.escape(named)):
        engine.compile_constraint(constraint)
    if without_vocabulary:
        with pytest.raises(StructuredOutputsError, match=re.escape(named)):
            check(constraint)  # without the model's vocabulary, for a front that has none
    else:
        check(constraint)
    generated = engine.tokens_generated_total
    [result] = engine.step([PrefillRow(1, engine.encode_chat([("user", "hi")]), Sampling(max_tokens=8, structured_outputs=constraint))])
    # The client's error ("invalid": INVALID_ARGUMENT at the adapter), not the engine's ("error": UNAVAILABLE).
    assert result.finish_reason == "invalid" and named in result.error and result.error.startswith("sampling.structured_outputs: ")
    assert result.completion_tokens == 0 and engine.tokens_generated_total == generated
    assert engine.active_slots == 0


@pytest.mark.parametrize("value", ["{not json", "[1, 2]"])
def test_a_json_schema_that_is_not_a_json_object_is_refused(value: str) -> None:
    with pytest.raises(StructuredOutputsError, match="JSON Schema"):
        StructuredOutputs.json_schema(value)


def test_an_empty_choice_or_regex_is_refused(engine: StepEngine) -> None:
    with pytest.raises(StructuredOutputsError, match="choice"):
        engine.compile_constraint(StructuredOutputs.choice([]))
    with pytest.raises(StructuredOutputsError, match="regex"):
        engine.compile_constraint(StructuredOutputs.regex(""))


def test_compiled_constraints_are_cached(engine: StepEngine) -> None:
    first = engine.compile_constraint(StructuredOutputs.json_schema(PERSON))
    assert engine.compile_constraint(StructuredOutputs.json_schema(json.dumps(PERSON))) is first


# -- generation -----------------------------------------------------------


@pytest.mark.parametrize(("temperature", "seed"), SAMPLED)
def test_every_constraint_kind_generates_valid_output(engine: StepEngine, temperature: float, seed: int | None) -> None:
    kinds = list(BOUNDED)
    rows = [
        PrefillRow(
            i, engine.encode_chat([("user", prompt)]), Sampling(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, structured_outputs=c)
        )
        for i, (c, prompt) in enumerate(BOUNDED.values())
    ]
    results = run_batch(engine, rows)
    for i, kind in enumerate(kinds):
        last = results[i][-1]
        assert last.finish_reason == "stop", (kind, text(results[i]), last)
        assert_valid(kind, text(results[i]))
    assert engine.active_slots == 0


def test_an_object_that_lists_its_properties_takes_no_others(engine: StepEngine) -> None:
    """As vLLM decodes a schema (sluice_common.structured_outputs.closed_objects): without it, a
    sampled 135M model added keys of its own to this object in about one answer in five and ran
    out of max_tokens (seen through the stack at seeds 7, 12, 15, 17 and 21 of 60)."""
    city = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "country": {"type": "string", "maxLength": 24},
            "population": {"type": "integer", "minimum": 0, "maximum": 50_000_000},
        },
        "required": ["name", "country", "population"],
    }
    prompt = engine.encode_chat([("user", "Describe Paris as JSON with its name, its country and its population.")])
    constraint = StructuredOutputs.json_schema(city)
    seeds = (7, 12, 15, 17, 21, 33, 37, 38)
    rows = [PrefillRow(i, prompt, Sampling(max_tokens=80, temperature=1.0, seed=seed, structured_outputs=constraint)) for i, seed in enumerate(seeds)]
    for results in run_batch(engine, rows).values():
        assert results[-1].finish_reason == "stop", text(results)
        assert set(json.loads(text(results))) == {"name", "country", "population"}, text(results)


def test_a_complete_constraint_ends_the_sequence_without_sampling_the_end(engine: StepEngine) -> None:
    [results] = run_batch(
        engine,
        [
            PrefillRow(
                1,
                engine.encode_chat([("user", "Name a color.")]),
                Sampling(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputs.choice(["purple"])),
            )
        ],
    ).values()
    assert text(results) == "purple" and results[-1].finish_reason == "stop"
    # The last token is the constraint's last, not an end-of-sequence token the constraint forced.
    assert results[-1].token_id not in engine.tokenizer.stop_ids


def test_json_object_output_is_an_object_or_says_length(engine: StepEngine) -> None:
    """Any JSON object is unbounded: a sampled one may run out of tokens, and must then say "length"."""
    prompt = engine.encode_chat([("user", 'Reply with a JSON object with the key "ok" set to true.')])
    rows = [
        PrefillRow(i, prompt, Sampling(max_tokens=48, temperature=t, seed=s, structured_outputs=StructuredOutputs.json_object()))
        for i, (t, s) in enumerate(SAMPLED)
    ]
    results = run_batch(engine, rows)
    complete = 0
    for rs in results.values():
        if rs[-1].finish_reason == "stop":
            assert_valid("json_object", text(rs))
            complete += 1
        else:
            assert rs[-1].finish_reason == "length" and rs[-1].completion_tokens == 48
            assert text(rs).startswith("{")
    assert results[0][-1].finish_reason == "stop"  # greedy answers {"ok": true}
    assert complete >= 2


def test_a_constraint_never_runs_past_max_tokens(engine: StepEngine) -> None:
    long_string = StructuredOutputs.json_schema(
        {"type": "object", "properties": {"essay": {"type": "string", "minLength": 200}}, "required": ["essay"]}
    )
    prompt = engine.encode_chat([("user", "Write an essay as JSON.")])
    [results] = run_batch(engine, [PrefillRow(1, prompt, Sampling(max_tokens=12, structured_outputs=long_string))]).values()
    assert [r.finish_reason for r in results] == [""] * 11 + ["length"]
    assert results[-1].completion_tokens == 12 and text(results).startswith('{"essay": "')


def test_rows_without_a_constraint_are_unaffected_by_constrained_neighbours(engine: StepEngine) -> None:
    """The engine's logits of a row do not depend on the rest of its batch (test_engine.py,
    test_batching_matches_sequential), so an unconstrained row's tokens must be the same bit for bit
    whether or not constrained rows share its steps."""
    free = [
        PrefillRow(10, engine.encode_chat([("user", "Name three colors.")]), Sampling(max_tokens=24)),
        PrefillRow(11, engine.encode_chat([("user", "Tell me about cats.")]), Sampling(max_tokens=24, temperature=1.0, seed=5)),
    ]
    alone = run_batch(engine, free)
    constrained = [
        PrefillRow(i, engine.encode_chat([("user", prompt)]), Sampling(max_tokens=MAX_TOKENS, structured_outputs=c))
        for i, (c, prompt) in enumerate(BOUNDED.values())
    ]
    together = run_batch(engine, [constrained[0], free[0], constrained[1], free[1], constrained[2], constrained[3]])
    for sid in (10, 11):
        assert [r.token_id for r in together[sid]] == [r.token_id for r in alone[sid]]
        assert together[sid][-1].finish_reason == alone[sid][-1].finish_reason
    assert_valid("json", text(together[0]))


# -- the mask -------------------------------------------------------------


def test_apply_masks_removes_exactly_the_disallowed_tokens_of_the_masked_rows() -> None:
    rng = np.random.default_rng(0)
    vocab = 100  # not a multiple of 32: the last word's spare bits are ignored
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    before = logits.copy()
    allowed = [0, 31, 32, 63, 99]
    bitmask = np.zeros((1, 4), dtype=np.int32)
    for t in allowed:
        bitmask[0, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    bitmask[0, 3] |= np.int32(-(1 << 31))  # bit for token 127: beyond the vocabulary
    apply_masks(logits, [1], bitmask)
    assert np.array_equal(logits[[0, 2]], before[[0, 2]])
    assert np.flatnonzero(np.isfinite(logits[1])).tolist() == allowed
    assert np.array_equal(logits[1, allowed], before[1, allowed])


def test_a_hand_built_constraint_with_a_bad_value_is_an_invalid_row_not_an_exception(engine: StepEngine) -> None:
    cases = [
        (StructuredOutputs("json", "{not json"), "the JSON Schema is not valid JSON"),
        (StructuredOutputs("xml", "<a/>"), "must set one of json, json_object"),
    ]
    for bad, named in cases:
        [result] = engine.step([PrefillRow(1, engine.encode_chat([("user", "hi")]), Sampling(max_tokens=8, structured_outputs=bad))])
        assert result.finish_reason == "invalid" and result.error.startswith(f"sampling.structured_outputs: {named}")
    assert engine.active_slots == 0


def test_a_sibling_sharing_an_unconstrained_leaders_prefill_keeps_its_own_constraint() -> None:
    """Two prefills of the same prompt in one step share one forward pass (the second copies the
    first's KV and samples from its logits row): the mask must still be the sibling's own."""
    sharing = StepEngine(gguf_path(), max_slots=4, max_context=512, threads=2, prefix_cache=True)
    prompt = sharing.encode_chat([("user", "Name a color.")])
    free = PrefillRow(1, prompt, Sampling(max_tokens=MAX_TOKENS))
    constrained = PrefillRow(2, prompt, Sampling(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputs.choice(["purple"])))
    results = run_batch(sharing, [free, constrained])
    assert results[2][0].cached_tokens == len(prompt)  # it was a sibling: the whole prompt shared
    assert text(results[2]) == "purple" and results[2][-1].finish_reason == "stop"
    assert text(results[1]) != "purple"
