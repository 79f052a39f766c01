"""Where records and scores live: SQLite (default, WAL) or PostgreSQL, with schema migrations.

- schema.py: the tables and their numbered migrations;
- sql.py: the SQL both backends run the same, on sluice-common's `SqlDb` (queries, summaries,
  finishing pending scores);
- sqlite.py, postgres.py: what each does its own way (storing a batch, claiming pending scores).

Inserts are idempotent by event id (`ON CONFLICT DO NOTHING`), so a redelivered event is stored
once. A score computed later (similarity: it waits on the adapter's embedding model) has a row in
`pending_scores` written in the same transaction as its record, so a crash between storing and
scoring loses nothing; similarity_worker.py claims due rows in batches (a lease: `not_before`
moves into the future and another replica skips them), then writes the scores and deletes the
rows in one transaction. Until then the score is absent from every query.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import asyncpg

from sluice_evaluation_logging.evaluators.base import ScoreResult
from sluice_evaluation_logging.model import PendingItem, RecordFilter, RecordRow, SummaryData
from sluice_evaluation_logging.store.postgres import PostgresStore
from sluice_evaluation_logging.store.schema import LATEST_VERSION, MIGRATIONS
from sluice_evaluation_logging.store.sqlite import SqliteStore

__all__ = ["LATEST_VERSION", "MIGRATIONS", "PostgresStore", "SqliteStore", "Store", "database_outage", "open_store", "refused_for_content"]


class Store(Protocol):
    """What the consumer, the similarity worker and the queries ask of the storage."""

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def schema_version(self) -> int: ...
    async def insert_batch(self, rows: Sequence[RecordRow]) -> int: ...
    async def get(self, event_id: str) -> RecordRow | None: ...
    async def query(self, where: RecordFilter, page_size: int, page_token: str) -> tuple[list[RecordRow], str]: ...
    async def summary_data(self, where: RecordFilter, max_records: int) -> SummaryData: ...
    async def count(self) -> int: ...
    async def claim_pending(self, name: str, limit: int, lease_s: float) -> list[PendingItem]: ...
    async def release_pending(self, name: str, event_ids: Sequence[str], delay_s: float, count_attempt: bool) -> None: ...
    async def complete_pending(self, name: str, scores: Sequence[tuple[str, ScoreResult]]) -> int: ...
    async def pending_count(self, name: str = "") -> int: ...


def open_store(database_url: str, sqlite_path: Path, pg_schema: str = "evallog") -> Store:
    """PostgreSQL (tables in `pg_schema`) when a URL is set, else SQLite at `sqlite_path`."""
    if database_url:
        return PostgresStore(database_url, pg_schema)
    return SqliteStore(sqlite_path)


# What a database raises when it refuses the rows it was given (a constraint, a value it cannot
# hold, an index entry too large: PostgreSQL's 54000), not when it is unreachable, locked or out
# of space: the same rows get the same answer on every retry, other rows may not.
_CONTENT_REFUSALS: tuple[type[BaseException], ...] = (
    sqlite3.IntegrityError,
    sqlite3.DataError,
    asyncpg.exceptions.IntegrityConstraintViolationError,
    asyncpg.exceptions.DataError,
    asyncpg.exceptions.ProgramLimitExceededError,
)


def refused_for_content(error: BaseException) -> bool:
    """Whether `error` from `insert_batch` is the database refusing what the rows hold (retrying
    them is useless) rather than the database failing (retrying is what to do)."""
    return isinstance(error, _CONTENT_REFUSALS)


# What a database raises when it cannot answer now but may later: unreachable or restarting
# (OSError covers refused and reset connections, and timeouts), out of connections, or, on SQLite,
# the file locked past the busy timeout or unreadable. Not a statement it refuses, nor a bug.
_OUTAGES: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.TooManyConnectionsError,
)
_SQLITE_OUTAGES = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN)


def database_outage(error: BaseException) -> bool:
    """Whether `error` from a store call is the database being unavailable (a caller may retry)."""
    if isinstance(error, sqlite3.OperationalError):
        # The primary result code is the low byte of the extended one (SQLITE_BUSY_SNAPSHOT is a BUSY).
        return error.sqlite_errorcode & 0xFF in _SQLITE_OUTAGES
    return isinstance(error, _OUTAGES)
