"""The PostgreSQL store: sluice-common's PostgresDb (a pool; migrations under an advisory lock, so
two replicas starting at once migrate once), tables in their own schema."""

from __future__ import annotations

import time
from collections.abc import Sequence

from sluice_common.sqlstore import PostgresDb
from sluice_evaluation_logging.model import PendingItem, RecordRow
from sluice_evaluation_logging.store.schema import METADATA_COLUMNS, MIGRATIONS, PENDING_COLUMNS, RECORD_COLUMNS, SCORE_COLUMNS
from sluice_evaluation_logging.store.sql import SqlStore, metadata_params, record_params, score_params

# The records columns' types, in RECORD_COLUMNS order, for unnest's arrays.
_RECORD_TYPES = ("text", "text", "text", "int4", "text", "int4", "text", "int4", "int4",
                 "float8", "float8", "float8", "float8", "float8", "bool", "bytea", "int4", "text", "text")  # fmt: skip
_SCORE_TYPES = ("text", "text", "float8", "bool", "bool", "text")


def _unnest(types: Sequence[str]) -> str:
    return "unnest(" + ", ".join(f"?::{kind}[]" for kind in types) + ")"


class PostgresStore(SqlStore):
    def __init__(self, dsn: str, schema: str = "evallog", pool_size: int = 4) -> None:
        self._pg = PostgresDb(dsn, schema, MIGRATIONS, pool_size)
        super().__init__(self._pg)

    @property
    def dsn(self) -> str:
        return self._pg.dsn

    @property
    def schema(self) -> str:
        return self._pg.schema

    async def insert_batch(self, rows: Sequence[RecordRow]) -> int:
        """Stores the records not stored yet, with their scores and pending markers, in one
        transaction; how many were new. Each table is one statement over arrays (unnest), whatever
        the batch's size; RETURNING names the records this insert stored, not a concurrent one."""
        if not rows:
            return 0
        stored_at = time.time()
        columns = [list(column) for column in zip(*(record_params(row, stored_at) for row in rows), strict=True)]
        async with self.db.transaction() as tx:
            inserted = await tx.fetchall(
                f"INSERT INTO records ({RECORD_COLUMNS}) SELECT * FROM {_unnest(_RECORD_TYPES)} ON CONFLICT (event_id) DO NOTHING RETURNING event_id",
                *columns,
            )
            fresh = {eid for (eid,) in inserted}
            scores = [score_params(row.event_id, s) for row in rows if row.event_id in fresh for s in row.scores]
            if scores:
                await tx.execute(
                    f"INSERT INTO scores ({SCORE_COLUMNS}) SELECT * FROM {_unnest(_SCORE_TYPES)} ON CONFLICT (event_id, name) DO NOTHING",
                    *[list(column) for column in zip(*scores, strict=True)],
                )
            metadata = [pair for row in rows if row.event_id in fresh for pair in metadata_params(row)]
            if metadata:
                await tx.execute(
                    f"INSERT INTO record_metadata ({METADATA_COLUMNS}) SELECT * FROM {_unnest(('text', 'text', 'text'))}"
                    " ON CONFLICT (event_id, name) DO NOTHING",
                    *[list(column) for column in zip(*metadata, strict=True)],
                )
            pending = [(row.event_id, name) for row in rows if row.event_id in fresh for name in row.pending]
            if pending:
                ids, names = zip(*pending, strict=True)
                await tx.execute(
                    f"INSERT INTO pending_scores ({PENDING_COLUMNS})"
                    " SELECT e, n, ?, ?, 0 FROM unnest(?::text[], ?::text[]) AS t (e, n)"
                    " ON CONFLICT (event_id, name) DO NOTHING",
                    stored_at, stored_at, list(ids), list(names),
                )  # fmt: skip
        return len(fresh)

    async def claim_pending(self, name: str, limit: int, lease_s: float) -> list[PendingItem]:
        """Up to `limit` due markers of score `name`, leased for `lease_s`."""
        now = time.time()
        # SKIP LOCKED: two replicas claiming at once take different rows instead of waiting.
        async with self.db.transaction() as tx:
            claimed = await tx.fetchall(
                "WITH due AS (SELECT event_id FROM pending_scores WHERE name = ? AND not_before <= ?"
                " ORDER BY not_before LIMIT ? FOR UPDATE SKIP LOCKED)"
                " UPDATE pending_scores p SET not_before = ?, attempts = p.attempts + 1"
                " FROM due, records r WHERE p.name = ? AND p.event_id = due.event_id AND r.event_id = p.event_id"
                " RETURNING p.event_id, p.attempts, r.event",
                name, now, limit, now + lease_s, name,
            )  # fmt: skip
        return [PendingItem(eid, bytes(event), int(attempts)) for eid, attempts, event in claimed]
