"""The job worker against the real RabbitMQ: no row message stays unacked past the broker's consumer
timeout while it waits for a slot.

With a prefetch of 128 and 4 rows running at once, the messages behind them waited unacked for a
slot for as long as the rows ahead took; past RabbitMQ's consumer timeout (30 min by default) the
broker closed the channel and requeued every message on it, each delivery counted, and after a few
rounds the worker dead-lettered rows that had never run as failed ABORTED.

The broker checks the timeout once per channel tick (channel_tick_interval, a minute by default, on
RabbitMQ 3 and 4 alike), and the local broker may predate per-queue consumer timeouts (RabbitMQ
3.12): so what is measured is the worker's side of the contract, how long it holds each delivery
unacked, against the consumer timeout it is told (WORKER_CONSUMER_TIMEOUT_S), on the real broker,
with a stand-in for the inference path that takes ROW_S a row."""

from __future__ import annotations

import asyncio
import os
import time
import types
import uuid
from pathlib import Path

import aio_pika
import pytest
from sluice.jobs.v1 import jobs_pb2

from sluice_common.amqp import JobTopology
from sluice_common.config import load_config
from sluice_common.errors import DeadlineExceeded
from sluice_common.supervision import Supervisor
from sluice_gateway.config import ENV_PREFIX, WorkerConfig
from sluice_gateway.jobs import worker as worker_module
from sluice_gateway.jobs.job import RowRun
from sluice_gateway.jobs.store import JobStore
from sluice_gateway.jobs.worker import JobWorker

AMQP_URL = os.environ.get("SLUICE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
TENANTS = str(Path(__file__).resolve().parents[3] / "config" / "tenants.toml")
ROWS = 8
ROW_S = 1.0
CONSUMER_TIMEOUT_S = 3.0


async def publish_embed_rows(job_worker: JobWorker, custom_ids: list[str]) -> None:
    """One embedding row of job "j" per custom id, published as the worker publishes a job's rows."""
    for custom_id in custom_ids:
        row = jobs_pb2.JobRow(custom_id=custom_id, embed=jobs_pb2.EmbedRow(model="m", inputs=["x"]))
        await job_worker._publish_row(jobs_pb2.RowTask(job_id="j", tenant="demo", row=row))


async def stop_and_delete_topology(job_worker: JobWorker, prefix: str) -> None:
    await job_worker.stop(1.0)
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        await JobTopology(prefix).delete(await connection.channel())


def record_deliveries(job_worker: JobWorker, monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], list[int]]:
    """How long the worker held each row delivery unacked, and each one's x-delivery-count."""
    received: dict[int, float] = {}
    held: list[float] = []
    delivery_counts: list[int] = []
    settle = {name: getattr(aio_pika.IncomingMessage, name) for name in ("ack", "nack", "reject")}

    def settling(name: str):  # noqa: ANN202 - records how long each delivery was held unacked
        async def settle_and_record(self: aio_pika.IncomingMessage, *args: object, **kwargs: object) -> None:
            if id(self) in received:
                held.append(time.monotonic() - received.pop(id(self)))
            await settle[name](self, *args, **kwargs)

        return settle_and_record

    for name in settle:
        monkeypatch.setattr(aio_pika.IncomingMessage, name, settling(name))
    on_row = job_worker._on_row

    async def recording_on_row(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        received[id(message)] = time.monotonic()
        delivery_counts.append(int(str((message.headers or {}).get("x-delivery-count") or 0)))
        await on_row(message)

    job_worker._on_row = recording_on_row  # type: ignore[method-assign]
    return held, delivery_counts


async def test_no_row_message_waits_unacked_for_a_slot_past_the_consumer_timeout(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = f"test-ct-{uuid.uuid4().hex[:8]}"
    settings = {
        "TENANTS_FILE": TENANTS, "AMQP_URL": AMQP_URL, "AMQP_PREFIX": prefix,
        "WORKER_CONCURRENCY_INITIAL": "2", "WORKER_CONCURRENCY_MAX": "2",
        "WORKER_CONSUMER_TIMEOUT_S": str(CONSUMER_TIMEOUT_S), "WORKER_ROW_TIMEOUT_CEILING_S": "2.5",
        "WORKER_ROW_TIMEOUT_FLOOR_S": "0.5", "WORKER_ROW_TIMEOUT_S": "2.5",
    }  # fmt: skip
    config = load_config(WorkerConfig, ENV_PREFIX, {f"{ENV_PREFIX}{name}": value for name, value in settings.items()})

    async def stand_in_path(path: object, task: jobs_pb2.RowTask, request_id: str, timeout_s: float) -> RowRun:
        await asyncio.sleep(ROW_S)
        return RowRun(jobs_pb2.RowResult(job_id=task.job_id, custom_id=task.row.custom_id, output="ok"), ROW_S)

    monkeypatch.setattr(worker_module, "run_row", stand_in_path)
    job_worker = JobWorker(config.shared, config.worker, types.SimpleNamespace(path=None), store)  # type: ignore[arg-type]
    held, delivery_counts = record_deliveries(job_worker, monkeypatch)
    custom_ids = [f"r{index}" for index in range(ROWS)]
    await store.accept("j", "demo", "", custom_ids, 3600.0)
    supervisor = Supervisor()
    try:
        await job_worker.start(supervisor)
        await publish_embed_rows(job_worker, custom_ids)
        deadline = time.monotonic() + 30
        while (job := await store.get_job("j")) is not None and job.completed_rows + job.failed_rows < ROWS:
            assert time.monotonic() < deadline, f"rows left undone: {await store.row_states('j')}"
            await asyncio.sleep(0.1)
    finally:
        await stop_and_delete_topology(job_worker, prefix)
    job = await store.get_job("j")
    assert job is not None and (job.completed_rows, job.failed_rows) == (ROWS, 0)  # none ABORTED
    assert max(delivery_counts) <= 1
    # Each delivery unacked for about one row: none waited out the consumer timeout behind the others.
    assert held and max(held) < CONSUMER_TIMEOUT_S, sorted(held)


async def test_the_rows_prefetch_follows_the_concurrency_bound(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """RabbitMQ applies a changed basic.qos only to consumers started after it: the worker consumes
    again with the bound as its prefetch, and cancels the consumer it replaces; rows still flow."""

    async def stand_in_path(path: object, task: jobs_pb2.RowTask, request_id: str, timeout_s: float) -> RowRun:
        await asyncio.sleep(0.05)
        return RowRun(jobs_pb2.RowResult(job_id=task.job_id, custom_id=task.row.custom_id, output="ok"), 0.05)

    monkeypatch.setattr(worker_module, "run_row", stand_in_path)
    prefix = f"test-prefetch-{uuid.uuid4().hex[:8]}"
    settings = {"TENANTS_FILE": TENANTS, "AMQP_URL": AMQP_URL, "AMQP_PREFIX": prefix, "WORKER_PREFETCH": "3", "WORKER_CONCURRENCY_INITIAL": "4"}
    config = load_config(WorkerConfig, ENV_PREFIX, {f"{ENV_PREFIX}{name}": value for name, value in settings.items()})
    job_worker = JobWorker(config.shared, config.worker, types.SimpleNamespace(path=None), store)  # type: ignore[arg-type]
    custom_ids = [f"r{index}" for index in range(6)]
    await store.accept("j", "demo", "", custom_ids, 3600.0)
    try:
        await job_worker.start(Supervisor())
        assert job_worker._prefetch == 3  # the bound (4), at most WORKER_PREFETCH
        first_tag = job_worker._rows_tag
        job_worker.concurrency.limit = 1.0  # as a decrease for RESOURCE_EXHAUSTED leaves it
        job_worker._bound_moved()
        assert job_worker._refollow is not None
        await asyncio.wait_for(job_worker._refollow, 10)
        assert job_worker._prefetch == 1 and job_worker._rows_tag != first_tag
        await publish_embed_rows(job_worker, custom_ids)
        deadline = time.monotonic() + 30
        while (job := await store.get_job("j")) is not None and job.completed_rows < len(custom_ids):
            assert time.monotonic() < deadline, f"rows left undone: {await store.row_states('j')}"
            await asyncio.sleep(0.05)
    finally:
        await stop_and_delete_topology(job_worker, prefix)


async def test_a_row_cut_again_and_again_is_handed_back_before_the_consumer_timeout(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row an overloaded engine keeps cutting was retried with doubling deadlines inside one
    delivery, past the consumer timeout (with the defaults 120 + 240 + 480 + 960 s before the
    ceiling's attempt). Through the real broker: it is handed back before an attempt that could not
    end in time, the deadline that cut it in its headers, and its next delivery goes on from there."""
    prefix = f"test-ct-cut-{uuid.uuid4().hex[:8]}"
    settings = {
        "TENANTS_FILE": TENANTS, "AMQP_URL": AMQP_URL, "AMQP_PREFIX": prefix, "WORKER_CONSUMER_TIMEOUT_S": "2",
        "WORKER_ROW_TIMEOUT_CEILING_S": "1.6", "WORKER_ROW_TIMEOUT_FLOOR_S": "0.1", "WORKER_ROW_TIMEOUT_S": "0.2",
        "WORKER_RETRY_BASE_S": "0.01", "WORKER_RETRY_CAP_S": "0.02",
    }  # fmt: skip
    config = load_config(WorkerConfig, ENV_PREFIX, {f"{ENV_PREFIX}{name}": value for name, value in settings.items()})
    given: list[float] = []

    async def overloaded_path(path: object, task: jobs_pb2.RowTask, request_id: str, timeout_s: float) -> RowRun:
        given.append(timeout_s)
        await asyncio.sleep(timeout_s)
        raise DeadlineExceeded("the row's deadline passed")

    monkeypatch.setattr(worker_module, "run_row", overloaded_path)
    job_worker = JobWorker(config.shared, config.worker, types.SimpleNamespace(path=None), store)  # type: ignore[arg-type]
    held, delivery_counts = record_deliveries(job_worker, monkeypatch)
    await store.accept("j", "demo", "", ["e"], 3600.0)
    try:
        await job_worker.start(Supervisor())
        await publish_embed_rows(job_worker, ["e"])
        deadline = time.monotonic() + 30
        while (job := await store.get_job("j")) is not None and job.failed_rows + job.completed_rows < 1:
            assert time.monotonic() < deadline, f"row left undone: {await store.row_states('j')}"
            await asyncio.sleep(0.1)
    finally:
        await stop_and_delete_topology(job_worker, prefix)
    # 0.2, 0.4, 0.8 s in the first delivery (1.6 s more would end past 1.9 s of it), the ceiling in the
    # second, where the row fails: the doubling went on across the hand-back.
    assert given == [pytest.approx(0.2), pytest.approx(0.4), pytest.approx(0.8), pytest.approx(1.6)]
    [result] = (await store.list_results("j", 10, ""))[0]
    assert result.error.code == "DEADLINE_EXCEEDED" and "the longest a row attempt may take" in result.error.message
    assert len(held) == 2 and max(held) < config.worker.consumer_timeout_s, held
    assert max(delivery_counts) == 0  # a new message each time: nothing the broker redelivered or counted
