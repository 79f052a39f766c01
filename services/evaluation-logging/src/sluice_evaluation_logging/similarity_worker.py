"""The similarity evaluator's second half, off the consume path.

The consumer stores a sampled event's record with a durable pending marker (`pending_scores`,
same transaction) and acks; this task, in the same process, takes due markers in large batches,
embeds the prompt and output of every event of a batch in ONE Embed call to the adapter, and
writes the scores and deletes the markers in one transaction. A marker outlives a crash: the
next process (or another replica, once the claim's lease has run out) picks it up.

- Claims are leases (`claim_lease_s`): a replica that dies mid-batch leaves its markers to be
  claimed again after the lease; PostgreSQL replicas claim with SKIP LOCKED, never the same rows.
- Embed answers UNIMPLEMENTED (the adapter serves no embeddings): every score of the batch is
  recorded as "skipped: embeddings unavailable (UNIMPLEMENTED)", as the inline evaluator did.
- UNAVAILABLE, a full queue (RESOURCE_EXHAUSTED, the adapter's backpressure): the markers are
  released and the task backs off (doubling up to `max_backoff_s`); they stay durable meanwhile,
  and such tries do not count.
- A deadline (DEADLINE_EXCEEDED): the call may have been too large for a slow encoder. Each claim
  is embedded in one call of at most the worker's claim size (`batch_max` at first): a call of
  several events that times out releases its markers uncounted and halves the claim size (down to
  one event), and each call answered in time grows it by one again, up to `batch_max`. A marker
  that times out alone counts, and is given up after `max_attempts` claims like any failing
  marker. One call per claim, so no call outlasts the claim's lease: `embed_timeout_s` must be
  shorter than `claim_lease_s`.
- Anything else (a bad answer, a bug): released and retried; after `max_attempts` claims the
  score is recorded as skipped with the error, so one poison record cannot block the rest.
- Background priority: while the consumer has a backlog (`busy`), the worker waits before each
  batch, at most `max_pause_s`, so storing and acking get the CPU (the embedding model runs on
  the same machine in the default setup) and similarity still progresses under sustained load.
- Idempotent: a score is written only while its marker exists, and the consumer writes a
  marker only with a freshly inserted record, so a redelivered event gets neither twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
from google.protobuf.message import DecodeError
from prometheus_client import Counter, Histogram
from sluice.evallog.v1 import events_pb2

from sluice_common.supervision import Supervisor, stop_tasks
from sluice_evaluation_logging.evaluators import similarity
from sluice_evaluation_logging.evaluators.base import (
    Embedder,
    EmbeddingsTimedOut,
    EmbeddingsUnavailable,
    EvalSettings,
    ScoreResult,
    skipped,
)
from sluice_evaluation_logging.model import PendingItem
from sluice_evaluation_logging.store import Store

log = structlog.stdlib.get_logger("sluice.evallog.similarity")

SCORED = Counter("sluice_evallog_deferred_scores_total", "Deferred scores written, by outcome.", ["name", "outcome"])
RETRIES = Counter("sluice_evallog_deferred_retries_total", "Deferred batches released to retry, by reason.", ["name", "reason"])
BATCH_SECONDS = Histogram(
    "sluice_evallog_deferred_batch_seconds",
    "Claim + Embed + store of one deferred batch.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


@dataclass(frozen=True)
class WorkerSettings:
    # Most events per claim, all embedded in one Embed call (two texts each: its prompt and its output).
    batch_max: int = 64
    # How often to look for markers when not nudged (other replicas' markers, released ones).
    poll_s: float = 1.0
    # A claim is this long; a replica that dies holding it leaves the markers to others after it.
    claim_lease_s: float = 60.0
    min_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    max_attempts: int = 5
    # While the consumer is busy, wait at most this long before each batch.
    max_pause_s: float = 2.0
    # The embedder's deadline per call: shorter than the lease, so a claim's one call ends within it.
    embed_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.embed_timeout_s >= self.claim_lease_s:
            raise ValueError(
                f"embed_timeout_s ({self.embed_timeout_s}) must be shorter than claim_lease_s ({self.claim_lease_s}):"
                " a claim's Embed call could outlast its lease, and another replica embed the same markers again"
            )


Scores = list[tuple[str, ScoreResult]]


def _texts(item: PendingItem) -> tuple[str, str] | None:
    event = events_pb2.CompletionEvent()
    try:
        event.ParseFromString(item.event)
    except DecodeError:
        return None
    return similarity.texts(event)


class SimilarityWorker:
    name = similarity.NAME

    def __init__(
        self,
        store: Store,
        embedder: Embedder,
        settings: EvalSettings,
        worker: WorkerSettings = WorkerSettings(),
        busy: Callable[[], bool] | None = None,
    ) -> None:
        self._store = store
        self._busy = busy
        self._embedder = embedder
        self._settings = settings
        self._worker = worker
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._backoff = worker.min_backoff_s
        # Markers per claim (one Embed call): halved when a call times out, grown back by one per answer.
        self._claim_size = worker.batch_max

    def start(self, supervisor: Supervisor | None = None) -> None:
        # Restarted when it dies: its work is durable markers in the store.
        self._task = (supervisor or Supervisor()).start("similarity-worker", self._run)

    def nudge(self) -> None:
        """New markers were committed (the consumer calls this): look now rather than at the next poll."""
        self._wake.set()

    async def stop(self) -> None:
        """Stops after the batch in progress (its markers stay durable if it cannot finish)."""
        self._stopping.set()
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), 10)
            await stop_tasks(self._task)

    async def _run(self) -> None:
        # Markers left by a previous process are due at once: the first pass takes them.
        while not self._stopping.is_set():
            self._wake.clear()
            await self._yield_to_consumer()
            try:
                done = await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the store is down: markers wait, we retry
                log.error("deferred_batch_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
                await self._sleep(self._next_backoff())
                continue
            if done == 0 and not self._stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._worker.poll_s)

    async def _yield_to_consumer(self) -> None:
        if self._busy is None:
            return
        deadline = time.monotonic() + self._worker.max_pause_s
        while self._busy() and time.monotonic() < deadline and not self._stopping.is_set():
            await asyncio.sleep(0.05)

    def _next_backoff(self) -> float:
        delay, self._backoff = self._backoff, min(self._backoff * 2, self._worker.max_backoff_s)
        return delay

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def run_once(self) -> int:
        """Claims one batch and settles it; returns how many markers it cleared (0: none due, or retrying)."""
        w = self._worker
        items = await self._store.claim_pending(self.name, self._claim_size, w.claim_lease_s)
        if not items:
            return 0
        started = asyncio.get_running_loop().time()
        scores: Scores = []
        embeddable: list[tuple[PendingItem, tuple[str, str]]] = []
        for item in items:
            pair = _texts(item)
            if pair is None:
                scores.append((item.event_id, skipped(self.name, "skipped: the stored event does not parse")))
            else:
                embeddable.append((item, pair))
        if embeddable:
            try:
                vectors = await self._embedder.embed([text for _, pair in embeddable for text in pair])
            except Exception as exc:  # noqa: BLE001 - each kind of failure is settled in _failed
                return await self._failed(exc, [item for item, _ in embeddable], scores, len(items), started)
            # Answered in time: one event more per claim, up to batch_max. By one, not doubled: a slow
            # spell that has passed is still grown out of, while an encoder that stays slow reaches the
            # size that timed out again only after about half that many calls, not every other call.
            self._claim_size = min(self._claim_size + 1, w.batch_max)
            for index, (item, _) in enumerate(embeddable):
                scores.append((item.event_id, similarity.score(vectors[2 * index], vectors[2 * index + 1], self._settings)))
        return await self._settle(scores, len(items), started)

    async def _failed(self, exc: Exception, items: list[PendingItem], scores: Scores, claimed: int, started: float) -> int:
        """Settles a claim whose Embed call for `items` failed with `exc`; `scores`: those decided without it."""
        if isinstance(exc, EmbeddingsUnavailable) and not exc.retryable:
            # The adapter serves no embeddings: waiting would not help any marker of the claim.
            outcome = similarity.unavailable(exc)
            scores.extend((item.event_id, outcome) for item in items)
            return await self._settle(scores, claimed, started)
        if isinstance(exc, EmbeddingsTimedOut) and len(items) > 1:
            # Maybe just too much for one call within the deadline: the next claims are half as large
            # as this call, and the try does not count (no one marker is to blame yet).
            self._claim_size = max(len(items) // 2, 1)
            again, count_attempt = items, False
            reason = f"{exc}: {len(items)} events per call, retrying with {self._claim_size}"
        elif isinstance(exc, EmbeddingsTimedOut):
            # Too slow even alone: this counts, so a marker that is never embedded in time is given up.
            again, count_attempt = self._give_up(items, f"skipped: embeddings timed out ({exc}) even for the event alone", scores), True
            reason = f"{exc}: one event per call"
        elif isinstance(exc, EmbeddingsUnavailable):
            # Down or busy (backpressure): waiting helps, and no marker is to blame, so it does not count.
            again, count_attempt = items, False
            reason = str(exc) or "unavailable"
        else:
            # Anything else: decided per marker, so one claimed max_attempts times is recorded as skipped
            # even when the call brings fresh markers along (they alone go round again).
            reason = f"{type(exc).__name__}: {exc}"
            again, count_attempt = self._give_up(items, f"skipped: evaluator failed: {reason}", scores), True
        if not again:
            return await self._settle(scores, claimed, started)
        if scores:
            await self._settle(scores, claimed, started, backed_off=True)
        return await self._retry(again, reason, count_attempt)

    def _give_up(self, items: list[PendingItem], detail: str, scores: Scores) -> list[PendingItem]:
        """Adds to `scores` as skipped (with `detail`) the markers claimed max_attempts times; returns the others."""
        failed = skipped(self.name, detail)
        scores.extend((item.event_id, failed) for item in items if item.attempts >= self._worker.max_attempts)
        return [item for item in items if item.attempts < self._worker.max_attempts]

    async def _settle(self, scores: list[tuple[str, ScoreResult]], claimed: int, started: float, backed_off: bool = False) -> int:
        """Stores the batch's decided scores (their markers cleared); how many, at least 1.
        `backed_off`: the rest of the batch failed, and the backoff goes on growing."""
        w = self._worker
        cleared = await self._store.complete_pending(self.name, scores)
        if not backed_off:
            self._backoff = w.min_backoff_s
        skipped_count = sum(1 for _, s in scores if s.skipped)
        SCORED.labels(self.name, "scored").inc(len(scores) - skipped_count)
        SCORED.labels(self.name, "skipped").inc(skipped_count)
        elapsed = asyncio.get_running_loop().time() - started
        BATCH_SECONDS.observe(elapsed)
        log.info("deferred_scores_stored", score=self.name, claimed=claimed, stored=cleared, skipped=skipped_count, seconds=round(elapsed, 4))
        return max(cleared, 1)  # something was settled: look again at once

    async def _retry(self, items: Sequence[PendingItem], reason: str, count_attempt: bool) -> int:
        delay = self._next_backoff()
        RETRIES.labels(self.name, reason.split(":")[0]).inc()
        log.warning("deferred_scores_retry", score=self.name, markers=len(items), reason=reason, retry_in_s=delay)
        await self._store.release_pending(self.name, [item.event_id for item in items], delay, count_attempt)
        await self._sleep(delay)
        return 0
