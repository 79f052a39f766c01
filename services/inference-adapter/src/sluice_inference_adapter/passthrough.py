"""Passthrough scheduling for Triton models that batch by themselves (vLLM, TensorRT-LLM).

Such an engine runs its own continuous batching, so the adapter does not build steps:
it keeps each replica's engine full but not overfull, holding at most `max_in_flight`
streams open and choosing who goes next in priority and tenant-fairness order (the same
waiting queue as the step scheduler). Cancellation closes the Triton stream, which the
engine turns into freeing the sequence.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

import structlog

from sluice_inference_adapter import metrics
from sluice_inference_adapter.chat_template import chatml
from sluice_inference_adapter.scheduler import Finish, ReplicaWork, Sequence
from sluice_inference_adapter.step_rows import SamplingSpec

log = structlog.stdlib.get_logger("sluice.passthrough")


class GenerateBackend(Protocol):
    """A Triton model with the text_input / text_output streaming interface."""

    def stream(self, text: str, sampling: SamplingSpec) -> AsyncIterator[str]:
        """Text deltas until the engine ends the sequence; closing the iterator cancels it."""
        ...


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
        clock: Callable[[], float] = time.monotonic,
        on_step: Callable[[bool], None] | None = None,
    ) -> None:
        super().__init__(limits.max_waiting, limits.retry_after_s, clock, on_step)
        self._backend = backend
        self._limits = limits
        self._in_flight: dict[Sequence, asyncio.Task[None]] = {}

    @property
    def running_count(self) -> int:
        return len(self._in_flight)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="passthrough-scheduler")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._in_flight.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
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
                sequence = self._waiting.pop()
                if sequence is None:
                    break
                sequence.prefilled_at = now
                metrics.QUEUE_SECONDS.observe(now - sequence.submitted_at)
                self._in_flight[sequence] = asyncio.create_task(self._stream(sequence))
            metrics.SLOTS_IN_USE.set(len(self._in_flight))

    async def _stream(self, sequence: Sequence) -> None:
        request = sequence.request
        try:
            async with asyncio.timeout(None if request.deadline is None else request.deadline - self._clock()):
                async with aclosing(self._backend.stream(chatml(request.prompt), request.sampling)) as chunks:
                    async for text in chunks:
                        sequence.completion_tokens += 1
                        sequence.emit_text(text, self._clock())
            self._report_step(ok=True)
            full = sequence.completion_tokens >= request.sampling.max_tokens
            sequence.finish(Finish.LENGTH if full else Finish.STOP, self._clock())
        except asyncio.CancelledError:
            sequence.finish(sequence.abandon_reason(self._clock()) or Finish.CANCELLED, self._clock())
        except TimeoutError:
            sequence.finish(Finish.DEADLINE, self._clock())
        except Exception as exc:  # noqa: BLE001 - the replica failed this stream
            log.warning("stream_failed", error=str(exc))
            self._report_step(ok=False)
            sequence.backend_failed = True
            sequence.finish(Finish.ERROR, self._clock(), error=f"the model backend failed: {exc}")
        finally:
            self._in_flight.pop(sequence, None)
            self._wakeup.set()
