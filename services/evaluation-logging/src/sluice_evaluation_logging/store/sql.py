"""The store's SQL where SQLite and PostgreSQL agree, written once on sluice-common's `SqlDb`.

Every statement here uses `?` placeholders (PostgreSQL gets them renumbered) and runs in a
`SqlDb` transaction. What the backends do differently lives in sqlite.py and postgres.py: storing
a batch (the consume path's hot write: chunked multi-row INSERTs in one trip to SQLite's thread,
arrays through `unnest` on PostgreSQL) and claiming pending scores (SQLite's write lock,
PostgreSQL's `FOR UPDATE SKIP LOCKED` between replicas).
"""

from __future__ import annotations

import base64
import functools
import math
import time
from collections.abc import Sequence
from typing import Any

from sluice_common.channels import within_page_bytes
from sluice_common.errors import InvalidArgument
from sluice_common.sqlstore import SqlDb, Tx
from sluice_evaluation_logging.evaluators.base import ScoreResult
from sluice_evaluation_logging.model import RecordFilter, RecordRow, SummaryData
from sluice_evaluation_logging.store.schema import RECORD_COLUMNS, SCORE_COLUMNS

# Rows (or ids) per multi-row statement: SQLite binds at most 32766 parameters per statement,
# PostgreSQL 32767; 256 records of 19 columns stay well below both.
CHUNK = 256
SCORE_VALUES = "(?, ?, ?, ?, ?, ?)"


def chunks(items: Sequence[Any], size: int = CHUNK) -> list[Sequence[Any]]:
    return [items[start : start + size] for start in range(0, len(items), size)]


def marks(count: int) -> str:
    return ", ".join("?" * count)


@functools.lru_cache(maxsize=256)
def multi_insert_sql(head: str, values: str, count: int, conflict: str) -> str:
    """`head VALUES values, values, ... ON CONFLICT (conflict) DO NOTHING`, `count` rows."""
    return f"{head} VALUES {', '.join([values] * count)} ON CONFLICT ({conflict}) DO NOTHING"


def metadata_params(row: RecordRow) -> list[tuple[str, str, str]]:
    """A row's metadata pairs in METADATA_COLUMNS order."""
    return [(row.event_id, name, value) for name, value in row.metadata]


def score_params(event_id: str, score: ScoreResult) -> tuple[Any, ...]:
    return (event_id, score.name, score.value, score.passed, score.skipped, score.detail)


def record_params(row: RecordRow, stored_at: float) -> tuple[Any, ...]:
    """A row's values in RECORD_COLUMNS order."""
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
        row.user,
    )


def row_from(values: Sequence[Any], scores: tuple[ScoreResult, ...] = ()) -> RecordRow:
    """A row from its values in RECORD_COLUMNS order (either backend's types)."""
    (eid, tenant, model, pclass, rid, finish, err, tin, tout, lat, ttft, started, finished, stored, logged, event, tcached, tid, user) = values
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
        user=str(user),
    )


def where_sql(where: RecordFilter, alias: str = "records") -> tuple[str, list[Any]]:
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
    if where.user:
        clauses.append(f"{alias}.end_user = ?")
        params.append(where.user)
    for name, value in where.metadata:
        clauses.append(f"EXISTS (SELECT 1 FROM record_metadata m WHERE m.event_id = {alias}.event_id AND m.name = ? AND m.value = ?)")
        params.extend([name, value])
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
        text, event_id = base64.urlsafe_b64decode(token.encode()).decode().split("|", 1)
        finished_at = float(text)
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgument("page_token", "not a token from a previous response") from None
    # float() also reads "nan" and "inf", which no record's time is: a forged token, and one that
    # SQLite (NaN bound as NULL) and PostgreSQL (NaN above every number) would page differently.
    if not math.isfinite(finished_at):
        raise InvalidArgument("page_token", "not a token from a previous response")
    return finished_at, event_id


def page_sql(where: RecordFilter, page_size: int, page_token: str) -> tuple[str, list[Any]]:
    """One more row than the page: whether there is a next page."""
    clause, params = where_sql(where)
    if page_token:
        finished_at, event_id = decode_page_token(page_token)
        clause += " AND (records.finished_at < ? OR (records.finished_at = ? AND records.event_id < ?))"
        params.extend([finished_at, finished_at, event_id])
    sql = f"SELECT {RECORD_COLUMNS} FROM records WHERE {clause} ORDER BY records.finished_at DESC, records.event_id DESC LIMIT ?"
    return sql, [*params, page_size + 1]


def scores_sql(count: int) -> str:
    return f"SELECT event_id, name, value, passed, detail, skipped FROM scores WHERE event_id IN ({marks(count)}) ORDER BY name"


def summary_sql(where: RecordFilter) -> tuple[str, str, list[Any]]:
    """The records' rows (the caller adds `LIMIT ?`: percentiles need every latency) and the scores
    aggregated per (tenant, model, name) in the database: a record has ~9 scores, none need be read."""
    clause, params = where_sql(where)
    records = (
        "SELECT tenant, model, finish_reason, error_code, latency_ms, ttft_ms, input_tokens, output_tokens, cached_tokens"
        f" FROM records WHERE {clause} LIMIT ?"
    )
    scores = (
        "SELECT records.tenant, records.model, s2.name,"
        " SUM(CASE WHEN s2.skipped THEN 0 ELSE 1 END), SUM(CASE WHEN s2.skipped THEN 0 ELSE s2.value END),"
        " SUM(CASE WHEN s2.passed AND NOT s2.skipped THEN 1 ELSE 0 END), SUM(CASE WHEN s2.skipped THEN 1 ELSE 0 END),"
        " MIN(CASE WHEN s2.skipped THEN NULL ELSE s2.value END), MAX(CASE WHEN s2.skipped THEN NULL ELSE s2.value END)"
        f" FROM scores s2 JOIN records ON records.event_id = s2.event_id WHERE {clause}"
        " GROUP BY records.tenant, records.model, s2.name"
    )
    return records, scores, params


def attach_scores(rows: list[RecordRow], score_rows: Sequence[Sequence[Any]]) -> list[RecordRow]:
    by_event: dict[str, list[ScoreResult]] = {}
    for eid, name, value, passed, detail, skip in score_rows:
        by_event.setdefault(eid, []).append(ScoreResult(name, float(value), bool(passed), detail, bool(skip)))
    return [RecordRow(**{**row.__dict__, "scores": tuple(by_event.get(row.event_id, ()))}) for row in rows]


# A page's records, measured as stored (the event, the scores' text), stop short of PAGE_BYTES
# (sluice_common.channels, as the gateway's job results do): records carry whole prompts and outputs,
# and gRPC clients refuse a message over 4 MiB by default (RESOURCE_EXHAUSTED), so a page of a
# thousand long answers would never arrive.


def record_size(row: RecordRow) -> int:
    """About what the record weighs in a response: its event, and its scores' names and details."""
    return len(row.event) + sum(len(s.name) + len(s.detail) + 32 for s in row.scores)


def next_token(rows: list[RecordRow], page_size: int) -> tuple[list[RecordRow], str]:
    """The page (`page_size` rows at most, and within PAGE_BYTES unless its first row alone is
    not) and the token of the next one: keyset tokens may cut a page anywhere."""
    page = within_page_bytes(rows, page_size, record_size)
    if len(page) == len(rows):
        return page, ""
    return page, encode_page_token(page[-1].finished_at, page[-1].event_id)


async def insert_scores(tx: Tx, scores: Sequence[tuple[Any, ...]]) -> None:
    """score_params rows; a score already stored for (event, name) stays as it is."""
    for chunk in chunks(scores):
        sql = multi_insert_sql(f"INSERT INTO scores ({SCORE_COLUMNS})", SCORE_VALUES, len(chunk), "event_id, name")
        await tx.execute(sql, *[value for row in chunk for value in row])


class SqlStore:
    """What both backends run the same; sqlite.py and postgres.py add `insert_batch` and `claim_pending`."""

    def __init__(self, db: SqlDb) -> None:
        self.db = db

    async def open(self) -> None:
        await self.db.open()

    async def close(self) -> None:
        await self.db.close()

    async def schema_version(self) -> int:
        async with self.db.transaction() as tx:
            found = await tx.fetchone("SELECT MAX(version) FROM schema_migrations")
        return int(found[0]) if found is not None else 0

    async def get(self, event_id: str) -> RecordRow | None:
        async with self.db.transaction() as tx:
            found = await tx.fetchone(f"SELECT {RECORD_COLUMNS} FROM records WHERE event_id = ?", event_id)
            if found is None:
                return None
            scores = await tx.fetchall(scores_sql(1), event_id)
        return attach_scores([row_from(found)], scores)[0]

    async def query(self, where: RecordFilter, page_size: int, page_token: str) -> tuple[list[RecordRow], str]:
        sql, params = page_sql(where, page_size, page_token)
        async with self.db.transaction() as tx:
            rows = [row_from(values) for values in await tx.fetchall(sql, *params)]
            if rows:
                ids = [row.event_id for row in rows]
                rows = attach_scores(rows, await tx.fetchall(scores_sql(len(ids)), *ids))
        return next_token(rows, page_size)

    async def summary_data(self, where: RecordFilter, max_records: int) -> SummaryData:
        """At most `max_records` + 1 records' rows: more than `max_records` means the window holds
        too many to summarize, and then the scores are not read at all."""
        records_sql, scores_sql_, params = summary_sql(where)
        async with self.db.transaction() as tx:
            records = await tx.fetchall(records_sql, *params, max_records + 1)
            if len(records) > max_records:
                return SummaryData(records)
            return SummaryData(records, await tx.fetchall(scores_sql_, *params))

    async def count(self) -> int:
        async with self.db.transaction() as tx:
            found = await tx.fetchone("SELECT COUNT(*) FROM records")
        return int(found[0]) if found is not None else 0

    async def release_pending(self, name: str, event_ids: Sequence[str], delay_s: float, count_attempt: bool) -> None:
        """Lets claimed markers be claimed again after `delay_s`; `count_attempt` False undoes the claim's count."""
        not_before = time.time() + delay_s
        undo = 0 if count_attempt else 1
        async with self.db.transaction() as tx:
            for chunk in chunks(list(event_ids)):
                await tx.execute(
                    "UPDATE pending_scores SET not_before = ?, attempts = attempts - ?"
                    f" WHERE name = ? AND event_id IN ({marks(len(chunk))})",
                    not_before, undo, name, *chunk,
                )  # fmt: skip

    async def complete_pending(self, name: str, scores: Sequence[tuple[str, ScoreResult]]) -> int:
        """Writes the scores whose marker is still there and deletes those markers; how many."""
        if not scores:
            return 0
        fresh: set[str] = set()
        async with self.db.transaction() as tx:
            for chunk in chunks(list(dict.fromkeys(eid for eid, _ in scores))):
                cleared = await tx.fetchall(
                    f"DELETE FROM pending_scores WHERE name = ? AND event_id IN ({marks(len(chunk))}) RETURNING event_id",
                    name, *chunk,
                )  # fmt: skip
                fresh.update(eid for (eid,) in cleared)
            # Only where the marker was still there: a score is written once, whoever computed it.
            await insert_scores(tx, [score_params(eid, s) for eid, s in scores if eid in fresh])
        return len(fresh)

    async def pending_count(self, name: str = "") -> int:
        async with self.db.transaction() as tx:
            if name:
                found = await tx.fetchone("SELECT COUNT(*) FROM pending_scores WHERE name = ?", name)
            else:
                found = await tx.fetchone("SELECT COUNT(*) FROM pending_scores")
        return int(found[0]) if found is not None else 0
