"""The job store on SQLite and on PostgreSQL: idempotent rows, counts, states, cancellation, pages,
completion windows (expired), summaries (finalizing) and the sweep."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import asyncpg
import pytest
from sluice.jobs.v1 import jobs_pb2

from sluice_common.channels import PAGE_BYTES
from sluice_common.errors import InvalidArgument
from sluice_common.sqlstore import open_sql_db
from sluice_gateway.jobs import store as s
from sluice_gateway.jobs.store import JobStore
from sluice_gateway.jobs.job import expired_result

PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"
DAY = 86400.0


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
    job, open_rows = await store.accept("j", "demo", "q", ["a", "b", "c"], DAY)
    assert (job.state, job.total_rows, open_rows) == (s.IN_PROGRESS, 3, {"a", "b", "c"})
    assert await store.claim_row("j", "a", "w1", take_over=False) == s.CLAIMED
    assert await store.claim_row("j", "a", "w2", take_over=False) == s.BUSY
    assert await store.finish_row(result("a")) is not None
    assert await store.finish_row(result("a")) is None  # a redelivered copy is never recorded twice
    assert await store.claim_row("j", "a", "w2", take_over=True) == s.DONE
    # The job message redelivered before it was acked: only the open rows are published again.
    _, again = await store.accept("j", "demo", "q", ["a", "b", "c"], DAY)
    assert again == {"b", "c"}
    await store.mark_split("j")
    assert (await store.accept("j", "demo", "q", ["a", "b", "c"], DAY))[1] == set()
    with pytest.raises(InvalidArgument):
        await store.accept("j", "other-tenant", "q", ["a"], DAY)
    assert await store.finish_row(result("b", error=True))
    assert await store.claim_row("j", "c", "w1", take_over=False) == s.CLAIMED
    await store.release_row("j", "c", "w1")
    assert await store.claim_row("j", "c", "w1", take_over=False) == s.CLAIMED
    last = await store.finish_row(result("c"))
    assert last is not None and last.ends_job
    job = await store.get_job("j")
    assert job is not None
    # Every row stored: finalizing until the summary is told, then completed.
    assert (job.state, job.completed_rows, job.failed_rows) == (s.FINALIZING, 2, 1)
    assert job.to_proto().state == jobs_pb2.JOB_STATE_FINALIZING
    await store.summary_told("j")
    job = await store.get_job("j")
    assert job is not None and job.state == s.COMPLETED
    proto = job.to_proto()
    assert proto.state == jobs_pb2.JOB_STATE_COMPLETED and proto.total_rows == 3


async def test_results_page_in_row_order(store: JobStore) -> None:
    ids = [f"r{i}" for i in range(7)]
    await store.accept("j", "demo", "", ids, DAY)
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


async def test_a_page_of_long_results_stops_short_of_page_bytes(store: JobStore) -> None:
    """1000 rows of long outputs (or logprobs) made one page over a client's 4 MiB receive limit
    (RESOURCE_EXHAUSTED: the results unreadable): a page stops short of PAGE_BYTES, holds at least
    one row (a row larger alone comes alone), and its token resumes after its last row."""
    ids = [f"r{i}" for i in range(6)]
    await store.accept("j", "demo", "", ids, DAY)
    for number, custom_id in enumerate(ids):
        await store.claim_row("j", custom_id, "w", False)
        size = PAGE_BYTES + 1 if number == 4 else 1024 * 1024  # r4: larger than a page alone
        await store.finish_row(jobs_pb2.RowResult(job_id="j", custom_id=custom_id, output="x" * size))
    pages: list[list[str]] = []
    token = ""
    while True:
        page, token = await store.list_results("j", 1000, token)
        assert sum(r.ByteSize() for r in page) <= PAGE_BYTES or len(page) == 1
        pages.append([r.custom_id for r in page])
        if not token:
            break
    assert pages == [["r0", "r1"], ["r2", "r3"], ["r4"], ["r5"]]


@pytest.mark.parametrize("token", ["x1", "-1", "²", "1" * 5000, "99999999999999999999", "99999999999", str(2**31)])
async def test_a_page_token_no_response_gave_is_invalid_argument(store: JobStore, token: str) -> None:
    """ "²" passes str.isdigit and fails int(); 5,000 digits exceed int()'s limit; 20 digits overflow
    the database's integer; 11 digits, or 2**31, overflow PostgreSQL's INTEGER (int4) that seq is:
    each was INTERNAL (SQLite answered an empty page)."""
    await store.accept("j", "demo", "", ["r"], DAY)
    with pytest.raises(InvalidArgument) as caught:
        await store.list_results("j", 3, token)
    assert caught.value.field_name == "page_token"


async def test_cancel_stops_new_rows_and_settles_when_running_rows_end(store: JobStore) -> None:
    await store.accept("j", "demo", "", ["a", "b", "c"], DAY)
    assert await store.claim_row("j", "a", "w", False) == s.CLAIMED
    job = await store.cancel("j")
    assert job is not None and job.state == s.CANCELLING
    assert await store.claim_row("j", "b", "w", False) == s.SKIPPED
    assert await store.finish_row(result("a"))
    job = await store.get_job("j")
    assert job is not None and (job.state, job.completed_rows) == (s.CANCELLED, 1)


async def test_submitted_then_failed_or_accepted(store: JobStore) -> None:
    job = await store.record_submitted("v", "demo", 2, "q", DAY)
    assert job.state == s.VALIDATING
    job, rows = await store.accept("v", "demo", "q", ["a", "b"], DAY)
    assert job.state == s.IN_PROGRESS and rows == {"a", "b"}
    await store.record_failed("f", "demo", "q", "bad")
    failed = await store.get_job("f")
    assert failed is not None and failed.state == s.FAILED and failed.error == "bad"


# ---- completion windows (expired), summaries (finalizing), the sweep


def task(custom_id: str, job_id: str = "j") -> jobs_pb2.RowTask:
    return jobs_pb2.RowTask(job_id=job_id, row=jobs_pb2.JobRow(custom_id=custom_id))


async def test_a_row_claimed_after_the_window_is_stored_once_as_expired(store: JobStore) -> None:
    await store.accept("j", "demo", "q", ["a", "b", "c"], 0.3, "application/json")
    assert await store.claim_row("j", "a", "w1", take_over=False) == s.CLAIMED  # running when the window ends
    await asyncio.sleep(0.35)
    # Two workers hold copies of b's message: neither runs it, and only one result is stored.
    assert await store.claim_row("j", "b", "w1", take_over=False) == s.OVERDUE
    assert await store.claim_row("j", "b", "w2", take_over=False) == s.OVERDUE
    job = await store.get_job("j")
    assert job is not None and job.state == s.EXPIRED and not job.settled
    assert job.window_s == pytest.approx(0.3)
    expired = expired_result(task("b"), job.window_s)
    first, second = await store.finish_row(expired), await store.finish_row(expired)
    assert first is not None and not first.ends_job and second is None
    # a was running: it finishes and is stored as usual, even though the job has expired.
    assert await store.claim_row("j", "a", "w2", take_over=False) == s.BUSY
    finished_a = await store.finish_row(result("a"))
    assert finished_a is not None and not finished_a.ends_job
    assert await store.claim_row("j", "c", "w1", take_over=True) == s.OVERDUE
    last = await store.finish_row(expired_result(task("c"), job.window_s))
    assert last is not None and last.ends_job  # the last row stored: the summary is due
    assert (last.job.state, last.job.completed_rows, last.job.failed_rows, last.job.total_rows) == (s.EXPIRED, 1, 2, 3)
    assert last.job.settled
    stored = await store.row_result("j", "b")
    assert stored is not None and stored.error.code == "EXPIRED" and "(0.3s)" in stored.error.message
    summary = last.job.summary()
    assert (summary.state, summary.completed_rows, summary.failed_rows) == (jobs_pb2.JOB_STATE_EXPIRED, 1, 2)
    assert summary.expires_at.ToNanoseconds() > summary.created_at.ToNanoseconds()
    assert last.job.reply_content_type == "application/json"
    # Left untold (a worker died), the sweep finds it; once told, never again.
    assert [j.job_id for j in await store.summaries_due(0.0)] == ["j"]
    await store.summary_told("j")
    assert await store.summaries_due(0.0) == []
    job = await store.get_job("j")
    assert job is not None and job.state == s.EXPIRED and job.summary_sent


async def test_the_sweep_expires_overdue_jobs_only(store: JobStore) -> None:
    await store.accept("short", "demo", "", ["a"], 60.0)
    await store.accept("long", "demo", "", ["a"], DAY)
    await store.accept("done", "demo", "", ["a"], 60.0)
    await store.finish_row(jobs_pb2.RowResult(job_id="done", custom_id="a", output="x"))
    later = time.time() + 120
    assert await store.expire_overdue(later) == 1
    assert await store.expire_overdue(later) == 0  # conditional on in_progress: never twice
    states = {job_id: (await store.get_job(job_id)).state for job_id in ("short", "long", "done")}  # type: ignore[union-attr]
    assert states == {"short": s.EXPIRED, "long": s.IN_PROGRESS, "done": s.FINALIZING}
    # An expired job is not settled until its rows are stored, so the sweep tells nothing yet.
    assert [j.job_id for j in await store.summaries_due(0.0, later)] == ["done"]


async def test_the_sweep_finishes_a_finalizing_job_its_worker_left(store: JobStore) -> None:
    await store.accept("j", "demo", "q", ["a", "b"], DAY)
    first = await store.finish_row(result("a"))
    last = await store.finish_row(result("b", error=True))
    assert first is not None and not first.ends_job
    assert last is not None and last.ends_job and last.job.state == s.FINALIZING
    assert last.job.summary().state == jobs_pb2.JOB_STATE_COMPLETED  # told as the outcome
    # The worker died before telling it: not due while fresh (its worker may be telling it now) ...
    assert await store.summaries_due(5.0) == []
    # ... due once it has been finalizing longer than the grace.
    (due,) = await store.summaries_due(5.0, time.time() + 6)
    assert (due.job_id, due.state, due.completed_rows, due.failed_rows) == ("j", s.FINALIZING, 1, 1)
    told = await store.summary_told("j")
    assert told is not None and told.state == s.COMPLETED and told.summary_sent
    again = await store.summary_told("j")  # a second sweeper: no change
    assert again is not None and again.state == s.COMPLETED and again.updated_at == told.updated_at
    assert await store.summaries_due(0.0, time.time() + 6) == []


async def test_a_cancelled_job_gets_its_summary_from_the_sweep(store: JobStore) -> None:
    await store.accept("j", "demo", "q", ["a", "b"], DAY)
    job = await store.cancel("j")
    assert job is not None and job.state == s.CANCELLED
    (due,) = await store.summaries_due(0.0, time.time() + 1)
    assert due.summary().state == jobs_pb2.JOB_STATE_CANCELLED
    await store.summary_told("j")
    assert await store.summaries_due(0.0, time.time() + 1) == []


async def test_concurrent_finishes_count_once_and_end_the_job_once(store: JobStore) -> None:
    ids = [f"r{i}" for i in range(12)]
    await store.accept("j", "demo", "q", ids, DAY)
    # Every row finished twice at once (two workers with copies), all rows at once.
    outcomes = await asyncio.gather(*(store.finish_row(result(cid)) for cid in ids + ids))
    stored = [o for o in outcomes if o is not None]
    assert len(stored) == len(ids)
    assert sum(o.ends_job for o in stored) == 1
    job = await store.get_job("j")
    assert job is not None and (job.state, job.completed_rows, job.failed_rows) == (s.FINALIZING, 12, 0)


async def test_concurrent_claims_of_one_row_claim_it_once(store: JobStore) -> None:
    ids = [f"r{i}" for i in range(30)]
    await store.accept("j", "demo", "q", ids, DAY)
    # Two workers holding copies of every row claim them all at once (PostgreSQL: two connections
    # that may both read "pending" before either writes).
    outcomes = await asyncio.gather(*(store.claim_row("j", cid, worker, False) for cid in ids for worker in ("w1", "w2")))
    per_row = [outcomes[i : i + 2] for i in range(0, len(outcomes), 2)]
    assert all(sorted(pair) == [s.BUSY, s.CLAIMED] for pair in per_row), per_row


async def test_a_stopped_job_does_not_cancel_a_row_running_elsewhere(store: JobStore) -> None:
    await store.accept("j", "demo", "", ["a", "b"], DAY)
    assert await store.claim_row("j", "a", "w1", False) == s.CLAIMED
    await store.cancel("j")
    # A second copy of "a" arrives at another worker: acked without running, "a" still finishes.
    assert await store.claim_row("j", "a", "w2", False) == s.SKIPPED
    assert await store.finish_row(result("a")) is not None
    job = await store.get_job("j")
    assert job is not None and (job.state, job.completed_rows) == (s.CANCELLED, 1)


async def test_cancelling_an_expired_job_keeps_its_rows_owed_their_expired_result(store: JobStore) -> None:
    await store.accept("j", "demo", "q", ["a", "b"], 60.0)
    assert await store.expire_overdue(time.time() + 120) == 1
    job = await store.cancel("j")
    assert job is not None and job.state == s.EXPIRED
    assert await store.row_states("j") == {"pending": 2}
    assert await store.claim_row("j", "a", "w", False) == s.OVERDUE


async def test_a_job_whose_last_row_is_stored_past_its_window_ends_expired(store: JobStore) -> None:
    await store.accept("j", "demo", "q", ["a", "b"], 0.2)
    # Both rows claimed within the window; neither a claim nor the sweep has seen it end.
    assert await store.claim_row("j", "a", "w", False) == s.CLAIMED
    assert await store.claim_row("j", "b", "w", False) == s.CLAIMED
    await store.finish_row(result("a"))
    await asyncio.sleep(0.3)
    finished = await store.finish_row(expired_result(task("b"), 0.2))
    assert finished is not None and finished.ends_job
    assert (finished.job.state, finished.job.completed_rows, finished.job.failed_rows) == (s.EXPIRED, 1, 1)
    assert finished.job.summary().state == jobs_pb2.JOB_STATE_EXPIRED


async def test_concurrent_last_rows_of_an_expired_job_end_it_once(store: JobStore) -> None:
    ids = [f"r{i}" for i in range(8)]
    await store.accept("j", "demo", "q", ids, 60.0)
    assert await store.expire_overdue(time.time() + 120) == 1
    outcomes = await asyncio.gather(*(store.finish_row(expired_result(task(cid), 60.0)) for cid in ids + ids))
    stored = [o for o in outcomes if o is not None]
    assert len(stored) == len(ids) and sum(o.ends_job for o in stored) == 1
    job = await store.get_job("j")
    assert job is not None and (job.state, job.failed_rows) == (s.EXPIRED, 8)


async def test_an_expired_job_split_by_a_worker_that_died_still_publishes_its_rows(store: JobStore) -> None:
    await store.accept("x", "demo", "q", ["a", "b"], 60.0)  # not marked split: the worker died
    await store.expire_overdue(time.time() + 120)
    _, open_rows = await store.accept("x", "demo", "q", ["a", "b"], 60.0)
    assert open_rows == {"a", "b"}  # so that each is still reported (as EXPIRED)
    await store.accept("c", "demo", "q", ["a"], DAY)
    await store.cancel("c")
    assert (await store.accept("c", "demo", "q", ["a"], DAY))[1] == set()  # cancelled rows never run


async def test_a_submitted_job_that_never_reaches_a_worker_fails_after_its_window(store: JobStore) -> None:
    lost = await store.record_submitted("lost", "demo", 2, "q", 60.0)
    await store.record_submitted("waiting", "demo", 1, "q", DAY)
    assert await store.fail_unadmitted(30.0, now=lost.expires_at + 29) == 0  # within the grace
    assert await store.fail_unadmitted(30.0, now=lost.expires_at + 31) == 1
    assert await store.fail_unadmitted(30.0, now=lost.expires_at + 31) == 0  # conditional: never twice
    failed = await store.get_job("lost")
    assert failed is not None and failed.state == s.FAILED and "did not reach a job worker" in failed.error
    waiting = await store.get_job("waiting")
    assert waiting is not None and waiting.state == s.VALIDATING
    # Its AdmittedJob arriving after all runs nothing.
    job, rows = await store.accept("lost", "demo", "q", ["a", "b"], 60.0)
    assert job.state == s.FAILED and rows == set()


async def test_the_window_counts_from_submit_job(store: JobStore) -> None:
    submitted = await store.record_submitted("v", "demo", 1, "q", 3600.0)
    assert submitted.expires_at == pytest.approx(submitted.created_at + 3600.0)
    job, _ = await store.accept("v", "demo", "q", ["a"], 3600.0, "application/x-protobuf")
    assert job.expires_at == pytest.approx(submitted.created_at + 3600.0)
    assert job.to_proto().expires_at.ToSeconds() == int(submitted.created_at + 3600.0)


@contextlib.asynccontextmanager
async def migrated(tmp_path: Path, backend: str, before: int, old_state: Callable[[JobStore], Awaitable[None]]) -> AsyncIterator[JobStore]:
    """A store made with the first `before` migrations, given `old_state`, then opened with every
    migration (what an upgrade does); its PostgreSQL schema dropped afterwards."""
    schema = f"jobs_test_{uuid.uuid4().hex[:8]}"
    dsn = PG_DSN if backend == "postgres" else ""
    old = JobStore(open_sql_db(dsn, tmp_path / f"{backend}.sqlite3", schema, s.MIGRATIONS[:before]))
    await old.open()
    await old_state(old)
    await old.close()
    new = JobStore.create(dsn, tmp_path / f"{backend}.sqlite3", schema)
    await new.open()
    try:
        yield new
    finally:
        await new.close()
        if backend == "postgres":
            connection = await asyncpg.connect(PG_DSN)
            await connection.execute(f'DROP SCHEMA "{schema}" CASCADE')
            await connection.close()


async def test_migration_2_keeps_old_jobs_and_tells_no_old_summary(tmp_path: Path) -> None:
    async def old_jobs(old: JobStore) -> None:
        async with old.db.transaction() as tx:
            for job_id, state in (("old-done", s.COMPLETED), ("old-cancelled", s.CANCELLED), ("old-running", s.IN_PROGRESS)):
                await tx.execute(
                    "INSERT INTO jobs (job_id, tenant, state, total_rows, reply_to, created_at, updated_at) VALUES (?, 'demo', ?, 1, 'q', 1.0, 1.0)",
                    job_id, state,
                )  # fmt: skip

    for backend in ("sqlite", "postgres"):
        async with migrated(tmp_path, backend, 1, old_jobs) as new:
            running = await new.get_job("old-running")
            assert running is not None and running.expires_at is None and not running.summary_sent
            assert await new.expire_overdue(time.time() + 10 * DAY) == 0  # no window: never expires
            assert await new.summaries_due(0.0) == []  # jobs that ended before summaries are not told one


async def test_rows_no_message_will_end_are_found_after_their_jobs_window(store: JobStore) -> None:
    """A row whose message the broker dead-lettered unrun (its delivery limit spent in an outage)
    stays pending; a running row whose worker died and whose message was lost stays running. Without
    a result each, the expired job's summary would never be due."""
    await store.accept("j", "demo", "q", ["done", "queued", "lost"], 10.0, "application/json")
    await store.accept("busy", "demo", "q", ["r"], DAY)  # in its window: nothing of it is stranded
    await store.claim_row("j", "done", "w", take_over=False)
    await store.finish_row(result("done"))
    await store.claim_row("j", "lost", "w-dead", take_over=False)
    after_window = time.time() + 10
    await store.expire_overdue(after_window)
    assert await store.stranded_rows(60.0, 600.0, after_window) == []  # the grace: their messages may still come
    pending_only = await store.stranded_rows(60.0, 600.0, after_window + 61)
    assert [(r.job_id, r.custom_id, r.running) for r in pending_only] == [("j", "queued", False)]
    assert (pending_only[0].reply_to, pending_only[0].reply_content_type) == ("q", "application/json")
    assert pending_only[0].window_s == pytest.approx(10.0)
    both = await store.stranded_rows(60.0, 600.0, after_window + 601)
    assert sorted((r.custom_id, r.running) for r in both) == [("lost", True), ("queued", False)]
    for row in both:
        await store.finish_row(expired_result(jobs_pb2.RowTask(job_id="j", row=jobs_pb2.JobRow(custom_id=row.custom_id)), row.window_s))
    assert await store.stranded_rows(60.0, 600.0, after_window + 601) == []
    assert [j.job_id for j in await store.summaries_due(0.0, after_window + 601)] == ["j"]  # the job can end


async def test_a_job_id_reused_for_other_rows_is_refused_before_and_after_the_split(store: JobStore) -> None:
    """Merged into the first job while it was being split: rows beyond its total, pages skipping
    rows, the job ending while the others still ran; ignored silently once it was split."""
    await store.accept("j", "demo", "q", ["a", "b"], DAY)
    for split in (False, True):
        if split:
            await store.mark_split("j")
        with pytest.raises(InvalidArgument, match="already used by a job of 2 other rows"):
            await store.accept("j", "demo", "q2", ["c", "d", "e"], DAY)
        with pytest.raises(InvalidArgument):
            await store.accept("j", "demo", "q", ["a"], DAY)  # a subset is another job too
    job, again = await store.accept("j", "demo", "q", ["b", "a"], DAY)  # the same rows: the same job
    assert again == set() and job.total_rows == 2 and await store.row_states("j") == {"pending": 2}


async def test_a_redelivered_copy_does_not_take_over_a_row_whose_worker_still_beats(store: JobStore) -> None:
    """A row message the broker redelivered (its channel was lost) to another worker while the
    first, alive, still ran it was taken over: the row ran twice (two leases, two events, billed
    twice)."""
    await store.accept("j", "demo", "q", ["a", "b"], DAY)
    assert await store.claim_row("j", "a", "w1", take_over=False) == s.CLAIMED
    assert await store.claim_row("j", "a", "w2", take_over=True) == s.BUSY  # claimed just now: fresh
    beat = time.time() + 5
    assert await store.heartbeat("w1", [("j", "a"), ("j", "b")], now=beat) == 1  # b is not w1's
    assert await store.claim_row("j", "a", "w2", take_over=True, now=beat + s.HEARTBEAT_STALE_S - 0.5) == s.BUSY
    assert await store.row_states("j") == {"running": 1, "pending": 1}
    # w1's run goes on: it stores the row, once, and the copy then finds it done.
    assert await store.finish_row(result("a")) is not None
    assert await store.claim_row("j", "a", "w2", take_over=True) == s.DONE


async def test_a_redelivered_copy_takes_over_a_row_whose_worker_stopped_beating(store: JobStore) -> None:
    """A worker that died (SIGKILL, OOM) leaves its rows running: their redelivered messages must
    still run them, once its heartbeat is stale; and then the new owner's run is protected in turn."""
    await store.accept("j", "demo", "q", ["a"], DAY)
    long_ago = time.time() - s.HEARTBEAT_STALE_S - 1
    assert await store.claim_row("j", "a", "w-dead", take_over=False, now=long_ago) == s.CLAIMED
    # Any copy takes it over, a redelivery or not (a replay from the dead-letter queue, a row the split
    # published again): the dead worker's own message may be gone.
    assert await store.claim_row("j", "a", "w2", take_over=False) == s.CLAIMED
    assert await store.claim_row("j", "a", "w3", take_over=True) == s.BUSY  # w2 claimed it just now
    assert await store.claim_row("j", "a", "w2", take_over=False) == s.BUSY  # w2's own: only a redelivery takes it again
    # w2's own row (its earlier run here ended unfinished): its copy may claim it again.
    assert await store.claim_row("j", "a", "w2", take_over=True) == s.CLAIMED
    assert await store.heartbeat("w-dead", [("j", "a")]) == 0  # the dead worker's beat no longer counts


async def test_a_stopped_jobs_row_whose_worker_still_beats_waits_for_it(store: JobStore) -> None:
    """Acked at once, the redelivered copy of a cancelled job's row a live worker runs was the row's
    only message: had that worker died, the row would stay running and the job cancelling forever."""
    await store.accept("j", "demo", "q", ["a", "b"], DAY)
    long_ago = time.time() - s.HEARTBEAT_STALE_S - 1
    assert await store.claim_row("j", "a", "w1", take_over=False) == s.CLAIMED
    assert await store.claim_row("j", "b", "w-dead", take_over=False, now=long_ago) == s.CLAIMED
    await store.cancel("j")
    assert await store.claim_row("j", "a", "w2", take_over=True) == s.BUSY
    assert await store.claim_row("j", "b", "w2", take_over=True) == s.SKIPPED  # stale: cancelled here
    assert await store.row_states("j") == {"running": 1, "cancelled": 1}
    assert await store.finish_row(result("a")) is not None
    job = await store.get_job("j")
    assert job is not None and job.state == s.CANCELLED


async def test_a_stopping_worker_lets_its_unfinished_rows_be_taken_over_at_once(store: JobStore) -> None:
    await store.accept("j", "demo", "q", ["a", "b"], DAY)
    assert await store.claim_row("j", "a", "w1", take_over=False) == s.CLAIMED
    assert await store.claim_row("j", "b", "w2", take_over=False) == s.CLAIMED
    assert await store.drop_heartbeats("w1") == 1
    assert await store.claim_row("j", "a", "w3", take_over=True) == s.CLAIMED
    assert await store.claim_row("j", "b", "w3", take_over=True) == s.BUSY  # w2's is still fresh


async def test_migration_4_adds_heartbeats_and_lets_rows_running_before_it_be_taken_over(tmp_path: Path) -> None:
    """Rows claimed before heartbeats existed have none: a redelivery takes them over, as before."""

    async def running_row(old: JobStore) -> None:
        # In SQL, as the code of that version wrote it: today's reads columns later migrations add.
        async with old.db.transaction() as tx:
            await tx.execute(
                "INSERT INTO jobs (job_id, tenant, state, total_rows, reply_to, split_done, created_at, updated_at, expires_at)"
                " VALUES ('j', 'demo', ?, 2, 'q', TRUE, ?, ?, ?)",
                s.IN_PROGRESS, time.time(), time.time(), time.time() + DAY,
            )  # fmt: skip
            for seq, custom_id in enumerate(("a", "b")):
                await tx.execute("INSERT INTO job_rows (job_id, custom_id, seq, state) VALUES ('j', ?, ?, 'pending')", custom_id, seq)
            await tx.execute("UPDATE job_rows SET state = 'running', claimed_by = 'w-old' WHERE custom_id = 'a'")

    for backend in ("sqlite", "postgres"):
        async with migrated(tmp_path, backend, 3, running_row) as new:
            assert await new.claim_row("j", "a", "w-new", take_over=True) == s.CLAIMED
            assert await new.claim_row("j", "b", "w-new", take_over=False) == s.CLAIMED
            assert await new.claim_row("j", "b", "w-other", take_over=True) == s.BUSY  # claimed since: it beats


async def test_a_cancelled_jobs_row_whose_worker_died_is_cancelled_by_any_copy(store: JobStore) -> None:
    """The dead worker's redelivered copy was dead-lettered, and the replayed one (not a redelivery)
    was acked as BUSY: the row stayed running, the job cancelling for ever (WatchJob never ended, no
    summary was told)."""
    await store.accept("j", "demo", "q", ["a", "b"], DAY)
    t = time.time()
    assert await store.claim_row("j", "a", "w1", take_over=False, now=t) == s.CLAIMED
    job = await store.cancel("j")
    assert job is not None and job.state == s.CANCELLING
    assert await store.claim_row("j", "a", "w2", False, now=t + 100) == s.SKIPPED
    assert await store.row_states("j") == {"cancelled": 2}
    job = await store.get_job("j")
    assert job is not None and job.state == s.CANCELLED


async def test_the_sweep_cancels_the_rows_of_a_cancelling_job_whose_worker_died(store: JobStore) -> None:
    """No message of the row will ever come (dead-lettered): only the sweep can end the job."""
    await store.accept("j", "demo", "q", ["a", "b", "c"], DAY)
    await store.accept("live", "demo", "q", ["a"], DAY)
    t = time.time()
    assert await store.claim_row("j", "a", "w-dead", take_over=False, now=t) == s.CLAIMED
    assert await store.claim_row("j", "b", "w-live", take_over=False, now=t) == s.CLAIMED
    assert await store.claim_row("live", "a", "w-dead", take_over=False, now=t) == s.CLAIMED  # its job goes on: not the sweep's
    await store.cancel("j")
    assert await store.heartbeat("w-live", [("j", "b")], now=t + 100) == 1
    assert await store.cancel_stale_rows(now=t + 100) == 1  # a; b's worker still beats
    assert (await store.get_job("j")).state == s.CANCELLING  # type: ignore[union-attr]
    assert await store.finish_row(result("b")) is not None
    job = await store.get_job("j")
    assert job is not None and job.state == s.CANCELLED
    assert await store.row_states("live") == {"running": 1}
    assert await store.cancel_stale_rows(now=t + 200) == 0
    assert [j.job_id for j in await store.summaries_due(0.0, time.time() + 1)] == ["j"]


async def test_a_worker_releasing_a_row_taken_over_meanwhile_changes_nothing(store: JobStore) -> None:
    """A stale worker X gave its row back after Y had taken it over: X reset Y's live claim to
    pending, or, its job cancelling, turned the row Y had finished from done into cancelled."""
    await store.accept("j", "demo", "q", ["a", "b"], DAY)
    t = time.time()
    assert await store.claim_row("j", "a", "x", take_over=False, now=t - 100) == s.CLAIMED
    assert await store.claim_row("j", "a", "y", take_over=True, now=t) == s.CLAIMED  # x's heartbeat is stale
    assert await store.claim_row("j", "b", "w", take_over=False, now=t) == s.CLAIMED
    assert not await store.release_row("j", "a", "x")
    assert await store.row_states("j") == {"running": 2}
    assert await store.claim_row("j", "a", "z", take_over=True, now=t + 1) == s.BUSY  # still y's
    assert await store.finish_row(result("a")) is not None
    assert (await store.cancel("j")).state == s.CANCELLING  # type: ignore[union-attr]  # b still runs
    assert not await store.release_row("j", "a", "x")
    assert await store.row_states("j") == {"done": 1, "running": 1}
    assert (await store.row_result("j", "a")) is not None
    # The worker that runs it releases it: back to pending, or cancelled when its job is cancelling.
    await store.accept("k", "demo", "q", ["a", "b"], DAY)
    assert await store.claim_row("k", "a", "w", take_over=False) == s.CLAIMED
    assert await store.release_row("k", "a", "w")
    assert await store.row_states("k") == {"pending": 2}
    assert await store.claim_row("k", "a", "w", take_over=False) == s.CLAIMED
    await store.cancel("k")
    assert await store.release_row("k", "a", "w")
    assert await store.row_states("k") == {"cancelled": 2}
    assert (await store.get_job("k")).state == s.CANCELLED  # type: ignore[union-attr]


async def test_the_largest_page_token_postgresql_s_integer_holds_is_taken(store: JobStore) -> None:
    await store.accept("j", "demo", "", ["r"], DAY)
    assert await store.list_results("j", 3, str(2**31 - 1)) == ([], "")


async def test_a_claim_naming_another_tenant_changes_nothing_and_the_claim_carries_the_job_s_tenant(store: JobStore) -> None:
    """A row runs as its job's tenant and text-logging setting (as accepted), never a message's."""
    await store.accept("j", "private", "q", ["a"], DAY, text_logging=False)
    claim = await store.claim("j", "a", "w1", take_over=False, tenant="demo")
    assert claim.state == s.WRONG_TENANT and claim.job is not None and claim.job.tenant == "private"
    assert await store.row_states("j") == {"pending": 1}  # not claimed, not stored: its real message runs it
    claim = await store.claim("j", "a", "w1", take_over=False, tenant="private")
    assert claim.state == s.CLAIMED and claim.job is not None and (claim.job.tenant, claim.job.text_logging) == ("private", False)
    assert (await store.claim("missing", "a", "w1", take_over=False, tenant="demo")).state == s.MISSING


async def test_the_text_logging_setting_submit_job_recorded_is_the_one_the_job_keeps(store: JobStore) -> None:
    await store.record_submitted("v", "private", 1, "q", DAY, text_logging=False)
    job, _ = await store.accept("v", "private", "q", ["a"], DAY, text_logging=True)  # a worker's directory says otherwise
    assert job.text_logging is False
    job, _ = await store.accept("w", "demo", "q", ["a"], DAY, text_logging=True)
    assert job.text_logging is True


async def test_migration_5_leaves_jobs_accepted_before_it_without_a_setting(tmp_path: Path) -> None:
    """NULL, not a default: a job accepted before the column runs its rows with their messages' setting."""

    async def old_job(old: JobStore) -> None:
        async with old.db.transaction() as tx:
            await tx.execute(
                "INSERT INTO jobs (job_id, tenant, state, total_rows, reply_to, split_done, created_at, updated_at, expires_at)"
                " VALUES ('j', 'demo', ?, 1, 'q', TRUE, ?, ?, ?)",
                s.IN_PROGRESS, time.time(), time.time(), time.time() + DAY,
            )  # fmt: skip
            await tx.execute("INSERT INTO job_rows (job_id, custom_id, seq, state) VALUES ('j', 'a', 0, 'pending')")

    for backend in ("sqlite", "postgres"):
        async with migrated(tmp_path, backend, 4, old_job) as new:
            claim = await new.claim("j", "a", "w", take_over=False, tenant="demo")
            assert claim.state == s.CLAIMED and claim.job is not None and claim.job.text_logging is None
            job, _ = await new.accept("k", "demo", "q", ["a"], DAY, text_logging=False)
            assert job.text_logging is False
