"""Backend errors told apart: the request's fault or the replica's, against vLLM's own messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice_inference_adapter.backend_errors import RequestRejected, engine_message, fault_field, is_request_fault
from sluice_inference_adapter.triton_backend import protocol_of

MESSAGES = json.loads((Path(__file__).parent / "fixtures" / "vllm_errors.json").read_text())
# The upstream interface, kept once for the adapter and triton-local's stand-in.
TRTLLM_CONFIG = json.loads((Path(__file__).parents[3] / "tests" / "fixtures" / "upstream" / "tensorrtllm_ensemble_interface.json").read_text())
VLLM_CONFIG = json.loads((Path(__file__).parents[3] / "tests" / "fixtures" / "upstream" / "vllm_backend_interface.json").read_text())


def _table(side: str) -> list[object]:
    return [pytest.param(entry["message"], id=entry["message"][:60]) for entry in MESSAGES[side]]


@pytest.mark.parametrize("message", _table("request_faults"))
def test_vllms_request_fault_wordings_are_the_clients_fault(message: str) -> None:
    assert is_request_fault(message)


@pytest.mark.parametrize("message", _table("replica_faults"))
def test_crashes_and_everything_else_are_the_replicas(message: str) -> None:
    """Issue 22: "out of range" took an engine's IndexError and CUDA's index errors for a bad request,
    and a JSON decoding error of the adapter's own sampling JSON too."""
    assert not is_request_fault(message)


@pytest.mark.parametrize("entry", [pytest.param(e, id=e["message"][:60]) for e in MESSAGES["request_faults"]])
def test_a_refused_option_names_its_field(entry: dict[str, str]) -> None:
    """vLLM's refusal of a sampling option reaches the client as INVALID_ARGUMENT naming the option
    (sampling.top_k, sampling.logit_bias...); a refused input names none (the adapter names the input)."""
    assert fault_field(engine_message(entry["message"])) == entry.get("field", "")
    assert RequestRejected(engine_message(entry["message"])).field == entry.get("field", "")


def test_every_fixture_names_its_source() -> None:
    for side in ("request_faults", "replica_faults"):
        assert all(entry["message"] and entry["source"] for entry in MESSAGES[side]), side


def test_the_cause_loses_the_wrappers() -> None:
    message = "[StatusCode.INTERNAL] Error generating stream: The decoder prompt (length 3) is longer than the maximum model length of 2."
    assert engine_message(message) == "The decoder prompt (length 3) is longer than the maximum model length of 2."


def test_the_request_id_triton_names_a_request_by_is_a_wrapper_too() -> None:
    """The adapter sends a stream's request id as its Triton request id, which Triton puts before the
    errors it raises itself: a refusal so prefixed is still the request's."""
    message = "[request id: 0123abc] Error generating stream: The decoder prompt (length 3) is longer than the maximum model length of 2."
    assert engine_message(message) == "The decoder prompt (length 3) is longer than the maximum model length of 2."
    assert is_request_fault(message)


def test_the_upstream_vllm_interface_is_fed_as_generate() -> None:
    assert protocol_of("m", {tensor["name"] for tensor in VLLM_CONFIG["inputs"]}) == "generate"


def test_a_vllm_backend_without_usage_outputs_is_refused_at_start() -> None:
    with pytest.raises(SystemExit, match="return_num_input_tokens"):
        protocol_of("m", {"text_input", "stream", "sampling_parameters", "exclude_input_in_output"})


def test_tensorrt_llm_is_refused_with_the_reason() -> None:
    """Upstream's ensemble reports token counts (num_input_tokens, num_output_tokens) but no finish reason."""
    assert {"num_input_tokens", "num_output_tokens"} <= set(TRTLLM_CONFIG["outputs"])
    assert not any("finish" in name for name in TRTLLM_CONFIG["outputs"])
    with pytest.raises(SystemExit, match="report no finish reason"):
        protocol_of("m", set(TRTLLM_CONFIG["inputs"]))


def test_a_python_traceback_gives_its_last_line() -> None:
    message = (
        '[StatusCode.INTERNAL] Traceback (most recent call last):\n  File "model.py", line 3, in __call__\n'
        "    raise ValueError(...)\nValueError: Error generating stream: The decoder prompt (length 9) is longer"
        " than the maximum model length of 8.\n"
    )
    assert is_request_fault(message)
    assert engine_message(message) == "The decoder prompt (length 9) is longer than the maximum model length of 8."


def test_sampling_options_the_vllm_backend_cannot_build_are_the_requests_fault_said_plainly() -> None:
    """vllm_backend's from_dict answers None for any SamplingParams vLLM refuses, and the client
    read "'NoneType' object has no attribute 'lora_name'" after every replica had been tried (and
    counted failed): the same request fails the same way everywhere."""
    message = "Error generating stream: 'NoneType' object has no attribute 'lora_name'"
    assert is_request_fault(message)
    rejected = RequestRejected(engine_message(message))
    assert rejected.field == "sampling" and "could not build vLLM's SamplingParams" in rejected.cause
    assert "lora_name" not in rejected.cause
