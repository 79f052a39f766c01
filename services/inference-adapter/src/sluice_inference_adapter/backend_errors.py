"""Which backend errors are the request's fault and which are the replica's.

A generate model reports every failure of a stream the same way: an error response whose
message Triton forwards (the vLLM backend sends `TritonError(f"Error generating stream: {e}")`
with Triton's default code, INTERNAL, whatever `e` was). Only the message tells a prompt longer
than the model's context from a crashed engine, so it is read here, against the messages vLLM
raises for a request it refuses (kept as fixtures in tests/fixtures/vllm_errors.json, each with its
source, beside crash messages that must not match).

A rejected request must not count against the replica's health (two long prompts would
otherwise take the only replica out of service) and reaches the client as INVALID_ARGUMENT;
everything else (transport failures, timeouts, server errors) is the replica's.
"""

from __future__ import annotations

import re

# Prefixes Triton and the vLLM backend put before the engine's own message. Triton names a request
# that has an id (the adapter sends the request id as a stream's id) in the errors it raises itself:
# "[request id: <id>] ...".
_WRAPPERS = (
    re.compile(r"^\s*\[StatusCode\.\w+\]\s*"),
    re.compile(r"^\s*\[request id: [^\]]*\]\s*", re.IGNORECASE),
    re.compile(r"^\s*Error generating stream:\s*", re.IGNORECASE),
)

# vLLM's own wordings for a request it refuses, anchored at the start of the engine's message so that a
# crash that merely contains such words ("list index out of range", "index out of range in self") is not
# read as one. Each is a fixture in tests/fixtures/vllm_errors.json with the file and version it comes
# from. Not here: JSON decoding errors. The sampling_parameters JSON is the adapter's own
# (sluice_common.sampling.vllm_sampling_parameters), so a backend that cannot parse it is not the client's doing.
_REQUEST_FAULTS = (
    # vllm/v1/engine/processor.py (Processor._validate_model_input)
    re.compile(r"^The (decoder|encoder) prompt \(length \d+\) is longer than the maximum model length of \d+"),
    re.compile(r"^The (decoder|encoder) prompt cannot be empty"),
    re.compile(r"^Token id \d+ is out of vocabulary"),
    # vllm/v1/engine/processor.py (Processor._validate_logit_bias)
    re.compile(r"^token_id\(s\) \[[-\d, ]*\] in logit_bias contain out-of-vocab token ids"),
    # vllm/engine/llm_engine.py (vLLM 0.6.x)
    re.compile(r"^The prompt \(total length \d+\) is too long to fit into the model \(context length \d+\)"),
    # vllm/entrypoints/openai/serving_engine.py
    re.compile(r"^This model's maximum context length is \d+ tokens"),
    # vllm/v1/engine/input_processor.py (InputProcessor._validate_logprobs): an operator's max_logprobs below Sluice's 20
    re.compile(r"^Requested sample logprobs of \d+, which is greater than max allowed: \d+"),
    # vllm/sampling_params.py (SamplingParams._verify_args)
    re.compile(r"^(n|temperature|top_p|top_k|min_p|max_tokens|min_tokens|presence_penalty|frequency_penalty|repetition_penalty) must be "),
    re.compile(r"^stop cannot contain an empty string"),
    # triton-inference-server/vllm_backend src/model.py (TritonPythonModel._verify_loras)
    re.compile(r"^LoRA \S+ is not supported, we currently support "),
    re.compile(r"^LoRA feature is not enabled\."),
    # triton-inference-server/vllm_backend src/utils/vllm_backend_utils.py: from_dict answers None
    # for any sampling_parameters vLLM's SamplingParams refuses (an option this version does not
    # take, a value it refuses), then request.py reads .lora_name off it: the request's doing, the
    # same on every replica.
    re.compile(r"^'NoneType' object has no attribute 'lora_name'"),
)


# The Sluice field a refused sampling option is (vLLM names it first, as SamplingParams does).
_OPTION_FAULT = re.compile(r"^(temperature|top_p|top_k|min_p|max_tokens|presence_penalty|frequency_penalty|repetition_penalty) must be ")
_LOGIT_BIAS_FAULT = re.compile(r"^token_id\(s\) .* in logit_bias ")
_STOP_FAULT = re.compile(r"^stop cannot contain an empty string")
_LOGPROBS_FAULT = re.compile(r"^Requested sample logprobs of ")
_UNBUILT_SAMPLING = re.compile(r"^'NoneType' object has no attribute 'lora_name'")
UNBUILT_SAMPLING_CAUSE = (
    "the model's vLLM backend could not build vLLM's SamplingParams from this request's sampling options"
    " (an option its vLLM version does not take, or a value it refuses; the backend's log names it)"
)


class RequestRejected(Exception):
    """The backend refused the request itself; `cause` is its reason, for the client to read, and
    `field` the request's option at fault when the reason names one ("sampling.top_k"), else ""."""

    def __init__(self, cause: str) -> None:
        field = fault_field(cause)
        cause = UNBUILT_SAMPLING_CAUSE if _UNBUILT_SAMPLING.match(cause) else cause
        super().__init__(cause)
        self.cause = cause
        self.field = field


def fault_field(cause: str) -> str:
    """The option a request fault names, as a Sluice field path; "" when the input is at fault."""
    option = _OPTION_FAULT.match(cause)
    if option:
        return f"sampling.{option.group(1)}"
    if _LOGIT_BIAS_FAULT.match(cause):
        return "sampling.logit_bias"
    if _STOP_FAULT.match(cause):
        return "sampling.stop"
    if _LOGPROBS_FAULT.match(cause):
        return "sampling.logprobs"
    if _UNBUILT_SAMPLING.match(cause):
        return "sampling"
    return ""


def engine_message(message: str) -> str:
    """The engine's own words, without the prefixes Triton and the backend add.

    A Python-backend model that lets an exception escape (PyTriton does so for every error)
    sends the whole traceback: its last line is the exception, "ValueError: <message>".
    """
    if "Traceback (most recent call last)" in message:
        last = [line for line in message.strip().splitlines() if line.strip()][-1]
        message = re.sub(r"^[\w.]+(Error|Exception): ", "", last.strip(), count=1)
    for wrapper in _WRAPPERS:
        message = wrapper.sub("", message, count=1)
    return message.strip()


def is_request_fault(message: str) -> bool:
    cause = engine_message(message)
    return any(pattern.search(cause) for pattern in _REQUEST_FAULTS)
