"""The job worker against the real RabbitMQ and a real job store: what reaches the rows queue runs
only as a row of its job's tenant, and a key never stays in the dead-letter queue.

A job's results went to the default exchange with its reply_to as the routing key, so a tenant
whose reply_to was `<prefix>.jobs.rows` put its RowResults on the internal row queue; the worker
read any message there as a RowTask, and a RowResult whose custom_id is a tenant's name and whose
output (forced by a structured-outputs regex) is the bytes of a JobRow decodes as a RowTask of that
tenant: the row ran as someone else. Here the reviewer's message is published as the worker's
replies were (the default exchange), and a RowTask naming another tenant than its job's as the
split publishes rows; the inference path is a stand-in recording who each row ran as."""

from __future__ import annotations

import asyncio
import json
import os
import time
import types
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aio_pika
import pytest
from sluice.common.v1 import types_pb2
from sluice.jobs.v1 import jobs_pb2

from sluice_common.amqp import DEAD_REASON_HEADER, JobTopology, replay_dead_letters
from sluice_common.config import load_config
from sluice_common.supervision import Supervisor
from sluice_gateway.config import ENV_PREFIX, WorkerConfig
from sluice_gateway.jobs import worker as worker_module
from sluice_gateway.jobs.job import PoisonRow, RowRun
from sluice_gateway.jobs.store import JobStore
from sluice_gateway.jobs.worker import JobWorker

AMQP_URL = os.environ.get("SLUICE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
TENANTS = str(Path(__file__).resolve().parents[3] / "config" / "tenants.toml")
DEMO_KEY = "sk-sluice-demo"


@dataclass
class Running:
    worker: JobWorker
    prefix: str
    channel: aio_pika.abc.AbstractChannel
    ran: list[tuple[str, str, str, bool]] = field(default_factory=list)  # (job id, custom id, tenant, text_logging)

    @property
    def topology(self) -> JobTopology:
        return JobTopology(self.prefix)

    async def dead_letters(self, wait_s: float = 5.0, expect: int = 1) -> list[aio_pika.abc.AbstractIncomingMessage]:
        """The messages in `<prefix>.jobs.dead` (acked), once `expect` have come or `wait_s` passed."""
        queue = await self.channel.get_queue(self.topology.dead_queue)
        found: list[aio_pika.abc.AbstractIncomingMessage] = []
        deadline = time.monotonic() + wait_s
        while len(found) < expect and time.monotonic() < deadline:
            message = await queue.get(fail=False, timeout=5)
            if message is None:
                await asyncio.sleep(0.05)
                continue
            await message.ack()
            found.append(message)
        return found


@pytest.fixture
async def running(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Running]:
    prefix = f"test-forged-{uuid.uuid4().hex[:8]}"
    settings = {"TENANTS_FILE": TENANTS, "AMQP_URL": AMQP_URL, "AMQP_PREFIX": prefix}
    config = load_config(WorkerConfig, ENV_PREFIX, {f"{ENV_PREFIX}{name}": value for name, value in settings.items()})
    ran: list[tuple[str, str, str, bool]] = []

    async def stand_in_path(path: object, task: jobs_pb2.RowTask, request_id: str, timeout_s: float) -> RowRun:
        ran.append((task.job_id, task.row.custom_id, task.tenant, task.text_logging))
        if not task.row.WhichOneof("body"):
            raise PoisonRow("the row has neither a generate nor an embed body")  # as run_row does
        return RowRun(jobs_pb2.RowResult(job_id=task.job_id, custom_id=task.row.custom_id, output="ok"), 0.01)

    monkeypatch.setattr(worker_module, "run_row", stand_in_path)
    job_worker = JobWorker(config.shared, config.worker, types.SimpleNamespace(path=None, tenants=_tenants()), store)  # type: ignore[arg-type]
    connection = await aio_pika.connect(AMQP_URL)
    try:
        await job_worker.start(Supervisor())
        channel = await connection.channel(publisher_confirms=True)
        yield Running(job_worker, prefix, channel, ran)
    finally:
        await job_worker.stop(1.0)
        await JobTopology(prefix).delete(await connection.channel())
        await connection.close()


def _tenants():  # noqa: ANN202 - the worker's TenantDirectory
    from sluice_common.tenants import TenantDirectory

    return TenantDirectory.from_file(Path(TENANTS))


async def wait_for(condition, timeout_s: float = 10.0) -> None:  # noqa: ANN001 - an async predicate
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def embed_row(custom_id: str) -> jobs_pb2.JobRow:
    return jobs_pb2.JobRow(custom_id=custom_id, embed=jobs_pb2.EmbedRow(model="all-minilm-l6-v2", inputs=["hello"]))


async def test_a_result_misrouted_into_the_rows_queue_is_dead_lettered_and_never_run(running: Running, store: JobStore) -> None:
    """The reviewer's message: the attacker's own job has a row "z" still pending; its RowResult
    (custom_id: the victim tenant's name; output: the bytes of a JobRow "z") reaches the rows queue
    as a reply would, and decodes as a RowTask of "z" under tenant "private"."""
    await store.accept("attacker-job", "demo", "", ["z"], 3600.0, text_logging=True)
    forged = embed_row("z").SerializeToString().decode()
    result = jobs_pb2.RowResult(job_id="attacker-job", custom_id="private", output=forged, finish_reason=types_pb2.FINISH_REASON_STOP)
    assert jobs_pb2.RowTask.FromString(result.SerializeToString()).tenant == "private"  # what the old worker ran it as
    reply = aio_pika.Message(
        result.SerializeToString(), content_type="application/x-protobuf", type="sluice.jobs.v1.RowResult", message_id="attacker-job/private"
    )
    await running.channel.default_exchange.publish(reply, running.topology.rows_queue)  # as _reply published it
    [dead] = await running.dead_letters()
    assert dead.body == result.SerializeToString() and dead.type == "sluice.jobs.v1.RowResult"
    assert "not a row message" in str(dead.headers[DEAD_REASON_HEADER]) and "sluice.jobs.v1.RowResult" in str(dead.headers[DEAD_REASON_HEADER])
    assert running.ran == []
    assert await store.row_states("attacker-job") == {"pending": 1}  # nothing stored for it: its real message still runs it


async def test_a_row_message_naming_another_tenant_does_not_run_as_it(running: Running, store: JobStore) -> None:
    """A RowTask of the row type (as a producer allowed on the exchange could publish one) naming
    another tenant than its job's: refused, nothing claimed or stored; the job's own row message
    then runs as the job's tenant, with the text-logging setting the job was accepted with."""
    await store.accept("job-of-private", "private", "", ["r"], 3600.0, text_logging=False)
    forged = jobs_pb2.RowTask(job_id="job-of-private", tenant="demo", row=embed_row("r"), text_logging=True)
    await running.worker._publish_row(forged)
    [dead] = await running.dead_letters()
    reason = str(dead.headers[DEAD_REASON_HEADER])
    assert "'demo'" in reason and "'private'" in reason, reason
    assert running.ran == [] and await store.row_states("job-of-private") == {"pending": 1}
    # The job's own row message, its text_logging forged on: runs as the job says.
    await running.worker._publish_row(jobs_pb2.RowTask(job_id="job-of-private", tenant="private", row=embed_row("r"), text_logging=True))

    async def done() -> bool:
        return await store.row_states("job-of-private") == {"done": 1}

    await wait_for(done)
    assert running.ran == [("job-of-private", "r", "private", False)]


async def test_a_row_the_worker_dead_lettered_keeps_its_type_when_replayed(running: Running, store: JobStore) -> None:
    """Every legitimate row message carries the row type, a replayed dead letter too: replayed, the
    row is read as a row (found done, acked), not dead-lettered again as no row message."""
    await store.accept("j", "demo", "", ["poison"], 3600.0, text_logging=True)
    await running.worker._publish_row(jobs_pb2.RowTask(job_id="j", tenant="demo", row=jobs_pb2.JobRow(custom_id="poison")))

    async def dead_count() -> int:
        queue = await running.channel.declare_queue(running.topology.dead_queue, passive=True)
        return queue.declaration_result.message_count or 0

    async def one_dead() -> bool:
        return await dead_count() == 1

    await wait_for(one_dead)
    assert await store.row_states("j") == {"done": 1}  # reported failed, the job goes on
    assert await replay_dead_letters(AMQP_URL, running.topology.dead_queue, running.topology.exchange) == 1

    async def consumed() -> bool:
        queue = await running.channel.declare_queue(running.topology.rows_queue, passive=True)
        return (queue.declaration_result.message_count or 0) == 0

    await wait_for(consumed)
    await asyncio.sleep(0.5)  # a copy dead-lettered again would be in jobs.dead by now
    assert await dead_count() == 0
    assert [custom_id for _, custom_id, _, _ in running.ran] == ["poison"]  # found done: not run again


async def test_a_job_request_the_worker_dead_letters_leaves_its_api_key_out(running: Running) -> None:
    """A producer's JobRequest under a Sluice type the worker does not know: kept in jobs.dead to be
    looked at or replayed, but without the producer's plaintext key; the rest as it was."""
    job = {"job_id": "ext", "api_key": DEMO_KEY, "reply_to": "my-results", "rows": [{"custom_id": "q", "embed": {"inputs": ["x"]}}]}
    exchange = await running.channel.get_exchange(running.topology.exchange)
    message = aio_pika.Message(json.dumps(job).encode(), content_type="application/json", type="sluice.jobs.v2.JobRequest", message_id="ext")
    await exchange.publish(message, running.topology.job_routing_key)
    [dead] = await running.dead_letters()
    assert DEMO_KEY.encode() not in dead.body
    assert json.loads(dead.body) == {name: value for name, value in job.items() if name != "api_key"}
    assert (dead.type, dead.message_id, dead.content_type) == ("sluice.jobs.v2.JobRequest", "ext", "application/json")
    assert "api_key was removed" in str(dead.headers[DEAD_REASON_HEADER])
