"""replay_dead_letters against the real RabbitMQ: bounded by what the dead-letter queue held when it
began, so messages that come straight back (still bad while their consumer runs) end the replay."""

from __future__ import annotations

import uuid

import aio_pika

from sluice_common.amqp import replay_dead_letters

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
    from sluice_common.amqp import dead_letter

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
