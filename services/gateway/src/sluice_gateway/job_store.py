"""Bulk jobs' state: one row per job, one per (job id, custom id), results kept until deleted.

SQLite by default (WAL; the gateway and its job workers on one host share the file), PostgreSQL
when SLUICE_GATEWAY_JOBS_POSTGRES_DSN is set (several workers on several hosts). Every change is
one transaction, and every row transition is conditional on the state it leaves, so two workers
holding copies of one row message can never both record it:

    pending --claim--> running --finish--> done        (result stored, counters +1, once)
       |                  \\--release--> pending       (retry later through the broker)
       \\-- job cancelled --> cancelled

A job: validating (SubmitJob seen, worker not yet) -> in_progress (split into row messages) ->
completed once every row is done; cancelling -> cancelled once no row is running; failed when
the job message could not be accepted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from sluice.jobs.v1 import jobs_pb2

from sluice_common.errors import InvalidArgument
from sluice_common.sqlstore import SqlDb, Tx, open_sql_db

S = jobs_pb2
VALIDATING, IN_PROGRESS, COMPLETED, FAILED = "validating", "in_progress", "completed", "failed"
CANCELLING, CANCELLED, FINALIZING, EXPIRED = "cancelling", "cancelled", "finalizing", "expired"
TERMINAL = (COMPLETED, FAILED, CANCELLED, EXPIRED)
STATE_ENUM = {
    VALIDATING: S.JOB_STATE_VALIDATING,
    IN_PROGRESS: S.JOB_STATE_IN_PROGRESS,
    FINALIZING: S.JOB_STATE_FINALIZING,
    COMPLETED: S.JOB_STATE_COMPLETED,
    FAILED: S.JOB_STATE_FAILED,
    EXPIRED: S.JOB_STATE_EXPIRED,
    CANCELLING: S.JOB_STATE_CANCELLING,
    CANCELLED: S.JOB_STATE_CANCELLED,
}

MIGRATIONS = (
    (
        1,
        "jobs and job rows",
        (
            """CREATE TABLE jobs (
                job_id TEXT PRIMARY KEY,
                tenant TEXT NOT NULL,
                state TEXT NOT NULL,
                total_rows INTEGER NOT NULL,
                completed_rows INTEGER NOT NULL DEFAULT 0,
                failed_rows INTEGER NOT NULL DEFAULT 0,
                reply_to TEXT NOT NULL,
                split_done BOOLEAN NOT NULL DEFAULT FALSE,
                error TEXT NOT NULL DEFAULT '',
                created_at DOUBLE PRECISION NOT NULL,
                updated_at DOUBLE PRECISION NOT NULL
            )""",
            """CREATE TABLE job_rows (
                job_id TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
                custom_id TEXT NOT NULL,
                seq INTEGER NOT NULL,
                state TEXT NOT NULL,
                failed BOOLEAN NOT NULL DEFAULT FALSE,
                claimed_by TEXT NOT NULL DEFAULT '',
                attempts INTEGER NOT NULL DEFAULT 0,
                result {blob},
                finished_at DOUBLE PRECISION,
                PRIMARY KEY (job_id, custom_id)
            )""",
            "CREATE INDEX job_rows_seq ON job_rows (job_id, seq)",
            "CREATE INDEX job_rows_state ON job_rows (job_id, state)",
            "CREATE INDEX jobs_tenant ON jobs (tenant, created_at)",
        ),
    ),
)


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    tenant: str
    state: str
    total_rows: int
    completed_rows: int
    failed_rows: int
    reply_to: str
    split_done: bool
    error: str
    created_at: float
    updated_at: float

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def to_proto(self) -> jobs_pb2.Job:
        job = jobs_pb2.Job(
            job_id=self.job_id,
            tenant=self.tenant,
            state=STATE_ENUM[self.state],
            total_rows=self.total_rows,
            completed_rows=self.completed_rows,
            failed_rows=self.failed_rows,
            error=self.error,
        )
        job.created_at.FromNanoseconds(int(self.created_at * 1e9))
        job.updated_at.FromNanoseconds(int(self.updated_at * 1e9))
        return job


_JOB_COLUMNS = (
    "job_id, tenant, state, total_rows, completed_rows, failed_rows, reply_to, split_done, error, created_at, updated_at"
)

# What claim_row found.
CLAIMED, DONE, BUSY, SKIPPED, MISSING = "claimed", "done", "busy", "skipped", "missing"


def _job(values: tuple) -> JobRecord:  # type: ignore[type-arg]
    (job_id, tenant, state, total, completed, failed, reply_to, split_done, error, created, updated) = values
    return JobRecord(
        job_id, tenant, state, int(total), int(completed), int(failed), reply_to, bool(split_done), error, float(created), float(updated)
    )


def encode_page_token(seq: int) -> str:
    return str(seq)


def decode_page_token(token: str) -> int:
    if not token:
        return -1
    if not token.isdigit():
        raise InvalidArgument("page_token", "not a token from a previous ListJobResults response")
    return int(token)


class JobStore:
    def __init__(self, db: SqlDb) -> None:
        self.db = db

    @classmethod
    def create(cls, postgres_dsn: str, sqlite_path: Path, schema: str = "jobs") -> JobStore:
        return cls(open_sql_db(postgres_dsn, sqlite_path, schema, MIGRATIONS))

    async def open(self) -> None:
        await self.db.open()

    async def close(self) -> None:
        await self.db.close()

    # ---- jobs

    async def _get(self, tx: Tx, job_id: str) -> JobRecord | None:
        row = await tx.fetchone(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE job_id = ?", job_id)
        return None if row is None else _job(row)

    async def get_job(self, job_id: str) -> JobRecord | None:
        async with self.db.transaction() as tx:
            return await self._get(tx, job_id)

    async def record_submitted(self, job_id: str, tenant: str, total_rows: int, reply_to: str) -> JobRecord:
        """SubmitJob's record (validating) before the worker has seen the job; idempotent."""
        now = time.time()
        async with self.db.transaction() as tx:
            await tx.execute(
                f"INSERT INTO jobs ({_JOB_COLUMNS}) VALUES (?, ?, ?, ?, 0, 0, ?, FALSE, '', ?, ?) ON CONFLICT (job_id) DO NOTHING",
                job_id, tenant, VALIDATING, total_rows, reply_to, now, now,
            )  # fmt: skip
            job = await self._get(tx, job_id)
        assert job is not None
        return job

    async def record_failed(self, job_id: str, tenant: str, reply_to: str, error: str) -> None:
        """A job message that could not be accepted, when it named an id and a known tenant."""
        now = time.time()
        async with self.db.transaction() as tx:
            await tx.execute(
                f"INSERT INTO jobs ({_JOB_COLUMNS}) VALUES (?, ?, ?, 0, 0, 0, ?, TRUE, ?, ?, ?) ON CONFLICT (job_id) DO NOTHING",
                job_id, tenant, FAILED, reply_to, error, now, now,
            )  # fmt: skip
            await tx.execute(
                "UPDATE jobs SET state = ?, error = ?, updated_at = ? WHERE job_id = ? AND tenant = ? AND state = ?",
                FAILED, error, now, job_id, tenant, VALIDATING,
            )  # fmt: skip

    async def accept(self, job_id: str, tenant: str, reply_to: str, custom_ids: list[str]) -> tuple[JobRecord, set[str]]:
        """Records the job and its rows (idempotent); returns the job and the custom ids whose row
        messages must (still) be published: all of them the first time, those not yet finished
        when a crash interrupted an earlier split. A job id of another tenant raises."""
        now = time.time()
        async with self.db.transaction() as tx:
            job = await self._get(tx, job_id)
            if job is not None and job.tenant != tenant:
                raise InvalidArgument("job_id", "already used by another tenant")
            if job is None:
                await tx.execute(
                    f"INSERT INTO jobs ({_JOB_COLUMNS}) VALUES (?, ?, ?, ?, 0, 0, ?, FALSE, '', ?, ?)",
                    job_id, tenant, IN_PROGRESS, len(custom_ids), reply_to, now, now,
                )  # fmt: skip
            elif job.state == VALIDATING:
                await tx.execute(
                    "UPDATE jobs SET state = ?, total_rows = ?, updated_at = ? WHERE job_id = ?",
                    IN_PROGRESS, len(custom_ids), now, job_id,
                )  # fmt: skip
            elif job.split_done or job.terminal:
                return job, set()
            existing = {cid for (cid,) in await tx.fetchall("SELECT custom_id FROM job_rows WHERE job_id = ?", job_id)}
            for seq, custom_id in enumerate(custom_ids):
                if custom_id not in existing:
                    await tx.execute(
                        "INSERT INTO job_rows (job_id, custom_id, seq, state) VALUES (?, ?, ?, ?)", job_id, custom_id, seq, "pending"
                    )
            open_rows = {
                cid for (cid,) in await tx.fetchall("SELECT custom_id FROM job_rows WHERE job_id = ? AND state IN ('pending', 'running')", job_id)
            }
            job = await self._get(tx, job_id)
        assert job is not None
        return job, open_rows

    async def mark_split(self, job_id: str) -> None:
        async with self.db.transaction() as tx:
            await tx.execute("UPDATE jobs SET split_done = TRUE WHERE job_id = ?", job_id)

    async def cancel(self, job_id: str) -> JobRecord | None:
        """cancelling at once; cancelled when no row is running. Rows not started never run."""
        now = time.time()
        async with self.db.transaction() as tx:
            await tx.execute(
                "UPDATE jobs SET state = ?, updated_at = ? WHERE job_id = ? AND state IN (?, ?)", CANCELLING, now, job_id, VALIDATING, IN_PROGRESS
            )
            await tx.execute("UPDATE job_rows SET state = 'cancelled' WHERE job_id = ? AND state = 'pending'", job_id)
            await self._settle_cancel(tx, job_id, now)
            return await self._get(tx, job_id)

    async def _settle_cancel(self, tx: Tx, job_id: str, now: float) -> None:
        await tx.execute(
            "UPDATE jobs SET state = ?, updated_at = ? WHERE job_id = ? AND state = ?"
            " AND NOT EXISTS (SELECT 1 FROM job_rows WHERE job_id = ? AND state = 'running')",
            CANCELLED, now, job_id, CANCELLING, job_id,
        )  # fmt: skip

    # ---- rows

    async def claim_row(self, job_id: str, custom_id: str, worker: str, take_over: bool) -> str:
        """CLAIMED: run it. DONE: already recorded. BUSY: another worker runs it (take_over=False).
        SKIPPED: the job is cancelled or over. MISSING: no such job or row."""
        now = time.time()
        async with self.db.transaction() as tx:
            job = await self._get(tx, job_id)
            row = await tx.fetchone("SELECT state FROM job_rows WHERE job_id = ? AND custom_id = ?", job_id, custom_id)
            if job is None or row is None:
                return MISSING
            state = row[0]
            if state == "done":
                return DONE
            if state == "cancelled":
                return SKIPPED
            if job.state in (CANCELLING, CANCELLED, FAILED, EXPIRED):
                await tx.execute("UPDATE job_rows SET state = 'cancelled' WHERE job_id = ? AND custom_id = ?", job_id, custom_id)
                await self._settle_cancel(tx, job_id, now)
                return SKIPPED
            if state == "running" and not take_over:
                return BUSY
            await tx.execute(
                "UPDATE job_rows SET state = 'running', claimed_by = ?, attempts = attempts + 1 WHERE job_id = ? AND custom_id = ?",
                worker, job_id, custom_id,
            )  # fmt: skip
            return CLAIMED

    async def release_row(self, job_id: str, custom_id: str) -> None:
        """Back to pending (its message goes back to the broker for a later try)."""
        async with self.db.transaction() as tx:
            await tx.execute("UPDATE job_rows SET state = 'pending' WHERE job_id = ? AND custom_id = ? AND state = 'running'", job_id, custom_id)
            job = await self._get(tx, job_id)
            if job is not None and job.state == CANCELLING:
                await tx.execute("UPDATE job_rows SET state = 'cancelled' WHERE job_id = ? AND custom_id = ?", job_id, custom_id)
                await self._settle_cancel(tx, job_id, time.time())

    async def finish_row(self, result: jobs_pb2.RowResult) -> bool:
        """Stores a row's result once; True when this call stored it (False: it already was)."""
        now = time.time()
        failed = result.HasField("error")
        async with self.db.transaction() as tx:
            changed = await tx.execute(
                "UPDATE job_rows SET state = 'done', failed = ?, result = ?, finished_at = ?"
                " WHERE job_id = ? AND custom_id = ? AND state IN ('pending', 'running')",
                failed, result.SerializeToString(), now, result.job_id, result.custom_id,
            )  # fmt: skip
            if not changed:
                return False
            column = "failed_rows" if failed else "completed_rows"
            await tx.execute(f"UPDATE jobs SET {column} = {column} + 1, updated_at = ? WHERE job_id = ?", now, result.job_id)
            await tx.execute(
                "UPDATE jobs SET state = ? WHERE job_id = ? AND state = ? AND completed_rows + failed_rows >= total_rows",
                COMPLETED, result.job_id, IN_PROGRESS,
            )  # fmt: skip
            await self._settle_cancel(tx, result.job_id, now)
            return True

    async def row_result(self, job_id: str, custom_id: str) -> jobs_pb2.RowResult | None:
        async with self.db.transaction() as tx:
            row = await tx.fetchone("SELECT result FROM job_rows WHERE job_id = ? AND custom_id = ? AND state = 'done'", job_id, custom_id)
        return None if row is None else jobs_pb2.RowResult.FromString(bytes(row[0]))

    async def list_results(self, job_id: str, page_size: int, page_token: str) -> tuple[list[jobs_pb2.RowResult], str]:
        after = decode_page_token(page_token)
        async with self.db.transaction() as tx:
            rows = await tx.fetchall(
                "SELECT seq, result FROM job_rows WHERE job_id = ? AND state = 'done' AND seq > ? ORDER BY seq LIMIT ?",
                job_id, after, page_size + 1,
            )  # fmt: skip
        more = len(rows) > page_size
        rows = rows[:page_size]
        results = [jobs_pb2.RowResult.FromString(bytes(blob)) for _, blob in rows]
        return results, encode_page_token(int(rows[-1][0])) if more else ""

    async def row_states(self, job_id: str) -> dict[str, int]:
        async with self.db.transaction() as tx:
            rows = await tx.fetchall("SELECT state, COUNT(*) FROM job_rows WHERE job_id = ? GROUP BY state", job_id)
        return {state: int(count) for state, count in rows}
