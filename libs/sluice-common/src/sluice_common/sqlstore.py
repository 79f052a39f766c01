"""SQL stores with schema migrations: SQLite by default (WAL), PostgreSQL when a DSN is set.

Both backends run the same SQL, written with `?` placeholders (PostgreSQL gets them renumbered
to `$n`); `{blob}` in a migration statement is the binary column type of the backend. Migrations
are (version, description, statements), applied once each and recorded in `schema_migrations`;
on PostgreSQL under an advisory lock so that two replicas starting at once never both migrate.

    db = open_sql_db(postgres_dsn, sqlite_path, schema="jobs", migrations=MIGRATIONS)
    await db.open()
    async with db.transaction() as tx:
        changed = await tx.execute("UPDATE t SET x = ? WHERE id = ?", 1, "a")
        rows = await tx.fetchall("SELECT x FROM t WHERE id = ?", "a")

PostgreSQL needs `asyncpg` in the service's environment (imported only when a DSN is set).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

Migrations = Sequence[tuple[int, str, Sequence[str]]]

MIGRATIONS_TABLE = """CREATE TABLE IF NOT EXISTS schema_migrations (
    version INTEGER PRIMARY KEY, description TEXT NOT NULL, applied_at DOUBLE PRECISION NOT NULL)"""


def dollar(sql: str) -> str:
    """`?` placeholders to asyncpg's `$1, $2, ...`."""
    parts = sql.split("?")
    return "".join(part + (f"${i + 1}" if i < len(parts) - 1 else "") for i, part in enumerate(parts))


@contextlib.contextmanager
def write_transaction(db: sqlite3.Connection) -> Iterator[None]:
    """A synchronous transaction on `db` (autocommit mode) for work already on its thread:
    BEGIN IMMEDIATE (the write lock at once, so a batch never fails half way on a busy file),
    COMMIT, or ROLLBACK on any error, a failed COMMIT's too: SQLite leaves the transaction open when
    COMMIT fails (a deferred foreign key violation, SQLITE_BUSY), and every later BEGIN on the
    connection would fail with "cannot start a transaction within a transaction"."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    try:
        db.execute("COMMIT")
    except BaseException:
        _rollback_if_open(db)
        raise


def _rollback_if_open(db: sqlite3.Connection) -> None:
    if db.in_transaction:
        db.execute("ROLLBACK")


def _commit_or_roll_back(db: sqlite3.Connection) -> None:
    """COMMIT, or ROLLBACK (then re-raise) when COMMIT fails and leaves the transaction open."""
    try:
        db.execute("COMMIT")
    except BaseException:
        _rollback_if_open(db)
        raise


def migrate_sqlite(db: sqlite3.Connection, migrations: Migrations) -> None:
    """Applies the missing migrations in one IMMEDIATE transaction (`db` in autocommit mode)."""
    with write_transaction(db):
        db.execute(MIGRATIONS_TABLE)
        applied = {v for (v,) in db.execute("SELECT version FROM schema_migrations")}
        for version, description, statements in migrations:
            if version in applied:
                continue
            for statement in statements:
                db.execute(statement.format(blob="BLOB"))
            db.execute(
                "INSERT INTO schema_migrations (version, description, applied_at) VALUES (?, ?, ?)",
                (version, description, time.time()),
            )


async def migrate_postgres(connection: Any, schema: str, migrations: Migrations, lock_name: str) -> None:
    """Creates `schema` and applies the missing migrations in it, under an advisory lock."""
    if not schema.isidentifier():
        raise ValueError(f"schema must be a plain identifier, got {schema!r}")
    async with connection.transaction():
        await connection.execute("SELECT pg_advisory_xact_lock(hashtext($1))", lock_name)
        await connection.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        await connection.execute(f'SET LOCAL search_path TO "{schema}"')
        await connection.execute(MIGRATIONS_TABLE)
        applied = {r["version"] for r in await connection.fetch("SELECT version FROM schema_migrations")}
        for version, description, statements in migrations:
            if version in applied:
                continue
            for statement in statements:
                await connection.execute(statement.format(blob="BYTEA"))
            await connection.execute(
                "INSERT INTO schema_migrations (version, description, applied_at) VALUES ($1, $2, $3)",
                version,
                description,
                time.time(),
            )


class Tx(Protocol):
    async def execute(self, sql: str, *args: Any) -> int: ...
    async def fetchall(self, sql: str, *args: Any) -> list[tuple[Any, ...]]: ...
    async def fetchone(self, sql: str, *args: Any) -> tuple[Any, ...] | None: ...


class SqlDb(Protocol):
    backend: str

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    def transaction(self) -> contextlib.AbstractAsyncContextManager[Tx]: ...


class _SqliteTx:
    def __init__(self, db: SqliteDb) -> None:
        self._db = db

    async def execute(self, sql: str, *args: Any) -> int:
        return int(await self._db.run(lambda c: c.execute(sql, args).rowcount))

    async def fetchall(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        return list(await self._db.run(lambda c: c.execute(sql, args).fetchall()))

    async def fetchone(self, sql: str, *args: Any) -> tuple[Any, ...] | None:
        return await self._db.run(lambda c: c.execute(sql, args).fetchone())


class SqliteDb:
    """One connection on one thread (sqlite3 blocks); transactions in this process take turns
    (an asyncio lock), other processes wait on SQLite's own lock (busy timeout 30 s)."""

    backend = "sqlite"

    def __init__(self, path: Path, migrations: Migrations) -> None:
        self.path = path
        self._migrations = migrations
        self._executor: ThreadPoolExecutor | None = None
        self._db: sqlite3.Connection | None = None
        self._lock = asyncio.Lock()

    async def run(self, fn: Any) -> Any:
        """fn(connection), on the connection's thread, without a turn: on this one connection it may
        run between the statements of an open transaction. Writes go through `transaction()` or
        `run_in_transaction()`."""
        assert self._db is not None, "open() first"
        db = self._db
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, db)

    async def open(self) -> None:
        """Opens (again, after close()) and migrates."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite")

        def work() -> sqlite3.Connection:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA foreign_keys=ON")
            try:
                migrate_sqlite(db, self._migrations)
            except BaseException:
                db.close()
                raise
            return db

        self._db = await asyncio.get_running_loop().run_in_executor(self._executor, work)

    async def close(self) -> None:
        if self._db is not None:
            await self.run(lambda c: c.close())
            self._db = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    async def run_in_transaction(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """fn(connection) inside one BEGIN IMMEDIATE ... COMMIT (ROLLBACK if it raises), in one trip
        to the connection's thread: for a hot path whose many statements would otherwise each cost
        a hop (and a GIL handoff with the event loop). It takes its turn with `transaction()`."""

        def work(connection: sqlite3.Connection) -> T:
            with write_transaction(connection):
                return fn(connection)

        async with self._lock:
            return await self.run(work)  # type: ignore[no-any-return]

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        async with self._lock:
            try:
                await self.run(lambda c: c.execute("BEGIN IMMEDIATE"))
            except BaseException:
                # Cancelled while waiting for BEGIN: it still runs on the connection's thread, and a
                # transaction left open there would fail every later one on this connection. The
                # thread runs jobs in order, so queueing the rollback now (not waiting for it) is enough.
                assert self._executor is not None and self._db is not None
                self._executor.submit(_rollback_if_open, self._db)
                raise
            try:
                yield _SqliteTx(self)
            except BaseException:
                await asyncio.shield(self.run(lambda c: c.execute("ROLLBACK")))
                raise
            # COMMIT and, should it fail, ROLLBACK in one trip to the connection's thread, shielded:
            # a COMMIT that fails (a deferred foreign key violation, SQLITE_BUSY) leaves the
            # transaction open, and every later BEGIN on this connection would fail.
            await asyncio.shield(self.run(_commit_or_roll_back))


def postgres_text(args: Sequence[Any]) -> tuple[Any, ...]:
    """Statement arguments with NUL in text (a str, or the str items of a list for unnest) as
    U+FFFD. PostgreSQL's text cannot hold NUL ("invalid byte sequence for encoding UTF8: 0x00"), so
    one in a client's end-user id or a score's detail would fail its whole batch on every retry;
    queries are asked the same way, so such a value is still found (SQLite keeps NUL as it is)."""
    return tuple(_without_nul(arg) for arg in args)


def _without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if isinstance(value, list) and any(isinstance(item, str) and "\x00" in item for item in value):
        return [_without_nul(item) for item in value]
    return value


class _PostgresTx:
    def __init__(self, connection: Any) -> None:
        self._c = connection

    async def execute(self, sql: str, *args: Any) -> int:
        status = await self._c.execute(dollar(sql), *postgres_text(args))
        tail = str(status).rsplit(" ", 1)[-1]
        return int(tail) if tail.isdigit() else 0

    async def fetchall(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in await self._c.fetch(dollar(sql), *postgres_text(args))]

    async def fetchone(self, sql: str, *args: Any) -> tuple[Any, ...] | None:
        row = await self._c.fetchrow(dollar(sql), *postgres_text(args))
        return None if row is None else tuple(row)


class PostgresDb:
    backend = "postgres"

    def __init__(self, dsn: str, schema: str, migrations: Migrations, pool_size: int = 8) -> None:
        if not schema.isidentifier():
            raise ValueError(f"schema must be a plain identifier, got {schema!r}")
        self.dsn = dsn
        self.schema = schema
        self._migrations = migrations
        self._pool_size = pool_size
        self._pool: Any = None

    async def open(self) -> None:
        import asyncpg

        bootstrap = await asyncpg.connect(self.dsn)
        try:
            await migrate_postgres(bootstrap, self.schema, self._migrations, f"sluice:{self.schema}")
        finally:
            await bootstrap.close()
        self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=self._pool_size, server_settings={"search_path": self.schema})

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @property
    def pool(self) -> Any:
        """The asyncpg pool, for stores that write asyncpg SQL themselves."""
        assert self._pool is not None, "open() first"
        return self._pool

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        assert self._pool is not None, "open() first"
        async with self._pool.acquire() as connection, connection.transaction():
            yield _PostgresTx(connection)


def open_sql_db(postgres_dsn: str, sqlite_path: Path, schema: str, migrations: Migrations) -> SqlDb:
    """PostgreSQL (tables in `schema`) when a DSN is set, else SQLite at `sqlite_path`."""
    if postgres_dsn:
        return PostgresDb(postgres_dsn, schema, migrations)
    return SqliteDb(sqlite_path, migrations)
