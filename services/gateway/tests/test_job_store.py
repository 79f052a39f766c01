"""The job store on SQLite and on PostgreSQL: idempotent rows, counts, states, cancellation, pages."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from sluice.jobs.v1 import jobs_pb2

from sluice_common.errors import InvalidArgument
from sluice_gateway import job_store as s
from sluice_gateway.job_store import JobStore

PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[JobStore]:
    schema = f"jobs_test_{uuid.uuid4().hex[:8]}"
    job_store = JobStore.create(PG_DSN if request.param == "postgres" else "", tmp_path / "jobs.sqlite3", schema)
    await job_store.open()
    yield job_store
    await job_store.close()
    if request.param == "postgres":
        connection = await asyncpg.connect(PG_DSN)
        await connection.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await connection.close()


def result(custom_id: str, error: bool = False) -> jobs_pb2.RowResult:
    r = jobs_pb2.RowResult(job_id="j", custom_id=custom_id, output="" if error else f"out {custom_id}")
    if error:
        r.error.code = "INVALID_ARGUMENT"
    return r


async def test_accept_is_idempotent_and_rows_finish_once(store: JobStore) -> None:
    job, open_rows = await store.accept("j", "demo", "q", ["a", "b", "c"])
    assert (job.state, job.total_rows, open_rows) == (s.IN_PROGRESS, 3, {"a", "b", "c"})
    assert await store.claim_row("j", "a", "w1", take_over=False) == s.CLAIMED
    assert await store.claim_row("j", "a", "w2", take_over=False) == s.BUSY
    assert await store.finish_row(result("a")) is True
    assert await store.finish_row(result("a")) is False  # a redelivered copy is never recorded twice
    assert await store.claim_row("j", "a", "w2", take_over=True) == s.DONE
    # The job message redelivered before it was acked: only the open rows are published again.
    _, again = await store.accept("j", "demo", "q", ["a", "b", "c"])
    assert again == {"b", "c"}
    await store.mark_split("j")
    assert (await store.accept("j", "demo", "q", ["a", "b", "c"]))[1] == set()
    with pytest.raises(InvalidArgument):
        await store.accept("j", "other-tenant", "q", ["a"])
    assert await store.finish_row(result("b", error=True))
    assert await store.claim_row("j", "c", "w1", take_over=False) == s.CLAIMED
    await store.release_row("j", "c")
    assert await store.claim_row("j", "c", "w1", take_over=False) == s.CLAIMED
    assert await store.finish_row(result("c"))
    job = await store.get_job("j")
    assert job is not None
    assert (job.state, job.completed_rows, job.failed_rows) == (s.COMPLETED, 2, 1)
    proto = job.to_proto()
    assert proto.state == jobs_pb2.JOB_STATE_COMPLETED and proto.total_rows == 3


async def test_results_page_in_row_order(store: JobStore) -> None:
    ids = [f"r{i}" for i in range(7)]
    await store.accept("j", "demo", "", ids)
    for custom_id in reversed(ids):
        await store.claim_row("j", custom_id, "w", False)
        await store.finish_row(result(custom_id))
    seen: list[str] = []
    token = ""
    while True:
        page, token = await store.list_results("j", 3, token)
        seen += [r.custom_id for r in page]
        if not token:
            break
    assert seen == ids
    assert (await store.row_result("j", "r3")).output == "out r3"  # type: ignore[union-attr]


async def test_cancel_stops_new_rows_and_settles_when_running_rows_end(store: JobStore) -> None:
    await store.accept("j", "demo", "", ["a", "b", "c"])
    assert await store.claim_row("j", "a", "w", False) == s.CLAIMED
    job = await store.cancel("j")
    assert job is not None and job.state == s.CANCELLING
    assert await store.claim_row("j", "b", "w", False) == s.SKIPPED
    assert await store.finish_row(result("a"))
    job = await store.get_job("j")
    assert job is not None and (job.state, job.completed_rows) == (s.CANCELLED, 1)


async def test_submitted_then_failed_or_accepted(store: JobStore) -> None:
    job = await store.record_submitted("v", "demo", 2, "q")
    assert job.state == s.VALIDATING
    job, rows = await store.accept("v", "demo", "q", ["a", "b"])
    assert job.state == s.IN_PROGRESS and rows == {"a", "b"}
    await store.record_failed("f", "demo", "q", "bad")
    failed = await store.get_job("f")
    assert failed is not None and failed.state == s.FAILED and failed.error == "bad"
