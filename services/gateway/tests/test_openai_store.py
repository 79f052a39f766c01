"""The Files/Batch store on SQLite and PostgreSQL (in the job store's database): per-tenant files,
OpenAI's newest-first cursor pages, result files made once."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from sluice_gateway.jobs.store import JobStore
from sluice_gateway.openai_front.store import FileInUse, OpenAIStore, StoredBatch

PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture(params=["sqlite", "postgres"])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[JobStore, OpenAIStore]]:
    schema = f"jobs_test_{uuid.uuid4().hex[:8]}"
    job_store = JobStore.create(PG_DSN if request.param == "postgres" else "", tmp_path / "jobs.sqlite3", schema)
    await job_store.open()
    yield job_store, OpenAIStore(job_store.db)
    await job_store.close()
    if request.param == "postgres":
        connection = await asyncpg.connect(PG_DSN)
        await connection.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await connection.close()


async def test_files_belong_to_their_tenant(stores: tuple[JobStore, OpenAIStore]) -> None:
    _, store = stores
    stored = await store.create_file("demo", "batch", "in.jsonl", b"{}\n")
    assert stored.file_id.startswith("file-") and stored.bytes == 3 and stored.to_openai()["object"] == "file"
    assert await store.get_file("demo", stored.file_id) == stored
    assert await store.file_content("demo", stored.file_id) == b"{}\n"
    assert await store.get_file("private", stored.file_id) is None
    assert await store.file_content("private", stored.file_id) is None
    assert not await store.delete_file("private", stored.file_id)
    assert await store.delete_file("demo", stored.file_id)
    assert await store.get_file("demo", stored.file_id) is None


async def test_a_file_with_a_given_id_is_stored_once(stores: tuple[JobStore, OpenAIStore]) -> None:
    _, store = stores
    first = await store.create_file("demo", "batch_output", "o.jsonl", b"one\n", file_id="file-x-output")
    again = await store.create_file("demo", "batch_output", "o.jsonl", b"two!\n", file_id="file-x-output")
    assert again == first and await store.file_content("demo", "file-x-output") == b"one\n"


async def test_lists_page_newest_first_after_an_id(stores: tuple[JobStore, OpenAIStore]) -> None:
    _, store = stores
    ids = [(await store.create_file("demo", "batch", f"{i}.jsonl", b"x", now=100.0 + i)).file_id for i in range(5)]
    await store.create_file("private", "batch", "p.jsonl", b"x", now=200.0)
    await store.create_file("demo", "batch_output", "o.jsonl", b"x", now=300.0)
    first = await store.list_files("demo", 2, purpose="batch")
    assert [f.file_id for f in first.items] == ids[::-1][:2] and first.has_more
    rest = await store.list_files("demo", 10, after=first.items[-1].file_id, purpose="batch")
    assert [f.file_id for f in rest.items] == ids[::-1][2:] and not rest.has_more
    assert len((await store.list_files("demo", 10)).items) == 6
    assert (await store.list_files("demo", 10, after="file-unknown")).items == []


async def test_files_page_oldest_first_when_asked(stores: tuple[JobStore, OpenAIStore]) -> None:
    """OpenAI's `order=asc` of GET /v1/files."""
    _, store = stores
    ids = [(await store.create_file("demo", "batch", f"{i}.jsonl", b"x", now=100.0 + i)).file_id for i in range(5)]
    first = await store.list_files("demo", 2, ascending=True)
    assert [f.file_id for f in first.items] == ids[:2] and first.has_more
    rest = await store.list_files("demo", 10, after=first.items[-1].file_id, ascending=True)
    assert [f.file_id for f in rest.items] == ids[2:] and not rest.has_more


async def test_an_input_file_is_kept_until_its_batchs_result_files_are_made(stores: tuple[JobStore, OpenAIStore]) -> None:
    jobs, store = stores
    source = await store.create_file("demo", "batch", "in.jsonl", b"{}\n")
    await jobs.record_submitted("batch_k", "demo", 1, "", 86400.0)
    batch = StoredBatch("batch_k", "demo", "/v1/chat/completions", source.file_id, "24h", None, 1.0, None, None, None, False)
    await store.create_batch(batch)
    assert [b.batch_id for b in await store.pending_batches("demo", source.file_id)] == ["batch_k"]
    assert await store.pending_batches("private", source.file_id) == []
    with pytest.raises(FileInUse) as caught:
        await store.delete_file("demo", source.file_id)
    assert caught.value.batch_id == "batch_k" and await store.get_file("demo", source.file_id) is not None
    assert not await store.delete_file("private", source.file_id)  # another tenant's: absent, as ever
    await store.set_result_files("batch_k", None, None)
    assert await store.pending_batches("demo", source.file_id) == []
    assert await store.delete_file("demo", source.file_id) and await store.get_file("demo", source.file_id) is None


async def test_batches_cancelling_time_and_result_files_once(stores: tuple[JobStore, OpenAIStore]) -> None:
    jobs, store = stores
    for i, batch_id in enumerate(("batch_a", "batch_b")):
        await jobs.record_submitted(batch_id, "demo", 1, "", 86400.0)
        await store.create_batch(
            StoredBatch(batch_id, "demo", "/v1/embeddings", "file-1", "24h", {"k": "v"} if i else None, 10.0 + i, None, None, None, False)
        )
    batch = await store.get_batch("demo", "batch_a")
    assert batch is not None and batch.metadata is None and not batch.files_made and batch.output_file_id is None
    assert await store.get_batch("private", "batch_a") is None
    await store.mark_cancelling("batch_a", now=50.0)
    await store.mark_cancelling("batch_a", now=60.0)
    await store.set_result_files("batch_a", "file-a-output", None)
    await store.set_result_files("batch_a", "file-other", "file-other")
    batch = await store.get_batch("demo", "batch_a")
    assert batch is not None and batch.cancelling_at == 50.0 and batch.files_made
    assert (batch.output_file_id, batch.error_file_id) == ("file-a-output", None)
    page = await store.list_batches("demo", 1)
    assert [b.batch_id for b in page.items] == ["batch_b"] and page.has_more and page.items[0].metadata == {"k": "v"}
    assert [b.batch_id for b in (await store.list_batches("demo", 5, after="batch_b")).items] == ["batch_a"]
