"""The adapter's side of the step protocol (services/triton-local/src/sluice_triton_local/step_protocol.py defines it).

Plain data, no Triton import: the scheduler builds StepRows, a StepBackend turns them
into one Triton request and answers one StepOutcome per row.
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from sluice_common.prompt_tokens import estimate_prompt_tokens
from sluice_common.sampling import Sampling


class Action(enum.IntEnum):
    PREFILL = 1
    DECODE = 2
    RELEASE = 3
    COUNT = 4
    # Ends the round in flight after its current step, so that waiting requests join sooner.
    END_ROUND = 5
    # As END_ROUND, and an interruptible round's step in progress stops midway (its rows answer no
    # token and are stepped again later): for an interactive request waiting behind bulk work.
    INTERRUPT = 6


@dataclass(frozen=True)
class PromptSpec:
    """Either a chat (the model applies its template), a raw prompt, or token ids (prefilled as given)."""

    messages: tuple[tuple[str, str], ...] = ()
    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()

    def estimated_tokens(self) -> int:
        """A guess until the model counts it (sluice_common.prompt_tokens, as the gateway guesses);
        a token-id prompt's is exact."""
        return estimate_prompt_tokens(self.messages, self.prompt, self.prompt_token_ids)

    def routing_text(self) -> str:
        """The raw prompt, or token ids spelled as text: prompts that share leading ids share a prefix."""
        return self.prompt or " ".join(map(str, self.prompt_token_ids))

    def to_json(self, sampling: Sampling | None = None, prefill_chunk: int = 0, owner: str = "", request_id: str = "") -> bytes:
        """A step request's REQUEST: the prompt, and for a prefill the options in their JSON form,
        and the request id the engine's log lines name the sequence by (an older step model ignores
        a key it does not know)."""
        body: dict[str, object]
        if self.messages:
            body = {"messages": [list(m) for m in self.messages]}
        elif self.prompt_token_ids:
            body = {"prompt_token_ids": list(self.prompt_token_ids)}
        else:
            body = {"prompt": self.prompt}
        if prefill_chunk:
            body["prefill_chunk"] = prefill_chunk
        if owner:
            body["owner"] = owner
        if request_id:
            body["request_id"] = request_id
        if sampling is not None:
            body.update(sampling.to_json())
        return json.dumps(body).encode()


@dataclass(frozen=True)
class StepRow:
    action: Action
    seq_id: int
    request: bytes = b""


# The step model's FINISH values besides "" (running), "stop" and "length" (Finish's values):
# "invalid" means the row's input was rejected (a client error); "busy" that a prefill found
# every slot taken (adapters share the engine): nothing happened, it is tried again later; "stale"
# that every slot is held by sequences nobody steps (their adapter stopped or dropped them): nothing
# happened either, the prefill waits as for "busy", but the replica cannot serve until the engine's
# slot lease frees them, so the step counts against its health.
FINISH_ERROR = "error"
FINISH_INVALID = "invalid"
FINISH_BUSY = "busy"
FINISH_STALE = "stale"

# How triton-local's engine words "error" rows it failed itself (engine/step_engine.py: a forward
# pass or sampling raised, or admitting a prefill did): the replica's fault, which another replica
# may not have. FINISH "error" also answers rows that are not (a decode of a sequence the engine no
# longer runs, released or reclaimed by its slot lease; a prompt longer than the context; a
# sequence whose shared prompt's leader was released), so only these messages count.
_ENGINE_FAULTS = ("forward pass failed:", "sampling failed:", "admission failed:")


@dataclass(frozen=True)
class StepOutcome:
    token_id: int
    text: str
    finish: str
    prompt_tokens: int
    completion_tokens: int
    error: str = ""
    seq_id: int = -1  # the row's sequence
    # Prompt tokens the engine took from its prefix cache instead of prefilling (part of
    # prompt_tokens; 0 when none, on rows that are not a sequence's, or from an engine without one).
    cached_tokens: int = 0
    # The token's log-probabilities in OpenAI's chat entry shape (step_protocol's LOGPROBS), when
    # its sequence asked for them.
    logprobs: dict[str, Any] | None = None


def engine_fault(outcome: StepOutcome) -> bool:
    """Whether the engine failed the row itself (not the row's input, not a sequence it no longer runs)."""
    return outcome.finish == FINISH_ERROR and outcome.error.startswith(_ENGINE_FAULTS)


def steps_in(outcomes: list[StepOutcome]) -> int:
    """Engine steps one response answers: each step answers each sequence it stepped once, so a
    response that several steps share (step_protocol's STREAM_INTERVAL_MS) repeats a sequence once
    per step."""
    if not outcomes:
        return 1
    return max(Counter(outcome.seq_id for outcome in outcomes).values())


@runtime_checkable
class StepBackend(Protocol):
    """One Triton request per call."""

    async def step(self, rows: list[StepRow]) -> list[StepOutcome]:
        """One engine step: rows in, one outcome per row out (same order)."""
        ...

    @property
    def follows_rounds(self) -> bool:
        """Whether `round(..., follows=True)` may be sent while another round runs."""
        ...

    @property
    def interrupts(self) -> bool:
        """Whether `round(..., interruptible=True)` and an INTERRUPT row are understood."""
        ...

    def round(self, rows: list[StepRow], steps: int, follows: bool = False, interruptible: bool = False) -> AsyncGenerator[list[StepOutcome], None]:
        """Up to `steps` engine steps, their outcomes as they are made: the first step's outcomes
        answer `rows` in order; each later step decodes the sequences still running (those that
        have not finished) and answers each of them by seq_id, until none is left. One yielded list
        may hold several steps' outcomes in step order (a sequence once per step: `steps_in`).
        A round that `follows` is the caller's next, sent while its current one runs: it starts
        when that one ends (not ending it early), its first step releasing, not decoding, a
        sequence the caller released meanwhile. An `interruptible` round's step in progress may be
        stopped midway by an INTERRUPT row (`interrupts` only): its rows then answer no token
        (token_id -1, finish "": a prefill's sequence is admitted, its prompt cached by its next
        decode) and the round ends."""
        ...
