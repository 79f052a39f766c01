"""SqliteDb's one-trip transaction on a real SQLite file: it commits or rolls back as a whole, and
takes its turn with `transaction()` on the same connection."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sluice_common.sqlstore import SqliteDb

MIGRATIONS = ((1, "a table", ("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL)",)),)


async def test_run_in_transaction_commits_or_rolls_back_as_a_whole(tmp_path: Path) -> None:
    db = SqliteDb(tmp_path / "t.sqlite3", MIGRATIONS)
    await db.open()
    try:
        assert await db.run_in_transaction(lambda c: c.execute("INSERT INTO t (id, v) VALUES (1, 'a')").rowcount) == 1

        def half_then_fail(c):  # type: ignore[no-untyped-def]
            c.execute("INSERT INTO t (id, v) VALUES (2, 'b')")
            c.execute("INSERT INTO t (id, v) VALUES (1, 'duplicate')")

        with pytest.raises(Exception, match="UNIQUE"):
            await db.run_in_transaction(half_then_fail)
        async with db.transaction() as tx:
            assert await tx.fetchall("SELECT id, v FROM t ORDER BY id") == [(1, "a")]
    finally:
        await db.close()


async def test_run_in_transaction_waits_for_an_open_transaction(tmp_path: Path) -> None:
    """Both share one connection: a batch that started inside another's transaction would fail
    ("cannot start a transaction within a transaction") or be rolled back with it."""
    db = SqliteDb(tmp_path / "t.sqlite3", MIGRATIONS)
    await db.open()
    try:
        inside = asyncio.Event()
        release = asyncio.Event()

        async def slow_transaction() -> None:
            async with db.transaction() as tx:
                await tx.execute("INSERT INTO t (id, v) VALUES (1, 'first')")
                inside.set()
                await release.wait()

        holder = asyncio.create_task(slow_transaction())
        await inside.wait()
        batch = asyncio.create_task(db.run_in_transaction(lambda c: c.execute("INSERT INTO t (id, v) VALUES (2, 'second')").rowcount))
        await asyncio.sleep(0.05)
        assert not batch.done()  # it waits its turn
        release.set()
        await holder
        assert await batch == 1
        async with db.transaction() as tx:
            assert await tx.fetchall("SELECT v FROM t ORDER BY id") == [("first",), ("second",)]
    finally:
        await db.close()


async def test_a_transaction_cancelled_while_its_begin_waits_leaves_no_transaction_open(tmp_path: Path) -> None:
    """BEGIN runs on the connection's thread whether or not its caller still waits: cancelled there
    (a worker's heartbeat stopped while another process held the write lock), it left the connection
    inside a transaction and every later one failed with "cannot start a transaction within a
    transaction"."""
    import sqlite3

    db = SqliteDb(tmp_path / "t.sqlite3", MIGRATIONS)
    await db.open()
    other_process = sqlite3.connect(tmp_path / "t.sqlite3", isolation_level=None)
    try:
        other_process.execute("BEGIN IMMEDIATE")  # the write lock: our BEGIN waits on it

        async def write() -> None:
            async with db.transaction() as tx:
                await tx.execute("INSERT INTO t (id, v) VALUES (1, 'never')")

        cancelled = asyncio.create_task(write())
        await asyncio.sleep(0.2)  # its BEGIN is on the connection's thread, waiting for the lock
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        other_process.execute("COMMIT")  # now that BEGIN gets the lock
        async with db.transaction() as tx:
            await tx.execute("INSERT INTO t (id, v) VALUES (2, 'after')")
        async with db.transaction() as tx:
            assert await tx.fetchall("SELECT v FROM t ORDER BY id") == [("after",)]
    finally:
        other_process.close()
        await db.close()


DEFERRED_FK = (
    (
        1,
        "a parent and a child whose foreign key is checked at COMMIT",
        (
            "CREATE TABLE parent (id INTEGER PRIMARY KEY)",
            "CREATE TABLE child (id INTEGER PRIMARY KEY, parent_id INTEGER NOT NULL REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)",
        ),
    ),
)


async def test_a_commit_that_fails_leaves_no_transaction_open(tmp_path: Path) -> None:
    """SQLite keeps the transaction open when COMMIT fails (here a deferred foreign key violation):
    every later BEGIN IMMEDIATE on the connection failed with "cannot start a transaction within a
    transaction", the store unusable until a restart."""
    import sqlite3

    db = SqliteDb(tmp_path / "t.sqlite3", DEFERRED_FK)
    await db.open()
    try:
        with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
            async with db.transaction() as tx:
                await tx.execute("INSERT INTO child (id, parent_id) VALUES (1, 404)")
        async with db.transaction() as tx:
            await tx.execute("INSERT INTO parent (id) VALUES (1)")
        with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
            await db.run_in_transaction(lambda c: c.execute("INSERT INTO child (id, parent_id) VALUES (2, 404)"))
        assert await db.run_in_transaction(lambda c: c.execute("INSERT INTO child (id, parent_id) VALUES (3, 1)").rowcount) == 1
        async with db.transaction() as tx:
            assert await tx.fetchall("SELECT id FROM child ORDER BY id") == [(3,)]
    finally:
        await db.close()
