"""Sluice's replies -> OpenAI's response objects (chat and text completions, whole and as stream
chunks; embeddings; models). Pure domain code: the HTTP fronts send what these build."""

from __future__ import annotations

import base64
import random
import string
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2

from sluice_gateway.openai_front.choices import ChoiceState, chat_logprobs, tool_call_objects
from sluice_gateway.openai_front.errors import OpenAIError
from sluice_gateway.openai_front.requests import EmbeddingCall, GenerationCall

FINISH_REASONS = {types_pb2.FINISH_REASON_STOP: "stop", types_pb2.FINISH_REASON_LENGTH: "length", types_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls"}


def finish_reason(call: GenerationCall, reason: int) -> str | None:
    """OpenAI's finish_reason for Sluice's; None for a generation that did not finish. A call forced
    by a named function in tool_choice ends "stop" (its call in tool_calls all the same): OpenAI and
    vLLM answer "tool_calls" only for the auto and required choices. gRPC keeps FINISH_REASON_TOOL_CALLS."""
    if reason == types_pb2.FINISH_REASON_TOOL_CALLS and call.request.tool_use.choice.mode == types_pb2.TOOL_CHOICE_MODE_FUNCTION:
        return "stop"
    return FINISH_REASONS.get(reason)


# Stream obfuscation pads a chunk's text to a multiple of this many characters.
OBFUSCATION_BLOCK = 16
_OBFUSCATION_ALPHABET = string.ascii_letters + string.digits


def obfuscation(padded: int) -> str:
    """OpenAI's `obfuscation` field of a chat stream chunk: random characters that round the
    chunk's `padded` characters of text up to a multiple of OBFUSCATION_BLOCK, so that a chunk's
    size says less about the tokens it carries (a mitigation of size side channels)."""
    return "".join(random.choices(_OBFUSCATION_ALPHABET, k=-padded % OBFUSCATION_BLOCK))


def usage_object(usage: types_pb2.Usage | None) -> dict[str, Any] | None:
    """Usage exactly as Sluice counted it; None when the adapter reported none (never estimated).
    The prompt tokens the engine took from its prefix cache are OpenAI's CompletionUsage
    prompt_tokens_details.cached_tokens (part of prompt_tokens), sent even when 0, as OpenAI does."""
    if usage is None or not (usage.prompt_tokens or usage.completion_tokens or usage.total_tokens):
        return None
    total = usage.total_tokens or usage.prompt_tokens + usage.completion_tokens
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": total,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass
class Completion:
    """The shapes of one chat or text completion's answers (whole, or as stream chunks)."""

    call: GenerationCall
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.call.chat else 'cmpl'}-{self.request_id}"

    def _base(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.call.request.model}

    def whole(self, text: str | list[ChoiceState], finish_reason: str | None, usage: types_pb2.Usage | None) -> dict[str, Any]:
        """One choice's text and finish reason, or every choice's state (n, logprobs)."""
        states = text if isinstance(text, list) else [ChoiceState(0, [text], finish_reason)]
        reply = self._base("chat.completion" if self.call.chat else "text_completion")
        reply["choices"] = [self._whole_choice(state) for state in states]
        counted = usage_object(usage)
        if counted is not None:  # optional and not nullable in OpenAI's schema: absent when not counted
            reply["usage"] = counted
        return reply

    def _whole_choice(self, state: ChoiceState) -> dict[str, Any]:
        asked = self.call.request.sampling.HasField("logprobs")
        if self.call.chat:
            message: dict[str, Any] = {"role": "assistant", "content": state.text, "refusal": None}
            if state.tool_calls:
                message.update(content=state.text or None, tool_calls=tool_call_objects(state.tool_calls))
            choice: dict[str, Any] = {"index": state.index, "message": message}
            logprobs = chat_logprobs(state.chat_entries) if asked else None
        else:
            echoed = self.call.prompt_text(state.index) if self.call.echo else ""
            choice = {"index": state.index, "text": echoed + state.text}
            logprobs = state.completion.body() if asked else None
        choice.update(logprobs=logprobs, finish_reason=state.finish_reason)
        return choice

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        first: bool = False,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A stream chunk of choice `index`; `logprobs` already in the endpoint's shape (those of
        the tokens this chunk covers). A completion's first chunk carries the echoed prompt."""
        if self.call.chat:
            reply = self._base("chat.completion.chunk")
            delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else {}
            if text and not first:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            reply = self._base("text_completion")
            echoed = self.call.prompt_text(index) if first and self.call.echo else ""
            choice = {"index": index, "text": echoed + (text or "")}
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        reply["choices"] = [choice]
        if self.call.options.include_usage and self.call.chat:
            # Null until the usage chunk, as OpenAI's chunk schema has it; a text completion's
            # chunk (CreateCompletionResponse) has usage optional and not nullable: omitted.
            reply["usage"] = None
        return self._obfuscated(reply, len(text or ""))

    def tool_calls_chunk(self, index: int, calls: list[types_pb2.ToolCall]) -> dict[str, Any]:
        """A chat stream's chunk carrying choice `index`'s calls, each whole."""
        reply = self._base("chat.completion.chunk")
        reply["choices"] = [
            {"index": index, "delta": {"tool_calls": tool_call_objects(calls, streamed=True)}, "logprobs": None, "finish_reason": None}
        ]
        if self.call.options.include_usage:
            reply["usage"] = None
        return self._obfuscated(reply, sum(len(call.name) + len(call.arguments) for call in calls))

    def usage_chunk(self, usage: types_pb2.Usage | None) -> dict[str, Any]:
        reply = self._base("chat.completion.chunk" if self.call.chat else "text_completion")
        reply["choices"] = []
        counted = usage_object(usage)
        if counted is not None or self.call.chat:
            reply["usage"] = counted
        return self._obfuscated(reply, 0)

    def _obfuscated(self, reply: dict[str, Any], padded: int) -> dict[str, Any]:
        """A chat chunk with its `obfuscation` field, unless stream_options.include_obfuscation is
        false (CreateChatCompletionStreamResponse has it; a text completion's chunk has none)."""
        if self.call.chat and self.call.options.include_obfuscation:
            reply["obfuscation"] = obfuscation(padded)
        return reply


def check_dimensions(call: EmbeddingCall, model: types_pb2.ModelInfo, param: str = "dimensions", line: int | None = None) -> None:
    """OpenAI's `dimensions` cannot shorten Sluice's embeddings: only the model's own is accepted."""
    if call.dimensions is None or call.dimensions == model.embedding_dimensions:
        return
    where = f"Line {line}: " if line is not None else ""
    raise OpenAIError(
        400,
        f"{where}{model.name} makes {model.embedding_dimensions}-dimensional embeddings; dimensions={call.dimensions} is not supported",
        param=param,
        code="invalid_value",
    )


def embedding_object(index: int, values: Any, as_base64: bool) -> dict[str, Any]:
    if as_base64:
        data: Any = base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    else:
        data = list(values)
    return {"object": "embedding", "index": index, "embedding": data}


def embeddings_reply(call: EmbeddingCall, reply: gateway_pb2.EmbedResponse) -> dict[str, Any]:
    usage = usage_object(reply.usage) if reply.HasField("usage") else None
    return {
        "object": "list",
        "data": [embedding_object(i, e.values, call.base64) for i, e in enumerate(reply.embeddings)],
        "model": call.request.model,
        "usage": None if usage is None else {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["total_tokens"]},
    }


def model_object(model: types_pb2.ModelInfo) -> dict[str, Any]:
    return {"id": model.name, "object": "model", "created": 0, "owned_by": "sluice"}
