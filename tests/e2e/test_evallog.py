"""Issue 5 acceptance on the real stack: events after the stream, stored once, dead letters, tenants."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime

import aio_pika
import grpc
import pytest
from google.protobuf import timestamp_pb2
from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import evallog_pb2, evallog_pb2_grpc, events_pb2
from sluice.gateway.v1 import gateway_pb2

from conftest import DEMO_KEY, MODEL, auth, read_store
from sluice_stack import REPO_ROOT
from sluice_common.amqp import DEAD_REASON_HEADER, EventTopology

PRIVATE_KEY = "sk-sluice-private"


@pytest.fixture(scope="module")
def evallog(stack) -> Iterator[evallog_pb2_grpc.EvalLogServiceStub]:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(stack.evallog_address) as channel:
        yield evallog_pb2_grpc.EvalLogServiceStub(channel)


@pytest.fixture(scope="module")
def topology(stack) -> EventTopology:  # type: ignore[no-untyped-def]
    return EventTopology(stack.amqp_prefix)


def amqp(stack, work):  # type: ignore[no-untyped-def]
    """Runs `work(channel)` on a fresh connection to the stack's broker."""

    async def run():  # type: ignore[no-untyped-def]
        connection = await aio_pika.connect(stack.amqp_url, timeout=10)
        async with connection:
            return await work(await connection.channel(publisher_confirms=True))

    return asyncio.run(run())


class Tap:
    """Its own queue on the events exchange, consumed in a thread: when each event arrived."""

    def __init__(self, stack, topology: EventTopology) -> None:  # type: ignore[no-untyped-def]
        self.arrivals: dict[str, float] = {}
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._url, self._topology = stack.amqp_url, topology
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    async def _run(self) -> None:
        connection = await aio_pika.connect(self._url)
        async with connection:
            channel = await connection.channel()
            exchange = await channel.get_exchange(self._topology.events_exchange)
            queue = await channel.declare_queue("", exclusive=True, auto_delete=True)
            await queue.bind(exchange, "completion.#")

            async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                event = events_pb2.CompletionEvent.FromString(message.body)
                self.arrivals[event.request_id] = time.time()
                await message.ack()

            await queue.consume(on_message)
            self._ready.set()
            while not self._stop.is_set():
                await asyncio.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def generate(gateway, key: str = DEMO_KEY, max_tokens: int = 6, content: str = "Name a colour.") -> tuple[str, float]:  # type: ignore[no-untyped-def]
    """Streams one completion; returns (request id, time of the final message)."""
    request = gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content=content)],
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens),
    )
    request_id, final_at = "", 0.0
    for response in gateway.Generate(request, metadata=auth(key), timeout=120):
        request_id = response.request_id
        if response.finish_reason:
            final_at = time.time()
    return request_id, final_at


def generate_returned_at(gateway_log: str, request_id: str) -> float:
    """When the gateway's Generate handler for `request_id` returned: its "rpc" summary line."""
    for line in gateway_log.splitlines():
        if request_id in line and '"rpc"' in line:
            entry = json.loads(line)
            if entry["event"] == "rpc" and entry["request_id"] == request_id and entry["rpc"].endswith("/Generate"):
                return datetime.fromisoformat(entry["timestamp"]).timestamp()
    raise AssertionError(f"no rpc line for {request_id} in the gateway's log")


def records_by_request(evallog, key: str, request_ids: set[str], timeout_s: float = 60.0) -> dict[str, list]:  # type: ignore[no-untyped-def]
    """Polls QueryRecords until every request id has a record; returns every record per request id."""
    deadline = time.monotonic() + timeout_s
    while True:
        found: dict[str, list] = {}
        token = ""
        while True:
            page = evallog.QueryRecords(evallog_pb2.QueryRecordsRequest(page_size=1000, page_token=token), metadata=auth(key), timeout=10)
            for record in page.records:
                if record.event.request_id in request_ids:
                    found.setdefault(record.event.request_id, []).append(record)
            token = page.next_page_token
            if not token:
                break
        if set(found) == request_ids or time.monotonic() > deadline:
            return found
        time.sleep(0.25)


def test_events_are_published_after_the_stream_closed_and_stored_with_scores(stack, gateway, evallog, topology) -> None:  # type: ignore[no-untyped-def]
    tap = Tap(stack, topology)
    try:
        streams = [generate(gateway) for _ in range(3)]
        deadline = time.monotonic() + 30
        while len(tap.arrivals) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        tap.close()
    assert {s[0] for s in streams} <= set(tap.arrivals)
    records = records_by_request(evallog, DEMO_KEY, {s[0] for s in streams})
    gateway_log = stack.service("gateway").log_path.read_text()
    for request_id, final_at in streams:
        (record,) = records[request_id]
        event = record.event
        # The causal chain inside the gateway, one clock, no thread of this process in between:
        # the handler returned after its last message was written (the "rpc" summary line), then the
        # call closed, then the done-callback stamped finished_at and built the event, which only
        # then reached the broker. An event published with the final token would be stamped before
        # that line. (The client's own end-of-stream stamp cannot order this: its gRPC thread may run
        # a millisecond after the broker delivered to the tap.)
        handler_returned = generate_returned_at(gateway_log, request_id)
        finished_at = event.finished_at.ToNanoseconds() / 1e9
        assert handler_returned <= finished_at <= tap.arrivals[request_id]
        assert event.tenant == "demo" and event.model == MODEL and event.text_logged
        assert event.messages[0].content == "Name a colour." and event.output
        assert event.finish_reason in (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH)
        assert event.usage.completion_tokens > 0 and event.timings.total_time_ms > 0
        assert event.finished_at.ToNanoseconds() / 1e9 >= final_at - 1.0
        scores = {s.name: s for s in record.scores}
        assert {"latency_slo", "ttft_slo", "truncation", "empty_output", "repetition", "pii"} <= set(scores)
        if "similarity" in scores and scores["similarity"].skipped:
            assert scores["similarity"].detail.startswith("skipped: embeddings unavailable")
    full = evallog.GetRecord(evallog_pb2.GetRecordRequest(event_id=records[streams[0][0]][0].event.event_id), metadata=auth())
    assert full.record.event.request_id == streams[0][0]
    summary = evallog.Summarize(evallog_pb2.SummarizeRequest(model=MODEL), metadata=auth())
    (group,) = summary.summaries
    assert group.tenant == "demo" and group.count >= 3 and group.latency.p50_ms > 0


def test_cli_logs_lists_recent_completions_and_a_summary_table(stack, gateway, evallog) -> None:  # type: ignore[no-untyped-def]
    """`sluice logs` against the stack: the private tenant's completions (no other test writes many of
    them), listed by request id, then a summary row for the model with the tenant's exact count."""
    env = {**os.environ, "SLUICE_EVALLOG_URL": stack.evallog_address, "SLUICE_API_KEY": DEMO_KEY}
    sluice = [str(REPO_ROOT / "bin" / "sluice")]
    request_ids = {generate(gateway, key=PRIVATE_KEY)[0] for _ in range(3)}
    records_by_request(evallog, PRIVATE_KEY, request_ids)
    (expected,) = evallog.Summarize(evallog_pb2.SummarizeRequest(model=MODEL), metadata=auth(PRIVATE_KEY)).summaries
    logs = subprocess.run(
        [*sluice, "logs", "--tenant-key", PRIVATE_KEY, "--since", "1h", "-n", "50"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert logs.returncode == 0, logs.stdout + logs.stderr
    for request_id in request_ids:
        assert request_id in logs.stdout
    row = re.search(rf"^{re.escape(MODEL)}\s+private\s+(\d+)\s", logs.stdout, re.M)
    assert row is not None, logs.stdout
    assert int(row.group(1)) == expected.count >= 3
    assert "LATENCY p50/p95/p99 ms" in logs.stdout and "SCORE" in logs.stdout
    # The demo key (the environment's default) never sees the private tenant's completions.
    demo = subprocess.run([*sluice, "logs", "--since", "0"], env=env, capture_output=True, text=True, timeout=60)
    assert demo.returncode == 0, demo.stderr
    assert not request_ids & set(demo.stdout.split()) and " private " not in demo.stdout
    refused = subprocess.run([*sluice, "logs", "--tenant", "private"], env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr

    # --follow prints a completion that finishes while it runs, and Ctrl-C ends it with the summary.
    follow = subprocess.Popen(
        [*sluice, "logs", "--tenant-key", PRIVATE_KEY, "-n", "1", "--follow", "--interval", "0.3"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in follow.stdout], daemon=True)  # type: ignore[union-attr]
    reader.start()
    printed = [lines.get(timeout=60)]  # the one recent completion: following has begun
    later = generate(gateway, key=PRIVATE_KEY)[0]
    deadline = time.monotonic() + 60
    while later not in printed[-1]:
        printed.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
    follow.send_signal(signal.SIGINT)
    follow.wait(timeout=60)
    reader.join(10)
    assert follow.returncode == 0, follow.stderr.read()  # type: ignore[union-attr]
    assert "LATENCY p50/p95/p99 ms" in "".join(lines.queue)


def test_text_logging_off_and_tenant_isolation(gateway, evallog) -> None:  # type: ignore[no-untyped-def]
    request_id, _ = generate(gateway, key=PRIVATE_KEY, content="my secret is 4111 1111 1111 1111")
    (record,) = records_by_request(evallog, PRIVATE_KEY, {request_id})[request_id]
    assert not record.event.text_logged
    assert record.event.output == "" and record.event.prompt == "" and not record.event.messages
    assert record.event.usage.completion_tokens > 0
    event_id = record.event.event_id
    with pytest.raises(grpc.RpcError) as not_found:
        evallog.GetRecord(evallog_pb2.GetRecordRequest(event_id=event_id), metadata=auth(DEMO_KEY))
    assert not_found.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as denied:
        evallog.QueryRecords(evallog_pb2.QueryRecordsRequest(tenant="private"), metadata=auth(DEMO_KEY))
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as denied:
        evallog.Summarize(evallog_pb2.SummarizeRequest(tenant="private"), metadata=auth(DEMO_KEY))
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as unauthenticated:
        evallog.QueryRecords(evallog_pb2.QueryRecordsRequest(), metadata=auth("sk-wrong"))
    assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED
    demo_ids = {r.event.event_id for r in evallog.QueryRecords(evallog_pb2.QueryRecordsRequest(page_size=1000), metadata=auth()).records}
    assert event_id not in demo_ids


def dead_count(stack, topology: EventTopology) -> int:  # type: ignore[no-untyped-def]
    async def work(channel):  # type: ignore[no-untyped-def]
        queue = await channel.declare_queue(topology.completions_dead_queue, passive=True)
        return queue.declaration_result.message_count

    return amqp(stack, work)


def test_garbage_goes_to_the_dead_letter_queue_with_its_reason_and_replays(stack, gateway, evallog, topology) -> None:  # type: ignore[no-untyped-def]
    marker = f"garbage-{uuid.uuid4().hex[:8]}"

    async def publish_garbage(channel):  # type: ignore[no-untyped-def]
        exchange = await channel.get_exchange(topology.events_exchange)
        await exchange.publish(
            aio_pika.Message(b"\x08\x96\x01 definitely not an event", message_id=marker, content_type="application/x-protobuf"),
            "completion.v1",
        )

    before = dead_count(stack, topology)
    amqp(stack, publish_garbage)
    deadline = time.monotonic() + 30
    while dead_count(stack, topology) < before + 1:
        assert time.monotonic() < deadline, "the garbage message never reached the dead-letter queue"
        time.sleep(0.1)

    async def peek(channel):  # type: ignore[no-untyped-def]
        queue = await channel.get_queue(topology.completions_dead_queue)
        held, found = [], None
        while (message := await queue.get(no_ack=False, fail=False)) is not None:
            held.append(message)
            if message.message_id == marker:
                found = dict(message.headers)
        for message in held:
            await message.nack(requeue=True)
        return found

    headers = amqp(stack, peek)
    assert headers is not None and headers[DEAD_REASON_HEADER]
    # Consumption goes on.
    request_id, _ = generate(gateway)
    assert records_by_request(evallog, DEMO_KEY, {request_id})[request_id]
    # The replay command moves it back; it is still garbage, so it lands there again.
    python = stack.service("evaluation-logging").python
    env = {"SLUICE_EVALLOG_AMQP_URL": stack.amqp_url, "SLUICE_EVALLOG_AMQP_PREFIX": stack.amqp_prefix, "PATH": "/usr/bin:/bin"}
    listed = subprocess.run([str(python), "-m", "sluice_evaluation_logging.replay", "--list"], env=env, capture_output=True, text=True, timeout=60)
    assert marker in listed.stdout, listed.stderr
    replayed = subprocess.run([str(python), "-m", "sluice_evaluation_logging.replay"], env=env, capture_output=True, text=True, timeout=60)
    assert replayed.returncode == 0 and "replayed" in replayed.stdout, replayed.stderr
    deadline = time.monotonic() + 30
    while amqp(stack, peek) is None:
        assert time.monotonic() < deadline, "the replayed garbage did not come back to the dead-letter queue"
        time.sleep(0.2)


def synthetic_event(tenant: str = "demo") -> events_pb2.CompletionEvent:
    now = timestamp_pb2.Timestamp()
    now.GetCurrentTime()
    return events_pb2.CompletionEvent(
        event_id=uuid.uuid4().hex,
        request_id=uuid.uuid4().hex,
        tenant=tenant,
        model=MODEL,
        output="Blue.",
        text_logged=True,
        finish_reason=types_pb2.FINISH_REASON_STOP,
        usage=types_pb2.Usage(prompt_tokens=10, completion_tokens=2, total_tokens=12),
        timings=types_pb2.Timings(time_to_first_token_ms=50, total_time_ms=90),
        started_at=now,
        finished_at=now,
    )


def stored_counts(stack, event_ids: list[str]) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(rows, distinct event ids) among `event_ids` in evaluation-logging's SQLite store."""
    with read_store(stack, "evallog.sqlite3") as db:
        db.execute("CREATE TEMP TABLE wanted (event_id TEXT PRIMARY KEY)")
        db.executemany("INSERT INTO wanted VALUES (?)", [(e,) for e in event_ids])
        return db.execute("SELECT COUNT(*), COUNT(DISTINCT records.event_id) FROM records JOIN wanted USING (event_id)").fetchone()


def test_evaluation_logging_killed_mid_batch_loses_and_duplicates_nothing(stack, topology) -> None:  # type: ignore[no-untyped-def]
    events = [synthetic_event() for _ in range(3000)]
    ids = [e.event_id for e in events]

    async def publish(channel):  # type: ignore[no-untyped-def]
        exchange = await channel.get_exchange(topology.events_exchange)
        await asyncio.gather(
            *(
                exchange.publish(
                    aio_pika.Message(
                        e.SerializeToString(),
                        message_id=e.event_id,
                        content_type="application/x-protobuf",
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    ),
                    "completion.v1",
                )
                for e in events
            )
        )

    amqp(stack, publish)
    service = stack.service("evaluation-logging")
    deadline = time.monotonic() + 60
    while stored_counts(stack, ids)[0] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    service.kill()  # SIGKILL while batches are in flight
    killed_at = stored_counts(stack, ids)[0]
    service.start()
    service.wait_ready(60)
    deadline = time.monotonic() + 120
    while stored_counts(stack, ids)[0] < len(ids) and time.monotonic() < deadline:
        time.sleep(0.2)
    rows, distinct = stored_counts(stack, ids)
    assert (rows, distinct) == (len(ids), len(ids)), f"{killed_at} stored when killed"


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=120)


def test_rabbitmq_restart_mid_traffic_stores_every_event_exactly_once(stack, gateway, evallog) -> None:  # type: ignore[no-untyped-def]
    streams: list[tuple[str, float]] = []
    errors: list[BaseException] = []

    def traffic() -> None:
        try:
            for _ in range(10):
                streams.append(generate(gateway, max_tokens=4))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    worker = threading.Thread(target=traffic)
    worker.start()
    while len(streams) < 3 and worker.is_alive():
        time.sleep(0.05)
    try:
        rabbitmqctl("stop_app")
        time.sleep(1.0)  # streams keep completing while the broker is away
    finally:
        rabbitmqctl("start_app")
    worker.join(180)
    assert not errors, errors
    assert len(streams) == 10
    request_ids = {s[0] for s in streams}
    records = records_by_request(evallog, DEMO_KEY, request_ids, timeout_s=90)
    assert set(records) == request_ids
    assert all(len(found) == 1 for found in records.values()), {k: len(v) for k, v in records.items()}
