"""The one way Sluice publishes to RabbitMQ (`ConfirmingPublisher`), losing nothing: `submit()`
never blocks nor awaits the broker; a background task publishes with pipelined publisher confirms (up to `max_in_flight`
unconfirmed at once), keeps a bounded in-memory outbox, republishes anything not confirmed after
a reconnect (a broker restart loses nothing; delivery is at least once, consumers dedupe by
message id), spills to a local file when the outbox is full, reads the file back when there is
room, and counts what it had to drop. A failure of one message, not of the connection (the broker
nacks it, or it is over `max_message_bytes`), fails that message alone: its `confirmed` future gets
MessageRejected, it is dropped (logged, counted as rejected) and the others go on; retried, it would
stand at the head of the outbox forever, every later message behind it. The spill file is written
and read by the publisher's own tasks through one disk thread, never on the caller's path: a slow
disk delays the spill, not the event loop that serves streams.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import aiormq
import structlog
from prometheus_client import Counter, Gauge

from sluice_common.amqp import PROTOBUF
from sluice_common.request_context import REQUEST_ID_KEY
from sluice_common.supervision import Supervisor, stop_tasks

log = structlog.stdlib.get_logger("sluice.amqp")

# RabbitMQ 4's default max_message_size (its body): a larger message makes the broker close the
# channel, which a publisher cannot tell from a lost connection, so larger ones are refused here.
BROKER_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class MessageRejected(Exception):
    """Set on a message's `confirmed` future when that message, and not the connection, failed: the
    broker refused it (basic.nack) or it is over the publisher's size bound. It is not retried."""


@dataclass
class OutgoingMessage:
    """One message to publish; `message_id` is what consumers deduplicate on."""

    body: bytes
    routing_key: str
    message_id: str
    request_id: str = ""
    type: str = ""
    content_type: str = PROTOBUF
    headers: dict[str, str] = field(default_factory=dict)
    # Set once the broker confirms this message (a caller that must know it is durable awaits it);
    # not kept when the message is spilled to the local file.
    confirmed: asyncio.Future[None] | None = field(default=None, compare=False, repr=False)

    def to_aio_pika(self) -> aio_pika.Message:
        headers: dict[str, aio_pika.abc.FieldValue] = dict(self.headers)
        if self.request_id:
            headers[REQUEST_ID_KEY] = self.request_id
        return aio_pika.Message(
            self.body,
            content_type=self.content_type,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=self.message_id,
            type=self.type or None,
            headers=headers,
            timestamp=time.time(),
        )

    def to_json_line(self) -> str:
        record = {
            "b": base64.b64encode(self.body).decode(),
            "k": self.routing_key,
            "id": self.message_id,
            "rid": self.request_id,
            "t": self.type,
            "ct": self.content_type,
            "h": self.headers,
        }
        return json.dumps(record, separators=(",", ":")) + "\n"

    @classmethod
    def from_json_line(cls, line: str) -> OutgoingMessage:
        record = json.loads(line)
        return cls(
            body=base64.b64decode(record["b"]),
            routing_key=record["k"],
            message_id=record["id"],
            request_id=record.get("rid", ""),
            type=record.get("t", ""),
            content_type=record.get("ct", PROTOBUF),
            headers=record.get("h", {}),
        )


class PublisherMetrics:
    """Counters of one publisher, named `<prefix>_published_total` and so on."""

    _registered: dict[str, PublisherMetrics] = {}

    def __init__(self, prefix: str, what: str) -> None:
        self.published = Counter(f"{prefix}_published_total", f"{what} confirmed by the broker.")
        self.retried = Counter(f"{prefix}_retried_total", f"{what} published again after a failure or reconnect.")
        self.spilled = Counter(f"{prefix}_spilled_total", f"{what} written to the spill file because the outbox was full.")
        self.dropped = Counter(f"{prefix}_dropped_total", f"{what} lost: outbox full and no spill file room (target: 0).")
        self.rejected = Counter(f"{prefix}_rejected_total", f"{what} not published: refused by the broker (nack) or over the size bound (target: 0).")
        self.outbox = Gauge(f"{prefix}_outbox", f"{what} waiting in memory, unconfirmed ones included.")
        self.connected = Gauge(f"{prefix}_connected", "1 while the publisher holds a broker connection.")

    @classmethod
    def get(cls, prefix: str, what: str = "Messages") -> PublisherMetrics:
        if prefix not in cls._registered:
            cls._registered[prefix] = cls(prefix, what)
        return cls._registered[prefix]


Declare = Callable[[aio_pika.abc.AbstractChannel], Awaitable[None]]


class ConfirmingPublisher:
    def __init__(
        self,
        url: str,
        exchange: str,
        declare: Declare,
        metrics: PublisherMetrics,
        *,
        outbox_max: int = 10_000,
        max_in_flight: int = 256,
        spill_path: Path | None = None,
        spill_max_bytes: int = 256 * 1024 * 1024,
        confirm_timeout_s: float = 15.0,
        reconnect_max_s: float = 5.0,
        max_message_bytes: int = BROKER_MAX_MESSAGE_BYTES,
    ) -> None:
        self._url = url
        self._exchange_name = exchange
        self._declare = declare
        self._metrics = metrics
        self._outbox_max = outbox_max
        self._max_in_flight = max_in_flight
        self._spill_path = spill_path
        self._spill_max_bytes = spill_max_bytes
        self._confirm_timeout_s = confirm_timeout_s
        self._reconnect_max_s = reconnect_max_s
        self._max_message_bytes = max_message_bytes
        self._outbox: collections.deque[OutgoingMessage] = collections.deque()
        self._in_flight: dict[int, OutgoingMessage] = {}
        # Beyond the outbox, waiting for the spill task to write them to the spill file.
        self._to_spill: collections.deque[OutgoingMessage] = collections.deque()
        self._spilling = 0  # taken from _to_spill, being written
        # The batch being written, until its write ran: a stop that cancels the spill task before the
        # disk thread got to it (queued behind another disk operation) spills it with the rest.
        self._spill_batch: list[OutgoingMessage] | None = None
        # One thread does every spill-file operation, in order: a write and a read never overlap.
        self._disk = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"spill:{exchange}")
        # Whether the spill file may hold messages (unknown at start: a previous run may have left some).
        self._spilled_on_disk = spill_path is not None
        self._wakeup = asyncio.Event()
        self._spill_wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._spill_task: asyncio.Task[None] | None = None
        self._closing = False

    # ---- the caller's side: never blocks, never touches the disk

    def submit(self, message: OutgoingMessage) -> None:
        if len(self._outbox) < self._outbox_max:
            self._outbox.append(message)
        elif self._spill_path is None:
            self._spill([message])  # no file: counted as dropped, no disk touched
        else:
            self._to_spill.append(message)
            self._spill_wakeup.set()
        self._changed()

    @property
    def pending(self) -> int:
        """Messages not yet confirmed and still in memory (those waiting to be spilled too)."""
        return len(self._outbox) + len(self._in_flight) + len(self._to_spill) + self._spilling

    def start(self, supervisor: Supervisor | None = None) -> None:
        # Restarted when it dies: its outbox (and spill file) still hold what it owes.
        supervisor = supervisor or Supervisor()
        if self._task is None:
            self._task = supervisor.start(f"publisher:{self._exchange_name}", self._run)
        if self._spill_task is None and self._spill_path is not None:
            self._spill_task = supervisor.start(f"publisher-spill:{self._exchange_name}", self._spill_loop)

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once everything in memory is confirmed (the spill file may still hold messages)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Publishes what it can within `timeout_s`, spills the rest so that the next start sends it."""
        if self._task is None:
            return
        await self.wait_idle(timeout_s)
        # The loops see _closing and end on their own; the cancel is for a session stuck in a call.
        self._closing = True
        self._wakeup.set()
        await stop_tasks(self._task, self._spill_task)
        self._task = self._spill_task = None
        # What the stopped tasks left in the disk thread ends first: a write lands, a read's messages
        # return to the outbox (its callback), and then what is owed is spilled after them, in order.
        await self._on_disk(lambda: None)
        unwritten = self._spill_batch or []  # its write never ran (cancelled before the disk thread took it)
        leftovers = list(self._in_flight.values()) + list(self._outbox) + unwritten + list(self._to_spill)
        self._in_flight.clear()
        self._outbox.clear()
        self._spill_batch = None
        self._to_spill.clear()
        if leftovers:
            log.warning("publisher_unsent_at_stop", count=len(leftovers), spill=str(self._spill_path))
            await self._on_disk(self._spill, leftovers)
            self._spilled_on_disk = True
        self._spilling = 0
        self._changed()

    # ---- the background side

    def _changed(self) -> None:
        self._metrics.outbox.set(self.pending)
        if self.pending:
            self._idle.clear()
        else:
            self._idle.set()
        self._wakeup.set()

    async def _on_disk(self, work: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._disk, work, *args)

    async def _spill_loop(self) -> None:
        """Writes what `submit` could not fit in the outbox to the spill file, a batch at a time."""
        while True:
            await self._spill_wakeup.wait()
            self._spill_wakeup.clear()
            while self._to_spill:
                batch = list(self._to_spill)
                self._to_spill.clear()
                self._spilling = len(batch)  # still pending until on disk: wait_idle means written
                self._spill_batch = batch
                writing = asyncio.get_running_loop().run_in_executor(self._disk, self._spill, batch)
                writing.add_done_callback(self._spill_written)
                # Shielded: a stop cancels this task, and a write still queued behind another disk
                # operation (a read of the file) was cancelled with it, its batch in neither the
                # outbox nor the file, lost. Shielded, it runs, and stop() waits for the disk thread.
                await asyncio.shield(writing)

    def _spill_written(self, writing: asyncio.Future[None]) -> None:
        """The spill task's write ran (its done callback, so that a stop that cancelled the task
        meanwhile still sees it): the batch is on disk, or counted dropped by _spill."""
        if writing.cancelled():
            return  # never ran: stop() spills _spill_batch with the rest
        self._spill_batch = None
        self._spilling = 0
        self._spilled_on_disk = True
        self._changed()

    def _spill(self, messages: list[OutgoingMessage]) -> None:
        """Appends the messages to the spill file (fsynced; the disk thread's work), or counts them
        dropped when there is no file or it cannot take them."""
        if self._spill_path is None:
            self._metrics.dropped.inc(len(messages))
            log.error("publisher_dropped", count=len(messages), reason="outbox full and no spill file")
            return
        try:
            size = self._spill_path.stat().st_size if self._spill_path.exists() else 0
            data = "".join(message.to_json_line() for message in messages)
            if size + len(data) > self._spill_max_bytes:
                raise OSError(f"spill file would exceed {self._spill_max_bytes} bytes")
            self._spill_path.parent.mkdir(parents=True, exist_ok=True)
            _append_lines(self._spill_path, data)
            self._metrics.spilled.inc(len(messages))
        except OSError as exc:
            self._metrics.dropped.inc(len(messages))
            log.error("publisher_dropped", count=len(messages), reason=str(exc))

    async def _unspill(self) -> None:
        """Moves spilled messages back into the outbox while it has room; the rest stay on disk."""
        if not self._spilled_on_disk or len(self._outbox) >= self._outbox_max // 2:
            return
        reading = asyncio.get_running_loop().run_in_executor(self._disk, self._read_spill, self._outbox_max - len(self._outbox))
        # The messages read are off the disk: they join the outbox from the read's own callback, so
        # that a session cancelled meanwhile (a stop, a broken connection) loses none of them.
        reading.add_done_callback(self._take_unspilled)
        await asyncio.shield(reading)

    def _take_unspilled(self, reading: asyncio.Future[tuple[list[OutgoingMessage], int]]) -> None:
        if reading.cancelled() or reading.exception() is not None:
            log.error("publisher_unspill_failed", error=repr(None if reading.cancelled() else reading.exception()))
            return
        loaded, left_on_disk = reading.result()
        self._outbox.extend(loaded)
        # The disk thread runs one operation at a time, in order, and their callbacks run in that
        # order: a spill written after this read sets the flag again when it completes.
        self._spilled_on_disk = left_on_disk > 0
        if loaded:
            log.info("publisher_unspilled", count=len(loaded), left_on_disk=left_on_disk)
        self._changed()

    def _read_spill(self, room: int) -> tuple[list[OutgoingMessage], int]:
        """The disk thread's: up to `room` messages from the spill file, the rest written back; (the
        messages, how many are left on disk)."""
        path = self._spill_path
        assert path is not None
        loading = path.with_name(path.name + ".loading")
        if not loading.exists():
            if not path.exists():
                return [], 0
            os.replace(path, loading)
        elif path.exists():
            # A crash mid-read left .loading behind, and what was spilled since is in the spill file:
            # read after the older messages, rather than left there until another spill or restart
            # (this read would say nothing is left on disk). A crash before the unlink reads them twice.
            _append_lines(loading, path.read_text(encoding="utf-8"))
            path.unlink()
        keep: list[str] = []
        loaded: list[OutgoingMessage] = []
        with loading.open(encoding="utf-8") as handle:
            for line in handle:
                if not line.strip():
                    continue
                if len(loaded) < room:
                    try:
                        loaded.append(OutgoingMessage.from_json_line(line))
                    except (ValueError, KeyError):
                        self._metrics.dropped.inc()
                        log.error("publisher_dropped", count=1, reason="unreadable spill line")
                else:
                    keep.append(line)
        if keep:
            _append_lines(path, "".join(line if line.endswith("\n") else line + "\n" for line in keep))
        loading.unlink()
        return loaded, len(keep)

    async def _run(self) -> None:
        backoff = 0.1
        while not self._closing:
            try:
                await self._session()
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any broker failure: reconnect and republish
                log.warning("publisher_disconnected", error=f"{type(exc).__name__}: {exc}", pending=self.pending)
            finally:
                self._metrics.connected.set(0)
                self._requeue_in_flight()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._reconnect_max_s)

    def _requeue_in_flight(self) -> None:
        if self._in_flight:
            self._metrics.retried.inc(len(self._in_flight))
            self._outbox.extendleft(reversed(list(self._in_flight.values())))
            self._in_flight.clear()
            self._changed()

    async def _session(self) -> None:
        connection = await aio_pika.connect(self._url, timeout=5)
        try:
            channel = await connection.channel(publisher_confirms=True)
            await self._declare(channel)
            exchange = await channel.get_exchange(self._exchange_name, ensure=False)
            self._metrics.connected.set(1)
            log.info("publisher_connected", exchange=self._exchange_name, pending=self.pending)
            failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
            tasks: set[asyncio.Task[None]] = set()
            sequence = 0
            try:
                while not self._closing:
                    if failed.done():
                        raise failed.result()
                    if connection.is_closed or channel.is_closed:
                        raise ConnectionError("the broker connection closed")
                    if not self._outbox:
                        await self._unspill()
                    if not self._outbox or len(self._in_flight) >= self._max_in_flight:
                        self._wakeup.clear()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._wakeup.wait(), 0.5)
                        continue
                    while self._outbox and len(self._in_flight) < self._max_in_flight:
                        message = self._outbox.popleft()
                        sequence += 1
                        self._in_flight[sequence] = message
                        task = asyncio.create_task(self._publish_one(exchange, sequence, message, failed))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
            finally:
                for task in list(tasks):
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), 2)

    async def _publish_one(
        self,
        exchange: aio_pika.abc.AbstractExchange,
        sequence: int,
        message: OutgoingMessage,
        failed: asyncio.Future[BaseException],
    ) -> None:
        try:
            if len(message.body) > self._max_message_bytes:
                raise MessageRejected(f"{len(message.body)} bytes, over the bound of {self._max_message_bytes} bytes on one message")
            confirmation = await exchange.publish(message.to_aio_pika(), message.routing_key, timeout=self._confirm_timeout_s)
            if not isinstance(confirmation, aiormq.spec.Basic.Ack):
                raise ConnectionError(f"the broker did not confirm the message: {confirmation!r}")
        except asyncio.CancelledError:
            raise  # the session is ending; _requeue_in_flight puts the message back
        except MessageRejected as exc:
            self._reject(sequence, message, exc)
            return
        except aiormq.exceptions.DeliveryError as exc:
            # A basic.nack (or reject) of this message; the channel stays open. (A PublishError, the
            # subclass for a returned message, is not raised: the channel has on_return_raises off.)
            self._reject(sequence, message, MessageRejected(f"the broker refused it: {exc.frame!r}"))
            return
        except Exception as exc:  # noqa: BLE001 - the session reconnects and everything unconfirmed is resent
            if not failed.done():
                failed.set_result(exc)
            self._wakeup.set()
            return
        if self._in_flight.pop(sequence, None) is not None:
            self._metrics.published.inc()
            self._changed()
        if message.confirmed is not None and not message.confirmed.done():
            message.confirmed.set_result(None)

    def _reject(self, sequence: int, message: OutgoingMessage, error: MessageRejected) -> None:
        """Drops one message that failed on its own; its caller, if it waits, is told."""
        if self._in_flight.pop(sequence, None) is None:
            return  # the session ended meanwhile and put it back: the next one decides again
        self._metrics.rejected.inc()
        log.error("publisher_rejected", message_id=message.message_id, routing_key=message.routing_key, bytes=len(message.body), reason=str(error))
        if message.confirmed is not None and not message.confirmed.done():
            message.confirmed.set_exception(error)
        self._changed()


def _append_lines(path: Path, data: str) -> None:
    """Appends whole lines to a spill file (fsynced), on a line of their own: a file whose last line
    was torn by a crash mid-write (no newline) would otherwise swallow the first line appended, and
    with it a message that was whole."""
    with path.open("a+b") as handle:
        if handle.tell() > 0:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                data = "\n" + data
        handle.write(data.encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())
