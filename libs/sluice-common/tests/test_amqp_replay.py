"""replay_dead_letters against the real RabbitMQ: bounded by what the dead-letter queue held when it
began, so messages that come straight back (still bad while their consumer runs) end the replay."""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import pytest

from sluice_common.amqp import ReplayIncomplete, Unroutable, dead_letter, replay_dead_letters

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"


async def test_a_replay_of_messages_that_come_straight_back_ends_after_one_pass() -> None:
    name = f"test.replay.{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        # The "original" exchange routes into the dead queue itself: every replayed message is dead
        # again at once, as one its consumer still refuses would be.
        exchange = await channel.declare_exchange(name, aio_pika.ExchangeType.FANOUT, auto_delete=True)
        dead = await channel.declare_queue(name, auto_delete=False)
        await dead.bind(exchange)
        try:
            for index in range(3):
                headers = {"x-sluice-dead-reason": "still bad", "x-delivery-count": 7}
                await channel.default_exchange.publish(aio_pika.Message(f"m{index}".encode(), headers=headers), name)
            assert await replay_dead_letters(AMQP_URL, name, name) == 3  # one pass, not for ever
            assert await replay_dead_letters(AMQP_URL, name, name, limit=2) == 2
            again = await dead.get(no_ack=True, timeout=5)
            assert again is not None and "x-delivery-count" not in (again.headers or {})  # a replay starts afresh
            assert again.headers["x-sluice-replayed"] >= 1
        finally:
            await dead.delete(if_unused=False, if_empty=False)


async def test_dead_lettering_and_replaying_keep_reply_to_and_correlation_id() -> None:
    """A producer may name its results queue in the AMQP reply_to property alone (the job worker
    reads it when the body names none): dead-lettered and replayed without it, a job ran and told
    its results to no one. The expiration is not carried: a TTL would drop the copy from the
    dead-letter queue, or count again from the replay."""
    name = f"test.replay.props.{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.declare_exchange(name, aio_pika.ExchangeType.DIRECT, auto_delete=True)
        target = await channel.declare_queue(f"{name}.target", auto_delete=False)
        dead = await channel.declare_queue(f"{name}.dead", auto_delete=False)
        await target.bind(exchange, "job")
        try:
            original = aio_pika.Message(
                b"{}", content_type="application/json", content_encoding="identity", priority=3, correlation_id="job-7",
                reply_to="my-results", expiration=600, message_id="job-7", type="my-app.job", app_id="producer",
            )  # fmt: skip
            await exchange.publish(original, "job")
            incoming = await target.get(no_ack=False, timeout=5)
            assert incoming is not None
            await dead_letter(channel.default_exchange, dead.name, incoming, "a newer gateway's type")
            await incoming.ack()
            assert await replay_dead_letters(AMQP_URL, dead.name, name) == 1
            replayed = await target.get(no_ack=True, timeout=5)
            assert replayed is not None
            kept = (replayed.reply_to, replayed.correlation_id, replayed.content_encoding, replayed.priority, replayed.app_id)
            assert kept == ("my-results", "job-7", "identity", 3, "producer")
            assert (replayed.message_id, replayed.type, replayed.content_type, replayed.body) == ("job-7", "my-app.job", "application/json", b"{}")
            assert replayed.expiration is None
        finally:
            await target.delete(if_unused=False, if_empty=False)
            await dead.delete(if_unused=False, if_empty=False)


# ---- a copy that routes nowhere is not a replay (nor a dead-lettering): the original stays


async def _count(channel: aio_pika.abc.AbstractChannel, queue: str) -> int:
    return (await channel.declare_queue(queue, passive=True)).declaration_result.message_count or 0


async def test_a_message_the_broker_dead_lettered_is_replayed_to_its_original_routing_key() -> None:
    """Rejected (or expired) on the completions queue, the broker dead-letters a message itself: no
    x-sluice-original-routing-key, and its routing key is the queue's name, which the events
    exchange routes nowhere. Its x-death names the key it was published with; replayed to the
    queue's name it was confirmed, acked, and lost while the replay said "replayed"."""
    from sluice_common.amqp import EventTopology

    topology = EventTopology(f"test-replay-broker-{uuid.uuid4().hex[:8]}")
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await topology.declare(channel)
        try:
            events = await channel.get_exchange(topology.events_exchange)
            await events.publish(aio_pika.Message(b"event-1", message_id="event-1"), topology.completion_routing_key)
            completions = await channel.get_queue(topology.completions_queue)
            delivered = await completions.get(no_ack=False, timeout=5)
            assert delivered is not None
            await delivered.reject(requeue=False)  # the broker dead-letters it (x-death, reason "rejected")
            for _ in range(50):
                if await _count(channel, topology.completions_dead_queue) == 1:
                    break
                await asyncio.sleep(0.05)
            assert await replay_dead_letters(AMQP_URL, topology.completions_dead_queue, topology.events_exchange) == 1
            back = await completions.get(no_ack=True, timeout=5)
            assert back is not None and back.body == b"event-1" and back.routing_key == topology.completion_routing_key
            assert "x-death" not in (back.headers or {})
            assert await _count(channel, topology.completions_dead_queue) == 0
        finally:
            await topology.delete(channel)


async def test_a_replay_that_routes_nowhere_leaves_the_message_and_says_so() -> None:
    name = f"test.replay.unroutable.{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.declare_exchange(name, aio_pika.ExchangeType.DIRECT, auto_delete=True)
        target = await channel.declare_queue(f"{name}.target", auto_delete=False)
        dead = await channel.declare_queue(f"{name}.dead", auto_delete=False)
        await target.bind(exchange, "known")
        try:
            for key in ("known", "unknown", "known"):
                headers: dict[str, aio_pika.abc.FieldValue] = {"x-sluice-original-routing-key": key}
                await channel.default_exchange.publish(aio_pika.Message(key.encode(), message_id=f"m-{key}", headers=headers), dead.name)
            with pytest.raises(ReplayIncomplete) as raised:
                await replay_dead_letters(AMQP_URL, dead.name, name)
            assert raised.value.replayed == 2 and len(raised.value.left) == 1
            assert "m-unknown" in raised.value.left[0] and "'unknown'" in raised.value.left[0]
            assert await _count(channel, target.name) == 2
            kept = await dead.get(no_ack=True, timeout=5)  # still there, as it was
            assert kept is not None and kept.body == b"unknown" and kept.headers["x-sluice-original-routing-key"] == "unknown"
        finally:
            await target.delete(if_unused=False, if_empty=False)
            await dead.delete(if_unused=False, if_empty=False)


async def test_dead_lettering_to_a_key_no_queue_is_bound_to_fails_before_the_ack() -> None:
    name = f"test.deadletter.unroutable.{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        source = await channel.declare_queue(name, auto_delete=False)
        dead_exchange = await channel.declare_exchange(f"{name}.dead", aio_pika.ExchangeType.DIRECT, auto_delete=True)
        try:
            await channel.default_exchange.publish(aio_pika.Message(b"m"), name)
            incoming = await source.get(no_ack=False, timeout=5)
            assert incoming is not None
            with pytest.raises(Unroutable):
                await dead_letter(dead_exchange, "no-binding", incoming, "bad")
            await incoming.nack(requeue=True)  # what a caller does when dead_letter raises
            again = await source.get(no_ack=True, timeout=5)
            assert again is not None and again.body == b"m"
        finally:
            await source.delete(if_unused=False, if_empty=False)
            await dead_exchange.delete()
