"""Which backend errors are the request's fault and which are the replica's.

A generate model reports every failure of a stream the same way: an error response whose
message Triton forwards (the vLLM backend sends `TritonError(f"Error generating stream: {e}")`
with Triton's default code, INTERNAL, whatever `e` was). Only the message tells a prompt longer
than the model's context from a crashed engine, so it is read here, against the messages vLLM
raises for a request it refuses (kept as fixtures in tests/fixtures/vllm_errors.json).

A rejected request must not count against the replica's health (two long prompts would
otherwise take the only replica out of service) and reaches the client as INVALID_ARGUMENT;
everything else (transport failures, timeouts, server errors) is the replica's.
"""

from __future__ import annotations

import re

# Prefixes Triton and the vLLM backend put before the engine's own message.
_WRAPPERS = (
    re.compile(r"^\s*\[StatusCode\.\w+\]\s*"),
    re.compile(r"^\s*Error generating stream:\s*", re.IGNORECASE),
)

# vLLM's messages for a request it refuses (vllm/v1/engine/processor.py, vllm/sampling_params.py,
# vllm/entrypoints and the backend's own input checks).
_REQUEST_FAULTS = (
    re.compile(r"is longer than the maximum model length", re.IGNORECASE),
    re.compile(r"too long to fit into the model", re.IGNORECASE),
    re.compile(r"maximum context length is \d+ tokens", re.IGNORECASE),
    re.compile(r"prompt cannot be empty", re.IGNORECASE),
    re.compile(r"\b(n|best_of|temperature|top_p|top_k|min_p|max_tokens|min_tokens|seed|presence_penalty|"
               r"frequency_penalty|repetition_penalty|logprobs|prompt_logprobs|stop) must be\b", re.IGNORECASE),
    re.compile(r"\bout of (the )?(vocabulary )?range\b", re.IGNORECASE),
    re.compile(r"When streaming, `exclude_input_in_output` = False is not allowed", re.IGNORECASE),
    re.compile(r"^LoRA .*(not supported|not enabled)", re.IGNORECASE),
    re.compile(r"Expecting value|Unterminated string|JSONDecodeError", re.IGNORECASE),
)


class RequestRejected(Exception):
    """The backend refused the request itself; `cause` is its reason, for the client to read."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


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
