"""Publisher -> real RabbitMQ -> consumer -> SQLite, with a garbage message in the middle."""

from __future__ import annotations

import asyncio
import logging
import uuid

import aio_pika
import pytest

from conftest import AMQP_URL, make_event
from sluice_common.amqp import DEAD_REASON_HEADER, EventTopology, replay_dead_letters
from sluice_common.amqp_publisher import ConfirmingPublisher, OutgoingMessage, PublisherMetrics
from sluice_evaluation_logging.consumer import CONNECTED, CompletionConsumer, ConsumerSettings
from sluice_evaluation_logging.evaluators.base import EvalContext, EvalSettings
from sluice_evaluation_logging.records import PoisonMessage, decode_event, otel_attributes
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


# ---- poison that decodes: a message the store (or a log line) cannot take must not stop the queue


async def publish(topology: EventTopology, *messages: aio_pika.Message) -> None:
    """Publishes straight to the events exchange, confirmed, in order."""
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await topology.declare(channel)
        exchange = await channel.get_exchange(topology.events_exchange)
        for outgoing in messages:
            await exchange.publish(outgoing, topology.completion_routing_key)


def protobuf_message(event) -> aio_pika.Message:  # type: ignore[no-untyped-def]
    return aio_pika.Message(event.SerializeToString(), content_type="application/x-protobuf", message_id=event.event_id)


def json_message(event_id: str, fields: str) -> aio_pika.Message:
    body = f'{{"eventId": "{event_id}", "tenant": "demo", "model": "m", {fields}}}'
    return aio_pika.Message(body.encode(), content_type="application/json", message_id=event_id)


async def dead_letters(topology: EventTopology) -> dict[str, str]:
    """message id -> dead-letter reason of what the completions dead-letter queue holds now (left there)."""
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(topology.completions_dead_queue)
        found: dict[str, str] = {}
        while (got := await queue.get(no_ack=False, fail=False)) is not None:
            found[got.message_id or ""] = str((got.headers or {}).get(DEAD_REASON_HEADER, ""))
        return found  # closing the channel requeues them all


async def queue_depth(topology: EventTopology) -> int:
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(topology.completions_queue, passive=True)
        return declared.declaration_result.message_count


def start_consumer(topology: EventTopology, store, batch_delay_s: float = 0.02) -> CompletionConsumer:  # type: ignore[no-untyped-def]
    consumer = CompletionConsumer(
        ConsumerSettings(AMQP_URL, topology, prefetch=64, batch_max=32, batch_delay_s=batch_delay_s),
        store,
        EvalContext(EvalSettings(similarity_sample_rate=0.0)),
    )
    consumer.start()
    return consumer


async def test_event_with_a_nan_timing_is_dead_lettered_and_the_next_one_stored(topology, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Protobuf's JSON accepts "NaN" for a double; SQLite stores NaN as NULL, which latency_ms refuses.
    store = SqliteStore(tmp_path / "evallog.sqlite3")
    await store.open()
    consumer = start_consumer(topology, store)
    try:
        await consumer.connected.wait()
        good = make_event()
        await publish(topology, json_message("nan-1", '"timings": {"totalTimeMs": "NaN"}'), protobuf_message(good))

        async def good_stored() -> bool:
            return await store.get(good.event_id) is not None

        await wait_for(good_stored, 10)
        dead = await dead_letters(topology)
        assert list(dead) == ["nan-1"]
        assert "total_time_ms" in dead["nan-1"] and "finite" in dead["nan-1"]
        assert await store.get("nan-1") is None
    finally:
        await consumer.stop()
        await store.close()


@pytest.mark.parametrize("value", ['"Infinity"', '"-Infinity"', '"NaN"'])
def test_decode_refuses_non_finite_timings(value: str) -> None:
    for field in ("queueTimeMs", "timeToFirstTokenMs", "meanInterTokenMs", "totalTimeMs"):
        body = json_message("e1", f'"timings": {{"{field}": {value}}}').body
        with pytest.raises(PoisonMessage, match="finite"):
            decode_event(body, "application/json")
    assert decode_event(json_message("e1", '"timings": {"totalTimeMs": 1.5}').body, "application/json").timings.total_time_ms == 1.5


async def refuse_event_in_database(store, event_id: str) -> None:  # type: ignore[no-untyped-def]
    """A real constraint (a trigger) that makes the database refuse this one, valid, event."""
    async with store.db.transaction() as tx:
        if isinstance(store, SqliteStore):
            await tx.execute(
                f"CREATE TRIGGER refuse_one BEFORE INSERT ON records WHEN NEW.event_id = '{event_id}'"
                " BEGIN SELECT RAISE(ABORT, 'refused for the test'); END"
            )
            return
        await tx.execute(
            "CREATE FUNCTION refuse_one() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            f" IF NEW.event_id = '{event_id}' THEN RAISE EXCEPTION 'refused for the test' USING ERRCODE = 'check_violation'; END IF;"
            " RETURN NEW; END $$"
        )
        await tx.execute("CREATE TRIGGER refuse_one BEFORE INSERT ON records FOR EACH ROW EXECUTE FUNCTION refuse_one()")


async def test_a_batch_the_database_refuses_is_stored_event_by_event(topology, store) -> None:  # type: ignore[no-untyped-def]
    events = [make_event() for _ in range(6)]
    refused = events[2]
    await refuse_event_in_database(store, refused.event_id)
    # A long batch delay: all six arrive in one batch, which the database refuses as a whole.
    consumer = start_consumer(topology, store, batch_delay_s=0.5)
    try:
        await consumer.connected.wait()
        await publish(topology, *(protobuf_message(event) for event in events))

        async def others_stored() -> bool:
            return await store.count() == 5

        await wait_for(others_stored, 10)
        assert await store.get(refused.event_id) is None
        dead = await dead_letters(topology)
        assert list(dead) == [refused.event_id]
        assert "refused for the test" in dead[refused.event_id]

        # Everything was acked and consumption goes on.
        late = make_event()
        await publish(topology, protobuf_message(late))

        async def late_stored() -> bool:
            return await store.get(late.event_id) is not None

        await wait_for(late_stored, 10)
        assert await queue_depth(topology) == 0
    finally:
        await consumer.stop()


async def test_a_database_outage_is_retried_not_dead_lettered(topology, tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = SqliteStore(tmp_path / "evallog.sqlite3")
    await store.open()
    # "no such table" is an OperationalError: the database cannot take anything, not this event.
    async with store.db.transaction() as tx:
        await tx.execute("ALTER TABLE records RENAME TO records_away")
    consumer = start_consumer(topology, store)
    try:
        await consumer.connected.wait()
        event = make_event()
        await publish(topology, protobuf_message(event))
        await asyncio.sleep(1.0)  # several failed attempts
        assert await dead_letters(topology) == {}
        async with store.db.transaction() as tx:
            await tx.execute("ALTER TABLE records_away RENAME TO records")

        async def stored() -> bool:
            return await store.get(event.event_id) is not None

        await wait_for(stored, 10)
        assert await dead_letters(topology) == {}
    finally:
        await consumer.stop()
        await store.close()


async def test_unknown_finish_reason_is_stored_with_debug_logging_on(topology, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    # The per-event DEBUG line names the finish reason: a newer gateway's value has no name here.
    caplog.set_level(logging.DEBUG, logger="sluice.evallog.consumer")
    store = SqliteStore(tmp_path / "evallog.sqlite3")
    await store.open()
    consumer = start_consumer(topology, store)
    try:
        await consumer.connected.wait()
        unknown, good = make_event(finish_reason=42), make_event()
        await publish(topology, json_message("json-42", '"finishReason": 42'), protobuf_message(unknown), protobuf_message(good))

        async def all_stored() -> bool:
            return await store.count() == 3

        await wait_for(all_stored, 10)
        record = await store.get(unknown.event_id)
        assert record is not None and record.finish_reason == 42
        assert await dead_letters(topology) == {}
    finally:
        await consumer.stop()
        await store.close()


def test_otel_attributes_name_an_unknown_finish_reason_by_its_number() -> None:
    assert otel_attributes(make_event(finish_reason=42))["gen_ai.response.finish_reasons"] == ["42"]
    assert otel_attributes(make_event())["gen_ai.response.finish_reasons"] == ["stop"]


# ---- the broker or the store away: the consumer comes back, and says so meanwhile


def gauge(dependency: str) -> float:
    return CONNECTED.labels(dependency)._value.get()


async def test_a_consumer_whose_queue_is_deleted_consumes_again_once_it_is_declared_again(topology, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Deleting the queue (or a quorum queue's leader moving) cancels the consumer with basic.cancel
    while its connection and channel stay open: the consumer went on waiting for deliveries that
    would never come, for good, and health and metrics said nothing."""
    store = SqliteStore(tmp_path / "evallog.sqlite3")
    await store.open()
    consumer = start_consumer(topology, store)
    try:
        await asyncio.wait_for(consumer.connected.wait(), 10)
        first = make_event()
        await publish(topology, protobuf_message(first))

        async def first_stored() -> bool:
            return await store.get(first.event_id) is not None

        await wait_for(first_stored, 10)
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            await (await connection.channel()).queue_delete(topology.completions_queue)
        await asyncio.sleep(1.0)
        later = make_event()
        await publish(topology, protobuf_message(later))  # declares the topology again, as the gateway's publisher does

        async def later_stored() -> bool:
            return await store.get(later.event_id) is not None

        await wait_for(later_stored, 10)
        assert await queue_depth(topology) == 0 and gauge("broker") == 1
    finally:
        await consumer.stop()
        await store.close()


async def test_the_connected_gauge_is_0_while_the_consumer_cannot_consume(topology, tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = SqliteStore(tmp_path / "evallog.sqlite3")
    await store.open()
    consumer = start_consumer(topology, store)
    try:
        await asyncio.wait_for(consumer.connected.wait(), 10)
        assert gauge("broker") == 1 and gauge("store") == 1
        # Deleted, then declared with other arguments before the consumer comes back: its declaration
        # fails (PRECONDITION_FAILED) on every try until that queue is gone.
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(topology.completions_queue)
            await channel.declare_queue(topology.completions_queue, durable=True)
        await asyncio.sleep(1.5)
        assert gauge("broker") == 0 and not consumer.connected.is_set()
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            await (await connection.channel()).queue_delete(topology.completions_queue)
        await asyncio.wait_for(consumer.connected.wait(), 10)
        assert gauge("broker") == 1
    finally:
        await consumer.stop()
        await store.close()
    assert gauge("broker") == 0  # stopped: not consuming


async def test_the_connected_gauge_says_when_the_store_takes_no_writes(topology, tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = SqliteStore(tmp_path / "evallog.sqlite3")
    await store.open()
    async with store.db.transaction() as tx:
        await tx.execute("ALTER TABLE records RENAME TO records_away")
    consumer = start_consumer(topology, store)
    try:
        await asyncio.wait_for(consumer.connected.wait(), 10)
        event = make_event()
        await publish(topology, protobuf_message(event))

        async def store_down() -> bool:
            return gauge("store") == 0

        await wait_for(store_down, 10)
        assert gauge("broker") == 1  # consuming still: the events wait unacked
        async with store.db.transaction() as tx:
            await tx.execute("ALTER TABLE records_away RENAME TO records")

        async def stored() -> bool:
            return await store.get(event.event_id) is not None

        await wait_for(stored, 10)
        assert gauge("store") == 1
    finally:
        await consumer.stop()
        await store.close()


async def test_a_failed_commit_ends_the_session_at_once_and_nothing_is_lost(topology, store) -> None:  # type: ignore[no-untyped-def]
    """The database refuses an event and its dead-lettering routes nowhere (the dead-letter queue
    deleted): the copy used to count as confirmed and the event was acked and lost. Now the commit
    fails; the loop, idle with no more deliveries, used to notice only with the next batch. It ends
    the session at once: the topology is declared again and the event dead-lettered for good."""
    refused = make_event()
    await refuse_event_in_database(store, refused.event_id)
    consumer = start_consumer(topology, store)
    try:
        await asyncio.wait_for(consumer.connected.wait(), 10)
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            await channel.queue_delete(topology.completions_dead_queue)
            # Not `publish`: it would declare the dead-letter queue again.
            events = await channel.get_exchange(topology.events_exchange)
            await events.publish(protobuf_message(refused), topology.completion_routing_key)

        async def dead_lettered() -> bool:
            try:
                return list(await dead_letters(topology)) == [refused.event_id]
            except aio_pika.exceptions.ChannelNotFoundEntity:
                return False  # not declared again (yet)

        await wait_for(dead_lettered, 5)
        assert await queue_depth(topology) == 0 and await store.get(refused.event_id) is None
    finally:
        await consumer.stop()
