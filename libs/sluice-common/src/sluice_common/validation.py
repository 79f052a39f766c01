"""Checks of a generation request that the gateway and the adapter share.

Raises InvalidArgument naming the field and the reason, so that a client can fix its
request without reading server logs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sluice.common.v1 import types_pb2

from sluice_common.errors import InvalidArgument
from sluice_common.sampling import StructuredOutputsError, problem
from sluice_common.errors import clip
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

# What a request may ask to be compiled (tools, constraints) or converted (logit_bias), every front
# alike: checked before anything is parsed or compiled, so that a request of megabytes (HTTP and gRPC
# take up to 32 MiB) is refused at once instead of holding the event loop while llguidance compiles
# it (measured: 10,000 tools 1.8 s, 80,000 choice options 5 s; a 64 Ki-character schema 0.1-0.3 s).
# OpenAI's documented maximum: "A max of 128 functions are supported" (chat completions' `tools`).
MAX_TOOLS = 128
# One tool's parameters (JSON text), all of a request's tools' together (tool_choice required compiles
# them as one constraint), and a structured-output constraint's text (JSON Schema, regex, grammar, or
# the choice options together), in characters: Sluice's bound; OpenAI documents none.
MAX_CONSTRAINT_CHARS = 64 * 1024
# The options of a `choice` constraint: Sluice's bound (vLLM's StructuredOutputsParams sets none).
MAX_CHOICE_OPTIONS = 1024
# logit_bias's entries: OpenAI's API reference documents no maximum; vLLM's GPU model runner holds at
# most 1,024 a request (MAX_NUM_LOGIT_BIAS_TOKENS), the bound taken here.
MAX_LOGIT_BIAS = 1024
# A model's name: Sluice's bound (ListModels' names are short); a longer one is refused before it is
# looked up, logged or recorded, and never quoted whole (a 20,000-character name outgrew gRPC's
# metadata: the client heard RESOURCE_EXHAUSTED instead of INVALID_ARGUMENT).
MAX_MODEL_NAME = 256


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
        if len(key) > MAX_METADATA_KEY:  # named by the map: the key is no field name to quote whole
            raise InvalidArgument("metadata", f"keys are 1 to {MAX_METADATA_KEY} characters, got {clip(key)!r} ({len(key)})")
        if not key or len(value) > MAX_METADATA_VALUE:
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
    _validate_sizes(sampling)
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


def constraint_too_large(kind: str, value: str | Sequence[str]) -> str | None:
    """Why a structured-output constraint (its kind, and its text or choice options) is too large to
    be compiled on a request's path, or None. Costs a length or two: checked before it is parsed."""
    if kind == "choice":
        if len(value) > MAX_CHOICE_OPTIONS:
            return f"choice: at most {MAX_CHOICE_OPTIONS} options, got {len(value)}"
        size = sum(len(option) for option in value if isinstance(option, str))
    else:
        size = len(value) if isinstance(value, str) else 0
    if size > MAX_CONSTRAINT_CHARS:
        return f"{kind}: at most {MAX_CONSTRAINT_CHARS} characters, got {size}"
    return None


def _validate_sizes(sampling: types_pb2.SamplingParams) -> None:
    """The bounds on what the options convert and compile (above), before anything does."""
    if len(sampling.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(sampling.logit_bias)}")
    if sampling.HasField("structured_outputs"):
        message = sampling.structured_outputs
        kind = message.WhichOneof("constraint") or ""
        if kind in ("json", "regex", "grammar", "choice"):
            reason = constraint_too_large(kind, message.choice.options if kind == "choice" else getattr(message, kind))
            if reason is not None:
                raise InvalidArgument("sampling.structured_outputs", reason)


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
            raise InvalidArgument(f"messages[{index}].role", f"must be one of {', '.join(ROLES)}, got {clip(message.role)!r}")
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
