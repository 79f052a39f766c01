"""Bulk jobs' state: one row per job, one per (job id, custom id), results kept until deleted.

SQLite by default (WAL; the gateway and its job workers on one host share the file), PostgreSQL
when SLUICE_GATEWAY_JOBS_POSTGRES_DSN is set (several workers on several hosts). Every change is
one transaction, and every transition, of a row or of a job, is conditional on the state it
leaves, so two workers holding copies of one row message (or sweeping at once) can never both
record it:

    pending --claim--> running --finish--> done        (result stored, counters +1, once)
       |                  \\--release--> pending       (retry later through the broker)
       |                  \\--claim (heartbeat stale)--> running (another worker)
       |                  \\--job cancelling, heartbeat stale (sweep)--> cancelled
       |-- job cancelled --> cancelled
       \\-- claimed once the job's window is over --finish--> done (failed, code EXPIRED)

A job (states as in the OpenAI Batch API):

    validating --accept--> in_progress --last row stored--> finalizing --summary told--> completed
        |     \\               |    \\--completion window over--> expired
        |      \\--cancel------+--cancel--> cancelling --no row running--> cancelled
        \\--job message malformed--> failed

validating: SubmitJob seen, worker not yet. in_progress: split into row messages. finalizing:
every row is stored; the worker that stored the last one tells the job's summary (a Job message)
to reply_to, then marks it completed; the sweep (summaries_due) finishes one a dead worker left.
expired: the completion window (expires_at) ended first; rows still pending are stored as failed
(code EXPIRED) when their message is claimed, rows running then finish normally, so every row is
still reported once; the summary is told once the last one is stored. A cancelled job's summary
is told by the sweep. summary_sent records that an expired or cancelled job's summary was told.

A running row carries its worker's heartbeat (heartbeat_at, refreshed every HEARTBEAT_S while the
worker runs it): a copy of its message (the broker redelivers the messages of a lost channel, even
while their worker lives on) takes it over only once that heartbeat is HEARTBEAT_STALE_S old, i.e.
its worker died; until then the copy is BUSY (a redelivered one waits). A cancelling job's rows
whose heartbeat is stale are cancelled by the sweep (cancel_stale_rows), their message maybe gone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice.jobs.v1 import jobs_pb2

from sluice_common.channels import within_page_bytes
from sluice_common.errors import InvalidArgument
from sluice_common.sqlstore import SqlDb, Tx, open_sql_db

S = jobs_pb2
VALIDATING, IN_PROGRESS, COMPLETED, FAILED = "validating", "in_progress", "completed", "failed"
CANCELLING, CANCELLED, FINALIZING, EXPIRED = "cancelling", "cancelled", "finalizing", "expired"
TERMINAL = (COMPLETED, FAILED, CANCELLED, EXPIRED)
# Where a row's message is acked without running: the job is over or on its way to cancelled.
STOPPED = (CANCELLING, CANCELLED, FAILED)
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
    (
        2,
        "completion windows (expired) and job summaries (finalizing)",
        (
            # NULL: a job recorded before windows existed; it never expires.
            "ALTER TABLE jobs ADD COLUMN expires_at DOUBLE PRECISION",
            # How the job message came (JSON or protobuf): the summary is told the same way.
            "ALTER TABLE jobs ADD COLUMN reply_content_type TEXT NOT NULL DEFAULT ''",
            "ALTER TABLE jobs ADD COLUMN summary_sent BOOLEAN NOT NULL DEFAULT FALSE",
            # Jobs that ended before summaries existed are not told one now.
            "UPDATE jobs SET summary_sent = TRUE WHERE state IN ('completed', 'failed', 'cancelled')",
            # The worker's sweep looks jobs up by state every few seconds.
            "CREATE INDEX jobs_state ON jobs (state, updated_at)",
        ),
    ),
    (
        3,
        "OpenAI Batch API: files and batches (openai_store)",
        (
            # Uploaded batch input files, and the output/error files made from a batch's results.
            """CREATE TABLE openai_files (
                file_id TEXT PRIMARY KEY,
                tenant TEXT NOT NULL,
                purpose TEXT NOT NULL,
                filename TEXT NOT NULL,
                bytes INTEGER NOT NULL,
                created_at DOUBLE PRECISION NOT NULL,
                content {blob} NOT NULL
            )""",
            "CREATE INDEX openai_files_tenant ON openai_files (tenant, created_at)",
            # A batch is a job (batch_id = job_id) plus what OpenAI's Batch object says beside it.
            """CREATE TABLE openai_batches (
                batch_id TEXT PRIMARY KEY REFERENCES jobs (job_id) ON DELETE CASCADE,
                tenant TEXT NOT NULL,
                endpoint TEXT NOT NULL,
                input_file_id TEXT NOT NULL,
                completion_window TEXT NOT NULL,
                metadata TEXT NOT NULL,
                created_at DOUBLE PRECISION NOT NULL,
                cancelling_at DOUBLE PRECISION,
                output_file_id TEXT,
                error_file_id TEXT,
                files_made BOOLEAN NOT NULL DEFAULT FALSE
            )""",
            "CREATE INDEX openai_batches_tenant ON openai_batches (tenant, created_at)",
        ),
    ),
    (
        4,
        "row heartbeats: a running row is taken over only when its worker stopped beating",
        (
            # NULL: claimed before heartbeats existed, or left by a worker that stopped: stale.
            "ALTER TABLE job_rows ADD COLUMN heartbeat_at DOUBLE PRECISION",
        ),
    ),
    (
        5,
        "a job's text-logging setting: its rows run with the job's, not with what their messages say",
        (
            # NULL: accepted before this column existed; its rows run with their messages' setting.
            "ALTER TABLE jobs ADD COLUMN text_logging BOOLEAN",
        ),
    ),
)

# How often a worker refreshes the heartbeat of the rows it runs (worker.py), and how old a
# heartbeat is stale. Several beats may be missed (a busy event loop, a slow write) before a live
# worker's row is taken over; a dead worker's rows wait at most this long for their copies to run.
HEARTBEAT_S = 2.0
HEARTBEAT_STALE_S = 3 * HEARTBEAT_S
# Rows per heartbeat statement: far below SQLite's bound on parameters (999 before 3.32).
_BEAT_CHUNK = 400


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
    expires_at: float | None = None
    reply_content_type: str = ""
    summary_sent: bool = False
    # The tenant's text-logging setting when the job was accepted; None for a job accepted before
    # the store kept it (migration 5).
    text_logging: bool | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def settled(self) -> bool:
        """Terminal and no row will be stored any more (an expired job stores its last rows late)."""
        return self.terminal and (self.state != EXPIRED or self.completed_rows + self.failed_rows >= self.total_rows)

    @property
    def window_s(self) -> float | None:
        """The completion window the job was given."""
        return None if self.expires_at is None else self.expires_at - self.created_at

    def overdue(self, now: float) -> bool:
        return self.state == IN_PROGRESS and self.expires_at is not None and self.expires_at <= now

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
        if self.expires_at is not None:
            job.expires_at.FromNanoseconds(int(self.expires_at * 1e9))
        return job

    def summary(self) -> jobs_pb2.Job:
        """What reply_to is told when the job ends. Finalizing is told as completed: it only lasts
        until this summary is confirmed, and consumers want the outcome."""
        job = self.to_proto()
        if self.state == FINALIZING:
            job.state = S.JOB_STATE_COMPLETED
        return job


_INSERT_COLUMNS = "job_id, tenant, state, total_rows, completed_rows, failed_rows, reply_to, split_done, error, created_at, updated_at"
_JOB_COLUMNS = f"{_INSERT_COLUMNS}, expires_at, reply_content_type, summary_sent, text_logging"

# A row a claim may change: pending, or running when the claim takes it over: a redelivered copy
# (take_over) of a row this worker claimed itself (its earlier run here ended unfinished; this
# process runs one copy at a time), or any copy of a row whose heartbeat is stale (its worker is
# presumed dead): a copy that is not a redelivery (a replay from the dead-letter queue, a row the
# split published again) may be the row's only message, its worker's own dead-lettered or lost.
# Parameters: take_over, the worker, the stale bound (heartbeats before it are stale).
_TAKEABLE = "(state = 'pending' OR (state = 'running' AND ((? AND claimed_by = ?) OR heartbeat_at IS NULL OR heartbeat_at < ?)))"

# What claim_row found. OVERDUE: the job's completion window is over; store the row as EXPIRED.
# WRONG_TENANT: the row message names another tenant than the job's (nothing changed; never run).
CLAIMED, DONE, BUSY, SKIPPED, MISSING, OVERDUE = "claimed", "done", "busy", "skipped", "missing", "overdue"
WRONG_TENANT = "wrong_tenant"


@dataclass(frozen=True)
class Claim:
    """JobStore.claim's answer: `state` (CLAIMED, DONE, ...) and the job as the claim read it
    (None when MISSING): a row runs as its job's tenant, with its job's text-logging setting."""

    state: str
    job: JobRecord | None = None


@dataclass(frozen=True)
class StrandedRow:
    """A row of an expired job that no message will end (JobStore.stranded_rows)."""

    job_id: str
    custom_id: str
    running: bool
    reply_to: str
    reply_content_type: str
    window_s: float


def _job(values: tuple) -> JobRecord:  # type: ignore[type-arg]
    (job_id, tenant, state, total, completed, failed, reply_to, split_done, error, created, updated, expires, content_type, told, logs) = values
    return JobRecord(
        job_id, tenant, state, int(total), int(completed), int(failed), reply_to, bool(split_done), error, float(created), float(updated),
        None if expires is None else float(expires), content_type, bool(told), None if logs is None else bool(logs),
    )  # fmt: skip


@dataclass(frozen=True)
class Finished:
    """finish_row stored the row. ends_job: it was the job's last, so its summary is due now (the
    job is finalizing, or expired with every row stored); exactly one row's call sees it."""

    job: JobRecord
    ends_job: bool


def encode_page_token(seq: int) -> str:
    return str(seq)


# A row's seq is its index in the job (below jobs_max_rows), an INTEGER column: int4 on PostgreSQL,
# so a token above its largest value is none a response gave (asyncpg refused it: INTERNAL).
_MAX_TOKEN_DIGITS = 10
_MAX_SEQ = 2**31 - 1


def decode_page_token(token: str) -> int:
    """isascii too: str.isdigit accepts "²" and other digits int() refuses; bounded (digits first,
    so int() never parses a long one), so that the database (a 32-bit integer on PostgreSQL) takes
    every token it lets through."""
    if not token:
        return -1
    if not (token.isascii() and token.isdigit() and len(token) <= _MAX_TOKEN_DIGITS and int(token) <= _MAX_SEQ):
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

    async def record_submitted(
        self, job_id: str, tenant: str, total_rows: int, reply_to: str, window_s: float, text_logging: bool | None = None
    ) -> JobRecord:
        """SubmitJob's record (validating) before the worker has seen the job; idempotent. The
        completion window counts from here."""
        now = time.time()
        async with self.db.transaction() as tx:
            await tx.execute(
                f"INSERT INTO jobs ({_INSERT_COLUMNS}, expires_at, text_logging) VALUES (?, ?, ?, ?, 0, 0, ?, FALSE, '', ?, ?, ?, ?)"
                " ON CONFLICT (job_id) DO NOTHING",
                job_id, tenant, VALIDATING, total_rows, reply_to, now, now, now + window_s, text_logging,
            )  # fmt: skip
            job = await self._get(tx, job_id)
        assert job is not None
        return job

    async def record_failed(self, job_id: str, tenant: str, reply_to: str, error: str) -> None:
        """A job message that could not be accepted, when it named an id and a known tenant."""
        now = time.time()
        async with self.db.transaction() as tx:
            await tx.execute(
                f"INSERT INTO jobs ({_INSERT_COLUMNS}) VALUES (?, ?, ?, 0, 0, 0, ?, TRUE, ?, ?, ?) ON CONFLICT (job_id) DO NOTHING",
                job_id, tenant, FAILED, reply_to, error, now, now,
            )  # fmt: skip
            await tx.execute(
                "UPDATE jobs SET state = ?, error = ?, updated_at = ? WHERE job_id = ? AND tenant = ? AND state = ?",
                FAILED, error, now, job_id, tenant, VALIDATING,
            )  # fmt: skip

    async def accept(
        self,
        job_id: str,
        tenant: str,
        reply_to: str,
        custom_ids: list[str],
        window_s: float,
        reply_content_type: str = "",
        text_logging: bool | None = None,
    ) -> tuple[JobRecord, set[str]]:
        """Records the job and its rows (idempotent); returns the job and the custom ids whose row
        messages must (still) be published: all of them the first time, those not yet finished
        when a crash interrupted an earlier split (an expired job's too: each is still reported,
        as EXPIRED). The completion window counts from the job's first record. A job id of
        another tenant raises. `text_logging`: the tenant's setting, which the job's rows run with
        (claim); the first one recorded is kept."""
        now = time.time()
        async with self.db.transaction() as tx:
            job = await self._get(tx, job_id)
            if job is not None and job.tenant != tenant:
                raise InvalidArgument("job_id", "already used by another tenant")
            if job is None:
                await tx.execute(
                    f"INSERT INTO jobs ({_INSERT_COLUMNS}, expires_at, reply_content_type, text_logging)"
                    " VALUES (?, ?, ?, ?, 0, 0, ?, FALSE, '', ?, ?, ?, ?, ?)",
                    job_id, tenant, IN_PROGRESS, len(custom_ids), reply_to, now, now, now + window_s, reply_content_type, text_logging,
                )  # fmt: skip
            elif job.state == VALIDATING:
                await tx.execute(
                    "UPDATE jobs SET state = ?, total_rows = ?, updated_at = ?, expires_at = created_at + ?, reply_content_type = ?,"
                    " text_logging = COALESCE(text_logging, ?) WHERE job_id = ? AND state = ?",
                    IN_PROGRESS, len(custom_ids), now, window_s, reply_content_type, text_logging, job_id, VALIDATING,
                )  # fmt: skip
            existing = {cid for (cid,) in await tx.fetchall("SELECT custom_id FROM job_rows WHERE job_id = ?", job_id)}
            if existing and existing != set(custom_ids):
                # A copy of the job (a redelivery, a producer's retry) names the same rows; other rows
                # under its id would be merged into it, its counts and pages mixed with theirs.
                raise InvalidArgument("job_id", f"{job_id!r} is already used by a job of {len(existing)} other rows: give this job an id of its own")
            if job is not None and (job.split_done or (job.terminal and job.state != EXPIRED)):
                return job, set()
            for seq, custom_id in enumerate(custom_ids):
                if custom_id not in existing:
                    await tx.execute("INSERT INTO job_rows (job_id, custom_id, seq, state) VALUES (?, ?, ?, ?)", job_id, custom_id, seq, "pending")
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
            # Only a job that is now cancelling gives up its pending rows: an expired job's pending
            # rows are still owed their EXPIRED result, a completed job has none.
            await tx.execute(
                "UPDATE job_rows SET state = 'cancelled' WHERE job_id = ? AND state = 'pending'"
                " AND EXISTS (SELECT 1 FROM jobs WHERE job_id = ? AND state = ?)",
                job_id, job_id, CANCELLING,
            )  # fmt: skip
            await self._settle_cancel(tx, job_id, now)
            return await self._get(tx, job_id)

    async def _settle_cancel(self, tx: Tx, job_id: str, now: float) -> None:
        await tx.execute(
            "UPDATE jobs SET state = ?, updated_at = ? WHERE job_id = ? AND state = ?"
            " AND NOT EXISTS (SELECT 1 FROM job_rows WHERE job_id = ? AND state = 'running')",
            CANCELLED, now, job_id, CANCELLING, job_id,
        )  # fmt: skip

    # ---- rows

    async def claim_row(self, job_id: str, custom_id: str, worker: str, take_over: bool, now: float | None = None, tenant: str | None = None) -> str:
        """claim's state."""
        return (await self.claim(job_id, custom_id, worker, take_over, now, tenant)).state

    async def claim(self, job_id: str, custom_id: str, worker: str, take_over: bool, now: float | None = None, tenant: str | None = None) -> Claim:
        """CLAIMED: run it. DONE: already recorded. BUSY: another worker runs it and its heartbeat is
        fresh (a redelivered copy waits and asks again; take_over=False: a copy that is not a
        redelivery, acked), or this worker claimed it and the copy is not a redelivery. SKIPPED: the
        job is cancelled or over. MISSING: no such job or row. WRONG_TENANT: `tenant` (the row
        message's) is not the job's: nothing is changed, and the row must not run on that message.
        With the state, the job as the claim read it: the tenant and text-logging setting its rows
        run with, whatever a row message says."""
        now = time.time() if now is None else now
        takeable = (take_over, worker, now - HEARTBEAT_STALE_S)
        async with self.db.transaction() as tx:
            job = await self._get(tx, job_id)
            row = await tx.fetchone(f"SELECT state, {_TAKEABLE} FROM job_rows WHERE job_id = ? AND custom_id = ?", *takeable, job_id, custom_id)
            if job is None or row is None:
                return Claim(MISSING)
            if tenant is not None and tenant != job.tenant:
                return Claim(WRONG_TENANT, job)
            state, may_take = row[0], bool(row[1])
            if state == "done":
                return Claim(DONE, job)
            if state == "cancelled":
                return Claim(SKIPPED, job)
            # Every write below is conditional on the row's state, re-checked by the UPDATE itself:
            # under PostgreSQL's READ COMMITTED two workers may both have read "pending" above.
            if job.state in STOPPED:
                await tx.execute(
                    f"UPDATE job_rows SET state = 'cancelled' WHERE job_id = ? AND custom_id = ? AND {_TAKEABLE}",
                    job_id, custom_id, *takeable,
                )  # fmt: skip
                await self._settle_cancel(tx, job_id, now)
                # A row running elsewhere finishes there and is stored. A redelivered copy waits for
                # it (BUSY), not acked: should that worker die, the copy is the row's only message.
                return Claim(BUSY if take_over and not may_take else SKIPPED, job)
            if not may_take:
                return Claim(BUSY, job)  # running elsewhere: it finishes there, even past the window
            if job.state == EXPIRED or job.overdue(now):
                await self._expire(tx, now, job_id)
                return Claim(OVERDUE, job)  # not run: the caller stores it (finish_row, once) as EXPIRED
            claimed = await tx.execute(
                "UPDATE job_rows SET state = 'running', claimed_by = ?, attempts = attempts + 1, heartbeat_at = ?"
                f" WHERE job_id = ? AND custom_id = ? AND {_TAKEABLE}",
                worker, now, job_id, custom_id, *takeable,
            )  # fmt: skip
            if claimed:
                return Claim(CLAIMED, job)
            now_state = await tx.fetchone("SELECT state FROM job_rows WHERE job_id = ? AND custom_id = ?", job_id, custom_id)
            return Claim({"done": DONE, "cancelled": SKIPPED}.get(now_state[0] if now_state else "", BUSY), job)

    async def heartbeat(self, worker: str, rows: Sequence[tuple[str, str]], now: float | None = None) -> int:
        """Refreshes the heartbeat of the rows (job id, custom id) `worker` runs now, so that no
        redelivered copy takes them over; only those it claimed and that are still running. One
        statement for up to _BEAT_CHUNK rows. Returns how many it refreshed."""
        now = time.time() if now is None else now
        refreshed = 0
        async with self.db.transaction() as tx:
            for start in range(0, len(rows), _BEAT_CHUNK):
                chunk = rows[start : start + _BEAT_CHUNK]
                keys = ", ".join(["(?, ?)"] * len(chunk))
                refreshed += await tx.execute(
                    "UPDATE job_rows SET heartbeat_at = ? WHERE claimed_by = ? AND state = 'running'"
                    f" AND (job_id, custom_id) IN (VALUES {keys})",
                    now, worker, *(part for key in chunk for part in key),
                )  # fmt: skip
        return refreshed

    async def drop_heartbeats(self, worker: str) -> int:
        """The rows a stopping worker leaves running (their runs cut at the end of its drain) stale at
        once, so that their redelivered copies need not wait HEARTBEAT_STALE_S. Returns how many."""
        async with self.db.transaction() as tx:
            return await tx.execute("UPDATE job_rows SET heartbeat_at = NULL WHERE claimed_by = ? AND state = 'running'", worker)

    async def release_row(self, job_id: str, custom_id: str, worker: str) -> bool:
        """Back to pending (its message goes back to the broker for a later try), or cancelled when
        its job is cancelling; only while `worker` still runs it: a worker whose row was taken over
        meanwhile (its heartbeat went stale) must neither turn the row another worker finished into
        cancelled nor reset that worker's live claim to pending. Returns whether it released it."""
        async with self.db.transaction() as tx:
            released = await tx.execute(
                "UPDATE job_rows SET state = 'pending' WHERE job_id = ? AND custom_id = ? AND state = 'running' AND claimed_by = ?",
                job_id, custom_id, worker,
            )  # fmt: skip
            if not released:
                return False
            job = await self._get(tx, job_id)
            if job is not None and job.state == CANCELLING:
                await tx.execute(
                    "UPDATE job_rows SET state = 'cancelled' WHERE job_id = ? AND custom_id = ? AND state = 'pending'", job_id, custom_id
                )
                await self._settle_cancel(tx, job_id, time.time())
            return True

    async def finish_row(self, result: jobs_pb2.RowResult) -> Finished | None:
        """Stores a row's result once; None when it already was (a copy of a finished row)."""
        now = time.time()
        failed = result.HasField("error")
        async with self.db.transaction() as tx:
            changed = await tx.execute(
                "UPDATE job_rows SET state = 'done', failed = ?, result = ?, finished_at = ?"
                " WHERE job_id = ? AND custom_id = ? AND state IN ('pending', 'running')",
                failed, result.SerializeToString(), now, result.job_id, result.custom_id,
            )  # fmt: skip
            if not changed:
                return None
            # This UPDATE locks the job's row until commit (PostgreSQL), so the counts read below
            # are exact: one call, and only one, sees them reach total_rows.
            column = "failed_rows" if failed else "completed_rows"
            await tx.execute(f"UPDATE jobs SET {column} = {column} + 1, updated_at = ? WHERE job_id = ?", now, result.job_id)
            # Past its window the job is expired, even when no claim or sweep has said so yet (its
            # last rows were claimed in time, or waited to retry): it must not end "completed".
            await self._expire(tx, now, result.job_id)
            finalizing = await tx.execute(
                "UPDATE jobs SET state = ? WHERE job_id = ? AND state = ? AND completed_rows + failed_rows >= total_rows",
                FINALIZING, result.job_id, IN_PROGRESS,
            )  # fmt: skip
            await self._settle_cancel(tx, result.job_id, now)
            job = await self._get(tx, result.job_id)
        assert job is not None
        return Finished(job, bool(finalizing) or (job.state == EXPIRED and job.settled))

    # ---- completion windows and summaries (the worker's sweep calls these every few seconds)

    async def _expire(self, tx: Tx, now: float, job_id: str | None = None) -> int:
        """in_progress -> expired once the window is over: one job, or every overdue one."""
        sql = "UPDATE jobs SET state = ?, updated_at = ? WHERE state = ? AND expires_at <= ?"
        if job_id is None:
            return await tx.execute(sql, EXPIRED, now, IN_PROGRESS, now)
        return await tx.execute(sql + " AND job_id = ?", EXPIRED, now, IN_PROGRESS, now, job_id)

    async def expire_overdue(self, now: float | None = None) -> int:
        """Flips overdue in_progress jobs to expired (so GetJob says so while no row flows)."""
        async with self.db.transaction() as tx:
            return await self._expire(tx, time.time() if now is None else now)

    async def fail_unadmitted(self, grace_s: float, now: float | None = None) -> int:
        """validating -> failed once the job's completion window and then grace_s are over. SubmitJob
        recorded it, but its AdmittedJob never reached a worker (the gateway died before the broker
        confirmed it, or the message was dead-lettered): nothing else would ever end it, and WatchJob
        would wait on it forever. An AdmittedJob that arrives later finds it terminal and runs nothing."""
        now = time.time() if now is None else now
        error = "the job did not reach a job worker within its completion window: its message was lost on the way, or no worker consumed it"
        async with self.db.transaction() as tx:
            return await tx.execute(
                "UPDATE jobs SET state = ?, error = ?, updated_at = ? WHERE state = ? AND expires_at + ? <= ?",
                FAILED, error, now, VALIDATING, grace_s, now,
            )  # fmt: skip

    async def cancel_stale_rows(self, now: float | None = None) -> int:
        """Running rows of cancelling jobs whose heartbeat is stale (their worker died) are cancelled,
        and their jobs settle: a row whose last message was dead-lettered (or replayed and acked as
        BUSY) would otherwise keep its job cancelling for ever, WatchJob never ending and no summary
        told. Returns how many rows it cancelled."""
        now = time.time() if now is None else now
        async with self.db.transaction() as tx:
            cancelled = await tx.execute(
                "UPDATE job_rows SET state = 'cancelled' WHERE state = 'running' AND (heartbeat_at IS NULL OR heartbeat_at < ?)"
                " AND job_id IN (SELECT job_id FROM jobs WHERE state = ?)",
                now - HEARTBEAT_STALE_S, CANCELLING,
            )  # fmt: skip
            if cancelled:
                await tx.execute(
                    "UPDATE jobs SET state = ?, updated_at = ? WHERE state = ?"
                    " AND NOT EXISTS (SELECT 1 FROM job_rows r WHERE r.job_id = jobs.job_id AND r.state = 'running')",
                    CANCELLED, now, CANCELLING,
                )  # fmt: skip
        return cancelled

    async def stranded_rows(self, pending_grace_s: float, running_grace_s: float, now: float | None = None, limit: int = 500) -> list[StrandedRow]:
        """Rows of expired jobs that no message will ever end: still pending `pending_grace_s` after
        the job's window (their message was dead-lettered by the broker, or lost), or still running
        `running_grace_s` after it (their worker died and their message did not come back; no
        attempt runs longer than the row deadline's ceiling). Without a result each, the job's
        summary would never be due."""
        now = time.time() if now is None else now
        async with self.db.transaction() as tx:
            rows = await tx.fetchall(
                "SELECT r.job_id, r.custom_id, r.state, j.reply_to, j.reply_content_type, j.created_at, j.expires_at"
                " FROM job_rows r JOIN jobs j ON j.job_id = r.job_id WHERE j.state = ?"
                " AND ((r.state = 'pending' AND j.expires_at + ? <= ?) OR (r.state = 'running' AND j.expires_at + ? <= ?))"
                " ORDER BY j.expires_at LIMIT ?",
                EXPIRED, pending_grace_s, now, running_grace_s, now, limit,
            )  # fmt: skip
        return [StrandedRow(job_id, custom_id, state == "running", reply_to, content_type, float(expires) - float(created))
                for job_id, custom_id, state, reply_to, content_type, created, expires in rows]  # fmt: skip

    async def summaries_due(self, grace_s: float, now: float | None = None, limit: int = 100) -> list[JobRecord]:
        """Jobs whose summary is still to be told, untouched for grace_s (so as not to race the
        worker telling it right now): finalizing ones (their worker died before telling it),
        cancelled ones, and expired ones with every row stored."""
        before = (time.time() if now is None else now) - grace_s
        async with self.db.transaction() as tx:
            rows = await tx.fetchall(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE updated_at <= ? AND (state = ?"
                " OR (state IN (?, ?) AND NOT summary_sent AND (state = ? OR completed_rows + failed_rows >= total_rows)))"
                " ORDER BY updated_at LIMIT ?",
                before, FINALIZING, EXPIRED, CANCELLED, CANCELLED, limit,
            )  # fmt: skip
        return [_job(row) for row in rows]

    async def summary_told(self, job_id: str) -> JobRecord | None:
        """After the summary was confirmed: finalizing -> completed; expired or cancelled: marked
        told. Conditional, so a second teller changes nothing."""
        now = time.time()
        async with self.db.transaction() as tx:
            await tx.execute(
                "UPDATE jobs SET state = ?, summary_sent = TRUE, updated_at = ? WHERE job_id = ? AND state = ?",
                COMPLETED, now, job_id, FINALIZING,
            )  # fmt: skip
            await tx.execute(
                "UPDATE jobs SET summary_sent = TRUE WHERE job_id = ? AND state IN (?, ?) AND NOT summary_sent", job_id, EXPIRED, CANCELLED
            )
            return await self._get(tx, job_id)

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
        # A page of long outputs (or logprobs) over a client's 4 MiB receive limit would never arrive.
        page = within_page_bytes(rows, page_size, lambda row: len(row[1]))
        results = [jobs_pb2.RowResult.FromString(bytes(blob)) for _, blob in page]
        return results, encode_page_token(int(page[-1][0])) if len(page) < len(rows) else ""

    async def row_states(self, job_id: str) -> dict[str, int]:
        async with self.db.transaction() as tx:
            rows = await tx.fetchall("SELECT state, COUNT(*) FROM job_rows WHERE job_id = ? GROUP BY state", job_id)
        return {state: int(count) for state, count in rows}
