"""The SQLite store (the default): sluice-common's SqliteDb, one connection on one thread, WAL."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sluice_common.sqlstore import SqliteDb
from sluice_evaluation_logging.model import PendingItem, RecordRow
from sluice_evaluation_logging.store.schema import METADATA_COLUMNS, MIGRATIONS, PENDING_COLUMNS, RECORD_COLUMNS, SCORE_COLUMNS
from sluice_evaluation_logging.store.sql import (
    CHUNK,
    SCORE_VALUES,
    SqlStore,
    chunks,
    marks,
    metadata_params,
    multi_insert_sql,
    record_params,
    score_params,
)

_RECORD_VALUES = "(" + marks(19) + ")"
_PENDING_VALUES = "(?, ?, ?, ?, 0)"


class SqliteStore(SqlStore):
    def __init__(self, path: Path) -> None:
        self.path = path
        self._sqlite = SqliteDb(path, MIGRATIONS)
        super().__init__(self._sqlite)

    async def insert_batch(self, rows: Sequence[RecordRow]) -> int:
        """Stores the records not stored yet, with their scores and pending markers, in one
        transaction; how many were new. The whole batch is one trip to the connection's thread:
        every sqlite3 step releases and retakes the GIL, which the event loop holds most of the
        time, so one step per chunk of rows instead of one per row (or per statement) is what keeps
        the store's thread from queueing behind the loop (and the loop from waiting for the store)."""
        batch = list(rows)
        return await self._sqlite.run_in_transaction(lambda db: _insert_batch(db, batch))

    async def claim_pending(self, name: str, limit: int, lease_s: float) -> list[PendingItem]:
        """Up to `limit` due markers of score `name`, leased for `lease_s` (under SQLite's write
        lock, so no other claim sees them due meanwhile)."""
        now = time.time()
        async with self.db.transaction() as tx:
            due = await tx.fetchall(
                "SELECT p.event_id, p.attempts, r.event FROM pending_scores p"
                " JOIN records r ON r.event_id = p.event_id"
                " WHERE p.name = ? AND p.not_before <= ? ORDER BY p.not_before LIMIT ?",
                name, now, limit,
            )  # fmt: skip
            for chunk in chunks([eid for eid, _, _ in due]):
                await tx.execute(
                    "UPDATE pending_scores SET not_before = ?, attempts = attempts + 1"
                    f" WHERE name = ? AND event_id IN ({marks(len(chunk))})",
                    now + lease_s, name, *chunk,
                )  # fmt: skip
        return [PendingItem(eid, bytes(event), int(attempts) + 1) for eid, attempts, event in due]


def _insert_chunks(db: sqlite3.Connection, head: str, values: str, conflict: str, rows: Sequence[Sequence[Any]]) -> None:
    for chunk in chunks(rows):
        db.execute(multi_insert_sql(head, values, len(chunk), conflict), [value for row in chunk for value in row])


def _insert_batch(db: sqlite3.Connection, rows: list[RecordRow]) -> int:
    """On the connection's thread, inside the write transaction."""
    stored_at = time.time()
    # Under the write lock, the ids already stored (redeliveries; usually none) are final.
    seen: set[str] = set()
    ids = list({row.event_id for row in rows})
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        found = db.execute(f"SELECT event_id FROM records WHERE event_id IN ({marks(len(chunk))})", chunk)
        seen.update(eid for (eid,) in found.fetchall())
    records: list[tuple[Any, ...]] = []
    scores: list[tuple[Any, ...]] = []
    pending: list[tuple[Any, ...]] = []
    metadata: list[tuple[Any, ...]] = []
    for row in rows:
        eid = row.event_id
        if eid in seen:
            continue
        seen.add(eid)  # the same event twice in one batch: stored once
        records.append(record_params(row, stored_at))
        scores.extend(score_params(eid, s) for s in row.scores)
        pending.extend((eid, name, stored_at, stored_at) for name in row.pending)
        metadata.extend(metadata_params(row))
    _insert_chunks(db, f"INSERT INTO records ({RECORD_COLUMNS})", _RECORD_VALUES, "event_id", records)
    _insert_chunks(db, f"INSERT INTO scores ({SCORE_COLUMNS})", SCORE_VALUES, "event_id, name", scores)
    _insert_chunks(db, f"INSERT INTO record_metadata ({METADATA_COLUMNS})", "(?, ?, ?)", "event_id, name", metadata)
    _insert_chunks(db, f"INSERT INTO pending_scores ({PENDING_COLUMNS})", _PENDING_VALUES, "event_id, name", pending)
    return len(records)
