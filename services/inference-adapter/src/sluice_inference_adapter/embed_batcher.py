"""Dynamic micro-batching for embeddings: one task owns the waiting texts.

Callers `await embed(texts, priority)`; they never touch the queue. Their texts wait as single
texts in one FIFO per priority class, so one caller's texts may share a batch with other callers'
texts or be split over several batches; each caller gets its vectors back in its own order. A
batch goes to the backend when `max_batch` texts are waiting, or `max_delay_s` after the oldest
waiting text arrived, whichever comes first. At most `max_in_flight` batches are at the backend at
once; while they run, new texts keep gathering, so batches grow under load by themselves.

Priority: a batch is filled with interactive texts first, then bulk ones, except that bulk texts
are owed a `bulk_share` of the slots of every batch formed while they wait (a credit that carries
over, so with max_batch 32 and the default 1/8 that is 4 slots a batch, with max_batch 4 one slot
every other batch): steady interactive load slows bulk work but never starves it. Bulk texts may
fill at most `bulk_max_waiting` of the `max_waiting` places (three quarters by default), so a bulk
backlog (a batch job, evaluation-logging's similarity worker) cannot make interactive calls
RESOURCE_EXHAUSTED.

Failure and cancellation are per batch and per caller:
- a backend failure fails exactly the callers with a text in that batch (their other texts
  still waiting are dropped); everyone else is untouched. An answer of the wrong shape (rows,
  token counts, or a vector width other than the model's `dim`) is such a failure;
- a caller cancelled before its texts were sent takes them out of the queue; texts already
  at the backend are computed and their vectors discarded;
- a full queue rejects at once with ResourceExhausted (RESOURCE_EXHAUSTED plus RetryInfo);
- a text longer than the model's maximum input (a model that reports its texts' token counts
  before truncation, `Embeddings.untruncated`, and cut it to its TOKENS) fails its caller alone
  with `InputTooLong` (INVALID_ARGUMENT naming `inputs[i]`, worded as OpenAI and vLLM refuse it),
  rather than answer for part of the text; the other callers in that batch get their vectors.
  The model computed it first: only the model's tokenizer knows the count. A caller that asked
  for truncation (`embed(..., truncate=True)`: vLLM's `truncate_prompt_tokens` -1) gets the
  vector of the cut text instead, its count the tokens embedded, and the text marked in its
  answer's `truncated` (the cache does not keep such a vector: a caller that did not ask for
  truncation must not be answered with it). Callers of either kind share batches.

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
from sluice_inference_adapter.priority import Priority

log = structlog.stdlib.get_logger("sluice.embed_batcher")

DEFAULT_EMBEDDING_DIM = 384
# The slots of each batch owed to waiting bulk texts, and the part of the waiting queue they may fill.
DEFAULT_BULK_SHARE = 0.125
DEFAULT_BULK_WAITING_SHARE = 0.75


@dataclass(frozen=True, eq=False)
class Embeddings:
    """Vectors for some texts, in their order, and the tokens each text was encoded to."""

    vectors: np.ndarray  # float32 [n, dim]
    tokens: np.ndarray | None  # int64 [n]; None when the model does not report token counts
    # int64 [n]: the tokens each text encodes to before the model's truncation (a backend's answer
    # only; the batcher refuses a text with more than its `tokens`). None: not reported.
    untruncated: np.ndarray | None = None
    # bool [n]: the texts the model cut to its maximum input (the batcher's answer to a caller that
    # asked for truncation only). None: none was cut, or the caller did not ask.
    truncated: np.ndarray | None = None


class InputTooLong(InvalidArgument):
    """A text over the embedding model's maximum input, refused rather than embedded truncated.
    `index`: its position among the texts embedded (`at` moves it to the caller's request)."""

    def __init__(self, index: int, tokens: int, limit: int) -> None:
        super().__init__(
            f"inputs[{index}]",
            f"This model's maximum context length is {limit} tokens. However, you requested {tokens} tokens in the input"
            " for embedding generation. Please reduce the length of the input.",
        )
        self.index = index
        self.tokens = tokens
        self.limit = limit

    def at(self, index: int) -> InputTooLong:
        return InputTooLong(index, self.tokens, self.limit)


class EmbedBackend(Protocol):
    """One backend request per call: texts in, their `Embeddings` out (same order)."""

    async def embed(self, texts: list[str]) -> Embeddings: ...


@dataclass(eq=False)
class _Job:
    """One caller's request inside the batcher."""

    texts: Sequence[str]
    priority: Priority
    future: asyncio.Future[Embeddings]
    remaining: int
    tokens: np.ndarray  # int64 [len(texts)], filled in as batches come back
    vectors: np.ndarray | None = None
    # False once any of its texts came back without a count: a partial sum would under-report.
    counted: bool = True
    # Whether the caller asked for truncation: a text the model cut is then answered, not refused.
    truncate: bool = False
    # bool [len(texts)]: its texts the model cut (only with `truncate`), made at the first one.
    truncated: np.ndarray | None = None
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
        bulk_share: float = DEFAULT_BULK_SHARE,
        bulk_max_waiting: int | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if max_delay_s < 0:
            raise ValueError("max_delay_s must not be negative")
        if max_waiting < 1:
            raise ValueError("max_waiting must be at least 1")
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if not 0 < bulk_share <= 1:
            raise ValueError("bulk_share must be in (0, 1]: bulk texts must never starve")
        if bulk_max_waiting is None:
            bulk_max_waiting = max(1, int(max_waiting * DEFAULT_BULK_WAITING_SHARE))
        if not 1 <= bulk_max_waiting <= max_waiting:
            raise ValueError("bulk_max_waiting must be in [1, max_waiting]")
        self._backend = backend
        self._max_batch = max_batch
        self._max_delay_s = max_delay_s
        self._max_waiting = max_waiting
        self._max_in_flight = max_in_flight
        self._retry_after_s = retry_after_s
        self._dim = dim
        self._bulk_share = bulk_share
        self._bulk_max_waiting = bulk_max_waiting
        self._queues: dict[Priority, deque[_Item]] = {Priority.INTERACTIVE: deque(), Priority.BULK: deque()}
        # Slots owed to bulk texts by the batches formed while they waited (see the module).
        self._bulk_credit = 0.0
        self._in_flight: set[asyncio.Task[None]] = set()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    # -- caller side ---------------------------------------------------------------

    async def embed(self, texts: Sequence[str], priority: Priority = Priority.INTERACTIVE, truncate: bool = False) -> Embeddings:
        """Vectors for `texts`, float32 [len(texts), dim], in order, with their token counts.

        Raises ResourceExhausted when the waiting queue cannot take `texts`, InvalidArgument
        when `texts` alone exceeds what its priority class may queue, InputTooLong when the
        model cut one of them and `truncate` is False (with `truncate`, the cut text's vector is
        answered and marked in `truncated`), and the backend's SluiceError (or Unavailable
        wrapping any other exception) when a batch carrying one of them failed.
        """
        if isinstance(texts, str):
            raise TypeError("embed takes a list of texts, not one string")
        if self._stopped:
            raise Unavailable("the embedding batcher is shut down")
        if not texts:
            return Embeddings(np.zeros((0, self._dim), dtype=np.float32), np.zeros(0, dtype=np.int64))
        self._admit(len(texts), priority)
        loop = asyncio.get_running_loop()
        job = _Job(texts, priority, loop.create_future(), remaining=len(texts), tokens=np.zeros(len(texts), np.int64), truncate=truncate)
        now = loop.time()
        self._queues[priority].extend(_Item(job, i, now) for i in range(len(texts)))
        metrics.EMBED_WAITING.set(self.waiting_count)
        self._wakeup.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            if not job.closed:
                job.closed = True
                metrics.CANCELLATIONS.labels(reason="embed_cancelled").inc()
                self._drop_waiting(job)
            raise

    def _admit(self, count: int, priority: Priority) -> None:
        """Raises unless `count` more texts of `priority` may wait: bulk ones only within their
        own bound, so that the rest of the queue stays open to interactive texts."""
        if count > self._max_waiting:
            raise InvalidArgument("texts", f"at most {self._max_waiting} texts per request, got {count}")
        if priority is Priority.BULK and count > self._bulk_max_waiting:
            raise InvalidArgument("texts", f"at most {self._bulk_max_waiting} bulk texts per request, got {count}")
        bulk_waiting = len(self._queues[Priority.BULK])
        if self.waiting_count + count > self._max_waiting:
            self._reject(f"the embedding queue is full ({self.waiting_count} of {self._max_waiting} texts waiting)")
        if priority is Priority.BULK and bulk_waiting + count > self._bulk_max_waiting:
            self._reject(f"the embedding queue's bulk share is full ({bulk_waiting} of {self._bulk_max_waiting} bulk texts waiting)")

    def _reject(self, why: str) -> None:
        metrics.REJECTIONS.labels(reason="embed_queue_full").inc()
        raise ResourceExhausted(f"{why}; retry later", retry_after_s=self._retry_after_s, quota_subject="adapter.embed_queue")

    @property
    def max_texts_per_request(self) -> int:
        """The most texts one `embed` call may carry (the waiting queue's bound)."""
        return self._max_waiting

    @property
    def waiting_count(self) -> int:
        """Texts waiting to be sent (not counting those at the backend)."""
        return sum(len(queue) for queue in self._queues.values())

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
        for queue in self._queues.values():
            for item in queue:
                self._fail(item.job, error)
            queue.clear()
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
        while not self.waiting_count:
            self._wakeup.clear()
            await self._wakeup.wait()

    def _oldest_arrival(self) -> float:
        return min(queue[0].enqueued_at for queue in self._queues.values() if queue)

    async def _wait_for_batch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Until max_batch texts wait or the oldest has waited max_delay_s."""
        while 0 < self.waiting_count < self._max_batch:
            remaining = self._oldest_arrival() + self._max_delay_s - loop.time()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                return
        # The queue may have emptied through cancellation: `_take_batch` then returns nothing.

    def _take_batch(self, now: float) -> _Batch:
        """Interactive texts first, but for the slots owed to bulk ones; slots that either class
        leaves empty go to the other."""
        batch = _Batch()
        interactive, bulk = self._queues[Priority.INTERACTIVE], self._queues[Priority.BULK]
        owed = self._bulk_slots_owed()
        self._take(interactive, batch, self._max_batch - owed, now)
        bulk_taken = self._take(bulk, batch, self._max_batch, now)
        self._take(interactive, batch, self._max_batch, now)
        self._bulk_credit = max(0.0, self._bulk_credit - bulk_taken) if bulk else 0.0
        metrics.EMBED_WAITING.set(self.waiting_count)
        return batch

    def _bulk_slots_owed(self) -> int:
        """Whole slots of this batch owed to waiting bulk texts; the fraction carries over, so a
        small max_batch still gives them a slot every few batches."""
        if not self._queues[Priority.BULK]:
            return 0
        self._bulk_credit = min(float(self._max_batch), self._bulk_credit + self._max_batch * self._bulk_share)
        return int(self._bulk_credit)

    def _take(self, queue: deque[_Item], batch: _Batch, up_to: int, now: float) -> int:
        """Moves live texts from `queue` into `batch` until it holds `up_to`; returns how many."""
        taken = 0
        while queue and len(batch.items) < up_to:
            item = queue.popleft()
            if item.job.closed:
                continue
            metrics.EMBED_QUEUE_SECONDS.observe(now - item.enqueued_at)
            batch.items.append(item)
            taken += 1
        return taken

    async def _send(self, batch: _Batch, slots: asyncio.Semaphore) -> None:
        loop = asyncio.get_running_loop()
        texts = [str(item.job.texts[item.index]) for item in batch.items]
        metrics.EMBED_BATCH_TEXTS.observe(len(texts))
        started = loop.time()
        try:
            vectors, tokens, untruncated = self._checked(await self._backend.embed(texts), len(texts))
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
        try:
            self._hand_out(batch, vectors, tokens, untruncated)
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave this batch's callers waiting for ever
            log.exception("embed_hand_out_failed", texts=len(texts))
            self._fail_batch(batch, Unavailable(f"the embedding batcher failed to hand out a batch: {exc!r}; retry"))

    def _checked(self, answer: Embeddings, count: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """The answer's vectors and token counts (after and before truncation; the latter only
        with the former), or Unavailable when their shape is not [count, dim] and [count]: a row of
        another width cannot join a caller's other rows."""
        vectors = np.asarray(answer.vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != count:
            raise Unavailable(f"the embedding backend answered shape {vectors.shape} for {count} texts")
        if vectors.shape[1] != self._dim:
            raise Unavailable(
                f"the embedding backend answered vectors of width {vectors.shape[1]}; the model's dimension is {self._dim}"
                " (a replica serving another model, or EMBEDDING_DIMENSIONS set wrong)"
            )
        tokens = None if answer.tokens is None else np.asarray(answer.tokens, dtype=np.int64)
        if tokens is not None and tokens.shape != (count,):
            raise Unavailable(f"the embedding backend answered token counts of shape {tokens.shape} for {count} texts")
        untruncated = None if answer.untruncated is None or tokens is None else np.asarray(answer.untruncated, dtype=np.int64)
        if untruncated is not None and untruncated.shape != (count,):
            raise Unavailable(f"the embedding backend answered untruncated token counts of shape {untruncated.shape} for {count} texts")
        return vectors, tokens, untruncated

    def _hand_out(self, batch: _Batch, vectors: np.ndarray, tokens: np.ndarray | None, untruncated: np.ndarray | None = None) -> None:
        """Puts each row in its caller's answer; answers a caller once its last row is in. A text
        the model cut to its maximum input fails its caller (and that caller alone), unless that
        caller asked for truncation: then it is marked as cut in the caller's answer."""
        for row, item in enumerate(batch.items):
            job = item.job
            if job.closed:
                continue
            if untruncated is not None and tokens is not None and untruncated[row] > tokens[row]:
                if not job.truncate:
                    self._fail(job, InputTooLong(item.index, int(untruncated[row]), int(tokens[row])))
                    continue
                if job.truncated is None:
                    job.truncated = np.zeros(len(job.texts), dtype=np.bool_)
                job.truncated[item.index] = True
            if job.vectors is None:
                job.vectors = np.empty((len(job.texts), self._dim), dtype=np.float32)
            job.vectors[item.index] = vectors[row]
            if tokens is None:
                job.counted = False
            else:
                job.tokens[item.index] = tokens[row]
            job.remaining -= 1
            if job.remaining == 0:
                # Built before the job is closed: should it raise, the job is still failed.
                result = Embeddings(job.vectors, job.tokens if job.counted else None, truncated=job.truncated)
                job.closed = True
                if not job.future.done():
                    job.future.set_result(result)

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
        """Takes a closed job's unsent texts out of its queue (and wakes the loop, whose
        deadline may have been set by one of them)."""
        queue = self._queues[job.priority]
        if any(item.job is job for item in queue):
            self._queues[job.priority] = deque(item for item in queue if item.job is not job)
            metrics.EMBED_WAITING.set(self.waiting_count)
            self._wakeup.set()
