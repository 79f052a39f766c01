"""Publisher -> real RabbitMQ -> consumer -> SQLite, with a garbage message in the middle."""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import pytest

from conftest import AMQP_URL, make_event
from sluice_common.amqp import DEAD_REASON_HEADER, EventTopology, replay_dead_letters
from sluice_common.amqp_publisher import ConfirmingPublisher, OutgoingMessage, PublisherMetrics
from sluice_evaluation_logging.consumer import CompletionConsumer, ConsumerSettings
from sluice_evaluation_logging.evaluators.base import EvalContext, EvalSettings
from sluice_evaluation_logging.store import SqliteStore


@pytest.fixture
async def topology():  # type: ignore[no-untyped-def]
    topo = EventTopology(f"sluice-unit-{uuid.uuid4().hex[:8]}")
    yield topo
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        await topo.delete(await connection.channel())


async def wait_for(predicate, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def message(event) -> OutgoingMessage:  # type: ignore[no-untyped-def]
    return OutgoingMessage(event.SerializeToString(), "completion.v1", event.event_id, event.request_id)


async def test_publish_consume_store_dead_letter_and_replay(topology, tmp_path) -> None:  # type: ignore[no-untyped-def]
    metrics = PublisherMetrics.get("test_unit_publisher")
    # A tiny outbox: most of the 300 events take the spill-file path and come back from it.
    publisher = ConfirmingPublisher(AMQP_URL, topology.events_exchange, topology.declare, metrics, outbox_max=20, spill_path=tmp_path / "spill")
    events = [make_event() for _ in range(300)]
    for event in events:
        publisher.submit(message(event))
    publisher.submit(message(events[0]))  # a duplicate delivery of one event
    publisher.submit(OutgoingMessage(b"\xff\x00 not protobuf", "completion.v1", "garbage-1"))
    publisher.start()

    store = SqliteStore(tmp_path / "evallog.sqlite3")
    await store.open()
    consumer = CompletionConsumer(
        ConsumerSettings(AMQP_URL, topology, prefetch=64, batch_max=32, batch_delay_s=0.02),
        store,
        EvalContext(EvalSettings(similarity_sample_rate=0.0)),
    )
    consumer.start()
    try:

        async def all_stored() -> bool:
            return await store.count() == 300

        await wait_for(all_stored)
        assert await publisher.wait_idle(10)
        assert metrics.spilled._value.get() > 0 and metrics.dropped._value.get() == 0
        assert not (tmp_path / "spill").exists()

        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            channel = await connection.channel()
            dead = await channel.get_queue(topology.completions_dead_queue)

            async def one_dead() -> bool:
                return (await channel.declare_queue(topology.completions_dead_queue, passive=True)).declaration_result.message_count == 1

            await wait_for(one_dead)
            got = await dead.get(no_ack=False)
            assert got.message_id == "garbage-1"
            assert "not a sluice.evallog.v1.CompletionEvent" in got.headers[DEAD_REASON_HEADER]
            await got.nack(requeue=True)

        # Consumption went on after the garbage; replaying it dead-letters it again, nothing else.
        late = make_event()
        publisher.submit(message(late))

        async def late_stored() -> bool:
            return await store.get(late.event_id) is not None

        await wait_for(late_stored)
        assert await replay_dead_letters(AMQP_URL, topology.completions_dead_queue, topology.events_exchange) == 1
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            channel = await connection.channel()

            async def dead_again() -> bool:
                q = await channel.declare_queue(topology.completions_dead_queue, passive=True)
                return q.declaration_result.message_count == 1

            await wait_for(dead_again)
        assert await store.count() == 301
    finally:
        await consumer.stop()
        await publisher.stop(2)
        await store.close()
