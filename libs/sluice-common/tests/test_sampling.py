"""The sampling contract: one Python type, its defaults, its JSON form, its proto twin, its ranges."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from sluice.common.v1 import types_pb2

from sluice_common.sampling import (
    FIELD_NAMES,
    Sampling,
    StructuredOutputs,
    StructuredOutputsError,
    choice_seed,
    field_error,
    problem,
    split_field_error,
    vllm_sampling_parameters,
)
from sluice_common.sampling_proto import from_proto, to_proto

# Every option away from its default; values exact in float32, so the proto keeps them as they are.
EVERYTHING = Sampling(
    max_tokens=32,
    temperature=0.75,
    top_p=0.5,
    top_k=40,
    min_p=0.125,
    presence_penalty=-1.5,
    frequency_penalty=0.25,
    repetition_penalty=1.25,
    logit_bias=((7, -100.0), (42, 2.5)),
    seed=(1 << 64) - 1,
    stop=("\n", "END"),
    logprobs=20,
    n=8,
    structured_outputs=StructuredOutputs.choice(("yes", "no")),
)


def test_the_proto_and_the_python_type_have_the_same_fields() -> None:
    """A field added to one and not the other fails here, not in a conversion in between."""
    assert set(FIELD_NAMES) == set(types_pb2.SamplingParams.DESCRIPTOR.fields_by_name)


def test_every_field_of_the_example_is_off_its_default() -> None:
    assert all(getattr(EVERYTHING, f.name) != f.default for f in fields(Sampling))


def test_an_unset_proto_is_the_defaults() -> None:
    assert from_proto(types_pb2.SamplingParams()) == Sampling()
    defaults = Sampling()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.min_p) == (0.0, 1.0, 0, 0.0)
    assert (defaults.presence_penalty, defaults.frequency_penalty, defaults.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (defaults.logit_bias, defaults.seed, defaults.stop, defaults.max_tokens) == ((), None, (), 0)
    assert not defaults.penalized and Sampling(max_tokens=1, repetition_penalty=1.1).penalized


def test_proto_python_json_round_trips() -> None:
    for sampling in (Sampling(), Sampling(max_tokens=5), EVERYTHING):
        assert from_proto(to_proto(sampling)) == sampling
        wire = json.loads(json.dumps(sampling.to_json()))  # through real JSON text
        assert Sampling.from_json(wire) == sampling
    message = to_proto(EVERYTHING)
    assert dict(message.logit_bias) == {7: -100.0, 42: 2.5}
    assert message.HasField("top_k") and message.top_k == 40


def test_explicit_neutral_values_in_the_proto_mean_the_defaults() -> None:
    message = types_pb2.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    assert from_proto(message) == Sampling()


def test_the_json_form_holds_only_what_differs_from_the_defaults() -> None:
    assert Sampling().to_json() == {}
    assert Sampling(max_tokens=8, seed=0).to_json() == {"max_tokens": 8, "seed": 0}
    assert EVERYTHING.to_json()["logit_bias"] == {"7": -100.0, "42": 2.5}  # JSON keys are strings
    # Keys that are not options are the step request's own and are left alone.
    assert Sampling.from_json({"messages": [["user", "hi"]], "prefill_chunk": 4, "max_tokens": 3}) == Sampling(max_tokens=3)
    assert Sampling.from_json({"stop": "x"}).stop == ("x",)


@pytest.mark.parametrize("body", [{"temperature": "hot"}, {"logit_bias": [1, 2]}, {"logit_bias": {"a": 1}}, {"top_k": True}])
def test_a_value_of_the_wrong_type_is_refused(body: dict[str, object]) -> None:
    with pytest.raises((ValueError, TypeError)):
        Sampling.from_json(body)


@pytest.mark.parametrize(
    ("changes", "name"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((3, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((3, float("nan")),)}, "logit_bias"),
        ({"seed": -1}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n"),
        ({"n": 9}, "n"),
    ],
)
def test_each_range_names_its_option(changes: dict[str, object], name: str) -> None:
    found = problem(Sampling(**{"max_tokens": 4, **changes}))  # type: ignore[arg-type]
    assert found is not None and found[0] == name and found[1]


def test_the_ranges_accept_their_bounds() -> None:
    edges = Sampling(max_tokens=1, temperature=2.0, top_p=1.0, min_p=1.0, presence_penalty=-2.0,
                     frequency_penalty=2.0, logit_bias=((0, -100.0), (1, 100.0)), seed=0)  # fmt: skip
    assert problem(edges) is None
    assert problem(EVERYTHING) is None
    assert problem(Sampling(max_tokens=1, logprobs=0, n=1)) is None


def test_logprobs_zero_is_not_unset_and_a_boolean_is_refused() -> None:
    """logprobs 0 asks for the sampled token's logprob alone: it must survive every form."""
    asked = Sampling(max_tokens=1, logprobs=0)
    assert from_proto(to_proto(asked)) == asked and to_proto(asked).HasField("logprobs")
    assert Sampling.from_json(json.loads(json.dumps(asked.to_json()))) == asked
    assert vllm_sampling_parameters(asked)["logprobs"] == 0
    assert from_proto(types_pb2.SamplingParams()).logprobs is None and from_proto(types_pb2.SamplingParams()).n == 1
    with pytest.raises(TypeError):
        Sampling.from_json({"logprobs": True})


def test_each_choice_of_n_draws_from_seed_plus_its_index() -> None:
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed((1 << 64) - 1, 1) == 0  # wraps within uint64
    assert choice_seed(None, 2) is None


def test_logit_bias_ids_are_checked_against_the_vocabulary_when_known() -> None:
    sampling = Sampling(max_tokens=4, logit_bias=((49152, 5.0),))
    assert problem(sampling) is None  # the gateway does not know the vocabulary
    name, reason = problem(sampling, vocab_size=49152)  # type: ignore[misc]
    assert name == "logit_bias" and "49152" in reason and "0..49151" in reason
    assert problem(Sampling(max_tokens=4, logit_bias=((49151, 5.0),)), vocab_size=49152) is None


def test_an_engines_field_error_splits_back_into_field_and_reason() -> None:
    message = field_error("logit_bias", "token id 99999 is not a token")
    assert split_field_error(message) == ("sampling.logit_bias", "token id 99999 is not a token")
    assert split_field_error("the prompt is 3000 tokens: too long") is None
    assert split_field_error("sampling.nonsense: x") is None


def test_the_vllm_form_sends_vllms_differing_defaults_and_the_options_set() -> None:
    assert vllm_sampling_parameters(Sampling(max_tokens=8)) == {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "stop": []}
    everything = vllm_sampling_parameters(EVERYTHING)
    assert set(everything) == set(FIELD_NAMES)
    assert everything["logit_bias"] == {"7": -100.0, "42": 2.5}
    assert everything["seed"] == EVERYTHING.seed and everything["stop"] == ["\n", "END"]


# -- structured outputs -------------------------------------------------------

CONSTRAINTS = (
    StructuredOutputs.json_schema({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}, "required": ["age"]}),
    StructuredOutputs.json_object(),
    StructuredOutputs.regex(r"\d{3}-\d{4}"),
    StructuredOutputs.choice(["red", "green"]),
    StructuredOutputs.grammar('start: "yes" | "no"'),
)


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: c.kind)
def test_each_constraint_round_trips_through_the_proto_and_vllms_json_form(constraint: StructuredOutputs) -> None:
    sampling = Sampling(max_tokens=4, structured_outputs=constraint)
    assert from_proto(to_proto(sampling)) == sampling
    assert Sampling.from_json(json.loads(json.dumps(sampling.to_json()))) == sampling
    # Triton's vLLM backend reads structured_outputs as JSON text; Sluice's stand-in reads it so too.
    sent = vllm_sampling_parameters(sampling)["structured_outputs"]
    assert isinstance(sent, str) and Sampling.from_json({"structured_outputs": sent}).structured_outputs == constraint
    assert problem(sampling) is None


def test_equal_schemas_are_one_value_whatever_their_spacing() -> None:
    assert StructuredOutputs.json_schema('{"type":  "object"}') == StructuredOutputs.json_schema({"type": "object"})
    assert hash(StructuredOutputs.choice(["a"])) == hash(StructuredOutputs.choice(("a",)))


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
        ({}, "exactly one"),
        ({"whitespace_pattern": " "}, "whitespace_pattern not supported"),
        ({"json_object": "yes"}, "json_object must be true"),
        ({"choice": "red"}, "choice must be a list"),
        ({"regex": 5}, "regex must be a string"),
        ({"json": "[1, 2]"}, "must be a JSON object"),
        ({"json": "{not json"}, "not valid JSON"),
        ("{not json", "structured_outputs is not valid JSON"),
        # json.loads raises a plain ValueError for an integer of more than 4,300 digits (it was an INTERNAL).
        ({"json": '{"type": "integer", "maximum": ' + "9" * 5000 + "}"}, "not valid JSON"),
    ],
)
def test_a_malformed_structured_outputs_object_is_refused_naming_why(body: object, named: str) -> None:
    with pytest.raises(StructuredOutputsError, match=named):
        Sampling.from_json({"max_tokens": 1, "structured_outputs": body})


def test_a_constraint_set_by_hand_is_checked_by_problem() -> None:
    for bad, named in (
        (StructuredOutputs("xml", "<a/>"), "must set one of"),
        (StructuredOutputs.choice([]), "non-empty list"),
        (StructuredOutputs.regex(""), "non-empty string"),
        (StructuredOutputs("json", "{"), "not valid JSON"),
    ):
        found = problem(Sampling(max_tokens=1, structured_outputs=bad))
        assert found is not None and found[0] == "structured_outputs" and named in found[1], (bad, found)


def test_a_proto_constraint_with_nothing_set_is_refused() -> None:
    message = types_pb2.SamplingParams(max_tokens=1)
    message.structured_outputs.SetInParent()
    found = problem(from_proto(message))
    assert found is not None and found[0] == "structured_outputs" and "must set one of" in found[1]
