"""A generation request's life in the adapter, whichever scheduler feeds its replica: what a
caller submits (GenerationRequest), the Sequence that carries it through the queue and the batch,
and the events its handle yields (tokens, then one finish with its counts and timings)."""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from sluice_common.sampling import Sampling
from sluice_inference_adapter import metrics
from sluice_inference_adapter.sequence_trace import SequenceTrace
from sluice_inference_adapter.step_rows import PromptSpec
from sluice_inference_adapter.priority import Priority


class Finish(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    INVALID = "invalid"
    ERROR = "error"


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    tenant: str
    prompt: PromptSpec
    sampling: Sampling
    priority: Priority = Priority.INTERACTIVE
    # time.monotonic() value after which the sequence is abandoned; None for no deadline.
    deadline: float | None = None
    # When the adapter received the call (the schedulers' clock, time.monotonic()), set once: a retry
    # on another replica, or a hand-back from a draining one, is the same request, and its time to
    # first token and queue time count from here. None: from its first submit (ReplicaPool.generate
    # sets it then, so its retries still count from there).
    arrived_at: float | None = None


@dataclass(frozen=True)
class TokenEvent:
    text: str
    token_count: int
    # One entry per token, in OpenAI's chat logprobs shape, when the request asked for logprobs.
    logprobs: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Timings:
    queue_s: float
    time_to_first_token_s: float
    mean_inter_token_s: float
    total_s: float


@dataclass(frozen=True)
class FinishEvent:
    finish: Finish
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    error: str = ""
    # The part of prompt_tokens the engine served from its prefix cache.
    cached_tokens: int = 0


Event = TokenEvent | FinishEvent


@dataclass(eq=False)
class Sequence:
    """A request's life inside the scheduler; its events are read through `SequenceHandle`."""

    seq_id: int
    request: GenerationRequest
    # When the request arrived at the adapter (GenerationRequest.arrived_at): the start of its
    # timings, time to first token included, whichever replica serves it in the end.
    submitted_at: float
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    prefilled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    prompt_tokens: int = 0
    # Of prompt_tokens, those the engine took from its prefix cache (0 from engines that do not say).
    cached_tokens: int = 0
    completion_tokens: int = 0
    waited_steps: int = 0
    # Set once its queue wait is in sluice_adapter_queue_seconds (a busy requeue waits on).
    queue_wait_observed: bool = False
    done: bool = False
    # Set when the sequence failed because its backend did: a caller may retry it elsewhere.
    backend_failed: bool = False
    # Its spans while its request is traced and sampled (sequence_trace), else None.
    trace: SequenceTrace | None = None
    # When it joined this replica's waiting queue (this attempt; NaN: at `submitted_at`): the start
    # of sluice_adapter_queue_seconds, which is per replica.
    queued_at: float = math.nan

    def __post_init__(self) -> None:
        if math.isnan(self.queued_at):
            self.queued_at = self.submitted_at

    @property
    def tenant(self) -> str:
        return self.request.tenant

    @property
    def priority(self) -> Priority:
        return self.request.priority

    @property
    def prefilling(self) -> bool:
        """Running, its prompt not yet all cached (no token yet)."""
        return self.prefilled_at is not None and self.first_token_at is None

    @property
    def reserved_tokens(self) -> int:
        """KV tokens this sequence may come to hold; the prompt is estimated until prefill counts it."""
        prompt = self.prompt_tokens or self.request.prompt.estimated_tokens()
        return prompt + self.request.sampling.max_tokens

    def emit_text(self, text: str, now: float, tokens: int = 1, logprobs: tuple[dict[str, Any], ...] = ()) -> None:
        """Generated tokens (one per step; a self-batching engine may send several at once), whose
        text may be empty while bytes are held back."""
        if self.first_token_at is None:
            self.first_token_at = now
            metrics.TIME_TO_FIRST_TOKEN.observe(now - self.submitted_at)
        elif self.last_token_at is not None:
            metrics.INTER_TOKEN.observe(now - self.last_token_at)
        self.last_token_at = now
        if text or logprobs:  # a token whose bytes are held back still has its logprob
            self.events.put_nowait(TokenEvent(text, tokens, logprobs))

    def finish(self, finish: Finish, now: float, error: str = "", handed_back: bool = False) -> None:
        """Ends the stream once; later calls are ignored. `handed_back`: it never started here and
        is routed to another replica (a drain): an ERROR for the replica pool, which retries it, but
        no error in its trace."""
        if self.done:
            return
        self.done = True
        if self.trace is not None:
            if handed_back:
                self.trace.handed_back(error)
            else:
                self.trace.finish(finish.value, self.prompt_tokens, self.completion_tokens, self.cached_tokens, error)
        if finish in (Finish.CANCELLED, Finish.DEADLINE):
            metrics.CANCELLATIONS.labels(reason=finish.value).inc()
        self.events.put_nowait(FinishEvent(finish, self.prompt_tokens, self.completion_tokens, self._timings(now), error, self.cached_tokens))

    def _timings(self, now: float) -> Timings:
        """From the request's arrival at the adapter: its queue time runs to the prefill of the
        replica that served it, a failed replica's time included."""
        start, first, last = self.submitted_at, self.first_token_at, self.last_token_at
        gaps = self.completion_tokens - 1
        return Timings(
            queue_s=(self.prefilled_at or now) - start,
            time_to_first_token_s=(first - start) if first is not None else 0.0,
            mean_inter_token_s=((last - first) / gaps) if first is not None and last is not None and gaps > 0 else 0.0,
            total_s=now - start,
        )

    def abandon_reason(self, now: float) -> Finish | None:
        """Why the scheduler should drop this sequence now, if it should. The deadline first: the
        gateway passes it as the call's gRPC timeout, whose expiry cancels the call too, and a
        deadline counted as a cancel would leave the deadline series of the metrics and traces empty."""
        if self.request.deadline is not None and now >= self.request.deadline:
            return Finish.DEADLINE
        if self.cancelled:
            return Finish.CANCELLED
        return None


class SequenceHandle:
    def __init__(self, sequence: Sequence, wake: Callable[[], None]) -> None:
        self._sequence = sequence
        self._wake = wake

    @property
    def seq_id(self) -> int:
        return self._sequence.seq_id

    @property
    def backend_failed(self) -> bool:
        return self._sequence.backend_failed

    @property
    def submitted_at(self) -> float:
        """When its request arrived (GenerationRequest.arrived_at, else this submit)."""
        return self._sequence.submitted_at

    def cancel(self) -> None:
        """Idempotent; the slot is released at the next step."""
        if not self._sequence.done and not self._sequence.cancelled:
            self._sequence.cancelled = True
            self._wake()

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._sequence.events.get()
            yield event
            if isinstance(event, FinishEvent):
                return
