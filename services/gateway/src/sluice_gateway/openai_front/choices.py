"""OpenAI's n, logprobs, top_logprobs and echo: parsing them, and the choices' shapes. Pure domain code.

Parsing (into the sampling contract's `n` and `logprobs`):
- chat: `logprobs` (boolean) and `top_logprobs` (0..20, only with logprobs true, as OpenAI refuses
  it otherwise): logprobs true is SamplingParams.logprobs = top_logprobs or 0;
- completions: `logprobs` (an integer, 0..20: vLLM's bound; OpenAI's legacy API says at most 5):
  SamplingParams.logprobs = that; `echo` (boolean): the prompt is prepended to each choice's text.
  echo with logprobs is refused (400 naming echo): OpenAI then returns the prompt tokens' logprobs
  too, and the engines compute logits for a prompt's last position only (llama.cpp's batch asks for
  no others), so they cannot be answered;
- both: `n`, 1..8 (sluice_common.sampling.MAX_N), checked by the contract.

Shapes, exactly OpenAI's (the openai SDK's types):
- chat: `choices[i].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}]}], "refusal": null}`; in a stream, each chunk's choice carries the content
  entries of the tokens that chunk covers;
- completions: `choices[i].logprobs = {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
  "text_offset"}`, text_offset counting characters of the choice's text (the echoed prompt
  included); per chunk in a stream, offsets continuing from the chunks before.
Each generated token has an entry except the end-of-sequence token (its text is never shown).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.common.v1 import types_pb2

from sluice_common.sampling import MAX_LOGPROBS, MAX_N
from sluice_gateway.openai_front.errors import invalid


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _n(body: dict[str, Any], sampling: types_pb2.SamplingParams) -> None:
    n = body.get("n")
    if n is None:
        return
    if not _is_int(n):
        raise invalid("n", f"n must be an integer, got {n!r}", "invalid_type")
    if not 1 <= n <= MAX_N:  # the contract's range, checked here too: an int32 must carry it
        raise invalid("n", f"n must be an integer from 1 to {MAX_N}, got {n}", "invalid_value")
    sampling.n = n


def parse_chat_choices(body: dict[str, Any], sampling: types_pb2.SamplingParams) -> None:
    _n(body, sampling)
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise invalid("logprobs", f"logprobs must be a boolean, got {asked!r}", "invalid_type")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
            raise invalid("top_logprobs", f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {top!r}", "invalid_value")
        if not asked:
            raise invalid("top_logprobs", "top_logprobs needs logprobs set to true", "invalid_value")
    if asked:
        sampling.logprobs = top or 0


def parse_completion_choices(body: dict[str, Any], sampling: types_pb2.SamplingParams) -> bool:
    """Sets n and logprobs; returns echo."""
    _n(body, sampling)
    count, echo = body.get("logprobs"), body.get("echo")
    if count is not None:
        if not _is_int(count) or not 0 <= count <= MAX_LOGPROBS:
            raise invalid("logprobs", f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {count!r}", "invalid_value")
        sampling.logprobs = count
    if echo is not None and not isinstance(echo, bool):
        raise invalid("echo", f"echo must be a boolean, got {echo!r}", "invalid_type")
    if echo and count is not None:
        raise invalid(
            "echo",
            "echo with logprobs is not supported: the prompt tokens' logprobs are not computed (the engine"
            " makes logits for a prompt's last position only); ask for one or the other",
            "invalid_value",
        )
    return bool(echo)


def chat_entry(lp: types_pb2.TokenLogprob) -> dict[str, Any]:
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": list(lp.bytes),
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in lp.top_logprobs],
    }


def chat_logprobs(entries: list[types_pb2.TokenLogprob]) -> dict[str, Any]:
    return {"content": [chat_entry(lp) for lp in entries], "refusal": None}


@dataclass
class CompletionLogprobs:
    """One choice's completions-shaped logprobs; `offset` is where its next token's text starts."""

    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, entries: list[types_pb2.TokenLogprob]) -> dict[str, Any]:
        """Records these tokens and returns their part alone (a stream chunk's logprobs)."""
        part = CompletionLogprobs(self.offset)
        for lp in entries:
            part.tokens.append(lp.token)
            part.token_logprobs.append(lp.logprob)
            part.top_logprobs.append({t.token: t.logprob for t in lp.top_logprobs})
            part.text_offset.append(part.offset)
            part.offset += len(lp.token)
        self.tokens += part.tokens
        self.token_logprobs += part.token_logprobs
        self.top_logprobs += part.top_logprobs
        self.text_offset += part.text_offset
        self.offset = part.offset
        return part.body()

    def body(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


@dataclass
class ChoiceState:
    """What one choice has produced so far: its text, finish reason and logprobs."""

    index: int
    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    chat_entries: list[types_pb2.TokenLogprob] = field(default_factory=list)
    completion: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    started: bool = False  # a stream sent its first chunk
    tool_calls: list[types_pb2.ToolCall] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)


def tool_call_objects(calls: list[types_pb2.ToolCall], streamed: bool = False) -> list[dict[str, Any]]:
    """OpenAI's message.tool_calls (a stream's delta.tool_calls adds each call's index: each is
    sent whole, in one delta)."""
    objects = []
    for index, call in enumerate(calls):
        entry: dict[str, Any] = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        objects.append({"index": index, **entry} if streamed else entry)
    return objects
