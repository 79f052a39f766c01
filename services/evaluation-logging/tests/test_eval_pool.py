"""The CPU-heavy evaluators in worker processes: the same scores as inline, and a worker that dies
loses nothing (the pool is recreated and the batch evaluated again)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid

import aio_pika
from google.protobuf import json_format
from sluice.common.v1 import types_pb2

from conftest import AMQP_URL, make_event, realistic_output
from sluice_common.amqp import EventTopology
from sluice_common.amqp_publisher import ConfirmingPublisher, OutgoingMessage, PublisherMetrics
from sluice_evaluation_logging.consumer import CompletionConsumer, ConsumerSettings
from sluice_evaluation_logging.eval_pool import CRASHED_DETAIL, POOL_PENDING, POOL_RESTARTS, EvalPool
from sluice_evaluation_logging.evaluators import CPU_HEAVY, EVALUATORS, evaluate_batch
from sluice_evaluation_logging.evaluators.base import EvalContext, EvalSettings
from sluice_evaluation_logging.store import SqliteStore

SETTINGS = EvalSettings(latency_slo_ms=1000, ttft_slo_ms=200, repetition_ngram=3, repetition_max_ratio=0.2)


def varied_events() -> list:  # type: ignore[type-arg]
    json_format = {"response_format": types_pb2.RESPONSE_FORMAT_JSON_OBJECT}
    events = [make_event(output=realistic_output(4000, seed)) for seed in range(20)] + [
        make_event(output="Call +44 20 7946 0958 or mail a.b@example.org; card 4111-1111-1111-1111, not 4111 1111 1111 1112."),
        make_event(output="again and again and again and again and again " * 40),
        make_event(output=json.dumps({"items": list(range(300)), "ok": True}), **json_format),
        make_event(output="[1, 2, 3]", **json_format),
        make_event(output='{"unterminated": ', **json_format),
        make_event(output="answer </s> leaked", sampling=types_pb2.SamplingParams(max_tokens=16, stop=["</s>"])),
        make_event(output="", finish_reason=types_pb2.FINISH_REASON_LENGTH),
        make_event(output="   \n"),
        make_event(output="secret 555-123-4567", text_logged=False),
        make_event(output="half an answer", finish_reason=types_pb2.FINISH_REASON_CANCELLED),
        make_event(output="ünïcödé ✓ " * 300),
    ]
    return events


def test_the_heavy_evaluators_are_the_ones_that_scan_the_output() -> None:
    assert [e.NAME for e in CPU_HEAVY] == ["repetition", "json_validity", "pii"]
    assert set(CPU_HEAVY) < set(EVALUATORS)


async def test_pooled_scores_equal_inline_scores() -> None:
    events = varied_events()
    ctx = EvalContext(SETTINGS, defer_model_calls=True)
    inline = await evaluate_batch(events, ctx)
    pool = EvalPool(2)  # two chunks: their answers come back in the batch's order
    await pool.start()
    try:
        pooled = await evaluate_batch(events, ctx, pool.evaluate)
        assert pooled == inline
        # and again, one event at a time (chunks smaller than the workers)
        assert [await evaluate_batch([event], ctx, pool.evaluate) for event in events[-6:]] == [
            await evaluate_batch([event], ctx) for event in events[-6:]
        ]
        assert await evaluate_batch([], ctx, pool.evaluate) == []
    finally:
        await pool.close()
    names = {score.name for scores in inline for score in scores}
    assert {"repetition", "json_validity", "pii"} <= names
    assert any(s.name == "pii" and s.value >= 3 for scores in inline for s in scores)


def heavy_batch(count: int = 256, size: int = 8000) -> list:  # type: ignore[type-arg]
    return [make_event(output=realistic_output(size, 1000 + i)) for i in range(count)]


async def kill_worker_when_busy(pool: EvalPool, delay_s: float = 0.1) -> int:
    await asyncio.sleep(delay_s)  # the chunk is being evaluated (a batch takes ~1 s in the worker)
    pid = pool.pids[0]
    os.kill(pid, signal.SIGKILL)
    return pid


async def test_a_worker_killed_mid_batch_loses_nothing_the_pool_is_recreated_and_the_batch_retried() -> None:
    events = heavy_batch()
    ctx = EvalContext(SETTINGS, defer_model_calls=True)
    inline = await evaluate_batch(events, ctx)
    pool = EvalPool(1)
    await pool.start()
    restarts = POOL_RESTARTS._value.get()
    try:
        evaluating = asyncio.ensure_future(evaluate_batch(events, ctx, pool.evaluate))
        killed = await kill_worker_when_busy(pool)
        assert await evaluating == inline
        assert POOL_RESTARTS._value.get() == restarts + 1
        assert pool.pids and killed not in pool.pids
        # The new pool serves the next batch as usual.
        assert await evaluate_batch(events[:8], ctx, pool.evaluate) == inline[:8]
        # A worker that dies while the pool is idle: the next batch finds the pool broken, and the same.
        os.kill(pool.pids[0], signal.SIGKILL)
        await asyncio.sleep(0.2)
        assert await evaluate_batch(events[:8], ctx, pool.evaluate) == inline[:8]
        assert POOL_RESTARTS._value.get() == restarts + 2
    finally:
        await pool.close()


async def test_a_batch_that_breaks_the_pool_every_time_gets_skipped_heavy_scores_not_lost() -> None:
    events = heavy_batch(128)
    ctx = EvalContext(SETTINGS, defer_model_calls=True)
    inline = await evaluate_batch(events, ctx)
    pool = EvalPool(1, max_attempts=1)
    await pool.start()
    try:
        evaluating = asyncio.ensure_future(evaluate_batch(events, ctx, pool.evaluate))
        await kill_worker_when_busy(pool)
        scores = await evaluating
    finally:
        await pool.close()
    heavy = {e.NAME for e in CPU_HEAVY}
    assert len(scores) == len(events)
    for got, want in zip(scores, inline, strict=True):
        assert [s for s in got if s.name not in heavy] == [s for s in want if s.name not in heavy]
        crashed = [s for s in got if s.name in heavy]
        assert crashed and all(s.skipped and s.detail == CRASHED_DETAIL for s in crashed)


async def test_the_consumer_loses_no_event_when_a_worker_dies_mid_batch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Real RabbitMQ and SQLite: the batch whose worker was killed stays unacked until the new
    pool has evaluated it; every event is stored once, with its real heavy scores."""
    topology = EventTopology(f"sluice-poolkill-{uuid.uuid4().hex[:8]}")
    publisher = ConfirmingPublisher(AMQP_URL, topology.events_exchange, topology.declare, PublisherMetrics.get("test_poolkill_publisher"))
    publisher.start()
    events = heavy_batch(512)
    for event in events:
        publisher.submit(OutgoingMessage(event.SerializeToString(), "completion.v1", event.event_id, event.request_id))
    assert await publisher.wait_idle(20)
    await publisher.stop(2)
    store = SqliteStore(tmp_path / "evallog.sqlite3")
    await store.open()
    pool = EvalPool(1)
    await pool.start()
    restarts = POOL_RESTARTS._value.get()
    consumer = CompletionConsumer(
        ConsumerSettings(AMQP_URL, topology, prefetch=512, batch_max=256, batch_delay_s=0.05),
        store,
        EvalContext(SETTINGS, defer_model_calls=True),
        offload=pool.evaluate,
    )
    consumer.start()
    try:
        async with asyncio.timeout(30):
            while POOL_PENDING._value.get() == 0:  # the first batch is in the worker
                await asyncio.sleep(0.005)
        assert await store.count() == 0  # nothing stored (so nothing acked) yet
        await kill_worker_when_busy(pool, 0.05)
        async with asyncio.timeout(60):
            while await store.count() < len(events):
                await asyncio.sleep(0.05)
        assert POOL_RESTARTS._value.get() == restarts + 1
        expected = await evaluate_batch(events, EvalContext(SETTINGS, defer_model_calls=True))
        for event, scores in list(zip(events, expected, strict=True))[::16]:
            row = await store.get(event.event_id)
            assert row is not None
            heavy = {e.NAME for e in CPU_HEAVY}
            assert sorted((s for s in row.scores if s.name in heavy), key=lambda s: s.name) == sorted(
                (s for s in scores if s.name in heavy), key=lambda s: s.name
            )
            assert not any(s.skipped for s in row.scores if s.name in heavy)
    finally:
        await consumer.stop()
        await pool.close()
        await store.close()
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            await topology.delete(await connection.channel())


async def test_the_consumer_hands_the_pool_each_message_body_as_received(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Real RabbitMQ and SQLite: the pool gets the bodies' own bytes, not the events serialized
    again. Each body here is two serialized halves of its event (a valid encoding that parses to
    the same event, in an order SerializeToString never writes), so a second serialization would
    show. The heavy scores are still the inline ones, and a JSON body is serialized once."""
    topology = EventTopology(f"sluice-poolbody-{uuid.uuid4().hex[:8]}")
    publisher = ConfirmingPublisher(AMQP_URL, topology.events_exchange, topology.declare, PublisherMetrics.get("test_poolbody_publisher"))
    publisher.start()
    events = varied_events()[:12]
    bodies = {}
    for event in events:
        tail = type(event)(output=event.output)
        head = type(event)()
        head.CopyFrom(event)
        head.ClearField("output")
        body = tail.SerializeToString() + head.SerializeToString()  # output first: not canonical order
        parsed = type(event)()
        parsed.ParseFromString(body)
        assert parsed == event and body != event.SerializeToString()
        bodies[event.event_id] = body
        publisher.submit(OutgoingMessage(body, "completion.v1", event.event_id, event.request_id))
    as_json = make_event(output="again and again and again " * 10)
    publisher.submit(
        OutgoingMessage(
            json_format.MessageToJson(as_json).encode(), "completion.v1", as_json.event_id, as_json.request_id, content_type="application/json"
        )
    )
    assert await publisher.wait_idle(20)
    await publisher.stop(2)
    store = SqliteStore(tmp_path / "evallog.sqlite3")
    await store.open()
    pool = EvalPool(1)
    await pool.start()
    handed: list[bytes] = []

    async def recording(serialized, settings):  # type: ignore[no-untyped-def]
        handed.extend(serialized)
        return await pool.evaluate(serialized, settings)

    ctx = EvalContext(SETTINGS, defer_model_calls=True)
    consumer = CompletionConsumer(ConsumerSettings(AMQP_URL, topology, prefetch=64, batch_max=64, batch_delay_s=0.05), store, ctx, offload=recording)
    consumer.start()
    try:
        async with asyncio.timeout(30):
            while await store.count() < len(events) + 1:
                await asyncio.sleep(0.05)
        assert sorted(handed) == sorted([*bodies.values(), as_json.SerializeToString()])
        inline = await evaluate_batch([*events, as_json], ctx)
        for event, scores in zip([*events, as_json], inline, strict=True):
            row = await store.get(event.event_id)
            assert row is not None and row.event == bodies.get(event.event_id, as_json.SerializeToString())
            assert sorted(row.scores, key=lambda s: s.name) == sorted(scores, key=lambda s: s.name)
    finally:
        await consumer.stop()
        await pool.close()
        await store.close()
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            await topology.delete(await connection.channel())
