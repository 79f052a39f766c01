"""OpenAI request bodies -> Sluice's requests (replies.py builds the answers).

Pure domain code (no HTTP, no grpc): the HTTP fronts parse with these. Every refusal is an
`OpenAIError` in OpenAI's shape, naming the offending param:

- a field Sluice does not know: 400 "Unrecognized request argument supplied: <name>";
- a field OpenAI defines that Sluice cannot honour (best_of, audio, ...): accepted at its default
  (null, or OpenAI's neutral value), otherwise 400 naming it; n, logprobs, top_logprobs (chat) and
  echo (completions) are honoured (choices);
- a wrong type or value: 400 naming the param ("messages[1].content", "temperature", ...);
- OpenAI's request metadata, `user` and `metadata` (chat and completions): checked against
  OpenAI's limits and carried on the request to the completion's evaluation record, queryable
  there; nothing is accepted and dropped. docs/developers/openai-http.md tabulates every field.

Sampling options honoured: OpenAI's temperature, top_p, seed, stop, presence_penalty,
frequency_penalty and logit_bias ({"<token id>": bias}), and vLLM's extensions top_k (-1 or 0: no
limit), min_p and repetition_penalty. Structured output by constrained decoding: OpenAI's
response_format json_object and json_schema, and vLLM's extension structured_outputs (json, regex,
choice, grammar); a schema the library cannot compile is a 400 naming the keyword, before anything
is queued. Their ranges are the sampling contract's
(sluice_common.sampling.problem), checked by the InferencePath as for every front; a logit_bias id
outside the model's vocabulary is refused by the engine, which knows it: 400 naming logit_bias too.

Defaults as OpenAI's: temperature 1.0 and top_p 1.0 when omitted or null (set explicitly on the
Sluice request); a completion's max_tokens omitted or null: OpenAI's 16 (vLLM's too, omitted); a chat's
max_tokens and max_completion_tokens omitted (OpenAI sets no default): left 0, which the
InferencePath turns into the model's remaining context capped by SLUICE_GATEWAY_DEFAULT_MAX_TOKENS,
as on gRPC.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2

from sluice_common.sampling import StructuredOutputs, StructuredOutputsError
from sluice_common.sampling_proto import structured_outputs_to_proto
from sluice_common.structured_outputs import check
from sluice_common.utf8 import invalid_json_text
from sluice_common.validation import (
    MAX_LOGIT_BIAS, MAX_METADATA_KEY, MAX_METADATA_PAIRS, MAX_METADATA_VALUE, MAX_MODEL_NAME, MAX_TOOLS, MAX_USER, constraint_too_large,
)  # fmt: skip
from sluice_gateway.openai_front.errors import invalid
from sluice_gateway.openai_front.choices import parse_chat_choices, parse_completion_choices

# OpenAI's defaults for sampling (https://platform.openai.com/docs/api-reference/chat/create).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
# OpenAI's default max_tokens of a (legacy) completion, and vLLM's: CreateCompletionRequest's
# `"default": 16`. Chat has none upstream: the InferencePath's default applies there.
COMPLETION_MAX_TOKENS = 16

# OpenAI's rule for response_format.json_schema.name.
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

# SamplingParams.max_tokens is an int32: anything larger cannot be carried, let alone served.
MAX_INT32 = (1 << 31) - 1


def check_text(document: dict[str, Any]) -> None:
    """Refuses a string that is valid JSON but not Unicode (an escaped lone surrogate such as
    "\\ud800"), naming its param: it could not be encoded for the model, the store or a log line."""
    path = invalid_json_text(document)
    if path is not None:
        param = path or "body"  # the path is "" only for a key "" at the top
        raise invalid(param, f"{param} is not valid Unicode text: it holds a lone surrogate (such as \\ud800)", "invalid_value")


# Params OpenAI defines on an endpoint that Sluice accepts there only at their neutral value (what
# OpenAI does when they are omitted). Anything else is refused naming the param; a param of another
# endpoint is unrecognized, as upstream has it.
_CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "functions": (None,),
    "function_call": (None, "none", "auto"),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "modalities": (None,),
    "prediction": (None,),
    "audio": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "safety_identifier": (None,),
    "prompt_cache_key": (None,),
    "prompt_cache_retention": (None,),
    "prompt_cache_options": (None,),
    "verbosity": (None,),
    "moderation": (None,),
}
_COMPLETION_NEUTRAL: dict[str, tuple[Any, ...]] = {"best_of": (None, 1), "suffix": (None, "")}
# OpenAI's metadata of a request (they change nothing about the output): recorded on the
# completion's evaluation record (GenerateRequest.user and metadata), where it can be queried.
_RECORDED = ("user", "metadata")

# OpenAI's sampling params and vLLM's extensions of them (its OpenAI server takes them in the body).
_SAMPLING_FIELDS = {
    "max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
    "top_k", "min_p", "repetition_penalty", "structured_outputs",
}  # fmt: skip
_CHAT_FIELDS = {
    *_RECORDED, "model", "messages", "max_completion_tokens", "stream", "stream_options", "response_format", *_SAMPLING_FIELDS,
    "n", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
}  # fmt: skip
_COMPLETION_FIELDS = {*_RECORDED, "model", "prompt", "stream", "stream_options", "response_format", *_SAMPLING_FIELDS, "n", "logprobs", "echo"}
_EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any, param: str, what: str) -> float:
    """A JSON number as a float; a 400 naming `param` for anything else, and for an integer too large
    for a float (10**400: float() would raise OverflowError)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise invalid(param, f"{what} must be a number, got {value!r}", "invalid_type")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise invalid(param, f"{what} must be a finite number, got {value!r}", "invalid_value")
    return number


def _same(value: Any, neutral: Any) -> bool:
    """Equal without Python's 0 == False and 1 == True."""
    if value is None or neutral is None or isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return type(value) in (int, float, str) and value == neutral


def _check_fields(body: dict[str, Any], known: set[str], neutrals: dict[str, tuple[Any, ...]]) -> None:
    for name, value in body.items():
        if name in known:
            continue
        if name in neutrals:
            neutral = neutrals[name]
            if any(_same(value, n) for n in neutral):
                continue
            if isinstance(value, (list, dict)) and not value and None in neutral:
                continue  # an empty list or map of tools, logit biases: nothing asked
            raise invalid(name, f"{name}={value!r} is not supported by Sluice; omit it or send {neutral[-1]!r}", "unsupported_parameter")
        raise invalid(name, f"Unrecognized request argument supplied: {name}", "unknown_parameter")


def _recorded(body: dict[str, Any], request: gateway_pb2.GenerateRequest) -> None:
    """OpenAI's `user` and `metadata`, checked against OpenAI's limits, onto the request."""
    user = body.get("user")
    if user is not None:
        if not isinstance(user, str):
            raise invalid("user", f"user must be a string, got {user!r}", "invalid_type")
        if len(user) > MAX_USER:
            raise invalid("user", f"user must be at most {MAX_USER} characters, got {len(user)}", "invalid_value")
        request.user = user
    request.metadata.update(check_metadata(body.get("metadata")) or {})


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's `metadata` (a request's, a batch's): None, or at most 16 string pairs, keys at most
    64 characters, values at most 512; a violation is a 400 naming metadata or metadata.<key>."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise invalid("metadata", f"metadata must be an object of at most {MAX_METADATA_PAIRS} string pairs, got {metadata!r}", "invalid_type")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise invalid(
                f"metadata.{key}",
                f"metadata keys are at most {MAX_METADATA_KEY} characters, values strings of at most {MAX_METADATA_VALUE}",
                "invalid_value",
            )
    return dict(metadata)


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise invalid("model", "you must provide a model parameter", "missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise invalid("model", f"model must be a non-empty string, got {model!r}", "invalid_type")
    if len(model) > MAX_MODEL_NAME:  # before it is logged (the InferencePath refuses it as gRPC's)
        raise invalid("model", f"model must be at most {MAX_MODEL_NAME} characters, got {len(model)}", "invalid_value")
    return model


def _optional_number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    return default if value is None else _number(value, name, name)


def _sampling(body: dict[str, Any]) -> types_pb2.SamplingParams:
    sampling = types_pb2.SamplingParams()
    for name in ("max_tokens", "max_completion_tokens"):  # both checked; the second wins
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value):
            raise invalid(name, f"{name} must be an integer, got {value!r}", "invalid_type")
        if not 1 <= value <= MAX_INT32:
            raise invalid(name, f"{name} must be from 1 to {MAX_INT32}, got {value}", "invalid_value")
        sampling.max_tokens = value
    sampling.temperature = _optional_number(body, "temperature", DEFAULT_TEMPERATURE)
    sampling.top_p = _optional_number(body, "top_p", DEFAULT_TOP_P)
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise invalid("seed", f"seed must be an integer, got {seed!r}", "invalid_type")
        if not -(1 << 63) <= seed < 1 << 63:
            raise invalid("seed", f"seed must be a 64-bit signed integer (from -2^63 to 2^63-1), got {seed}", "invalid_value")
        sampling.seed = seed % (1 << 64)  # the uint64 of the same bits
    for name in ("presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"):
        if body.get(name) is not None:  # null or omitted: unset, the contract's neutral value
            setattr(sampling, name, _optional_number(body, name, 0.0))
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or not -1 <= top_k <= MAX_INT32:
            raise invalid("top_k", f"top_k must be an integer, -1 or 0 for no limit, got {top_k!r}", "invalid_type")
        if top_k > 0:  # -1 is vLLM's "no limit", as 0 is
            sampling.top_k = top_k
    _logit_bias(body.get("logit_bias"), sampling)
    _structured_outputs(body.get("structured_outputs"), sampling)
    stop = body.get("stop")
    if isinstance(stop, str):
        sampling.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        sampling.stop.extend(stop)
    elif stop is not None:
        raise invalid("stop", f"stop must be a string or an array of strings, got {stop!r}", "invalid_type")
    return sampling


def _logit_bias(value: Any, sampling: types_pb2.SamplingParams) -> None:
    """OpenAI's logit_bias: an object of token ids (integer strings, as JSON keys are) to biases."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid("logit_bias", f"logit_bias must be an object of token ids to biases, got {value!r}", "invalid_type")
    if len(value) > MAX_LOGIT_BIAS:  # sluice_common.validation's bound, before the entries are read
        raise invalid("logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(value)}", "invalid_value")
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            token = None
        if token is None or str(token) != key or not -MAX_INT32 <= token <= MAX_INT32:
            raise invalid("logit_bias", f"logit_bias keys must be token ids (integers as strings), got {key!r}", "invalid_value")
        sampling.logit_bias[token] = _number(bias, "logit_bias", f"the logit_bias of token {key}")


def _structured_outputs(value: Any, sampling: types_pb2.SamplingParams) -> None:
    """vLLM's extension: `structured_outputs` {"json" | "json_object" | "regex" | "choice" |
    "grammar": ...} (its StructuredOutputsParams), enforced while decoding."""
    if value is None:
        return
    _constrain(sampling, value, "structured_outputs")


# The outcome of each constraint checked within memoised_checks (None: it compiles).
_CHECKED: ContextVar[dict[StructuredOutputs, str | None] | None] = ContextVar("checked_constraints", default=None)


@contextmanager
def memoised_checks() -> Iterator[None]:
    """Within it, each distinct constraint is compiled once: a batch file's lines often share one
    schema or pattern, and compiling it per line took a 100,000-line file a minute."""
    token = _CHECKED.set({})
    try:
        yield
    finally:
        _CHECKED.reset(token)


def _check(constraint: StructuredOutputs) -> None:
    memo = _CHECKED.get()
    if memo is None or constraint.problem() is not None:  # a malformed one may not even hash
        check(constraint)
        return
    if constraint not in memo:
        try:
            check(constraint)
            memo[constraint] = None
        except StructuredOutputsError as exc:
            memo[constraint] = str(exc)
    problem = memo[constraint]
    if problem is not None:
        raise StructuredOutputsError(problem)


def _constrain(sampling: types_pb2.SamplingParams, value: dict[str, Any] | StructuredOutputs, param: str) -> None:
    """Sets the constraint, refusing one that is malformed or that the library cannot compile
    (naming the keyword) before the request goes anywhere."""
    try:
        constraint = value if isinstance(value, StructuredOutputs) else StructuredOutputs.from_json(value)
        too_large = constraint_too_large(constraint.kind, constraint.value)  # before it is compiled
        if too_large is not None:
            raise StructuredOutputsError(too_large)
        _check(constraint)
    except StructuredOutputsError as exc:
        raise invalid(param, f"{param}: {exc}", "invalid_value") from None
    sampling.structured_outputs.CopyFrom(structured_outputs_to_proto(constraint))


def _response_format(value: Any, request: gateway_pb2.GenerateRequest) -> None:
    """OpenAI's response_format: "text"; "json_object" (any JSON object); "json_schema" with
    {"name", "schema", "strict", "description"}: the output is decoded under the schema whether or not
    strict is true (vLLM does the same), so it always validates."""
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("json_object", "json_schema") and request.sampling.HasField("structured_outputs"):
        raise invalid("response_format", "give response_format or structured_outputs, not both", "invalid_value")
    if kind == "text":
        request.response_format = types_pb2.RESPONSE_FORMAT_TEXT
        return
    if kind == "json_object":
        request.response_format = types_pb2.RESPONSE_FORMAT_JSON_OBJECT
        _constrain(request.sampling, StructuredOutputs.json_object(), "response_format")
        return
    if kind != "json_schema":
        raise invalid("response_format", f"response_format.type must be text, json_object or json_schema, got {value!r}", "invalid_value")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("response_format.json_schema", "response_format.json_schema must be an object with name and schema", "invalid_type")
    for name in spec:
        if name not in ("name", "schema", "strict", "description"):
            raise invalid(
                f"response_format.json_schema.{name}",
                f"Unrecognized request argument supplied: response_format.json_schema.{name}",
                "unknown_parameter",
            )
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise invalid(
            "response_format.json_schema.name", f"name must be 1 to 64 letters, digits, underscores or dashes, got {name!r}", "invalid_value"
        )
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise invalid(
            "response_format.json_schema.schema", f"response_format.json_schema.schema must be a JSON Schema object, got {schema!r}", "invalid_type"
        )
    if spec.get("strict") not in (None, True, False):
        raise invalid("response_format.json_schema.strict", f"strict must be a boolean, got {spec.get('strict')!r}", "invalid_type")
    _constrain(request.sampling, StructuredOutputs.json_schema(schema), "response_format")
    if schema.get("type") == "object":
        request.response_format = types_pb2.RESPONSE_FORMAT_JSON_OBJECT  # the evaluators check it parses


@dataclass(frozen=True)
class StreamOptions:
    stream: bool = False
    include_usage: bool = False
    # OpenAI pads chat stream chunks (their `obfuscation` field) unless this is false.
    include_obfuscation: bool = True


def _stream_options(body: dict[str, Any]) -> StreamOptions:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream", f"stream must be a boolean, got {stream!r}", "invalid_type")
    options = body.get("stream_options")
    if options is None:
        return StreamOptions(bool(stream))
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true", "invalid_value")
    if not isinstance(options, dict):
        raise invalid("stream_options", f"stream_options must be an object, got {options!r}", "invalid_type")
    for name in options:
        if name not in ("include_usage", "include_obfuscation"):
            raise invalid(f"stream_options.{name}", f"Unrecognized request argument supplied: stream_options.{name}", "unknown_parameter")
    flags = {name: options.get(name) for name in ("include_usage", "include_obfuscation")}
    for name, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise invalid(f"stream_options.{name}", f"{name} must be a boolean, got {value!r}", "invalid_type")
    return StreamOptions(True, bool(flags["include_usage"]), flags["include_obfuscation"] is not False)


def _content(value: Any, param: str, assistant: bool = False) -> str:
    """A message's content: a string, or an array of text parts (joined with newlines, as vLLM does).
    An assistant's may hold refusal parts too (OpenAI's ChatCompletionRequestAssistantMessageContentPart),
    taken as text as vLLM takes them."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_part_text(part, f"{param}[{index}]", assistant) for index, part in enumerate(value))
    raise invalid(param, f"content must be a string or an array of text parts, got {value!r}", "invalid_type")


def _part_text(part: Any, param: str, assistant: bool) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    key = "text" if kind == "text" else "refusal" if assistant and kind == "refusal" else None
    if key is None or not isinstance(part.get(key), str):
        shapes = '{"type": "text", "text": ...}' + (' or {"type": "refusal", "refusal": ...}' if assistant else "")
        raise invalid(param, f"only text content parts ({shapes}) are supported", "invalid_value")
    return str(part[key])


@dataclass
class GenerationCall:
    """A parsed chat or text completion: the Sluice request and how to answer it."""

    request: gateway_pb2.GenerateRequest
    options: StreamOptions
    chat: bool
    echo: bool = False  # completions: the prompt is prepended to each choice's text
    # A completions prompt list of several prompts: one request per prompt (the first is `request`),
    # answered as one by the InferencePath; empty for one prompt.
    prompt_requests: list[gateway_pb2.GenerateRequest] = field(default_factory=list)
    # The params an error of the InferencePath names (by Sluice's field) -> the field this client
    # sent instead: max_tokens is its max_completion_tokens, structured_outputs its response_format
    # or constrained tool_choice.
    sent_as: dict[str, str] = field(default_factory=dict)

    def requests(self) -> list[gateway_pb2.GenerateRequest]:
        return self.prompt_requests or [self.request]

    def choice_count(self) -> int:
        """Every prompt's n choices: choice i x n + j is prompt i's choice j (vLLM's order)."""
        return max(1, self.request.sampling.n) * len(self.requests())

    def prompt_text(self, index: int) -> str:
        """The prompt of choice `index`, which echo prepends to its text."""
        return self.requests()[index // max(1, self.request.sampling.n)].prompt


def parse_chat(body: dict[str, Any]) -> GenerationCall:
    _check_fields(body, _CHAT_FIELDS, _CHAT_NEUTRAL)
    request = gateway_pb2.GenerateRequest(model=_model(body))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty array of {role, content} objects", "invalid_type")
    for index, message in enumerate(messages):
        request.messages.append(_message(message, f"messages[{index}]"))
    request.sampling.CopyFrom(_sampling(body))
    parse_chat_choices(body, request.sampling)
    _response_format(body.get("response_format"), request)
    _tool_use(body, request)
    _recorded(body, request)
    return GenerationCall(request, _stream_options(body), chat=True, sent_as=_sent_as(body, request))


def _sent_as(body: dict[str, Any], request: gateway_pb2.GenerateRequest) -> dict[str, str]:
    sent_as: dict[str, str] = {}
    if body.get("max_completion_tokens") is not None:
        sent_as["max_tokens"] = "max_completion_tokens"
    if isinstance(body.get("stop"), str):
        sent_as["stop[0]"] = "stop"  # one stop string, carried as a list of one
    if body.get("structured_outputs") is None:
        if request.sampling.HasField("structured_outputs"):
            sent_as["structured_outputs"] = "response_format"
        elif request.tool_use.choice.mode in (types_pb2.TOOL_CHOICE_MODE_REQUIRED, types_pb2.TOOL_CHOICE_MODE_FUNCTION):
            sent_as["structured_outputs"] = "tool_choice"  # the constraint the InferencePath sets for it
    return sent_as


_MESSAGE_FIELDS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "refusal", "tool_calls"},
    "tool": {"role", "content", "tool_call_id"},
}


def _message(message: Any, param: str) -> types_pb2.ChatMessage:
    if not isinstance(message, dict):
        raise invalid(param, "a message must be an object with role and content", "invalid_type")
    role = message.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise invalid(f"{param}.role", f"role must be one of {', '.join(_ROLES)}, got {role!r}", "invalid_value")
    for name in message:
        if name not in _MESSAGE_FIELDS[role]:
            raise invalid(
                f"{param}.{name}",
                f"Unrecognized message field: {name} (a {role} message takes {', '.join(sorted(_MESSAGE_FIELDS[role]))})",
                "unknown_parameter",
            )
    calls = message.get("tool_calls") or []
    if role == "assistant" and calls and message.get("content") is None:
        content = ""  # a turn that only called tools
    else:
        content = _content(message.get("content"), f"{param}.content", assistant=role == "assistant")
    parsed = types_pb2.ChatMessage(role=_ROLES[role], content=content)
    if not isinstance(calls, list):
        raise invalid(f"{param}.tool_calls", "tool_calls must be an array", "invalid_type")
    for index, call in enumerate(calls):
        parsed.tool_calls.append(_tool_call(call, f"{param}.tool_calls[{index}]"))
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"{param}.tool_call_id", "a tool message must name the call it answers (tool_call_id)", "missing_required_parameter")
        parsed.tool_call_id = call_id
    return parsed


def _tool_call(call: Any, param: str) -> types_pb2.ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise invalid(param, 'a tool call must be {"id", "type": "function", "function": {"name", "arguments"}}', "invalid_type")
    name, arguments, call_id = function.get("name"), function.get("arguments", ""), call.get("id", "")
    if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(call_id, str):
        raise invalid(param, "a tool call's id, function.name and function.arguments must be strings", "invalid_type")
    return types_pb2.ToolCall(id=call_id, name=name, arguments=arguments)


_TOOL_CHOICES = {"none": types_pb2.TOOL_CHOICE_MODE_NONE, "auto": types_pb2.TOOL_CHOICE_MODE_AUTO, "required": types_pb2.TOOL_CHOICE_MODE_REQUIRED}


def _tool_use(body: dict[str, Any], request: gateway_pb2.GenerateRequest) -> None:
    """OpenAI's tools, tool_choice and parallel_tool_calls as the request's ToolUse."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if tools is None and choice is None and parallel is None:
        return
    tool_use = request.tool_use
    if tools is not None and not isinstance(tools, list):
        raise invalid("tools", 'tools must be an array of {"type": "function", "function": {...}}', "invalid_type")
    if tools is not None and len(tools) > MAX_TOOLS:  # as the InferencePath refuses it, before the tools are read
        raise invalid("tools", f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "invalid_value")
    for index, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict):
            raise invalid(f"tools[{index}]", 'a tool must be {"type": "function", "function": {"name", "description", "parameters"}}', "invalid_type")
        for name in function:
            if name not in ("name", "description", "parameters", "strict"):
                raise invalid(
                    f"tools[{index}].function.{name}", f"Unrecognized request argument supplied: tools[{index}].function.{name}", "unknown_parameter"
                )
        name, description, parameters = function.get("name"), function.get("description") or "", function.get("parameters")
        if not isinstance(name, str) or not isinstance(description, str) or not (parameters is None or isinstance(parameters, dict)):
            raise invalid(f"tools[{index}].function", "name and description must be strings, parameters a JSON Schema object", "invalid_type")
        # Compact and unescaped, as the client likely sent it: the InferencePath bounds its length.
        text = json.dumps(parameters, separators=(",", ":"), ensure_ascii=False) if parameters is not None else ""
        tool_use.tools.append(types_pb2.Tool(name=name, description=description, parameters=text))
    if isinstance(choice, str) and choice in _TOOL_CHOICES:
        tool_use.choice.mode = _TOOL_CHOICES[choice]
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        tool_use.choice.mode = types_pb2.TOOL_CHOICE_MODE_FUNCTION
        tool_use.choice.function = choice["function"]["name"]
    elif choice is not None:
        raise invalid(
            "tool_choice",
            f'tool_choice must be none, auto, required or {{"type": "function", "function": {{"name": ...}}}}, got {choice!r}',
            "invalid_value",
        )
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise invalid("parallel_tool_calls", f"parallel_tool_calls must be a boolean, got {parallel!r}", "invalid_type")
        tool_use.parallel_tool_calls = parallel


# The most prompts one completions request may list: their P x n sequences run at once, and one
# request must not take a replica's whole batch (vLLM and OpenAI take more).
MAX_PROMPTS = 16

_PROMPT_SHAPES = "a string, an array of strings, an array of token ids or an array of arrays of token ids"


def _prompts(value: Any) -> list[str | list[int]]:
    """OpenAI's and vLLM's completions prompt: one prompt or a list of them, each a text or token ids."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise invalid("prompt", f"prompt must be {_PROMPT_SHAPES}", "invalid_type")
    if all(_is_int(token) for token in value):
        prompts: list[Any] = [value]  # one prompt as token ids
    elif all(isinstance(text, str) for text in value) or all(isinstance(ids, list) for ids in value):
        prompts = value
    else:
        raise invalid("prompt", f"prompt must be {_PROMPT_SHAPES}, not a mix", "invalid_type")
    if len(prompts) > MAX_PROMPTS:
        raise invalid("prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}", "invalid_value")
    for index, prompt in enumerate(prompts):
        param = f"prompt[{index}]" if len(prompts) > 1 else "prompt"
        if isinstance(prompt, list) and not all(_is_int(token) and 0 <= token <= MAX_INT32 for token in prompt):
            shown = repr(prompt) if len(prompt) <= 20 else repr(prompt[:20])[:-1] + ", ...]"
            raise invalid("prompt", f"{param} must hold token ids (integers from 0 to {MAX_INT32}), got {shown}", "invalid_value")
        if not prompt:
            raise invalid("prompt", f"{param} must not be empty", "invalid_value")
    return prompts


def parse_completion(body: dict[str, Any]) -> GenerationCall:
    _check_fields(body, _COMPLETION_FIELDS, _COMPLETION_NEUTRAL)
    request = gateway_pb2.GenerateRequest(model=_model(body))
    prompts = _prompts(body.get("prompt"))
    request.sampling.CopyFrom(_sampling(body))
    request.sampling.max_tokens = request.sampling.max_tokens or COMPLETION_MAX_TOKENS
    _response_format(body.get("response_format"), request)
    echo = parse_completion_choices(body, request.sampling)
    _recorded(body, request)  # before the fan-out: every prompt's request (and event) carries them
    if echo and any(isinstance(prompt, list) for prompt in prompts):
        # The gateway holds no tokenizer to spell the ids back as text.
        raise invalid("echo", "echo is not supported with a prompt of token ids; send the prompt as text", "unsupported_parameter")
    each = []
    for prompt in prompts:
        one = gateway_pb2.GenerateRequest()
        one.CopyFrom(request)
        if isinstance(prompt, str):
            one.prompt = prompt
        else:
            one.prompt_token_ids.extend(prompt)
        each.append(one)
    return GenerationCall(
        each[0], _stream_options(body), chat=False, echo=echo, prompt_requests=each if len(each) > 1 else [], sent_as=_sent_as(body, request)
    )


@dataclass
class EmbeddingCall:
    request: gateway_pb2.EmbedRequest
    base64: bool
    dimensions: int | None = None


def parse_embeddings(body: dict[str, Any]) -> EmbeddingCall:
    _check_fields(body, _EMBEDDING_FIELDS, {})
    if body.get("user") not in (None, ""):
        # An embedding has no evaluation record to carry it: refused rather than dropped.
        raise invalid("user", "user is not supported on embeddings (they have no evaluation record to carry it); omit it", "unsupported_parameter")
    request = gateway_pb2.EmbedRequest(model=_model(body))
    inputs = body.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(text, str) for text in inputs):
        raise invalid("input", "input must be a string or a non-empty array of strings (token arrays are not supported)", "invalid_type")
    for index, text in enumerate(inputs):
        if not text:
            raise invalid(f"input[{index}]" if len(inputs) > 1 else "input", "input must not be empty", "invalid_value")
    request.inputs.extend(inputs)
    encoding = body.get("encoding_format")
    if encoding not in (None, "float", "base64"):
        raise invalid("encoding_format", f"encoding_format must be float or base64, got {encoding!r}", "invalid_value")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not _is_int(dimensions) or dimensions < 1):
        raise invalid("dimensions", f"dimensions must be a positive integer, got {dimensions!r}", "invalid_type")
    # vLLM's extension, its opt-in to truncation: -1 (or the model's maximum input) embeds a longer
    # input from its first tokens rather than refuse it. Its type is checked here (vLLM's ge=-1);
    # the adapter, which knows the model's maximum, refuses a count the model cannot cut at.
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None:
        if not _is_int(truncate) or not -1 <= truncate <= MAX_INT32:
            raise invalid(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens must be an integer of at least -1 (-1: the model's maximum input), got {truncate!r}",
                "invalid_type",
            )
        request.truncate_prompt_tokens = truncate
    return EmbeddingCall(request, encoding == "base64", dimensions)
