"""The OpenAI Batch API's durable state: files (uploads and batch output) and batches.

Lives in the job store's database (the tables come with jobs.store's migration 3), so that a batch,
its job, its rows and its files are one SQLite file or one PostgreSQL schema: a gateway restart
loses none of them, and several gateways behind one PostgreSQL see the same files. Every lookup is
by (id, tenant): another tenant's id reads as absent (the HTTP front answers 404).

Plain domain code (no HTTP, no grpc), unit-tested directly.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from sluice_common.sqlstore import SqlDb

# OpenAI's bounds on a list's `limit`: batches 1 to 100 (default 20), files 1 to 10,000 (default 10,000).
MAX_LIST_LIMIT = 100
MAX_FILES_LIMIT = 10_000


def new_id(prefix: str) -> str:
    """OpenAI-looking ids ("file-...", "batch_..."): 24 random hex digits."""
    return prefix + secrets.token_hex(12)


@dataclass(frozen=True)
class StoredFile:
    file_id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: float

    def to_openai(self) -> dict[str, Any]:
        """openai.types.FileObject."""
        return {
            "id": self.file_id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(self.created_at),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
        }


@dataclass(frozen=True)
class StoredBatch:
    batch_id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None
    created_at: float
    cancelling_at: float | None
    output_file_id: str | None
    error_file_id: str | None
    files_made: bool


_FILE_COLUMNS = "file_id, tenant, purpose, filename, bytes, created_at"
_BATCH_COLUMNS = (
    "batch_id, tenant, endpoint, input_file_id, completion_window, metadata, created_at, cancelling_at, output_file_id, error_file_id, files_made"
)


# The batches that still read a file (their output and error files not yet made from it).
_PENDING_READERS = "SELECT batch_id FROM openai_batches WHERE input_file_id = ? AND NOT files_made"


def _file(row: tuple[Any, ...]) -> StoredFile:
    file_id, tenant, purpose, filename, size, created = row
    return StoredFile(file_id, tenant, purpose, filename, int(size), float(created))


def _batch(row: tuple[Any, ...]) -> StoredBatch:
    batch_id, tenant, endpoint, input_file_id, window, metadata, created, cancelling, output_id, error_id, made = row
    return StoredBatch(
        batch_id, tenant, endpoint, input_file_id, window, json.loads(metadata), float(created),
        None if cancelling is None else float(cancelling), output_id, error_id, bool(made),
    )  # fmt: skip


class FileInUse(Exception):
    """A batch's output and error files are still to be made from this input file."""

    def __init__(self, batch_id: str) -> None:
        super().__init__(batch_id)
        self.batch_id = batch_id


@dataclass(frozen=True)
class Page:
    """One page of a list, as OpenAI's cursor lists: ordered newest first (or oldest, asked so), `after` an id."""

    items: list[Any]
    has_more: bool


class OpenAIStore:
    def __init__(self, db: SqlDb) -> None:
        self.db = db

    # ---- files

    async def create_file(
        self, tenant: str, purpose: str, filename: str, content: bytes, file_id: str | None = None, now: float | None = None
    ) -> StoredFile:
        """Stores a file; with a given file_id (a batch's output), a second call keeps the first."""
        stored = StoredFile(file_id or new_id("file-"), tenant, purpose, filename, len(content), time.time() if now is None else now)
        async with self.db.transaction() as tx:
            await tx.execute(
                f"INSERT INTO openai_files ({_FILE_COLUMNS}, content) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (file_id) DO NOTHING",
                stored.file_id, tenant, purpose, filename, stored.bytes, stored.created_at, content,
            )  # fmt: skip
            row = await tx.fetchone(f"SELECT {_FILE_COLUMNS} FROM openai_files WHERE file_id = ?", stored.file_id)
        assert row is not None
        return _file(row)

    async def get_file(self, tenant: str, file_id: str) -> StoredFile | None:
        async with self.db.transaction() as tx:
            row = await tx.fetchone(f"SELECT {_FILE_COLUMNS} FROM openai_files WHERE file_id = ? AND tenant = ?", file_id, tenant)
        return None if row is None else _file(row)

    async def file_content(self, tenant: str, file_id: str) -> bytes | None:
        async with self.db.transaction() as tx:
            row = await tx.fetchone("SELECT content FROM openai_files WHERE file_id = ? AND tenant = ?", file_id, tenant)
        return None if row is None else bytes(row[0])

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        """False for a file that is not there; FileInUse while a batch still needs it to make its
        result files (they are shaped from its requests). The check is part of the delete statement:
        a batch recorded before it keeps its file."""
        async with self.db.transaction() as tx:
            if await tx.execute(
                f"DELETE FROM openai_files WHERE file_id = ? AND tenant = ? AND NOT EXISTS ({_PENDING_READERS})", file_id, tenant, file_id
            ):
                return True
            exists = await tx.fetchone("SELECT 1 FROM openai_files WHERE file_id = ? AND tenant = ?", file_id, tenant)
            reader = await tx.fetchone(f"{_PENDING_READERS} LIMIT 1", file_id) if exists else None
        if reader is not None:
            raise FileInUse(reader[0])
        return False

    async def pending_batches(self, tenant: str, file_id: str) -> list[StoredBatch]:
        """The tenant's batches whose result files are still to be made from this input file."""
        async with self.db.transaction() as tx:
            rows = await tx.fetchall(
                f"SELECT {_BATCH_COLUMNS} FROM openai_batches WHERE tenant = ? AND input_file_id = ? AND NOT files_made", tenant, file_id
            )
        return [_batch(row) for row in rows]

    async def list_files(self, tenant: str, limit: int, after: str | None = None, purpose: str | None = None, ascending: bool = False) -> Page:
        where, args = "tenant = ?", [tenant]
        if purpose:
            where, args = where + " AND purpose = ?", [*args, purpose]
        return await self._page("openai_files", _FILE_COLUMNS, "file_id", where, args, limit, after, _file, ascending)

    # ---- batches

    async def create_batch(self, batch: StoredBatch) -> None:
        async with self.db.transaction() as tx:
            await tx.execute(
                f"INSERT INTO openai_batches ({_BATCH_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                batch.batch_id, batch.tenant, batch.endpoint, batch.input_file_id, batch.completion_window,
                json.dumps(batch.metadata), batch.created_at, batch.cancelling_at, batch.output_file_id, batch.error_file_id,
                batch.files_made,
            )  # fmt: skip

    async def get_batch(self, tenant: str, batch_id: str) -> StoredBatch | None:
        async with self.db.transaction() as tx:
            row = await tx.fetchone(f"SELECT {_BATCH_COLUMNS} FROM openai_batches WHERE batch_id = ? AND tenant = ?", batch_id, tenant)
        return None if row is None else _batch(row)

    async def list_batches(self, tenant: str, limit: int, after: str | None = None) -> Page:
        return await self._page("openai_batches", _BATCH_COLUMNS, "batch_id", "tenant = ?", [tenant], limit, after, _batch)

    async def mark_cancelling(self, batch_id: str, now: float | None = None) -> None:
        """The first cancel request's time (OpenAI's cancelling_at); later ones keep it."""
        async with self.db.transaction() as tx:
            await tx.execute(
                "UPDATE openai_batches SET cancelling_at = ? WHERE batch_id = ? AND cancelling_at IS NULL",
                time.time() if now is None else now, batch_id,
            )  # fmt: skip

    async def set_result_files(self, batch_id: str, output_file_id: str | None, error_file_id: str | None) -> None:
        """Once: the output and error files were stored (with ids derived from the batch's, so two
        gateways making them at once store the same files and set the same ids)."""
        async with self.db.transaction() as tx:
            await tx.execute(
                "UPDATE openai_batches SET output_file_id = ?, error_file_id = ?, files_made = TRUE WHERE batch_id = ? AND NOT files_made",
                output_file_id, error_file_id, batch_id,
            )  # fmt: skip

    async def _page(
        self,
        table: str,
        columns: str,
        id_column: str,
        where: str,
        args: list[Any],
        limit: int,
        after: str | None,
        build: Any,
        ascending: bool = False,
    ) -> Page:
        """Newest first (created_at, then id, descending), or oldest first; `after`: the items after that id."""
        beyond, order = (">", "ASC") if ascending else ("<", "DESC")
        async with self.db.transaction() as tx:
            if after:
                anchor = await tx.fetchone(f"SELECT created_at FROM {table} WHERE {id_column} = ? AND {where}", after, *args)
                if anchor is None:
                    return Page([], False)
                where = f"{where} AND (created_at {beyond} ? OR (created_at = ? AND {id_column} {beyond} ?))"
                args = [*args, anchor[0], anchor[0], after]
            rows = await tx.fetchall(
                f"SELECT {columns} FROM {table} WHERE {where} ORDER BY created_at {order}, {id_column} {order} LIMIT ?", *args, limit + 1
            )
        return Page([build(row) for row in rows[:limit]], len(rows) > limit)
