"""Token-id prompts (vLLM's prompt_token_ids) on the adapter: the step request carries them as given,
their count is their length, and a model behind Triton's vLLM backend (text_input only) declares
that it takes none, so that they are refused naming prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2

from sluice_common.errors import InvalidArgument
from sluice_common.validation import validate_generation
from sluice_inference_adapter.__main__ import takes_token_prompts
from sluice_inference_adapter.servicer import _generation_request
from sluice_inference_adapter.step_rows import PromptSpec

VLLM_INTERFACE = json.loads((Path(__file__).parents[3] / "tests" / "fixtures" / "upstream" / "vllm_backend_interface.json").read_text())
STEP_MODEL = types_pb2.ModelInfo(name="step", context_length=2048, max_output_tokens=256, token_prompts=True)
VLLM_MODEL = types_pb2.ModelInfo(name="vllm", context_length=2048, max_output_tokens=256, token_prompts=takes_token_prompts("vllm"))


def test_the_step_request_carries_the_ids_as_given() -> None:
    request = inference_pb2.GenerateRequest(model="step", prompt_token_ids=[1, 9906, 0], sampling=types_pb2.SamplingParams(max_tokens=4))
    prompt = _generation_request(request, None).prompt
    assert prompt.prompt_token_ids == (1, 9906, 0)
    body = json.loads(PromptSpec(prompt_token_ids=(1, 9906, 0)).to_json())
    assert body == {"prompt_token_ids": [1, 9906, 0]}
    assert prompt.estimated_tokens() == 3  # exact, not a guess


def test_prompt_spec_routes_token_prompts_by_their_leading_ids() -> None:
    assert PromptSpec(prompt_token_ids=(1, 2, 3)).routing_text().startswith(PromptSpec(prompt_token_ids=(1, 2)).routing_text())


def test_only_the_step_protocol_takes_token_prompts() -> None:
    """Triton's vLLM backend has one prompt input, text_input: no way to hand it ids."""
    prompt_inputs = [t["name"] for t in VLLM_INTERFACE["inputs"] if "input" in t["name"] and t["data_type"] == "TYPE_STRING"]
    assert prompt_inputs == ["text_input"] and not any(t["data_type"].startswith("TYPE_INT") for t in VLLM_INTERFACE["inputs"])
    assert takes_token_prompts("step") and not takes_token_prompts("vllm")


def test_a_token_prompt_to_a_text_only_model_is_invalid_naming_prompt() -> None:
    sampling = types_pb2.SamplingParams(max_tokens=4)
    validate_generation([], "", sampling, STEP_MODEL, [1, 2])
    with pytest.raises(InvalidArgument) as refused:
        validate_generation([], "", sampling, VLLM_MODEL, [1, 2])
    assert refused.value.field_name == "prompt" and "token ids" in refused.value.message


@pytest.mark.parametrize(("prompt", "ids"), [("text", [1]), ("", [-1])])
def test_a_token_prompt_beside_a_text_or_with_a_negative_id_is_invalid(prompt: str, ids: list[int]) -> None:
    with pytest.raises(InvalidArgument) as refused:
        validate_generation([], prompt, types_pb2.SamplingParams(max_tokens=4), STEP_MODEL, ids)
    assert refused.value.field_name == "prompt"
