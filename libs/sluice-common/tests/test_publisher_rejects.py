"""A message that fails on its own (the broker nacks it, or it is over the size bound) fails alone:
its caller is told, it is dropped and counted, and the messages behind it are published. Before,
it was taken for a lost connection and put back at the head of the outbox, forever, with every
later message behind it. Against a real RabbitMQ (SLUICE_TEST_AMQP_URL), on names of the test's own."""

from __future__ import annotations

import asyncio
import os
import uuid

import aio_pika
import pytest

from sluice_common.amqp_publisher import ConfirmingPublisher, Declare, MessageRejected, OutgoingMessage, PublisherMetrics

BROKER = os.environ.get("SLUICE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
# Time enough for a connection and a confirm on a busy machine; the old code never got there.
SETTLES_S = 20.0


def _declare(exchange: str) -> Declare:
    async def declare(channel: aio_pika.abc.AbstractChannel) -> None:
        # Routing key "full": a queue that refuses every message (max length 0, reject-publish), so
        # the broker nacks what is published there, with the channel left open. "ok": a queue that
        # takes them. Exclusive: they go with the publisher's connection.
        target = await channel.declare_exchange(exchange, aio_pika.ExchangeType.DIRECT, auto_delete=True)
        full = await channel.declare_queue(exclusive=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
        await full.bind(target, "full")
        ok = await channel.declare_queue(exclusive=True)
        await ok.bind(target, "ok")

    return declare


def _message(key: str, body: bytes, loop: asyncio.AbstractEventLoop) -> OutgoingMessage:
    return OutgoingMessage(body, key, f"{key}-{uuid.uuid4().hex[:8]}", confirmed=loop.create_future())


def _publisher(max_message_bytes: int = 1 << 20) -> tuple[ConfirmingPublisher, PublisherMetrics]:
    exchange = f"sluice-test-reject-{uuid.uuid4().hex[:8]}"
    metrics = PublisherMetrics.get(f"test_reject_{uuid.uuid4().hex[:8]}")
    return ConfirmingPublisher(BROKER, exchange, _declare(exchange), metrics, max_message_bytes=max_message_bytes), metrics


async def test_a_message_the_broker_nacks_fails_alone_and_the_next_ones_are_published() -> None:
    publisher, metrics = _publisher()
    loop = asyncio.get_running_loop()
    refused = _message("full", b"no room", loop)
    after = [_message("ok", f"next {i}".encode(), loop) for i in range(3)]
    publisher.submit(refused)
    for message in after:
        publisher.submit(message)
    publisher.start()
    try:
        with pytest.raises(MessageRejected, match="the broker refused it"):
            await asyncio.wait_for(refused.confirmed, SETTLES_S)  # type: ignore[arg-type]
        await asyncio.wait_for(asyncio.gather(*(m.confirmed for m in after)), SETTLES_S)  # type: ignore[misc]
        assert await publisher.wait_idle(SETTLES_S)
        assert metrics.rejected._value.get() == 1 and metrics.published._value.get() == 3
        assert metrics.retried._value.get() == 0  # not taken for a lost connection
    finally:
        await publisher.stop(0)


async def test_a_message_over_the_bound_is_not_sent_and_fails_alone() -> None:
    """RabbitMQ closes the channel on a message over its max_message_size (16 MiB by default since
    4.0), which reads as a lost connection: the publisher refuses such a message itself."""
    publisher, metrics = _publisher(max_message_bytes=1024)
    loop = asyncio.get_running_loop()
    large = _message("ok", b"x" * 1025, loop)
    small = _message("ok", b"x" * 1024, loop)
    publisher.submit(large)
    publisher.submit(small)
    publisher.start()
    try:
        with pytest.raises(MessageRejected, match="1025 bytes, over the bound of 1024 bytes"):
            await asyncio.wait_for(large.confirmed, SETTLES_S)  # type: ignore[arg-type]
        await asyncio.wait_for(small.confirmed, SETTLES_S)  # type: ignore[arg-type]
        assert await publisher.wait_idle(SETTLES_S)
        assert (metrics.rejected._value.get(), metrics.published._value.get(), publisher.pending) == (1, 1, 0)
    finally:
        await publisher.stop(0)
