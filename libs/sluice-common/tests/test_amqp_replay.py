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
