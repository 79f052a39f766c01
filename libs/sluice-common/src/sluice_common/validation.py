"""Checks of a generation request that the gateway and the adapter share.

Raises InvalidArgument naming the field and the reason, so that a client can fix its
request without reading server logs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sluice.common.v1 import types_pb2

from sluice_common.errors import InvalidArgument
from sluice_common.sampling import StructuredOutputsError, problem
from sluice_common.sampling_proto import from_proto, structured_outputs_from_proto
from sluice_common.structured_outputs import check

ROLES = ("system", "user", "assistant")
MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 64
MAX_EMBED_INPUTS = 256
MAX_EMBED_INPUT_CHARS = 16384
# OpenAI's bounds on a request's metadata; OpenAI sets none on `user`: Sluice's own.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_USER = 256
# The HTTP front keeps the first 128 characters of X-Client-Request-Id; gRPC is held to the same.
MAX_CLIENT_REQUEST_ID = 128


def validate_recorded(user: str, metadata: Mapping[str, str], client_request_id: str = "") -> None:
    """A request's end user, metadata and client request id (recorded on its evaluation record,
    never sent to the model) within those bounds, whichever front they came from."""
    if len(client_request_id) > MAX_CLIENT_REQUEST_ID:
        raise InvalidArgument("client_request_id", f"must be at most {MAX_CLIENT_REQUEST_ID} characters, got {len(client_request_id)}")
    if len(user) > MAX_USER:
        raise InvalidArgument("user", f"must be at most {MAX_USER} characters, got {len(user)}")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidArgument("metadata", f"at most {MAX_METADATA_PAIRS} key-value pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if not key or len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise InvalidArgument(f"metadata.{key}", f"keys are 1 to {MAX_METADATA_KEY} characters, values at most {MAX_METADATA_VALUE}")


def validate_generation(
    messages: Sequence[types_pb2.ChatMessage],
    prompt: str,
    sampling: types_pb2.SamplingParams,
    model: types_pb2.ModelInfo,
    prompt_token_ids: Sequence[int] = (),
) -> None:
    _validate_input(messages, prompt, prompt_token_ids, model)
    if sampling.max_tokens <= 0:
        raise InvalidArgument("sampling.max_tokens", f"must be > 0, got {sampling.max_tokens}")
    if sampling.max_tokens > model.max_output_tokens:
        raise InvalidArgument(
            "sampling.max_tokens",
            f"{sampling.max_tokens} is above the limit of {model.name} ({model.max_output_tokens})",
        )
    # The options' ranges are the contract's own (sluice_common.sampling.problem), shared with the
    # engine; logit_bias's token ids are checked against the vocabulary there, where it is known.
    found = problem(from_proto(sampling))
    if found is not None:
        name, reason = found
        raise InvalidArgument(f"sampling.{name}", reason)
    if sampling.HasField("logprobs") and not model.logprobs:
        # Decided from the model's declared capabilities (ListModels), before any lease is taken.
        raise InvalidArgument("sampling.logprobs", f"{model.name} does not report token log-probabilities")
    if sampling.logit_bias and not model.logit_bias:
        raise InvalidArgument("sampling.logit_bias", f"{model.name} does not apply logit_bias")
    if sampling.HasField("structured_outputs"):
        _validate_structured_outputs(sampling.structured_outputs, model)
    if len(sampling.stop) > MAX_STOP_SEQUENCES:
        raise InvalidArgument("sampling.stop", f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(sampling.stop)}")
    for index, stop in enumerate(sampling.stop):
        if not stop or len(stop) > MAX_STOP_LENGTH:
            raise InvalidArgument(f"sampling.stop[{index}]", f"must be 1 to {MAX_STOP_LENGTH} characters long")


def _validate_structured_outputs(message: types_pb2.StructuredOutputs, model: types_pb2.ModelInfo) -> None:
    if not model.structured_outputs:
        raise InvalidArgument("sampling.structured_outputs", f"{model.name} does not enforce structured outputs")
    try:
        # Compiled without the vocabulary: a schema the library cannot compile is refused here,
        # naming the keyword, before a lease is taken (the engine compiles it again for its model).
        check(structured_outputs_from_proto(message))
    except StructuredOutputsError as exc:
        raise InvalidArgument("sampling.structured_outputs", str(exc)) from None


def _validate_input(messages: Sequence[types_pb2.ChatMessage], prompt: str, prompt_token_ids: Sequence[int], model: types_pb2.ModelInfo) -> None:
    if sum(map(bool, (messages, prompt, prompt_token_ids))) > 1:
        raise InvalidArgument("prompt", "give exactly one of messages, prompt or prompt_token_ids")
    if not messages and not prompt and not prompt_token_ids:
        raise InvalidArgument("messages", "no messages and no prompt: give a chat or a raw prompt")
    if prompt_token_ids:
        if not model.token_prompts:
            # Decided from the model's declared capabilities (ListModels), before any lease is taken.
            raise InvalidArgument("prompt", f"{model.name} takes text prompts only, not token ids")
        negative = next((t for t in prompt_token_ids if t < 0), None)
        if negative is not None:
            raise InvalidArgument("prompt", f"token ids must be >= 0, got {negative}")
    for index, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidArgument(f"messages[{index}].role", f"must be one of {', '.join(ROLES)}, got {message.role!r}")
        if not message.content:
            raise InvalidArgument(f"messages[{index}].content", "must not be empty")


def validate_priority_class(value: int) -> None:
    """An enum value the proto does not define (a client's newer enum, or junk) is refused, not read as
    interactive and never as a crash."""
    if value not in types_pb2.PriorityClass.values():
        names = ", ".join(types_pb2.PriorityClass.keys())
        raise InvalidArgument("priority_class", f"must be one of {names}, got {value}")


def validate_embedding(inputs: Sequence[str]) -> None:
    if not inputs:
        raise InvalidArgument("inputs", "no texts to embed")
    if len(inputs) > MAX_EMBED_INPUTS:
        raise InvalidArgument("inputs", f"at most {MAX_EMBED_INPUTS} texts per request, got {len(inputs)}")
    for index, text in enumerate(inputs):
        if len(text) > MAX_EMBED_INPUT_CHARS:
            raise InvalidArgument(f"inputs[{index}]", f"longer than {MAX_EMBED_INPUT_CHARS} characters")
