"""The adapter's side of the sampling contract: the step request's JSON and the vLLM passthrough's
sampling_parameters carry every option, under names Triton's vLLM backend takes."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
from sluice.common.v1 import types_pb2

from sluice_common.errors import InvalidArgument
from sluice_common.sampling import STRUCTURED_KINDS, FIELD_NAMES, Sampling, StructuredOutputs, field_error, vllm_sampling_parameters
from sluice_common.sampling_proto import from_proto
from sluice_inference_adapter.sequence import Finish, FinishEvent, Timings
from sluice_inference_adapter.servicer import _final_response
from sluice_inference_adapter.step_rows import PromptSpec

FIXTURES = Path(__file__).parent / "fixtures"
VLLM = json.loads((FIXTURES / "vllm_sampling_params.json").read_text())
VLLM_STRUCTURED = json.loads((FIXTURES / "vllm_structured_outputs_params.json").read_text())

EVERYTHING = Sampling(
    max_tokens=9, temperature=0.5, top_p=0.75, top_k=20, min_p=0.25, presence_penalty=1.0, frequency_penalty=-0.5,
    repetition_penalty=1.5, logit_bias=((11, 100.0), (12, -100.0)), seed=7, stop=("\n",), logprobs=3, n=2,
    structured_outputs=StructuredOutputs.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
)  # fmt: skip


def test_the_fixture_says_where_it_comes_from() -> None:
    assert "vllm/sampling_params.py" in VLLM["_source"] and "vllm_backend" in VLLM["_source"]


def test_every_option_has_vllms_own_name() -> None:
    """Each option is a field of vLLM's SamplingParams under the same name: a new option whose name
    vLLM does not know fails here, not on a GPU box."""
    assert set(FIELD_NAMES) <= set(VLLM["fields"])


def test_the_passthrough_sends_every_option_set() -> None:
    parameters = vllm_sampling_parameters(EVERYTHING)
    assert set(parameters) == set(FIELD_NAMES)
    assert all(name in VLLM["fields"] for name in parameters)
    assert parameters["logit_bias"] == {"11": 100.0, "12": -100.0}
    assert (parameters["top_k"], parameters["min_p"], parameters["repetition_penalty"]) == (20, 0.25, 1.5)
    # Unset options are left to vLLM, whose defaults are Sluice's neutral values; temperature and
    # max_tokens are always sent, vLLM's own defaults (1.0, 16) being different.
    plain = vllm_sampling_parameters(Sampling(max_tokens=5))
    assert plain["temperature"] == 0.0 and VLLM["fields"]["temperature"]["default"] == 1.0
    assert plain["max_tokens"] == 5 and "top_k" not in plain and "logit_bias" not in plain and "seed" not in plain


def test_each_constraint_is_one_of_vllms_structured_outputs_fields() -> None:
    assert set(STRUCTURED_KINDS) <= set(VLLM_STRUCTURED["constraints"])
    assert VLLM_STRUCTURED["backend_reads_structured_outputs_as"] == "json_text"
    samples = {
        "json": StructuredOutputs.json_schema({"type": "object"}),
        "json_object": StructuredOutputs.json_object(),
        "regex": StructuredOutputs.regex("[0-9]+"),
        "choice": StructuredOutputs.choice(["yes", "no"]),
        "grammar": StructuredOutputs.grammar('start: "a"'),
    }
    assert set(samples) == set(STRUCTURED_KINDS)
    for kind, constraint in samples.items():
        sent = vllm_sampling_parameters(Sampling(max_tokens=4, structured_outputs=constraint))["structured_outputs"]
        # The backend json.loads the text into StructuredOutputsParams(**fields): one constraint set.
        assert isinstance(sent, str)
        fields_set = json.loads(sent)
        assert list(fields_set) == [kind] and kind in VLLM_STRUCTURED["constraints"]
    # json is a dict (the backend refuses anything else), choice a list of strings.
    assert json.loads(vllm_sampling_parameters(Sampling(max_tokens=1, structured_outputs=samples["json"]))["structured_outputs"]) == {
        "json": {"type": "object"}
    }
    assert json.loads(vllm_sampling_parameters(Sampling(max_tokens=1, structured_outputs=samples["choice"]))["structured_outputs"]) == {
        "choice": ["yes", "no"]
    }


def test_the_step_request_carries_every_option() -> None:
    body = json.loads(PromptSpec(prompt="p").to_json(EVERYTHING, prefill_chunk=4, owner="a"))
    assert body["prompt"] == "p" and body["prefill_chunk"] == 4 and body["owner"] == "a"
    assert Sampling.from_json(body) == EVERYTHING
    assert json.loads(PromptSpec(prompt="p").to_json()) == {"prompt": "p"}  # a count row: no options


def test_the_grpc_request_becomes_the_contracts_type() -> None:
    message = types_pb2.SamplingParams(max_tokens=9, top_k=3, logit_bias={5: 2.0}, presence_penalty=0.5)
    assert from_proto(message) == Sampling(max_tokens=9, top_k=3, logit_bias=((5, 2.0),), presence_penalty=0.5)
    assert {f.name for f in fields(Sampling)} == set(FIELD_NAMES)


def finish_invalid(error: str) -> FinishEvent:
    return FinishEvent(Finish.INVALID, 0, 0, Timings(0.0, 0.0, 0.0, 0.0), error=error)


def test_an_option_the_engine_refuses_is_invalid_argument_naming_it() -> None:
    with pytest.raises(InvalidArgument) as caught:
        _final_response(finish_invalid(field_error("logit_bias", "token id 49152 is not a token")), input_field="messages")
    assert caught.value.field_name == "sampling.logit_bias" and "49152" in caught.value.reason
    with pytest.raises(InvalidArgument) as caught:
        _final_response(finish_invalid("the prompt is 3000 tokens: too long"), input_field="prompt")
    assert caught.value.field_name == "prompt"
