"""`make bench-evallog`: what completion logging costs the client, and how fast events are stored.

(a) Time from the final response message to the end of the stream, as the client sees it, with
    logging on (the stack's gateway) vs off (a second gateway on the same adapter, AMQP off),
    requests interleaved in the same run. Target: on p99 <= off p99 + 1 ms.
(b) Events stored per second by evaluation-logging (evaluated, SQLite, acked) vs a raw aio-pika
    consume with batched acks of the same messages, same broker, same run. Target: >= 0.5x.
    Similarity (the adapter's embedding model) is scored off that path from durable pending
    markers; after (b) the bench also reports how fast that backlog drains (no target): only
    similarity scores actually computed count, not markers settled as skipped (a score the
    worker gave up on, or one the adapter could not embed), which are reported separately.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import aio_pika
import grpc
from google.protobuf import timestamp_pb2
from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import events_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from sluice_stack import Stack, StackPorts

KEY = "sk-sluice-demo"
MODEL = "smollm2-135m-instruct"
REQUESTS = int(os.environ.get("BENCH_EVALLOG_REQUESTS", "80"))
EVENTS = int(os.environ.get("BENCH_EVALLOG_EVENTS", "5000"))


def bench(name: str, value: float, unit: str) -> None:
    print(f"BENCH {name} {value:.3f} {unit}", flush=True)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def close_gap_ms(stub: gateway_pb2_grpc.GatewayServiceStub) -> float:
    request = gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content="Say hi.")],
        sampling=types_pb2.SamplingParams(max_tokens=3),
    )
    final_at = None
    for response in stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=120):
        if response.finish_reason:
            final_at = time.perf_counter()
    assert final_at is not None
    return (time.perf_counter() - final_at) * 1000


def synthetic(count: int) -> list[bytes]:
    now = timestamp_pb2.Timestamp()
    now.GetCurrentTime()
    return [
        events_pb2.CompletionEvent(
            event_id=uuid.uuid4().hex,
            request_id=uuid.uuid4().hex,
            tenant="demo",
            model=MODEL,
            messages=[types_pb2.ChatMessage(role="user", content="What is the capital of France?")],
            output="The capital of France is Paris. It is known for the Eiffel Tower.",
            text_logged=True,
            sampling=types_pb2.SamplingParams(max_tokens=32),
            finish_reason=types_pb2.FINISH_REASON_STOP,
            usage=types_pb2.Usage(prompt_tokens=14, completion_tokens=16, total_tokens=30),
            timings=types_pb2.Timings(time_to_first_token_ms=80, total_time_ms=900),
            started_at=now,
            finished_at=now,
        ).SerializeToString()
        for _ in range(count)
    ]


async def publish(url: str, exchange_name: str, routing_key: str, bodies: list[bytes]) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(exchange_name) if exchange_name else channel.default_exchange
        for start in range(0, len(bodies), 500):
            await asyncio.gather(
                *(
                    exchange.publish(
                        aio_pika.Message(b, content_type="application/x-protobuf", delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                        routing_key,
                    )
                    for b in bodies[start : start + 500]
                )
            )


async def raw_consume_rate(url: str, bodies: list[bytes]) -> float:
    """Persistent messages in a durable queue, consumed with prefetch 512 and an ack every 256."""
    name = f"sluice-bench-raw-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, durable=True)
        await publish(url, "", name, bodies)
        await channel.set_qos(prefetch_count=512)
        done = asyncio.Event()
        seen = 0
        first = 0.0

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal seen, first
            if seen == 0:
                first = time.perf_counter()
            events_pb2.CompletionEvent.FromString(message.body)
            seen += 1
            if seen % 256 == 0 or seen == len(bodies):
                await message.ack(multiple=True)
            if seen == len(bodies):
                done.set()

        await queue.consume(on_message)
        await asyncio.wait_for(done.wait(), 120)
        elapsed = time.perf_counter() - first
        await queue.delete(if_unused=False, if_empty=False)
    return (len(bodies) - 1) / elapsed


def stored(db_path: Path) -> int:
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30) as db:
        return int(db.execute("SELECT COUNT(*) FROM records").fetchone()[0])


def similarity_scores(db_path: Path) -> tuple[int, int]:
    """(scored, skipped): similarity scores stored, split by whether they were really computed."""
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30) as db:
        rows = dict(db.execute("SELECT skipped, COUNT(*) FROM scores WHERE name = 'similarity' GROUP BY skipped").fetchall())
    return int(rows.get(0, 0)), int(rows.get(1, 0))


def pending_similarity(db_path: Path) -> int:
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30) as db:
        return int(db.execute("SELECT COUNT(*) FROM pending_scores WHERE name = 'similarity'").fetchone()[0])


def main() -> int:
    run_dir = Path(tempfile.mkdtemp(prefix="sluice-bench-evallog-"))
    prefix = f"sluice-bench-{uuid.uuid4().hex[:8]}"
    stack = Stack(run_dir=run_dir, ports=StackPorts.ephemeral(), amqp_prefix=prefix)
    print(f"starting the stack (logs in {run_dir}) ...", flush=True)
    stack.start(timeout_s=300)
    try:
        # The logging-off gateway: the stack gateway's settings without RabbitMQ, on ports it binds
        # itself (a copy of the stack gateway's environment took that one's HTTP port too, and died
        # with "address already in use"); it needs no HTTP front.
        _, off_address, _ = stack.add_gateway("gateway-logging-off", env={"SLUICE_GATEWAY_AMQP_URL": "", "SLUICE_GATEWAY_HTTP_PORT": "0"})
        on_stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(stack.gateway_address))
        off_stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(off_address))
        for stub in (on_stub, off_stub):
            for _ in range(3):
                close_gap_ms(stub)
        on, offs = [], []
        for _ in range(REQUESTS):
            on.append(close_gap_ms(on_stub))
            offs.append(close_gap_ms(off_stub))
        bench("evallog_close_gap_off_p50", pct(offs, 50), "ms")
        bench("evallog_close_gap_off_p99", pct(offs, 99), "ms")
        bench("evallog_close_gap_on_p50", pct(on, 50), "ms")
        bench("evallog_close_gap_on_p99", pct(on, 99), "ms")
        bench("evallog_close_gap_p99_on_minus_off", pct(on, 99) - pct(offs, 99), "ms")
        print(f"(a) {REQUESTS} streams each; mean on {statistics.mean(on):.3f} ms, off {statistics.mean(offs):.3f} ms", flush=True)

        bodies = synthetic(EVENTS)
        raw = asyncio.run(raw_consume_rate(stack.amqp_url, bodies))
        service = stack.service("evaluation-logging")
        service.stop()
        db_path = run_dir / "evallog.sqlite3"
        before = stored(db_path)
        asyncio.run(publish(stack.amqp_url, f"{prefix}.events", "completion.v1", bodies))
        service.start()
        while stored(db_path) == before:
            time.sleep(0.002)
        first, first_count = time.perf_counter(), stored(db_path)
        deadline = time.monotonic() + 300
        while stored(db_path) < before + EVENTS and time.monotonic() < deadline:
            time.sleep(0.01)
        elapsed = time.perf_counter() - first
        rate = (stored(db_path) - first_count) / elapsed
        bench("evallog_raw_consume_rate", raw, "events/s")
        bench("evallog_store_rate", rate, "events/s")
        bench("evallog_store_vs_raw", rate / raw, "x")
        backlog, drain_started = pending_similarity(db_path), time.perf_counter()
        scored_before, skipped_before = similarity_scores(db_path)
        drain_deadline = time.monotonic() + 120
        while pending_similarity(db_path) and time.monotonic() < drain_deadline:
            time.sleep(0.1)
        drain_s = time.perf_counter() - drain_started
        left = pending_similarity(db_path)
        scored_after, skipped_after = similarity_scores(db_path)
        scored, skipped = scored_after - scored_before, skipped_after - skipped_before
        print(
            f"(b) similarity backlog after the burst: {backlog} events, {left} left after draining;"
            f" {scored} scored, {skipped} settled as skipped (not counted in the rate)",
            flush=True,
        )
        bench("evallog_similarity_drain_rate", scored / drain_s, "events/s")
        bench("evallog_similarity_skipped", skipped, "events")
        return 0
    finally:
        stack.stop()
        asyncio.run(_delete_topology(stack.amqp_url, prefix))


async def _delete_topology(url: str, prefix: str) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        for queue in (f"{prefix}.evallog.completions", f"{prefix}.evallog.completions.dead"):
            await channel.queue_delete(queue)
        for exchange in (f"{prefix}.events", f"{prefix}.events.dead"):
            await channel.exchange_delete(exchange)


if __name__ == "__main__":
    raise SystemExit(main())
