"""The generation options in Python: one type, its defaults, its ranges and its JSON form.

`sluice.common.v1.SamplingParams` is the wire contract (gRPC API, job rows, completion events);
`Sampling` is its twin for code: the adapter carries it, the step protocol sends its JSON form
(`to_json` / `from_json`) to the engine, which samples with it, and the vLLM passthrough maps it to
the backend's `sampling_parameters` (`vllm_sampling_parameters`). Its field names are the proto's and
vLLM's SamplingParams' own, so every conversion here and in `sampling_proto` walks the fields
instead of naming them: adding an option is adding it to the proto and to `Sampling` (with its
default and its range in `problem`), then to the code that honours it, nothing in between.

Defaults are the neutral values (what an unset proto field means): greedy, no truncation, no
penalty, no bias, no seed. max_tokens 0 means "not chosen yet": the gateway's InferencePath is the
one place that turns it into a number, and the engine refuses 0.

Stdlib only: the deploy/triton image copies this module beside the engine without protobuf.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

# OpenAI's ranges (https://platform.openai.com/docs/api-reference/chat/create), which vLLM checks too.
MAX_TEMPERATURE = 2.0
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_SEED = (1 << 64) - 1
# OpenAI's top_logprobs bound (0..20); vLLM's OpenAI server takes the same.
MAX_LOGPROBS = 20
# Sequences per prompt (n): each holds a KV slot of its own while it decodes, so a bound keeps one
# request from taking a replica's batch; OpenAI documents none, vLLM none but its batch size.
MAX_N = 8


class StructuredOutputsError(ValueError):
    """A constraint that is malformed or cannot be compiled; the message names the field, keyword or
    construct at fault (an HTTP 400 / INVALID_ARGUMENT for whoever sent it)."""


# vLLM's StructuredOutputsParams fields, one of which a constraint sets (the proto's oneof).
STRUCTURED_KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """What a sequence's output must match (the proto's StructuredOutputs). `kind` is the one field of
    vLLM's StructuredOutputsParams it sets; `value` holds the JSON Schema as JSON text (json), the
    pattern (regex), the options (choice) or the Lark/GBNF text (grammar); "" for json_object.
    Hashable, so that an engine keeps the compiled form of the ones it sees again."""

    kind: str
    value: str | tuple[str, ...] = ""

    @classmethod
    def json_object(cls) -> StructuredOutputs:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutputs:
        """Compact JSON text of the schema (so equal schemas are one cache entry)."""
        return cls("json", json.dumps(_schema_object(schema), separators=(",", ":")))

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputs:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str] | tuple[str, ...]) -> StructuredOutputs:
        return cls("choice", tuple(options))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutputs:
        return cls("grammar", text)

    def schema(self) -> dict[str, Any]:
        """The JSON Schema of a "json" constraint ({"type": "object"} for json_object)."""
        if self.kind == "json_object":
            return {"type": "object"}
        return _schema_object(str(self.value))

    def problem(self) -> str | None:
        """Why the constraint is malformed (before any compiler sees it), or None."""
        kind, value = self.kind, self.value
        if kind not in STRUCTURED_KINDS:
            return f"must set one of {', '.join(STRUCTURED_KINDS)} (got {kind!r})"
        if kind == "json":
            try:
                self.schema()
            except StructuredOutputsError as exc:
                return str(exc)
        if kind in ("regex", "grammar") and not (isinstance(value, str) and value.strip()):
            return f"{kind} must be a non-empty string"
        if kind == "choice" and not (isinstance(value, tuple) and value and all(isinstance(v, str) and v for v in value)):
            return "choice must be a non-empty list of non-empty strings"
        return None

    def to_json(self) -> dict[str, Any]:
        """vLLM's StructuredOutputsParams as a JSON object: {"json": {schema}}, {"json_object": true},
        {"regex": "..."}, {"choice": [...]} or {"grammar": "..."}."""
        if self.kind == "json":
            return {"json": self.schema()}
        if self.kind == "json_object":
            return {"json_object": True}
        return {self.kind: list(self.value) if isinstance(self.value, tuple) else self.value}

    @classmethod
    def from_json(cls, body: dict[str, Any] | str) -> StructuredOutputs:
        """The inverse of to_json; also takes the object as JSON text (Triton's vLLM backend reads
        `structured_outputs` so). Exactly one field must be set; fields vLLM has and Sluice does not
        honour (whitespace_pattern, structural_tag, ...) are refused by name."""
        if isinstance(body, str):
            body = _parse_json(body, "structured_outputs")
        if not isinstance(body, dict):
            raise StructuredOutputsError(f"structured_outputs must be an object, got {body!r}")
        given = {key: value for key, value in body.items() if value not in (None, False)}
        unknown = sorted(set(given) - set(STRUCTURED_KINDS))
        if unknown:
            raise StructuredOutputsError(f"structured_outputs: {', '.join(unknown)} not supported; set one of {', '.join(STRUCTURED_KINDS)}")
        if len(given) != 1:
            raise StructuredOutputsError(f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}, got {sorted(given) or 'none'}")
        ((kind, value),) = given.items()
        if kind == "json":
            return cls.json_schema(value)
        if kind == "json_object":
            if value is not True:
                raise StructuredOutputsError(f"structured_outputs.json_object must be true, got {value!r}")
            return cls.json_object()
        if kind == "choice":
            if not isinstance(value, list):
                raise StructuredOutputsError(f"structured_outputs.choice must be a list of strings, got {value!r}")
            return cls.choice(tuple(value))
        if not isinstance(value, str):
            raise StructuredOutputsError(f"structured_outputs.{kind} must be a string, got {value!r}")
        return cls(kind, value)


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4,300 digits
        raise StructuredOutputsError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise StructuredOutputsError(f"{what} is nested too deeply") from None


def _schema_object(schema: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(schema, str):
        schema = _parse_json(schema, "the JSON Schema")
    if not isinstance(schema, dict):
        raise StructuredOutputsError(f"the JSON Schema must be a JSON object, got {type(schema).__name__}")
    return schema


@dataclass(frozen=True)
class Sampling:
    """What the proto's SamplingParams says, with every unset field at its default."""

    max_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs sorted by id: hashable and in one order, unlike a dict.
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # None: no log-probabilities; k in 0..MAX_LOGPROBS: the sampled token's and the k most likely
    # alternatives' at each generated position (vLLM's SamplingParams.logprobs).
    logprobs: int | None = None
    # Sequences for the prompt (the gateway fans them out: engines only ever see 1).
    n: int = 1
    # What the output must match, enforced while decoding; None: free text.
    structured_outputs: StructuredOutputs | None = None

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def to_json(self) -> dict[str, Any]:
        """The fields that differ from their defaults, as JSON values (logit_bias: an object of
        integer-string keys, as OpenAI and vLLM write it)."""
        body: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if f.name == "logit_bias":
                value = {str(token): bias for token, bias in value}
            elif isinstance(value, StructuredOutputs):
                value = value.to_json()
            elif isinstance(value, tuple):
                value = list(value)
            body[f.name] = value
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Sampling:
        """The options among `body`'s keys (others are the caller's: a step request's prompt...),
        absent ones at their defaults. Raises ValueError or TypeError for a value of the wrong type."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in body or body[f.name] is None:
                continue
            values[f.name] = _coerce(f.name, f.default, body[f.name])
        return cls(**values)


_DEFAULTS = {f.name: f.default for f in fields(Sampling)}
FIELD_NAMES = tuple(_DEFAULTS)


def _coerce(name: str, default: Any, value: Any) -> Any:
    if name == "logit_bias":
        if not isinstance(value, dict):
            raise TypeError(f"logit_bias must be an object of token id -> bias, got {value!r}")
        return logit_bias_pairs((int(token), float(bias)) for token, bias in value.items())
    if name == "structured_outputs":
        return value if isinstance(value, StructuredOutputs) else StructuredOutputs.from_json(value)
    if name in ("seed", "logprobs"):
        if isinstance(value, bool):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        return int(value)
    if isinstance(default, tuple):
        if isinstance(value, str):
            return (value,)
        return tuple(str(item) for item in value)
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return type(default)(value)


def logit_bias_pairs(items: Any) -> tuple[tuple[int, float], ...]:
    """Sampling.logit_bias's form of a mapping's items: sorted by token id."""
    return tuple(sorted((int(token), float(bias)) for token, bias in items))


def problem(sampling: Sampling, vocab_size: int | None = None) -> tuple[str, str] | None:
    """The first option out of its range, as (field name, reason), or None. The token ids of
    logit_bias are checked against `vocab_size` when it is known (the engine knows it)."""
    s = sampling
    if s.max_tokens < 1:
        return "max_tokens", f"must be > 0, got {s.max_tokens}"
    if not (math.isfinite(s.temperature) and 0.0 <= s.temperature <= MAX_TEMPERATURE):
        return "temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {s.temperature}"
    if not (0.0 < s.top_p <= 1.0):
        return "top_p", f"must be in (0, 1], got {s.top_p}"
    if s.top_k < 0:
        return "top_k", f"must be 0 (no limit) or more, got {s.top_k}"
    if not (0.0 <= s.min_p <= 1.0):
        return "min_p", f"must be in [0, 1], got {s.min_p}"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not (PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]):
            return name, f"must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}], got {value}"
    if not (math.isfinite(s.repetition_penalty) and s.repetition_penalty > 0.0):
        return "repetition_penalty", f"must be a finite number > 0, got {s.repetition_penalty}"
    for token, bias in s.logit_bias:
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            where = f"in 0..{vocab_size - 1}, the model's vocabulary" if vocab_size is not None else ">= 0"
            return "logit_bias", f"token id {token} is not a token: ids must be {where}"
        if not (LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]):
            return "logit_bias", f"the bias of token {token} must be in [{LOGIT_BIAS_RANGE[0]:g}, {LOGIT_BIAS_RANGE[1]:g}], got {bias}"
    if s.seed is not None and not 0 <= s.seed <= MAX_SEED:
        return "seed", f"must be in [0, 2^64), got {s.seed}"
    if s.logprobs is not None and not 0 <= s.logprobs <= MAX_LOGPROBS:
        return "logprobs", f"must be in [0, {MAX_LOGPROBS}] (alternatives per token), got {s.logprobs}"
    if not 1 <= s.n <= MAX_N:
        return "n", f"must be in [1, {MAX_N}], got {s.n}"
    if s.structured_outputs is not None:
        reason = s.structured_outputs.problem()
        if reason is not None:
            return "structured_outputs", reason
    return None


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of an n > 1 request: seed + index (mod 2^64), so that the choices
    differ from each other and each is reproducible; unseeded choices stay unseeded."""
    return None if seed is None else (seed + index) & MAX_SEED


# An engine that refuses an option answers why as "sampling.<field>: <reason>" (step protocol's
# ERROR of an "invalid" row), so that the adapter can name the field to the client.
FIELD_PREFIX = "sampling."


def field_error(name: str, reason: str) -> str:
    return f"{FIELD_PREFIX}{name}: {reason}"


def split_field_error(message: str) -> tuple[str, str] | None:
    """(field path, reason) of a message made by `field_error`; None for any other message."""
    head, sep, reason = message.partition(": ")
    if sep and head.startswith(FIELD_PREFIX) and head[len(FIELD_PREFIX) :] in _DEFAULTS:
        return head, reason
    return None


# vLLM's SamplingParams names for Sampling's fields: the same names (tests check them against the
# fields vLLM documents, services/inference-adapter/tests/fixtures/vllm_sampling_params.json).
# Sent even at Sluice's default: the fields whose vLLM default differs (max_tokens 16, temperature
# 1.0), so that vLLM's own never applies unseen. Others are sent only when set: a neutral value
# is vLLM's default too, and an older vLLM refuses some of Sluice's neutral forms (top_k 0).
VLLM_ALWAYS_SENT = ("max_tokens", "temperature", "top_p", "stop")


def vllm_sampling_parameters(sampling: Sampling) -> dict[str, Any]:
    """The `sampling_parameters` JSON object of Triton's vLLM backend (whose `structured_outputs` is
    StructuredOutputsParams' fields as JSON text: the backend json.loads it)."""
    parameters: dict[str, Any] = {name: value for name, value in sampling.to_json().items()}
    if "structured_outputs" in parameters:
        parameters["structured_outputs"] = json.dumps(parameters["structured_outputs"])
    for name in VLLM_ALWAYS_SENT:
        value = getattr(sampling, name)
        parameters.setdefault(name, list(value) if isinstance(value, tuple) else value)
    return parameters
