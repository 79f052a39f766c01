"""Consumes CompletionEvents: decode, evaluate, store a batch in one transaction, then ack it.

Delivery is at least once and storage is idempotent by event id, so the only rule is: ack
after the batch is durably stored. Nothing here waits on a model: an evaluator that needs one
(similarity) answers Deferred, the record is stored with a durable pending marker, and
similarity_worker.py computes the score later (`on_pending` tells it there is work). A batch closes at `batch_max` events or `batch_delay_s`
after its first event. A message that can never become a record is published to the
dead-letter exchange with its reason (confirmed) and then acked; consumption goes on. So is
an event whose record the database refuses (a constraint, a value it cannot hold): a batch it
refuses is stored event by event, and only the events still refused are dead-lettered.
On any broker failure the session is rebuilt (the topology declared again); what was unacked is
redelivered. So is it when the broker cancels the consumer while the connection stays open (its
queue deleted, a quorum queue's leader moved): otherwise it would never consume again. A commit
that fails (a dead-lettering no queue takes) ends the session at once, not at the next batch.
`sluice_evallog_consumer_connected` says, per dependency, whether the consumer is consuming from
the broker and whether the store takes its writes.
The CPU-heavy evaluators run in worker processes (`offload`, eval_pool.py) so the event loop
stays responsive while a batch is evaluated; the batch is acked only after that, as before.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Sequence
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aio_pika
import structlog
from aio_pika.abc import AbstractIncomingMessage
from prometheus_client import Counter, Gauge, Histogram
from sluice.evallog.v1 import events_pb2

from sluice_common.amqp import EventTopology, dead_letter
from sluice_common.request_context import REQUEST_ID_KEY
from sluice_common.supervision import Supervisor, stop_tasks
from sluice_evaluation_logging.evaluators import Offload, evaluate_batch
from sluice_evaluation_logging.event_tracing import end_process_spans, start_process_spans, trace_id_of
from sluice_evaluation_logging.evaluators.base import EvalContext, ScoreResult
from sluice_evaluation_logging.model import RecordRow
from sluice_evaluation_logging.record_metrics import observe_stored
from sluice_evaluation_logging.records import PoisonMessage, decode_event, event_bytes, otel_attributes, to_row
from sluice_evaluation_logging.store import Store, refused_for_content

log = structlog.stdlib.get_logger("sluice.evallog.consumer")
# The stdlib logger under `log` (structlog renders through it): asked whether DEBUG is on.
_stdlib_log = logging.getLogger("sluice.evallog.consumer")

EVENTS = Counter("sluice_evallog_events_total", "Events consumed, by outcome (stored, duplicate, dead_lettered).", ["outcome"])
# Exported at 0 from the start: increase() over a series that first appears at 1 is 0, and
# SluiceEventsDeadLettered would miss the first dead-lettering after a restart.
EVENT_OUTCOMES = ("stored", "duplicate", "dead_lettered")
for _outcome in EVENT_OUTCOMES:
    EVENTS.labels(_outcome)
BATCH_SIZE = Histogram("sluice_evallog_batch_size", "Events per stored batch.", buckets=(1, 4, 16, 64, 128, 256, 512, 1024))
BATCH_SECONDS = Histogram("sluice_evallog_batch_seconds", "Evaluate + store + ack of one batch.", buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.5, 1, 5))
# Health stays SERVING while either is 0: the query API needs neither RabbitMQ nor a consumer, and
# a readiness probe that followed them would take the queries down with it. This gauge (and its
# alert, SluiceEvaluationLoggingConsumerDisconnected) is how an operator hears of it.
CONNECTED = Gauge(
    "sluice_evallog_consumer_connected",
    "1 while the consumer consumes from RabbitMQ (dependency=broker) / while the store takes its writes (dependency=store).",
    ["dependency"],
)
for _dependency in ("broker", "store"):
    CONNECTED.labels(_dependency).set(0)

# Per-event work on the loop (decoding, the cheap evaluators, building rows) costs ~5-20 us an
# event: a batch of 256 in one go held the loop ~10 ms; this many at a time holds it ~1 ms.
YIELD_EVERY = 64

Stored = list[tuple[AbstractIncomingMessage, RecordRow]]


class _Refused(Exception):
    """The database refused the rows for what they hold: retrying the same rows cannot succeed."""


class ConsumerCancelled(ConnectionError):
    """The broker cancelled the consumer (basic.cancel): the queue was deleted, or its leader moved."""


@dataclass(frozen=True)
class ConsumerSettings:
    url: str
    topology: EventTopology
    prefetch: int = 512
    batch_max: int = 256
    batch_delay_s: float = 0.05


def _wake_on_failure(task: asyncio.Task[None] | None, wake: asyncio.Event) -> None:
    """Sets `wake` should `task` (a commit) fail: the loop, waiting for deliveries, then ends the
    session at once rather than with the next batch (its messages unacked meanwhile)."""

    def done(finished: asyncio.Task[None]) -> None:
        if not finished.cancelled() and finished.exception() is not None:
            wake.set()

    if task is not None:
        task.add_done_callback(done)


class CompletionConsumer:
    def __init__(
        self,
        settings: ConsumerSettings,
        store: Store,
        context: EvalContext,
        on_pending: Callable[[], None] | None = None,
        offload: Offload | None = None,
    ) -> None:
        """`offload` (EvalPool.evaluate): where the CPU-heavy evaluators run; None runs them on the loop."""
        self._settings = settings
        self._offload = offload
        self._store = store
        self._context = context
        self._on_pending = on_pending
        # When a batch last closed with more waiting (full, or the inbox not empty): see `busy`.
        self._backlog_at = -1e9
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        # The previous batch's store-then-ack, running while the next batch is decoded and evaluated.
        self._committing: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

    def busy(self, within_s: float = 0.25) -> bool:
        """The consumer had a backlog within the last `within_s`: background work (similarity)
        should not take the CPU from storing and acking now."""
        return time.monotonic() - self._backlog_at < within_s

    def start(self, supervisor: Supervisor | None = None) -> None:
        # The store was opened before: up until a write says otherwise.
        CONNECTED.labels("store").set(1)
        # Restarted when it dies: what it had not acked is redelivered by the broker.
        self._task = (supervisor or Supervisor()).start("completion-consumer", self._run)

    async def stop(self) -> None:
        """Stops taking messages; the batch in progress is finished (stored and acked) first."""
        self._stopping.set()
        if self._task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), 10)
            await stop_tasks(self._task)

    async def _run(self) -> None:
        backoff = 0.2
        while not self._stopping.is_set():
            try:
                await self._session()
                backoff = 0.2
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reconnect; unacked messages are redelivered
                log.warning("consumer_disconnected", error=f"{type(exc).__name__}: {exc}")
            self.connected.clear()
            CONNECTED.labels("broker").set(0)
            if not self._stopping.is_set():
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _session(self) -> None:
        s = self._settings
        connection = await aio_pika.connect(s.url, timeout=5)
        try:
            channel = await connection.channel(publisher_confirms=True)
            await channel.set_qos(prefetch_count=s.prefetch)
            await s.topology.declare(channel)
            queue = await channel.get_queue(s.topology.completions_queue, ensure=False)
            dead = await channel.get_exchange(s.topology.dead_exchange, ensure=False)
            # Deliveries wait here; `arrived` wakes the batcher for a first message, `full` when a
            # batch's worth is waiting: one wakeup (and one timer) per batch, not per message.
            inbox: collections.deque[AbstractIncomingMessage] = collections.deque()
            arrived, full = asyncio.Event(), asyncio.Event()
            # Set by the broker's basic.cancel of this channel's only consumer; `arrived` too, so that
            # the loop wakes and ends the session at once.
            cancelled = asyncio.Event()

            async def on_message(message: AbstractIncomingMessage) -> None:
                inbox.append(message)
                arrived.set()
                if len(inbox) >= s.batch_max:
                    full.set()

            def on_cancel(_frame: object) -> None:  # aiormq's Basic.Cancel frame
                cancelled.set()
                arrived.set()

            # The connection and the channel stay open after a basic.cancel: only this callback says it.
            (await channel.get_underlay_channel()).on_consumer_cancel_callbacks.add(on_cancel)
            tag = await queue.consume(on_message, no_ack=False)
            self.connected.set()
            CONNECTED.labels("broker").set(1)
            log.info("consuming", queue=s.topology.completions_queue, prefetch=s.prefetch, batch_max=s.batch_max)
            while not self._stopping.is_set():
                if connection.is_closed or channel.is_closed:
                    raise ConnectionError("the broker connection closed")
                if cancelled.is_set():
                    raise ConsumerCancelled("the broker cancelled the consumer (its queue deleted, or its leader moved)")
                if self._committing is not None and self._committing.done():
                    await self._settle_commit()  # raises what the commit raised: the session is rebuilt
                if not inbox:
                    arrived.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(arrived.wait(), 0.5)
                    continue
                # A batch closes at batch_max events or batch_delay_s after its first event.
                if len(inbox) < s.batch_max and s.batch_delay_s > 0:
                    full.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(full.wait(), s.batch_delay_s)
                batch = [inbox.popleft() for _ in range(min(s.batch_max, len(inbox)))]
                if inbox or len(batch) >= s.batch_max:
                    self._backlog_at = time.monotonic()
                await self._handle(batch, dead)
                _wake_on_failure(self._committing, arrived)
            await self._settle_commit()  # the last batch is stored and acked before we let go
            with contextlib.suppress(Exception):
                await queue.cancel(tag)
        finally:
            # A commit still running (the session failed) finishes or fails on its own; nothing it
            # did not ack is lost: the broker redelivers it and the store dedupes by event id.
            with contextlib.suppress(Exception):
                await self._settle_commit()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), 2)

    async def _settle_commit(self) -> None:
        """Waits for the batch being stored and acked; raises what it raised (the session then reconnects)."""
        committing, self._committing = self._committing, None
        if committing is not None:
            await committing

    async def _handle(self, batch: Sequence[AbstractIncomingMessage], dead: aio_pika.abc.AbstractExchange) -> None:
        """Decodes and evaluates one batch, then hands it to a commit task (store, then ack).

        The commit of batch N runs (the SQLite work on its own thread) while batch N+1 is decoded
        and evaluated here; batch N+1's commit starts only after batch N is stored and acked, so a
        multiple-ack never covers a message whose record is not durably stored.
        """
        started = time.perf_counter()
        spans = start_process_spans(batch, self._settings.topology.completions_queue)
        try:
            to_store, dead_lettered = await self._evaluate(batch, dead)
            await self._settle_commit()
        except BaseException as exc:
            end_process_spans(spans, stored=False, error=exc)
            raise
        commit = self._commit(batch, to_store, dead, dead_lettered, started, spans)
        self._committing = asyncio.create_task(commit, name="evallog-commit")

        def cancelled(task: asyncio.Task[None]) -> None:
            # Cancelled before it ever ran (the service stopping), the commit could not end them itself.
            if task.cancelled():
                end_process_spans(spans, stored=False, error=asyncio.CancelledError())

        self._committing.add_done_callback(cancelled)

    async def _evaluate(self, batch: Sequence[AbstractIncomingMessage], dead: aio_pika.abc.AbstractExchange) -> tuple[Stored, int]:
        """The batch decoded (what cannot be is dead-lettered: counted) and evaluated, as rows to store."""
        decoded: list[tuple[AbstractIncomingMessage, events_pb2.CompletionEvent]] = []
        dead_lettered = 0
        for index, message in enumerate(batch):
            if index and index % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # let deliveries, acks and queries in between: see YIELD_EVERY
            try:
                decoded.append((message, decode_event(message.body, message.content_type)))
            except PoisonMessage as exc:
                await self._dead_letter(dead, message, str(exc))
                dead_lettered += 1
        # Each event's bytes, once: handed to the evaluator pool and stored, both as received.
        serialized = [event_bytes(message.body, message.content_type, event) for message, event in decoded]
        all_scores = await evaluate_batch([event for _, event in decoded], self._context, self._offload, serialized)
        to_store: Stored = []
        for index, ((message, event), scores, body) in enumerate(zip(decoded, all_scores, serialized, strict=True)):
            if index and index % YIELD_EVERY == 0:
                await asyncio.sleep(0)
            to_store.append((message, to_row(event, scores, body, trace_id_of(message.headers))))
        # One line per batch at INFO (in _commit); the per-event line (GenAI attributes, scores)
        # only at DEBUG, where building it is worth its cost: at one line per event it was most of
        # the consumer's CPU.
        if _stdlib_log.isEnabledFor(logging.DEBUG):
            for (message, event), scores in zip(decoded, all_scores, strict=True):
                log.debug(
                    "event",
                    request_id=event.request_id,
                    redelivered=message.redelivered,
                    scores={s.name: round(s.value, 4) if isinstance(s, ScoreResult) else "pending" for s in scores},
                    **otel_attributes(event),
                )
        return to_store, dead_lettered

    async def _dead_letter(self, dead: aio_pika.abc.AbstractExchange, message: AbstractIncomingMessage, reason: str) -> None:
        """Confirmed by the broker on return: the message may then be acked."""
        await dead_letter(dead, self._settings.topology.completions_queue, message, reason)
        log.warning(
            "event_dead_lettered",
            reason=reason,
            message_id=message.message_id,
            request_id=(message.headers or {}).get(REQUEST_ID_KEY, ""),
        )

    async def _commit(
        self,
        batch: Sequence[AbstractIncomingMessage],
        to_store: Stored,
        dead: aio_pika.abc.AbstractExchange,
        dead_lettered: int,
        started: float,
        spans: list[Any] | None = None,
    ) -> None:
        try:
            rows, inserted = await self._store_batch(to_store, dead)
            dead_lettered += len(to_store) - len(rows)
            # One multiple-ack covers the whole batch (deliveries on a channel are acked in order).
            await batch[-1].ack(multiple=True)
        except BaseException as exc:  # unacked: the broker delivers the batch again
            end_process_spans(spans, stored=False, error=exc)
            raise
        end_process_spans(spans, stored=True)
        if self._on_pending is not None and inserted and any(row.pending for row in rows):
            self._on_pending()
        elapsed = time.perf_counter() - started
        for start in range(0, len(rows), YIELD_EVERY):  # the loop's other work between chunks
            if start:
                await asyncio.sleep(0)
            observe_stored(rows[start : start + YIELD_EVERY])
        EVENTS.labels("stored").inc(inserted)
        EVENTS.labels("duplicate").inc(len(rows) - inserted)
        EVENTS.labels("dead_lettered").inc(dead_lettered)
        BATCH_SIZE.observe(len(batch))
        BATCH_SECONDS.observe(elapsed)
        log.info(
            "batch_stored",
            messages=len(batch),
            stored=inserted,
            duplicates=len(rows) - inserted,
            dead_lettered=dead_lettered,
            redelivered=sum(1 for message in batch if message.redelivered),
            seconds=round(elapsed, 4),
        )

    async def _store_batch(self, to_store: Stored, dead: aio_pika.abc.AbstractExchange) -> tuple[list[RecordRow], int]:
        """Stores the batch in one transaction: the rows stored (or already there) and how many
        were new. A batch the database refuses is stored event by event, and what it still
        refuses is dead-lettered: retrying it whole would hold the queue for good behind one event."""
        rows = [row for _, row in to_store]
        try:
            return rows, await self._store_until_done(rows)
        except _Refused as exc:
            log.warning("batch_refused", error=str(exc), batch=len(rows))
        kept: list[RecordRow] = []
        inserted = 0
        for message, row in to_store:
            try:
                inserted += await self._store_until_done([row])
            except _Refused as exc:
                await self._dead_letter(dead, message, f"the store refused its record: {exc}")
                continue
            kept.append(row)
        return kept, inserted

    async def _store_until_done(self, rows: list[RecordRow]) -> int:
        """Retries while the database is down: the batch stays unacked with us meanwhile. Raises
        _Refused when the database refuses these rows themselves, which no retry changes."""
        if not rows:
            return 0
        backoff = 0.2
        while True:
            try:
                inserted = await self._store.insert_batch(rows)
            except Exception as exc:  # noqa: BLE001 - a database outage must not lose or ack events
                error = f"{type(exc).__name__}: {exc}"
                if refused_for_content(exc):
                    CONNECTED.labels("store").set(1)  # it answered: it refused these rows, not writes
                    raise _Refused(error) from exc
                CONNECTED.labels("store").set(0)
                if self._stopping.is_set():
                    raise
                log.error("store_failed", error=error, batch=len(rows))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            CONNECTED.labels("store").set(1)
            return inserted
