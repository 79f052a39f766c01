"""What both ways of feeding a replica share (the batching scheduler, scheduler.py, and the
passthrough, passthrough.py): the bounded fair waiting queue, the owner task's wake-up and
supervision, the replica's health reports, and its drain (no new sequence starts; those that wait
are handed back to be routed to another replica)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from sluice_common.errors import ResourceExhausted
from sluice_common.supervision import Supervisor
from sluice_inference_adapter import metrics, sequence_trace
from sluice_inference_adapter.sequence import Finish, GenerationRequest, Sequence, SequenceHandle
from sluice_inference_adapter.waiting_queue import FairWaitingQueue


class ReplicaWork:
    """What both ways of feeding a replica share: the bounded fair waiting queue in front of it,
    the wake-up of the task that owns the replica's work, and its health reports."""

    def __init__(
        self,
        max_waiting: int,
        retry_after_s: float,
        clock: Callable[[], float],
        on_step: Callable[[bool], None] | None,
        replica: str = "",
    ) -> None:
        self._replica = replica
        self._max_waiting = max_waiting
        self._retry_after_s = retry_after_s
        self._clock = clock
        # Told whether each step (or stream) reached the backend, for replica health.
        self._on_step = on_step
        self._waiting: FairWaitingQueue[Sequence] = FairWaitingQueue(replica)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # The replica is leaving (its address left discovery): no sequence starts here any more, so
        # the waiting queue stays empty (`drain`, `submit`, and the step scheduler's busy requeue).
        self._draining = False

    def submit(self, request: GenerationRequest) -> SequenceHandle:
        """Queues the request, or RESOURCE_EXHAUSTED with RetryInfo when the queue is full."""
        if len(self._waiting) >= self._max_waiting:
            metrics.REJECTIONS.labels(reason="queue_full").inc()
            raise ResourceExhausted(
                f"the generation queue is full ({self._max_waiting} waiting); retry later",
                retry_after_s=self._retry_after_s,
                quota_subject="adapter.waiting_queue",
            )
        # Random ids: several adapters may share one Triton, and ids must not collide there.
        now = self._clock()
        # Its timings start when the adapter received it, not at this attempt: a retry on another
        # replica (or a hand-back from a draining one) keeps the time spent on the first.
        arrived_at = request.arrived_at if request.arrived_at is not None else now
        sequence = Sequence(seq_id=random.getrandbits(62) + 1, request=request, submitted_at=arrived_at, queued_at=now)
        sequence.trace = sequence_trace.start(request)
        if self._draining:  # routed here before the drain began: sent on at once
            self._hand_back(sequence)
            return SequenceHandle(sequence, lambda: None)
        self._waiting.push(sequence)
        self._wakeup.set()
        self._on_arrival()
        return SequenceHandle(sequence, lambda: self._on_cancel(sequence))

    def _on_arrival(self) -> None:
        """A request joined the waiting queue (the owner loop was woken)."""

    def _on_cancel(self, sequence: Sequence) -> None:
        """A caller cancelled `sequence`: the owner loop drops it at its next step."""
        self._wakeup.set()

    # -- drain -----------------------------------------------------------------------

    def drain(self) -> int:
        """No new sequence starts on this replica: those waiting are handed back (`_hand_back`) and
        those running finish here (their KV cache is here). Returns how many were handed back.

        Why not let the waiting ones start: a draining Triton pod is stopped at the end of its
        preStop, and a sequence started late in it is cut there after streaming tokens, when it can
        no longer move; one that has not started moves now, before its first token."""
        self._draining = True
        now = self._clock()
        handed_back = 0
        for sequence in self._waiting.remove_if(lambda _: True):
            reason = sequence.abandon_reason(now)
            if reason is not None:  # its caller has gone: nothing to route
                sequence.finish(reason, now)
            else:
                self._hand_back(sequence)
                handed_back += 1
        self._wakeup.set()
        return handed_back

    def undrain(self) -> None:
        """The replica's address came back before it was removed: sequences start here again."""
        self._draining = False

    def _hand_back(self, sequence: Sequence) -> None:
        """Ends a sequence that never started here as a backend failure before its first token, which
        the replica pool retries on another replica (ReplicaPool.generate). Its span ends without an
        error: a re-route, not a failure (the retry shows as its `sluice.handed_back` event)."""
        sequence.backend_failed = True
        error = f"Triton replica {self._replica or '(unnamed)'} is draining; retry"
        sequence.finish(Finish.ERROR, self._clock(), error=error, handed_back=True)

    @property
    def waiting_count(self) -> int:
        return len(self._waiting)

    @property
    def running_count(self) -> int:
        raise NotImplementedError

    @property
    def load(self) -> int:
        """What least-loaded routing compares: waiting plus running sequences."""
        return len(self._waiting) + self.running_count

    def _report_step(self, ok: bool) -> None:
        if self._on_step is not None:
            self._on_step(ok)

    # -- lifecycle -----------------------------------------------------------------

    task_name = "replica-work"

    def start(self, supervisor: Supervisor | None = None) -> None:
        """Runs the owner loop under supervision: if it dies its callers fail at once (on_death)
        and it starts over with an empty batch."""
        name = f"{self.task_name}@{self._replica}" if self._replica else self.task_name
        self._task = (supervisor or Supervisor()).start(name, self._run, on_death=self._on_death)

    async def _run(self) -> None:
        raise NotImplementedError

    def _on_death(self, error: BaseException) -> None:
        raise NotImplementedError
