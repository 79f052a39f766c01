"""The vLLM-backend stand-in: its interface is upstream's, and it reads and answers requests as
the backend does (the whole model is exercised through a real Triton in tests/e2e/test_passthrough.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sluice_triton_local.engine.step_engine import RowResult
from sluice_triton_local.generate_model import VLLM_INPUTS, VLLM_OUTPUTS, _Progress, _response, fit_to_context, parse_request

UPSTREAM = json.loads((Path(__file__).parents[3] / "tests" / "fixtures" / "upstream" / "vllm_backend_interface.json").read_text())
TRITON_TYPES = {bytes: "TYPE_STRING", np.bool_: "TYPE_BOOL", np.float32: "TYPE_FP32", np.uint32: "TYPE_UINT32"}


def declared(tensors: tuple[tuple[str, type, tuple[int, ...]], ...]) -> list[tuple[str, str, list[int]]]:
    return [(name, TRITON_TYPES[dtype], list(shape)) for name, dtype, shape in tensors]


def test_inputs_and_outputs_are_upstreams() -> None:
    assert declared(VLLM_INPUTS) == [(t["name"], t["data_type"], t["dims"]) for t in UPSTREAM["inputs"]]
    assert declared(VLLM_OUTPUTS) == [(t["name"], t["data_type"], t["dims"]) for t in UPSTREAM["outputs"]]


def request(sampling: dict[str, object] | None = None, **flags: bool) -> dict[str, np.ndarray]:
    inputs = {"text_input": np.array([b"Hello"], dtype=np.object_)}
    if sampling is not None:
        inputs["sampling_parameters"] = np.array([json.dumps(sampling).encode()], dtype=np.object_)
    inputs.update({name: np.array([value]) for name, value in flags.items()})
    return inputs


def test_reads_sampling_parameters_and_the_requested_outputs() -> None:
    parsed = parse_request(request({"max_tokens": 5, "temperature": 0, "seed": 3, "stop": ["."]}, stream=True,
                                   exclude_input_in_output=True, return_finish_reason=True, return_num_output_tokens=True))
    assert (parsed.params.max_tokens, parsed.params.temperature, parsed.params.seed, parsed.params.stop) == (5, 0.0, 3, (".",))
    assert parsed.stream and not parsed.prepend_input
    assert parsed.outputs == {"finish_reason", "num_output_tokens"}


def test_vllm_defaults_without_sampling_parameters() -> None:
    parsed = parse_request(request())
    assert (parsed.params.max_tokens, parsed.params.temperature, parsed.stream, parsed.prepend_input) == (16, 1.0, False, True)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (request({"max_tokens": 0}), "max_tokens must be at least 1, got 0."),
        (request({"temperature": -1}), "temperature must be non-negative, got -1.0."),
        (request({"top_p": 1.5}), "top_p must be in (0, 1], got 1.5."),
        (request(stream=True, exclude_input_in_output=False), "When streaming, `exclude_input_in_output` = False is not allowed."),
    ],
)
def test_refuses_what_vllm_refuses_in_its_words(inputs: dict[str, np.ndarray], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_request(inputs)
    assert str(caught.value) == message


def test_prompt_longer_than_the_context_is_refused_and_max_tokens_cut_at_its_end() -> None:
    parsed = parse_request(request({"max_tokens": 100}))
    with pytest.raises(ValueError, match=r"^The decoder prompt \(length 2049\) is longer than the maximum model length of 2048\."):
        fit_to_context(parsed, 2049, 2048)
    assert fit_to_context(parsed, 2000, 2048).max_tokens == 48
    assert fit_to_context(parsed, 10, 2048).max_tokens == 100


def test_responses_carry_finish_reason_and_token_counts_since_the_last_one() -> None:
    progress = _Progress(prompt_tokens=12)
    outputs = frozenset({"finish_reason", "num_input_tokens", "num_output_tokens"})
    first = _response("Par", RowResult(1, 5, "Par", "", 12, 2), progress, outputs)
    last = _response("is", RowResult(1, 6, "is", "stop", 12, 3), progress, outputs)
    assert [r["finish_reason"][0] for r in (first, last)] == [b"None", b"stop"]
    assert [int(r["num_output_tokens"][0]) for r in (first, last)] == [2, 1]
    assert int(last["num_input_tokens"][0]) == 12 and last["num_input_tokens"].dtype == np.uint32
    assert set(_response("x", RowResult(1, 7, "x", "", 12, 4), progress, frozenset())) == {"text_output"}
