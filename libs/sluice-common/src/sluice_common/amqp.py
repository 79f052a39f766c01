"""RabbitMQ topology every Sluice service shares, and the consumers' dead-letter helpers.

Topology (all durable; names derive from one prefix so that test runs never collide):

    <prefix>.events               topic exchange the gateway publishes CompletionEvents to
    <prefix>.events.dead          direct exchange for messages no consumer could handle
    <prefix>.evallog.completions  evaluation-logging's queue, bound to <prefix>.events with "completion.#",
                                  dead-lettering to <prefix>.events.dead
    <prefix>.evallog.completions.dead  the dead-letter queue (reason in the x-sluice-dead-reason header)

Both the publisher and the consumer declare the whole topology, so that events published before
evaluation-logging first starts are queued rather than dropped as unroutable.

Publishing goes through `amqp_publisher.ConfirmingPublisher`; consumers dead-letter with a reason
(`dead_letter`) and operators replay a dead-letter queue (`replay_dead_letters`). Both publish
mandatory and count a message the broker returns (no queue bound for its routing key) as not
published: the original is then left unacked, never lost behind a confirm that routed nowhere.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import aio_pika
import aiormq
import structlog


log = structlog.stdlib.get_logger("sluice.amqp")

PROTOBUF = "application/x-protobuf"
DEAD_REASON_HEADER = "x-sluice-dead-reason"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"


@dataclass(frozen=True)
class EventTopology:
    prefix: str = "sluice"

    @property
    def events_exchange(self) -> str:
        return f"{self.prefix}.events"

    @property
    def dead_exchange(self) -> str:
        return f"{self.prefix}.events.dead"

    @property
    def completions_queue(self) -> str:
        return f"{self.prefix}.evallog.completions"

    @property
    def completions_dead_queue(self) -> str:
        return f"{self.prefix}.evallog.completions.dead"

    completion_routing_key: str = "completion.v1"
    completion_binding: str = "completion.#"

    async def declare(self, channel: aio_pika.abc.AbstractChannel) -> None:
        events = await channel.declare_exchange(self.events_exchange, aio_pika.ExchangeType.TOPIC, durable=True)
        dead = await channel.declare_exchange(self.dead_exchange, aio_pika.ExchangeType.DIRECT, durable=True)
        queue = await channel.declare_queue(
            self.completions_queue,
            durable=True,
            arguments={"x-dead-letter-exchange": self.dead_exchange, "x-dead-letter-routing-key": self.completions_queue},
        )
        await queue.bind(events, self.completion_binding)
        dead_queue = await channel.declare_queue(self.completions_dead_queue, durable=True)
        await dead_queue.bind(dead, self.completions_queue)

    async def delete(self, channel: aio_pika.abc.AbstractChannel) -> None:
        """Removes everything `declare` made (for test teardown)."""
        await _delete(channel, (self.completions_queue, self.completions_dead_queue), (self.events_exchange, self.dead_exchange))


@dataclass(frozen=True)
class JobTopology:
    """Bulk jobs (issue 6); all durable, quorum queues so that the broker counts deliveries:

        <prefix>.jobs            direct exchange: producers publish JobRequests with routing key "job";
                                 the job worker publishes one RowTask per row with routing key "row"
        <prefix>.jobs.requests   job messages (key "job"), consumed by the job workers
        <prefix>.jobs.rows       row messages (key "row"), consumed by the job workers
        <prefix>.jobs.dead       direct exchange and queue: rows and jobs past the delivery limit
                                 (reason in the x-sluice-dead-reason header)

    `delivery_limit` is the broker's safety net (x-delivery-limit) for a message that crashes its
    consumer every time; the worker itself dead-letters a row at its own, lower, limit.
    """

    prefix: str = "sluice"
    delivery_limit: int = 20
    job_routing_key: str = "job"
    row_routing_key: str = "row"

    @property
    def exchange(self) -> str:
        return f"{self.prefix}.jobs"

    @property
    def requests_queue(self) -> str:
        return f"{self.prefix}.jobs.requests"

    @property
    def rows_queue(self) -> str:
        return f"{self.prefix}.jobs.rows"

    @property
    def dead_exchange(self) -> str:
        return f"{self.prefix}.jobs.dead"

    @property
    def dead_queue(self) -> str:
        return f"{self.prefix}.jobs.dead"

    async def declare(self, channel: aio_pika.abc.AbstractChannel) -> None:
        jobs = await channel.declare_exchange(self.exchange, aio_pika.ExchangeType.DIRECT, durable=True)
        dead = await channel.declare_exchange(self.dead_exchange, aio_pika.ExchangeType.DIRECT, durable=True)
        for name, key in ((self.requests_queue, self.job_routing_key), (self.rows_queue, self.row_routing_key)):
            queue = await channel.declare_queue(
                name,
                durable=True,
                arguments={
                    "x-queue-type": "quorum",
                    "x-delivery-limit": self.delivery_limit,
                    "x-dead-letter-exchange": self.dead_exchange,
                },
            )
            await queue.bind(jobs, key)
        dead_queue = await channel.declare_queue(self.dead_queue, durable=True, arguments={"x-queue-type": "quorum"})
        for key in (self.job_routing_key, self.row_routing_key):
            await dead_queue.bind(dead, key)

    async def delete(self, channel: aio_pika.abc.AbstractChannel) -> None:
        """Removes everything `declare` made (for test teardown)."""
        await _delete(channel, (self.requests_queue, self.rows_queue, self.dead_queue), (self.exchange, self.dead_exchange))


async def _delete(channel: aio_pika.abc.AbstractChannel, queues: tuple[str, ...], exchanges: tuple[str, ...]) -> None:
    """Best effort: what is already gone (or was never declared) is skipped."""
    for queue in queues:
        with contextlib.suppress(Exception):
            await channel.queue_delete(queue)
    for exchange in exchanges:
        with contextlib.suppress(Exception):
            await channel.exchange_delete(exchange)


# ---- consumers' helpers: dead-lettering with a reason, and replaying a dead-letter queue


class Unroutable(Exception):
    """The broker returned a mandatory message: no queue is bound for its routing key on that exchange."""


class ReplayIncomplete(Exception):
    """A replay left messages in the dead-letter queue (their copies routed nowhere); `replayed` went back."""

    def __init__(self, replayed: int, left: list[str]) -> None:
        super().__init__(f"{len(left)} message(s) left in the dead-letter queue: " + "; ".join(left[:5]) + ("; ..." if len(left) > 5 else ""))
        self.replayed = replayed
        self.left = left


async def publish_routed(exchange: aio_pika.abc.AbstractExchange, message: aio_pika.Message, routing_key: str) -> None:
    """Publishes `message` on a channel with publisher confirms; returns once a queue has it.

    aio_pika publishes mandatory by default, and a channel opened with its default
    on_return_raises=False answers a returned (unroutable) message with the message itself, not an
    error: taken for a confirm, the caller would ack the original of a copy that no queue holds.
    Raises Unroutable for it instead.
    """
    confirmation = await exchange.publish(message, routing_key)
    if isinstance(confirmation, aiormq.abc.DeliveredMessage):
        raise Unroutable(f"exchange {exchange.name!r} routes routing key {routing_key!r} to no queue")


async def dead_letter(
    exchange: aio_pika.abc.AbstractExchange,
    routing_key: str,
    message: aio_pika.abc.AbstractIncomingMessage,
    reason: str,
    body: bytes | None = None,
) -> None:
    """Publishes `message` (body and properties kept, see _copy) to the dead-letter exchange with its reason.

    `body`, when given, replaces the message's body in the copy (a consumer takes a secret out of
    it, such as a producer's api_key); the rest is kept. The caller's channel must have publisher
    confirms on: this returns once a queue has the copy, so the caller can then ack the original
    without ever losing it. Raises Unroutable when no queue is bound for `routing_key` (the
    original must then not be acked).
    """
    headers = dict(message.headers or {})
    headers[DEAD_REASON_HEADER] = reason[:1000]
    headers["x-sluice-dead-at"] = time.time()
    headers["x-sluice-original-routing-key"] = message.routing_key or ""
    headers["x-sluice-original-exchange"] = message.exchange or ""
    await publish_routed(exchange, _copy(message, headers, body), routing_key)


def _copy(message: aio_pika.abc.AbstractIncomingMessage, headers: dict[str, aio_pika.abc.FieldValue], body: bytes | None = None) -> aio_pika.Message:
    """A persistent copy of `message` with `headers`, keeping the properties its consumer reads: a
    job's reply_to (where the producer contract lets a producer name its results queue) and
    correlation_id go with it, or a replayed job would run and tell its results to no one.

    Not kept: expiration (a per-message TTL would silently drop the copy from the dead-letter queue,
    and once replayed it would count again from the replay; the broker itself strips it when it
    dead-letters), and user_id (the broker refuses a message whose user_id is not the publishing
    connection's user, as the dead-lettering or replaying one may not be)."""
    return aio_pika.Message(
        message.body if body is None else body,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        priority=message.priority,
        correlation_id=message.correlation_id,
        reply_to=message.reply_to,
        message_id=message.message_id,
        type=message.type,
        app_id=message.app_id,
        headers=headers,
        timestamp=message.timestamp,
    )


# What a dead-lettering left on a message, by Sluice or by the broker: a replayed message starts
# afresh (a stale x-delivery-count could count its earlier deliveries against the queue's limit).
_DEATH_HEADERS = (
    DEAD_REASON_HEADER, "x-sluice-dead-at", "x-sluice-original-routing-key", "x-sluice-original-exchange",
    "x-death", "x-delivery-count", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
    "x-last-death-exchange", "x-last-death-queue", "x-last-death-reason",
)  # fmt: skip


def original_routing_key(message: aio_pika.abc.AbstractIncomingMessage) -> str:
    """The routing key `message` had before it was dead-lettered: `dead_letter` records it in a
    header; the broker (a reject, a TTL, a length limit) records it in x-death, whose first entry is
    the latest death. Its own routing key is the dead-letter one (the queue's name), which the
    original exchange routes nowhere; it is the last resort."""
    headers = message.headers or {}
    recorded = headers.get("x-sluice-original-routing-key")
    if recorded:
        return str(recorded)
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], dict):
        keys = deaths[0].get("routing-keys")
        if isinstance(keys, list) and keys:
            return str(keys[0])
    return message.routing_key or ""


async def replay_dead_letters(
    url: str,
    dead_queue: str,
    exchange: str,
    routing_key: str | None = None,
    limit: int | None = None,
) -> int:
    """Moves messages from `dead_queue` back to `exchange` (each routed to a queue and confirmed before its ack).

    The routing key is the message's original one (`original_routing_key`) unless `routing_key` is
    given. Stops when the queue is empty, after `limit` messages, or after as many as the queue held
    when it began: a message still bad while its consumer runs comes straight back to this queue,
    and replaying it again would never end. Returns how many were replayed; raises ReplayIncomplete
    (after the pass) when some routed to no queue: those stay in `dead_queue`, unacked until the end.
    """
    replayed = 0
    left: list[str] = []
    held: list[aio_pika.abc.AbstractIncomingMessage] = []
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        target = await channel.get_exchange(exchange, ensure=True)
        queue = await channel.declare_queue(dead_queue, passive=True)
        waiting = queue.declaration_result.message_count or 0
        limit = waiting if limit is None else min(limit, waiting)
        while replayed + len(held) < limit:
            message = await queue.get(no_ack=False, fail=False, timeout=10)
            if message is None:
                break
            key = routing_key or original_routing_key(message)
            try:
                await publish_routed(target, _copy(message, _replay_headers(message)), key)
            except Unroutable as exc:
                # Held (not requeued at once, or the next get would return it again) and given back below.
                held.append(message)
                left.append(f"{message.message_id or '(no message id)'}: {exc}")
                continue
            await message.ack()
            replayed += 1
        for message in held:
            await message.nack(requeue=True)
    if left:
        raise ReplayIncomplete(replayed, left)
    return replayed


def _replay_headers(message: aio_pika.abc.AbstractIncomingMessage) -> dict[str, aio_pika.abc.FieldValue]:
    headers = dict(message.headers or {})
    for name in _DEATH_HEADERS:
        headers.pop(name, None)
    headers["x-sluice-replayed"] = int(str(headers.get("x-sluice-replayed") or 0)) + 1
    return headers
