"""Dynamic micro-batching for embeddings: one task owns the waiting texts.

Callers `await embed(texts)`; they never touch the queue. Their texts wait in one FIFO of
single texts, so one caller's texts may share a batch with other callers' texts or be split
over several batches; each caller gets its vectors back in its own order. A batch goes to
the backend when `max_batch` texts are waiting, or `max_delay_s` after the oldest waiting
text arrived, whichever comes first. At most `max_in_flight` batches are at the backend at
once; while they run, new texts keep gathering, so batches grow under load by themselves.

Failure and cancellation are per batch and per caller:
- a backend failure fails exactly the callers with a text in that batch (their other texts
  still waiting are dropped); everyone else is untouched;
- a caller cancelled before its texts were sent takes them out of the queue; texts already
  at the backend are computed and their vectors discarded;
- a full queue rejects at once with ResourceExhausted (RESOURCE_EXHAUSTED plus RetryInfo).

Token counts travel with the vectors: each caller gets the count of each of its texts, or
None when a batch carrying one of its texts came from a model that does not report them.

No transport import here: the backend (Triton, through tritonclient) is behind `EmbedBackend`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import structlog

from sluice_common.errors import InvalidArgument, ResourceExhausted, SluiceError, Unavailable
from sluice_common.supervision import Supervisor, stop_tasks
from sluice_inference_adapter import metrics

log = structlog.stdlib.get_logger("sluice.embed_batcher")

DEFAULT_EMBEDDING_DIM = 384


@dataclass(frozen=True, eq=False)
class Embeddings:
    """Vectors for some texts, in their order, and the tokens each text was encoded to."""

    vectors: np.ndarray  # float32 [n, dim]
    tokens: np.ndarray | None  # int64 [n]; None when the model does not report token counts


class EmbedBackend(Protocol):
    """One backend request per call: texts in, their `Embeddings` out (same order)."""

    async def embed(self, texts: list[str]) -> Embeddings: ...


@dataclass(eq=False)
class _Job:
    """One caller's request inside the batcher."""

    texts: Sequence[str]
    future: asyncio.Future[Embeddings]
    remaining: int
    tokens: np.ndarray  # int64 [len(texts)], filled in as batches come back
    vectors: np.ndarray | None = None
    # False once any of its texts came back without a count: a partial sum would under-report.
    counted: bool = True
    # Set once the caller has its answer (vectors, an error, or it went away).
    closed: bool = False


@dataclass(eq=False)
class _Item:
    job: _Job
    index: int
    enqueued_at: float


@dataclass(eq=False)
class _Batch:
    items: list[_Item] = field(default_factory=list)


class EmbedBatcher:
    def __init__(
        self,
        backend: EmbedBackend,
        max_batch: int,
        max_delay_s: float,
        max_waiting: int,
        *,
        max_in_flight: int = 1,
        retry_after_s: float = 1.0,
        dim: int = DEFAULT_EMBEDDING_DIM,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if max_delay_s < 0:
            raise ValueError("max_delay_s must not be negative")
        if max_waiting < 1:
            raise ValueError("max_waiting must be at least 1")
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self._backend = backend
        self._max_batch = max_batch
        self._max_delay_s = max_delay_s
        self._max_waiting = max_waiting
        self._max_in_flight = max_in_flight
        self._retry_after_s = retry_after_s
        self._dim = dim
        self._waiting: deque[_Item] = deque()
        self._in_flight: set[asyncio.Task[None]] = set()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    # -- caller side ---------------------------------------------------------------

    async def embed(self, texts: Sequence[str]) -> Embeddings:
        """Vectors for `texts`, float32 [len(texts), dim], in order, with their token counts.

        Raises ResourceExhausted when the waiting queue cannot take `texts`, InvalidArgument
        when `texts` alone exceeds the queue, and the backend's SluiceError (or Unavailable
        wrapping any other exception) when a batch carrying one of them failed.
        """
        if isinstance(texts, str):
            raise TypeError("embed takes a list of texts, not one string")
        if self._stopped:
            raise Unavailable("the embedding batcher is shut down")
        if not texts:
            return Embeddings(np.zeros((0, self._dim), dtype=np.float32), np.zeros(0, dtype=np.int64))
        if len(texts) > self._max_waiting:
            raise InvalidArgument("texts", f"at most {self._max_waiting} texts per request, got {len(texts)}")
        if len(self._waiting) + len(texts) > self._max_waiting:
            metrics.REJECTIONS.labels(reason="embed_queue_full").inc()
            raise ResourceExhausted(
                f"the embedding queue is full ({len(self._waiting)} of {self._max_waiting} texts waiting); retry later",
                retry_after_s=self._retry_after_s,
                quota_subject="adapter.embed_queue",
            )
        loop = asyncio.get_running_loop()
        job = _Job(texts=texts, future=loop.create_future(), remaining=len(texts), tokens=np.zeros(len(texts), np.int64))
        now = loop.time()
        self._waiting.extend(_Item(job, i, now) for i in range(len(texts)))
        metrics.EMBED_WAITING.set(len(self._waiting))
        self._wakeup.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            if not job.closed:
                job.closed = True
                metrics.CANCELLATIONS.labels(reason="embed_cancelled").inc()
                self._drop_waiting(job)
            raise

    @property
    def max_texts_per_request(self) -> int:
        """The most texts one `embed` call may carry (the waiting queue's bound)."""
        return self._max_waiting

    @property
    def waiting_count(self) -> int:
        """Texts waiting to be sent (not counting those at the backend)."""
        return len(self._waiting)

    @property
    def in_flight_count(self) -> int:
        """Batches at the backend now."""
        return len(self._in_flight)

    # -- lifecycle -----------------------------------------------------------------

    def start(self, supervisor: Supervisor | None = None) -> None:
        self._stopped = False
        self._task = (supervisor or Supervisor()).start("embed-batcher", self._run, on_death=self._on_death)

    def _on_death(self, error: BaseException) -> None:
        """The loop died: texts waiting for a batch would wait for ever."""
        self._fail_waiting(Unavailable(f"the embedding batcher failed: {error!r}; retry"))

    def _fail_waiting(self, error: SluiceError) -> None:
        for item in self._waiting:
            self._fail(item.job, error)
        self._waiting.clear()
        metrics.EMBED_WAITING.set(0)

    async def stop(self) -> None:
        self._stopped = True
        tasks = [t for t in (self._task, *self._in_flight) if t is not None]
        await stop_tasks(*tasks)
        self._task = None
        self._fail_waiting(Unavailable("the adapter is shutting down"))

    # -- the loop ------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(self._max_in_flight)
        while True:
            await self._wait_for_work()
            await slots.acquire()
            try:
                await self._wait_for_batch(loop)
                batch = self._take_batch(loop.time())
            except BaseException:
                slots.release()
                raise
            if not batch.items:
                slots.release()
                continue
            task = asyncio.create_task(self._send(batch, slots), name="embed-batch")
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _wait_for_work(self) -> None:
        while not self._waiting:
            self._wakeup.clear()
            await self._wakeup.wait()

    async def _wait_for_batch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Until max_batch texts wait or the oldest has waited max_delay_s."""
        while self._waiting and len(self._waiting) < self._max_batch:
            remaining = self._waiting[0].enqueued_at + self._max_delay_s - loop.time()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                return
        # The queue may have emptied through cancellation: `_take_batch` then returns nothing.

    def _take_batch(self, now: float) -> _Batch:
        batch = _Batch()
        while self._waiting and len(batch.items) < self._max_batch:
            item = self._waiting.popleft()
            if item.job.closed:
                continue
            metrics.EMBED_QUEUE_SECONDS.observe(now - item.enqueued_at)
            batch.items.append(item)
        metrics.EMBED_WAITING.set(len(self._waiting))
        return batch

    async def _send(self, batch: _Batch, slots: asyncio.Semaphore) -> None:
        loop = asyncio.get_running_loop()
        texts = [str(item.job.texts[item.index]) for item in batch.items]
        metrics.EMBED_BATCH_TEXTS.observe(len(texts))
        started = loop.time()
        try:
            answer = await self._backend.embed(texts)
            vectors = np.asarray(answer.vectors, dtype=np.float32)
            if vectors.ndim != 2 or vectors.shape[0] != len(texts):
                raise Unavailable(f"the embedding backend answered shape {vectors.shape} for {len(texts)} texts")
            tokens = None if answer.tokens is None else np.asarray(answer.tokens, dtype=np.int64)
            if tokens is not None and tokens.shape != (len(texts),):
                raise Unavailable(f"the embedding backend answered token counts of shape {tokens.shape} for {len(texts)} texts")
        except asyncio.CancelledError:
            self._fail_batch(batch, Unavailable("the adapter is shutting down"))
            raise
        except Exception as exc:  # noqa: BLE001 - the backend failed: fail this batch's callers
            log.warning("embed_batch_failed", error=str(exc), texts=len(texts))
            error = exc if isinstance(exc, SluiceError) else Unavailable(f"the embedding backend failed: {exc}")
            self._fail_batch(batch, error)
            return
        finally:
            metrics.EMBED_BATCH_SECONDS.observe(loop.time() - started)
            slots.release()
        for row, item in enumerate(batch.items):
            job = item.job
            if job.closed:
                continue
            if job.vectors is None:
                job.vectors = np.empty((len(job.texts), vectors.shape[1]), dtype=np.float32)
            job.vectors[item.index] = vectors[row]
            if tokens is None:
                job.counted = False
            else:
                job.tokens[item.index] = tokens[row]
            job.remaining -= 1
            if job.remaining == 0:
                job.closed = True
                if not job.future.done():
                    job.future.set_result(Embeddings(job.vectors, job.tokens if job.counted else None))

    # -- helpers -------------------------------------------------------------------

    def _fail_batch(self, batch: _Batch, error: BaseException) -> None:
        for job in {id(item.job): item.job for item in batch.items}.values():
            self._fail(job, error)

    def _fail(self, job: _Job, error: BaseException) -> None:
        if job.closed:
            return
        job.closed = True
        if not job.future.done():
            job.future.set_exception(error)
        self._drop_waiting(job)

    def _drop_waiting(self, job: _Job) -> None:
        """Takes a closed job's unsent texts out of the queue (and wakes the loop, whose
        deadline may have been set by one of them)."""
        if any(item.job is job for item in self._waiting):
            self._waiting = deque(item for item in self._waiting if item.job is not job)
            metrics.EMBED_WAITING.set(len(self._waiting))
            self._wakeup.set()
