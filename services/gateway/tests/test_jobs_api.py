"""The job RPCs' logic on a real (SQLite) job store: the completion window from SubmitJob, and
WatchJob following a job through finalizing and expired."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from google.protobuf import duration_pb2
from sluice.jobs.v1 import jobs_pb2

from sluice_common.errors import InvalidArgument
from sluice_gateway.jobs.store import JobStore
from sluice_gateway.jobs.job import expired_result
from sluice_gateway.jobs.api import JobsApi
from sluice_common.tenants import TenantDirectory

TENANTS = TenantDirectory.from_file(Path(__file__).resolve().parents[3] / "config" / "tenants.toml")
KEY = "sk-sluice-demo"


def job_request(job_id: str, rows: int, window: duration_pb2.Duration | None = None) -> jobs_pb2.JobRequest:
    job = jobs_pb2.JobRequest(job_id=job_id, reply_to="q")
    for i in range(rows):
        job.rows.add(custom_id=f"r{i}").embed.inputs.append("x")
    if window is not None:
        job.completion_window.CopyFrom(window)
    return job


async def test_submit_sets_the_window_and_rejects_a_bad_one(store: JobStore) -> None:
    published: list[jobs_pb2.AdmittedJob] = []
    api = JobsApi(store, TENANTS, published.append, max_rows=10, completion_window_s=86400.0)
    tenant = TENANTS.authenticate(f"Bearer {KEY}")
    default = await api.submit(tenant, job_request("d", 1))
    assert default.expires_at.ToSeconds() - default.created_at.ToSeconds() in (86399, 86400)
    short = await api.submit(tenant, job_request("s", 1, duration_pb2.Duration(seconds=60)))
    assert short.expires_at.ToSeconds() - short.created_at.ToSeconds() in (59, 60)
    with pytest.raises(InvalidArgument, match="completion_window"):
        await api.submit(tenant, job_request("bad", 1, duration_pb2.Duration(seconds=0)))
    assert [a.job.job_id for a in published] == ["d", "s"]


async def test_watch_follows_finalizing_and_ends_on_completed(store: JobStore) -> None:
    api = JobsApi(store, TENANTS, lambda job: None, max_rows=10, completion_window_s=86400.0, watch_poll_s=0.01)
    tenant = TENANTS.authenticate(f"Bearer {KEY}")
    await store.accept("j", "demo", "q", ["a"], 86400.0)
    states: list[int] = []

    async def watch() -> None:
        async for job in api.watch(tenant, "j"):
            states.append(job.state)

    watching = asyncio.create_task(watch())
    await asyncio.sleep(0.05)
    await store.finish_row(jobs_pb2.RowResult(job_id="j", custom_id="a", output="x"))
    await asyncio.sleep(0.05)
    assert not watching.done()  # finalizing is not the end
    await store.summary_told("j")
    await asyncio.wait_for(watching, 2)
    assert states == [jobs_pb2.JOB_STATE_IN_PROGRESS, jobs_pb2.JOB_STATE_FINALIZING, jobs_pb2.JOB_STATE_COMPLETED]


async def test_watch_ends_on_expired_only_once_every_row_is_stored(store: JobStore) -> None:
    api = JobsApi(store, TENANTS, lambda job: None, max_rows=10, completion_window_s=86400.0, watch_poll_s=0.01)
    tenant = TENANTS.authenticate(f"Bearer {KEY}")
    await store.accept("j", "demo", "q", ["a", "b"], 0.05)
    await asyncio.sleep(0.1)
    await store.expire_overdue()
    seen: list[jobs_pb2.Job] = []

    async def watch() -> None:
        async for job in api.watch(tenant, "j"):
            seen.append(job)

    watching = asyncio.create_task(watch())
    await asyncio.sleep(0.05)
    assert not watching.done() and seen[-1].state == jobs_pb2.JOB_STATE_EXPIRED  # rows still to be stored
    for custom_id in ("a", "b"):
        task = jobs_pb2.RowTask(job_id="j", row=jobs_pb2.JobRow(custom_id=custom_id))
        await store.finish_row(expired_result(task, 0.05))
    await asyncio.wait_for(watching, 2)
    assert (seen[-1].state, seen[-1].failed_rows, seen[-1].total_rows) == (jobs_pb2.JOB_STATE_EXPIRED, 2, 2)


async def test_a_submitted_job_carries_submit_jobs_request_id_to_the_worker() -> None:
    """The worker binds the message's x-request-id: without it, its job_accepted line could not be
    joined to the SubmitJob call that made the job."""
    from sluice_common.amqp import JobTopology
    from sluice_common.request_context import bind_request_id
    from sluice_gateway.jobs.api import JobRequestPublisher

    sent = []

    class Outbox:
        def submit(self, message) -> None:  # type: ignore[no-untyped-def]
            sent.append(message)

    bind_request_id("req-submit-1")
    JobRequestPublisher(Outbox(), JobTopology("t")).submit_job(jobs_pb2.AdmittedJob(job=job_request("j", 1), tenant="demo"))  # type: ignore[arg-type]
    [message] = sent
    assert message.request_id == "req-submit-1" and message.to_aio_pika().headers["x-request-id"] == "req-submit-1"
