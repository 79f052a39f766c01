"""Where records and scores live: SQLite (default, WAL) or PostgreSQL, with schema migrations.

Records and scores are separate tables linked by event id. Inserts are idempotent by event id
(`ON CONFLICT DO NOTHING`), so a redelivered event is stored once. Both backends run the same
SQL, written with `?` placeholders (PostgreSQL gets them renumbered to `$n`).

A score computed later (similarity: it waits on the adapter's embedding model) has a row in
`pending_scores` written in the same transaction as its record, so a crash between storing and
scoring loses nothing; similarity_worker.py claims due rows in batches (a lease: `not_before`
moves into the future and another replica skips them), then writes the scores and deletes the
rows in one transaction. Until then the score is absent from every query.
"""

from __future__ import annotations

import base64
import functools
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import asyncpg

from sluice_common.errors import InvalidArgument
from sluice_common.sqlstore import PostgresDb, SqliteDb, dollar, write_transaction
from sluice_evaluation_logging.evaluators.base import ScoreResult


@dataclass(frozen=True)
class RecordRow:
    event_id: str
    tenant: str
    model: str
    priority_class: int
    request_id: str
    finish_reason: int
    error_code: str
    input_tokens: int
    output_tokens: int
    latency_ms: float
    ttft_ms: float
    started_at: float
    finished_at: float
    text_logged: bool
    event: bytes
    scores: tuple[ScoreResult, ...] = ()
    stored_at: float = 0.0
    # Names of the scores to compute later (a pending marker each, stored with the record).
    pending: tuple[str, ...] = ()
    # Of input_tokens, those the engine served from its prefix cache (Usage.cached_tokens).
    cached_tokens: int = 0
    # The W3C trace id the event's message carried (empty: none).
    trace_id: str = ""


@dataclass(frozen=True)
class PendingItem:
    """A claimed pending score: the record's serialized event, and how often it was claimed."""

    event_id: str
    event: bytes
    attempts: int


@dataclass(frozen=True)
class Threshold:
    name: str
    min_value: float | None = None
    max_value: float | None = None
    passed: bool | None = None


@dataclass(frozen=True)
class RecordFilter:
    tenant: str
    model: str = ""
    start: float | None = None
    end: float | None = None
    finish_reason: int = 0
    thresholds: tuple[Threshold, ...] = ()


@dataclass
class SummaryData:
    """Raw rows for summaries: (tenant, model, finish_reason, error_code, latency, ttft, in, out,
    cached in) and (tenant, model, score name, value, passed, skipped)."""

    records: list[tuple[Any, ...]] = field(default_factory=list)
    scores: list[tuple[Any, ...]] = field(default_factory=list)


class Store(Protocol):
    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def schema_version(self) -> int: ...
    async def insert_batch(self, rows: Sequence[RecordRow]) -> int: ...
    async def get(self, event_id: str) -> RecordRow | None: ...
    async def query(self, where: RecordFilter, page_size: int, page_token: str) -> tuple[list[RecordRow], str]: ...
    async def summary_data(self, where: RecordFilter) -> SummaryData: ...
    async def count(self) -> int: ...
    async def claim_pending(self, name: str, limit: int, lease_s: float) -> list[PendingItem]: ...
    async def release_pending(self, name: str, event_ids: Sequence[str], delay_s: float, count_attempt: bool) -> None: ...
    async def complete_pending(self, name: str, scores: Sequence[tuple[str, ScoreResult]]) -> int: ...
    async def pending_count(self, name: str = "") -> int: ...


# ---- schema

# (version, description, statements); {blob} is the binary column type of the backend.
MIGRATIONS: tuple[tuple[int, str, tuple[str, ...]], ...] = (
    (
        1,
        "records and scores",
        (
            """CREATE TABLE records (
                event_id TEXT PRIMARY KEY,
                tenant TEXT NOT NULL,
                model TEXT NOT NULL,
                priority_class INTEGER NOT NULL,
                request_id TEXT NOT NULL,
                finish_reason INTEGER NOT NULL,
                error_code TEXT NOT NULL,
                input_tokens INTEGER NOT NULL,
                output_tokens INTEGER NOT NULL,
                latency_ms DOUBLE PRECISION NOT NULL,
                ttft_ms DOUBLE PRECISION NOT NULL,
                started_at DOUBLE PRECISION NOT NULL,
                finished_at DOUBLE PRECISION NOT NULL,
                stored_at DOUBLE PRECISION NOT NULL,
                text_logged BOOLEAN NOT NULL,
                event {blob} NOT NULL
            )""",
            "CREATE INDEX records_tenant_time ON records (tenant, finished_at, event_id)",
            "CREATE INDEX records_tenant_model_time ON records (tenant, model, finished_at)",
            """CREATE TABLE scores (
                event_id TEXT NOT NULL REFERENCES records (event_id) ON DELETE CASCADE,
                name TEXT NOT NULL,
                value DOUBLE PRECISION NOT NULL,
                passed BOOLEAN NOT NULL,
                skipped BOOLEAN NOT NULL,
                detail TEXT NOT NULL,
                PRIMARY KEY (event_id, name)
            )""",
            "CREATE INDEX scores_name_value ON scores (name, value)",
        ),
    ),
    (
        2,
        "pending scores (computed off the consume path)",
        (
            """CREATE TABLE pending_scores (
                event_id TEXT NOT NULL REFERENCES records (event_id) ON DELETE CASCADE,
                name TEXT NOT NULL,
                queued_at DOUBLE PRECISION NOT NULL,
                not_before DOUBLE PRECISION NOT NULL,
                attempts INTEGER NOT NULL,
                PRIMARY KEY (event_id, name)
            )""",
            "CREATE INDEX pending_scores_due ON pending_scores (name, not_before)",
            # No query reads scores by (name, value): thresholds are correlated by event id and use
            # the primary key. This index cost an update per score row (8-9 per event) on the
            # consume path and bought nothing.
            "DROP INDEX scores_name_value",
        ),
    ),
    (
        3,
        "prompt tokens served from the engine's prefix cache",
        (
            # Records stored before engines reported it count none (their events have no such field).
            "ALTER TABLE records ADD COLUMN cached_tokens INTEGER NOT NULL DEFAULT 0",
        ),
    ),
    (
        4,
        "the trace id of the request behind each record",
        # Records stored before tracing have none.
        ("ALTER TABLE records ADD COLUMN trace_id TEXT NOT NULL DEFAULT ''",),
    ),
)

LATEST_VERSION = MIGRATIONS[-1][0]

_RECORD_COLUMNS = (
    "event_id, tenant, model, priority_class, request_id, finish_reason, error_code, input_tokens, output_tokens,"
    " latency_ms, ttft_ms, started_at, finished_at, stored_at, text_logged, event, cached_tokens, trace_id"
)
# SQLite batches: multi-row INSERTs of at most this many rows (SQLite binds at most 32766
# parameters per statement). Every sqlite3 step releases and retakes the GIL, which the event loop
# holds most of the time: one step per chunk instead of one per row is what keeps the store's
# thread from queueing behind the loop (and the loop from waiting for the store).
_SQLITE_CHUNK = 256
_RECORD_VALUES = "(" + ", ".join("?" * 18) + ")"
_SCORE_VALUES = "(?, ?, ?, ?, ?, ?)"
_PENDING_VALUES = "(?, ?, ?, ?, 0)"


@functools.lru_cache(maxsize=256)
def _multi_insert_sql(head: str, values: str, count: int, conflict: str) -> str:
    return f"{head} VALUES {', '.join([values] * count)} ON CONFLICT ({conflict}) DO NOTHING"


def _insert_chunks(db: sqlite3.Connection, head: str, values: str, conflict: str, rows: Sequence[Sequence[Any]]) -> None:
    for start in range(0, len(rows), _SQLITE_CHUNK):
        chunk = rows[start : start + _SQLITE_CHUNK]
        db.execute(_multi_insert_sql(head, values, len(chunk), conflict), [value for row in chunk for value in row])


_SCORE_HEAD = "INSERT INTO scores (event_id, name, value, passed, skipped, detail)"
_INSERT_SCORE = f"{_SCORE_HEAD} VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (event_id, name) DO NOTHING"
_PENDING_HEAD = "INSERT INTO pending_scores (event_id, name, queued_at, not_before, attempts)"


def _record_params(row: RecordRow, stored_at: float) -> tuple[Any, ...]:
    return (
        row.event_id,
        row.tenant,
        row.model,
        row.priority_class,
        row.request_id,
        row.finish_reason,
        row.error_code,
        row.input_tokens,
        row.output_tokens,
        row.latency_ms,
        row.ttft_ms,
        row.started_at,
        row.finished_at,
        stored_at,
        row.text_logged,
        row.event,
        row.cached_tokens,
        row.trace_id,
    )


def _row_from(values: Sequence[Any], scores: tuple[ScoreResult, ...] = ()) -> RecordRow:
    (eid, tenant, model, pclass, rid, finish, err, tin, tout, lat, ttft, started, finished, stored, logged, event, tcached, tid) = values
    return RecordRow(
        event_id=eid,
        tenant=tenant,
        model=model,
        priority_class=int(pclass),
        request_id=rid,
        finish_reason=int(finish),
        error_code=err,
        input_tokens=int(tin),
        output_tokens=int(tout),
        latency_ms=float(lat),
        ttft_ms=float(ttft),
        started_at=float(started),
        finished_at=float(finished),
        stored_at=float(stored),
        text_logged=bool(logged),
        event=bytes(event),
        scores=scores,
        cached_tokens=int(tcached),
        trace_id=str(tid),
    )


def _where(where: RecordFilter, alias: str = "records") -> tuple[str, list[Any]]:
    clauses = [f"{alias}.tenant = ?"]
    params: list[Any] = [where.tenant]
    if where.model:
        clauses.append(f"{alias}.model = ?")
        params.append(where.model)
    if where.start is not None:
        clauses.append(f"{alias}.finished_at >= ?")
        params.append(where.start)
    if where.end is not None:
        clauses.append(f"{alias}.finished_at < ?")
        params.append(where.end)
    if where.finish_reason:
        clauses.append(f"{alias}.finish_reason = ?")
        params.append(where.finish_reason)
    for threshold in where.thresholds:
        parts = ["s.event_id = " + f"{alias}.event_id", "s.name = ?", "s.skipped = ?"]
        params.extend([threshold.name, False])
        if threshold.min_value is not None:
            parts.append("s.value >= ?")
            params.append(threshold.min_value)
        if threshold.max_value is not None:
            parts.append("s.value <= ?")
            params.append(threshold.max_value)
        if threshold.passed is not None:
            parts.append("s.passed = ?")
            params.append(threshold.passed)
        clauses.append(f"EXISTS (SELECT 1 FROM scores s WHERE {' AND '.join(parts)})")
    return " AND ".join(clauses), params


def encode_page_token(finished_at: float, event_id: str) -> str:
    return base64.urlsafe_b64encode(f"{finished_at!r}|{event_id}".encode()).decode()


def decode_page_token(token: str) -> tuple[float, str]:
    try:
        finished_at, event_id = base64.urlsafe_b64decode(token.encode()).decode().split("|", 1)
        return float(finished_at), event_id
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgument("page_token", "not a token from a previous response") from None


def _page_sql(where: RecordFilter, page_size: int, page_token: str) -> tuple[str, list[Any]]:
    clause, params = _where(where)
    if page_token:
        finished_at, event_id = decode_page_token(page_token)
        clause += " AND (records.finished_at < ? OR (records.finished_at = ? AND records.event_id < ?))"
        params.extend([finished_at, finished_at, event_id])
    sql = (
        f"SELECT {_RECORD_COLUMNS} FROM records WHERE {clause}"
        " ORDER BY records.finished_at DESC, records.event_id DESC LIMIT ?"
    )
    return sql, [*params, page_size + 1]


def _scores_sql(count: int) -> str:
    return (
        "SELECT event_id, name, value, passed, detail, skipped FROM scores"
        f" WHERE event_id IN ({', '.join('?' * count)}) ORDER BY name"
    )


def _summary_sql(where: RecordFilter) -> tuple[str, str, list[Any]]:
    clause, params = _where(where)
    records = (
        "SELECT tenant, model, finish_reason, error_code, latency_ms, ttft_ms, input_tokens, output_tokens, cached_tokens"
        f" FROM records WHERE {clause}"
    )
    scores = (
        "SELECT records.tenant, records.model, s2.name, s2.value, s2.passed, s2.skipped"
        f" FROM scores s2 JOIN records ON records.event_id = s2.event_id WHERE {clause}"
    )
    return records, scores, params


def _attach_scores(rows: list[RecordRow], score_rows: Sequence[Sequence[Any]]) -> list[RecordRow]:
    by_event: dict[str, list[ScoreResult]] = {}
    for eid, name, value, passed, detail, skip in score_rows:
        by_event.setdefault(eid, []).append(ScoreResult(name, float(value), bool(passed), detail, bool(skip)))
    return [
        RecordRow(**{**row.__dict__, "scores": tuple(by_event.get(row.event_id, ()))}) for row in rows
    ]


def _next_token(rows: list[RecordRow], page_size: int) -> tuple[list[RecordRow], str]:
    if len(rows) <= page_size:
        return rows, ""
    page = rows[:page_size]
    return page, encode_page_token(page[-1].finished_at, page[-1].event_id)


# ---- SQLite


class SqliteStore:
    """sluice-common's SqliteDb (one connection on one thread, WAL, migrations); each call below is
    one synchronous piece of work on that thread, a whole batch in one transaction."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sqlite = SqliteDb(path, MIGRATIONS)

    async def open(self) -> None:
        await self._sqlite.open()

    async def close(self) -> None:
        await self._sqlite.close()

    async def schema_version(self) -> int:
        return await self._sqlite.run(lambda db: db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0])

    async def insert_batch(self, rows: Sequence[RecordRow]) -> int:
        batch = list(rows)
        return await self._sqlite.run(lambda db: _insert_batch(db, batch))

    async def get(self, event_id: str) -> RecordRow | None:
        def work(db: sqlite3.Connection) -> RecordRow | None:
            found = db.execute(f"SELECT {_RECORD_COLUMNS} FROM records WHERE event_id = ?", (event_id,)).fetchone()
            if found is None:
                return None
            return _attach_scores([_row_from(found)], db.execute(_scores_sql(1), (event_id,)).fetchall())[0]

        return await self._sqlite.run(work)

    async def query(self, where: RecordFilter, page_size: int, page_token: str) -> tuple[list[RecordRow], str]:
        sql, params = _page_sql(where, page_size, page_token)

        def work(db: sqlite3.Connection) -> list[RecordRow]:
            rows = [_row_from(values) for values in db.execute(sql, params).fetchall()]
            if not rows:
                return rows
            ids = [row.event_id for row in rows]
            return _attach_scores(rows, db.execute(_scores_sql(len(ids)), ids).fetchall())

        return _next_token(await self._sqlite.run(work), page_size)

    async def summary_data(self, where: RecordFilter) -> SummaryData:
        records_sql, scores_sql, params = _summary_sql(where)
        return await self._sqlite.run(
            lambda db: SummaryData(db.execute(records_sql, params).fetchall(), db.execute(scores_sql, params).fetchall())
        )

    async def count(self) -> int:
        return await self._sqlite.run(lambda db: db.execute("SELECT COUNT(*) FROM records").fetchone()[0])

    async def claim_pending(self, name: str, limit: int, lease_s: float) -> list[PendingItem]:
        def work(db: sqlite3.Connection) -> list[PendingItem]:
            now = time.time()
            with write_transaction(db):
                due = db.execute(
                    "SELECT p.event_id, p.attempts, r.event FROM pending_scores p"
                    " JOIN records r ON r.event_id = p.event_id"
                    " WHERE p.name = ? AND p.not_before <= ? ORDER BY p.not_before LIMIT ?",
                    (name, now, limit),
                ).fetchall()
                db.executemany(
                    "UPDATE pending_scores SET not_before = ?, attempts = attempts + 1 WHERE event_id = ? AND name = ?",
                    [(now + lease_s, eid, name) for eid, _, _ in due],
                )
            return [PendingItem(eid, bytes(event), int(attempts) + 1) for eid, attempts, event in due]

        return await self._sqlite.run(work)

    async def release_pending(self, name: str, event_ids: Sequence[str], delay_s: float, count_attempt: bool) -> None:
        not_before = time.time() + delay_s
        undo = 0 if count_attempt else 1
        sql = "UPDATE pending_scores SET not_before = ?, attempts = attempts - ? WHERE event_id = ? AND name = ?"

        def work(db: sqlite3.Connection) -> None:
            with write_transaction(db):
                db.executemany(sql, [(not_before, undo, eid, name) for eid in event_ids])

        await self._sqlite.run(work)

    async def complete_pending(self, name: str, scores: Sequence[tuple[str, ScoreResult]]) -> int:
        def work(db: sqlite3.Connection) -> int:
            cleared = 0
            with write_transaction(db):
                for eid, s in scores:
                    # Only while the marker is there: a score is written once, whoever computed it.
                    if db.execute("DELETE FROM pending_scores WHERE event_id = ? AND name = ?", (eid, name)).rowcount:
                        cleared += 1
                        db.execute(_INSERT_SCORE, (eid, s.name, s.value, s.passed, s.skipped, s.detail))
            return cleared

        return await self._sqlite.run(work)

    async def pending_count(self, name: str = "") -> int:
        sql = "SELECT COUNT(*) FROM pending_scores" + (" WHERE name = ?" if name else "")
        return await self._sqlite.run(lambda db: db.execute(sql, (name,) if name else ()).fetchone()[0])


def _insert_batch(db: sqlite3.Connection, rows: list[RecordRow]) -> int:
    stored_at = time.time()
    with write_transaction(db):
        # Under the write lock, the ids already stored (redeliveries; usually none) are final.
        seen: set[str] = set()
        ids = list({row.event_id for row in rows})
        for start in range(0, len(ids), _SQLITE_CHUNK):
            chunk = ids[start : start + _SQLITE_CHUNK]
            found = db.execute(f"SELECT event_id FROM records WHERE event_id IN ({', '.join('?' * len(chunk))})", chunk)
            seen.update(eid for (eid,) in found.fetchall())
        records: list[tuple[Any, ...]] = []
        scores: list[tuple[Any, ...]] = []
        pending: list[tuple[Any, ...]] = []
        for row in rows:
            eid = row.event_id
            if eid in seen:
                continue
            seen.add(eid)  # the same event twice in one batch: stored once
            records.append(_record_params(row, stored_at))
            scores.extend((eid, s.name, s.value, s.passed, s.skipped, s.detail) for s in row.scores)
            pending.extend((eid, name, stored_at, stored_at) for name in row.pending)
        _insert_chunks(db, f"INSERT INTO records ({_RECORD_COLUMNS})", _RECORD_VALUES, "event_id", records)
        _insert_chunks(db, _SCORE_HEAD, _SCORE_VALUES, "event_id, name", scores)
        _insert_chunks(db, _PENDING_HEAD, _PENDING_VALUES, "event_id, name", pending)
    return len(records)


# ---- PostgreSQL


class PostgresStore:
    def __init__(self, dsn: str, schema: str = "evallog", pool_size: int = 4) -> None:
        # Connection, migrations (under an advisory lock, so two replicas starting at once
        # migrate once) and the pool come from sluice-common; the SQL below is this store's.
        self._db = PostgresDb(dsn, schema, MIGRATIONS, pool_size)

    @property
    def dsn(self) -> str:
        return self._db.dsn

    @property
    def schema(self) -> str:
        return self._db.schema

    @property
    def pool(self) -> asyncpg.Pool:
        return self._db.pool

    async def open(self) -> None:
        await self._db.open()

    async def close(self) -> None:
        await self._db.close()

    async def schema_version(self) -> int:
        return int(await self.pool.fetchval("SELECT MAX(version) FROM schema_migrations"))

    async def insert_batch(self, rows: Sequence[RecordRow]) -> int:
        if not rows:
            return 0
        stored_at = time.time()
        columns = list(zip(*(_record_params(row, stored_at) for row in rows), strict=True))
        types = ("text", "text", "text", "int4", "text", "int4", "text", "int4", "int4",
                 "float8", "float8", "float8", "float8", "float8", "bool", "bytea", "int4", "text")  # fmt: skip
        unnest = ", ".join(f"${i + 1}::{kind}[]" for i, kind in enumerate(types))
        async with self.pool.acquire() as connection, connection.transaction():
            inserted = await connection.fetch(
                f"INSERT INTO records ({_RECORD_COLUMNS}) SELECT * FROM unnest({unnest})"
                " ON CONFLICT (event_id) DO NOTHING RETURNING event_id",
                *[list(column) for column in columns],
            )
            fresh = {record["event_id"] for record in inserted}
            scores = [
                (row.event_id, s.name, s.value, s.passed, s.skipped, s.detail)
                for row in rows
                if row.event_id in fresh
                for s in row.scores
            ]
            if scores:
                await connection.execute(
                    "INSERT INTO scores (event_id, name, value, passed, skipped, detail)"
                    " SELECT * FROM unnest($1::text[], $2::text[], $3::float8[], $4::bool[], $5::bool[], $6::text[])"
                    " ON CONFLICT (event_id, name) DO NOTHING",
                    *[list(column) for column in zip(*scores, strict=True)],
                )
            pending = [(row.event_id, name) for row in rows if row.event_id in fresh for name in row.pending]
            if pending:
                ids, names = zip(*pending, strict=True)
                await connection.execute(
                    "INSERT INTO pending_scores (event_id, name, queued_at, not_before, attempts)"
                    " SELECT e, n, $3, $3, 0 FROM unnest($1::text[], $2::text[]) AS t (e, n)"
                    " ON CONFLICT (event_id, name) DO NOTHING",
                    list(ids), list(names), stored_at,
                )
        return len(fresh)

    async def get(self, event_id: str) -> RecordRow | None:
        async with self.pool.acquire() as connection:
            found = await connection.fetchrow(f"SELECT {_RECORD_COLUMNS} FROM records WHERE event_id = $1", event_id)
            if found is None:
                return None
            scores = await connection.fetch(dollar(_scores_sql(1)), event_id)
        return _attach_scores([_row_from(tuple(found))], [tuple(s) for s in scores])[0]

    async def query(self, where: RecordFilter, page_size: int, page_token: str) -> tuple[list[RecordRow], str]:
        sql, params = _page_sql(where, page_size, page_token)
        async with self.pool.acquire() as connection:
            rows = [_row_from(tuple(values)) for values in await connection.fetch(dollar(sql), *params)]
            if rows:
                ids = [row.event_id for row in rows]
                scores = await connection.fetch(dollar(_scores_sql(len(ids))), *ids)
                rows = _attach_scores(rows, [tuple(s) for s in scores])
        return _next_token(rows, page_size)

    async def summary_data(self, where: RecordFilter) -> SummaryData:
        records_sql, scores_sql, params = _summary_sql(where)
        async with self.pool.acquire() as connection:
            records = await connection.fetch(dollar(records_sql), *params)
            scores = await connection.fetch(dollar(scores_sql), *params)
        return SummaryData([tuple(r) for r in records], [tuple(s) for s in scores])

    async def count(self) -> int:
        return int(await self.pool.fetchval("SELECT COUNT(*) FROM records"))

    async def claim_pending(self, name: str, limit: int, lease_s: float) -> list[PendingItem]:
        now = time.time()
        # SKIP LOCKED: two replicas claiming at once take different rows instead of waiting.
        claimed = await self.pool.fetch(
            "WITH due AS (SELECT event_id FROM pending_scores WHERE name = $1 AND not_before <= $2"
            " ORDER BY not_before LIMIT $3 FOR UPDATE SKIP LOCKED)"
            " UPDATE pending_scores p SET not_before = $4, attempts = p.attempts + 1"
            " FROM due, records r WHERE p.name = $1 AND p.event_id = due.event_id AND r.event_id = p.event_id"
            " RETURNING p.event_id, p.attempts, r.event",
            name, now, limit, now + lease_s,
        )
        return [PendingItem(c["event_id"], bytes(c["event"]), int(c["attempts"])) for c in claimed]

    async def release_pending(self, name: str, event_ids: Sequence[str], delay_s: float, count_attempt: bool) -> None:
        await self.pool.execute(
            "UPDATE pending_scores SET not_before = $1, attempts = attempts - $2 WHERE name = $3 AND event_id = ANY($4::text[])",
            time.time() + delay_s, 0 if count_attempt else 1, name, list(event_ids),
        )

    async def complete_pending(self, name: str, scores: Sequence[tuple[str, ScoreResult]]) -> int:
        if not scores:
            return 0
        async with self.pool.acquire() as connection, connection.transaction():
            cleared = await connection.fetch(
                "DELETE FROM pending_scores WHERE name = $1 AND event_id = ANY($2::text[]) RETURNING event_id",
                name, [eid for eid, _ in scores],
            )
            # Only where the marker was still there: a score is written once, whoever computed it.
            fresh = {c["event_id"] for c in cleared}
            rows = [(eid, s.name, s.value, s.passed, s.skipped, s.detail) for eid, s in scores if eid in fresh]
            if rows:
                await connection.execute(
                    "INSERT INTO scores (event_id, name, value, passed, skipped, detail)"
                    " SELECT * FROM unnest($1::text[], $2::text[], $3::float8[], $4::bool[], $5::bool[], $6::text[])"
                    " ON CONFLICT (event_id, name) DO NOTHING",
                    *[list(column) for column in zip(*rows, strict=True)],
                )
        return len(fresh)

    async def pending_count(self, name: str = "") -> int:
        if name:
            return int(await self.pool.fetchval("SELECT COUNT(*) FROM pending_scores WHERE name = $1", name))
        return int(await self.pool.fetchval("SELECT COUNT(*) FROM pending_scores"))


def open_store(database_url: str, sqlite_path: Path, pg_schema: str = "evallog") -> Store:
    if database_url:
        return PostgresStore(database_url, pg_schema)
    return SqliteStore(sqlite_path)
