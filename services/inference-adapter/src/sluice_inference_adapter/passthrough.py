"""Passthrough scheduling for Triton models that batch by themselves (Triton's vLLM backend).

Such an engine runs its own continuous batching, so the adapter does not build steps:
it keeps each replica's engine full but not overfull, holding at most `max_in_flight`
streams open and choosing who goes next in priority and tenant-fairness order (the same
waiting queue as the step scheduler). Cancellation closes the Triton stream, which the
engine turns into freeing the sequence.

Usage and the finish reason are the engine's own (vLLM's num_input_tokens, num_output_tokens
and finish_reason). A request the engine refuses (a prompt longer than its context, a bad
sampling value) ends INVALID and counts as an answer from a healthy replica; only a failed
stream counts against it.

With `timeouts` (step_timeout.StepTimeouts, one per model for the pool), a stream's wait for each
response of the engine is bounded as a step would be: the gap between two responses (about one
engine iteration) by `multiplier x` the p99 of such gaps, and the wait for the first response by
that plus the prompt's tokens x the p99 per prompt token (its prefill, and any engine queueing,
charged to the prompt). A stream that waits longer fails as a failed stream does (UNAVAILABLE naming
the replica and the timeout; retried elsewhere before its first token) and counts against the replica.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

import structlog

from sluice_common.sampling import FIELD_PREFIX, Sampling, field_error
from sluice_common.supervision import stop_tasks
from sluice_inference_adapter import metrics
from sluice_inference_adapter.sequence_trace import traced_request
from sluice_inference_adapter.backend_errors import RequestRejected
from sluice_inference_adapter.chat_template import ChatTemplateError
from sluice_inference_adapter.generated_chunk import GeneratedChunk
from sluice_inference_adapter.sequence import Finish, Sequence
from sluice_inference_adapter.replica_work import ReplicaWork
from sluice_inference_adapter.step_rows import PromptSpec
from sluice_inference_adapter.step_timeout import StepTimeouts

log = structlog.stdlib.get_logger("sluice.passthrough")


# vLLM's other reason, "abort", only reaches us when the engine aborted by itself (we close the
# stream when the client goes away): a failure of the replica, not a finish.
_FINISHES = {"stop": Finish.STOP, "length": Finish.LENGTH}


class GenerateBackend(Protocol):
    """A Triton model with the vLLM backend's streaming interface."""

    def stream(self, text: str, sampling: Sampling, request_id: str = "") -> AsyncGenerator[GeneratedChunk, None]:
        """Responses until the engine ends the sequence (raises RequestRejected for a request it
        refuses); closing the iterator cancels it. `request_id` names the request to Triton."""
        ...


class StreamTimedOut(Exception):
    """The engine sent no response within the stream's adaptive timeout."""


@dataclass(frozen=True)
class PassthroughLimits:
    max_in_flight: int = 8
    max_waiting: int = 256
    retry_after_s: float = 1.0


class PassthroughScheduler(ReplicaWork):
    def __init__(
        self,
        backend: GenerateBackend,
        limits: PassthroughLimits,
        render: Callable[[PromptSpec], str],
        clock: Callable[[], float] = time.monotonic,
        on_step: Callable[[bool], None] | None = None,
        replica: str = "",
        timeouts: StepTimeouts | None = None,
    ) -> None:
        super().__init__(limits.max_waiting, limits.retry_after_s, clock, on_step, replica)
        self._backend = backend
        self._limits = limits
        self._timeouts = timeouts
        # The model's chat template (chat_template.py): the engine takes raw text.
        self._render = render
        self._in_flight: dict[Sequence, asyncio.Task[None]] = {}

    @property
    def running_count(self) -> int:
        return len(self._in_flight)

    task_name = "passthrough-scheduler"

    def _on_death(self, error: BaseException) -> None:
        # Streams already open run on in their own tasks; those waiting for one would wait for ever.
        now = self._clock()
        for sequence in self._waiting.remove_if(lambda _: True):
            sequence.finish(Finish.ERROR, now, error=f"the passthrough scheduler failed: {error!r}")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._in_flight.values()) if t is not None]
        await stop_tasks(*tasks)
        now = self._clock()
        for sequence in [*self._in_flight, *self._waiting.remove_if(lambda _: True)]:
            sequence.finish(Finish.ERROR, now, error="the adapter is shutting down")

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            now = self._clock()
            for sequence, task in list(self._in_flight.items()):
                if sequence.abandon_reason(now) is not None:
                    task.cancel()
            for sequence in self._waiting.remove_if(lambda s: s.abandon_reason(now) is not None):
                sequence.finish(sequence.abandon_reason(now) or Finish.CANCELLED, now)
            while len(self._in_flight) < self._limits.max_in_flight:
                admitted = self._waiting.pop()
                if admitted is None:
                    break
                admitted.prefilled_at = now
                if admitted.trace is not None:
                    admitted.trace.admitted()
                metrics.QUEUE_SECONDS.labels(replica=self._replica).observe(now - admitted.queued_at)
                self._in_flight[admitted] = asyncio.create_task(self._stream(admitted))
            metrics.SLOTS_IN_USE.labels(replica=self._replica).set(len(self._in_flight))

    async def _stream(self, sequence: Sequence) -> None:
        request = sequence.request
        try:
            async with asyncio.timeout(None if request.deadline is None else request.deadline - self._clock()):
                finish = await traced_request(sequence.trace, self._relay(sequence), self._backend)
            if finish is None:  # a failure of the replica, counted once below (not a success first)
                raise RuntimeError("the stream ended without a finish reason")
            self._report_step(ok=True)
            sequence.finish(finish, self._clock())
        except RequestRejected as exc:
            self._report_step(ok=True)  # the replica answered: the request was at fault
            # An option the backend refused is named as the step engine names it (servicer splits it).
            error = field_error(exc.field.removeprefix(FIELD_PREFIX), exc.cause) if exc.field else exc.cause
            sequence.finish(Finish.INVALID, self._clock(), error=error)
        except ChatTemplateError as exc:  # the template refused the messages; no replica was asked
            sequence.finish(Finish.INVALID, self._clock(), error=str(exc))
        except asyncio.CancelledError:
            sequence.finish(sequence.abandon_reason(self._clock()) or Finish.CANCELLED, self._clock())
        except TimeoutError:
            sequence.finish(Finish.DEADLINE, self._clock())
        except Exception as exc:  # noqa: BLE001 - the replica failed this stream
            # This task serves the stream, not its call: the request id is named here.
            log.warning("stream_failed", replica=self._replica, request_id=request.request_id, seq_id=sequence.seq_id, error=str(exc))
            self._report_step(ok=False)
            sequence.backend_failed = True
            sequence.finish(Finish.ERROR, self._clock(), error=f"the model backend failed: {exc}")
        finally:
            self._in_flight.pop(sequence, None)
            self._wakeup.set()

    async def _bounded(self, chunks: AsyncIterator[GeneratedChunk], prompt_tokens: int) -> AsyncGenerator[GeneratedChunk, None]:
        """The engine's responses, each awaited within the adaptive timeout (see the module)."""
        timeouts = self._timeouts
        if timeouts is None:
            async for chunk in chunks:
                yield chunk
            return
        waiting_for = prompt_tokens  # the first response: the prompt's prefill
        while True:
            limit = timeouts.limit(waiting_for)
            started = time.perf_counter()
            try:
                async with asyncio.timeout(limit):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except TimeoutError:
                timeouts.observe_timeout(limit, waiting_for)
                kind = "stream_first" if waiting_for else "stream_gap"
                metrics.TIMEOUTS.labels(kind=kind).inc()
                metrics.STEP_TIMEOUT.labels(model=timeouts.model).set(timeouts.limit())
                which = "first" if waiting_for else "next"
                raise StreamTimedOut(
                    f"Triton replica {self._replica or '(unnamed)'} did not send a stream's {which} response within its"
                    f" timeout of {limit:.2f}s ({timeouts.policy.multiplier:g}x the p99 of recent waits, within"
                    f" [{timeouts.policy.floor_s:g}s, {timeouts.policy.ceiling_s:g}s]); the replica is counted as failing"
                ) from None
            timeouts.observe(time.perf_counter() - started, waiting_for)
            metrics.STEP_TIMEOUT.labels(model=timeouts.model).set(timeouts.limit())
            waiting_for = 0
            yield chunk

    async def _relay(self, sequence: Sequence) -> Finish | None:
        """Passes the engine's responses on; returns its finish reason."""
        request = sequence.request
        finish = None
        stream = self._backend.stream(self._render(request.prompt), request.sampling, request_id=request.request_id)
        async with aclosing(stream) as chunks, aclosing(self._bounded(chunks, request.prompt.estimated_tokens())) as bounded:
            async for chunk in bounded:
                if chunk.input_tokens is not None:
                    sequence.prompt_tokens = chunk.input_tokens
                # sequence.cached_tokens stays 0: Triton's vLLM backend has no output for prompt
                # tokens served from vLLM's prefix cache (its additional outputs are finish_reason,
                # cumulative_logprob, logprobs, num_input_tokens and num_output_tokens; see
                # tests/fixtures/upstream/vllm_backend_interface.json), so none is reported.
                if chunk.output_tokens or chunk.text:
                    sequence.completion_tokens += chunk.output_tokens
                    sequence.emit_text(chunk.text, self._clock(), tokens=chunk.output_tokens, logprobs=chunk.logprobs)
                if chunk.finish_reason is not None:
                    if chunk.finish_reason not in _FINISHES:
                        raise RuntimeError(f"the engine ended the sequence with finish_reason {chunk.finish_reason!r}")
                    finish = _FINISHES[chunk.finish_reason]
        return finish
