"""/v1/files and /v1/batches on the HTTP front over a real (SQLite) job store and the real JobsApi;
the job worker's part is played by the store calls it makes (accept, finish_row, summary_told).
Replies are checked against the openai package's types."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import FormData
from aiohttp.test_utils import TestClient, TestServer
from openai.types import Batch, FileObject
from openai.types.chat import ChatCompletion
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2
from sluice.jobs.v1 import jobs_pb2
from structlog.testing import capture_logs

from sluice_common.amqp_publisher import MessageRejected
from sluice_gateway.jobs import api as jobs_api
from sluice_gateway.jobs.store import JobStore
from sluice_gateway.jobs.api import JobsApi
from sluice_gateway.path.model_catalog import ModelCatalog
from sluice_gateway.openai_front import batch_http
from sluice_gateway.openai_front.batch_http import BatchFront
from sluice_gateway.openai_front.http import OpenAIFront, build_app
from sluice_gateway.openai_front.store import MAX_FILES_LIMIT, OpenAIStore
from sluice_common.tenants import TenantDirectory

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TENANTS = TenantDirectory.from_file(Path(__file__).resolve().parents[3] / "config" / "tenants.toml")
DEMO = {"Authorization": "Bearer sk-sluice-demo"}
PRIVATE = {"Authorization": "Bearer sk-sluice-private"}
USAGE = types_pb2.Usage(prompt_tokens=7, completion_tokens=2, total_tokens=9)


class _Models:
    """The adapter's model list (all the catalog asks it)."""

    async def ListModels(self, request, timeout=None):  # type: ignore[no-untyped-def]  # noqa: N802
        return inference_pb2.ListModelsResponse(
            models=[
                types_pb2.ModelInfo(name="g", kind=types_pb2.MODEL_KIND_GENERATION, context_length=2048),
                types_pb2.ModelInfo(name="e", kind=types_pb2.MODEL_KIND_EMBEDDING, embedding_dimensions=3),
            ]
        )


class Setup:
    def __init__(self, client: TestClient, store: JobStore, published: list[jobs_pb2.AdmittedJob]) -> None:
        self.client = client
        self.store = store
        self.published = published

    async def upload(self, content: str, headers: dict[str, str] = DEMO, purpose: str = "batch") -> Any:
        form = FormData()
        form.add_field("purpose", purpose)
        form.add_field("file", content.encode(), filename="in.jsonl", content_type="application/jsonl")
        return await self.client.post("/v1/files", data=form, headers=headers)

    async def batch(self, file_id: str, endpoint: str = "/v1/chat/completions", headers: dict[str, str] = DEMO) -> Any:
        body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h", "metadata": {"run": "t"}}
        return await self.client.post("/v1/batches", json=body, headers=headers)


Publish = Callable[[jobs_pb2.AdmittedJob], "asyncio.Future[None] | None"]


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, publish: Publish | None = None, max_message_bytes: int = 1 << 20) -> AsyncIterator[Setup]:
    """The HTTP front over a real job store and JobsApi; `publish` stands for the job publisher
    (by default: kept in Setup.published, nothing to wait for)."""
    store = JobStore.create("", tmp_path / "jobs.sqlite3")
    await store.open()
    published: list[jobs_pb2.AdmittedJob] = []
    jobs = JobsApi(store, TENANTS, publish or published.append, max_rows=10, completion_window_s=86400.0, max_message_bytes=max_message_bytes)
    models = ModelCatalog(_Models())  # type: ignore[arg-type]
    await models.refresh()
    front = OpenAIFront(TENANTS, None)  # type: ignore[arg-type]  # the batch routes never run a request inline
    batches = BatchFront(front.tenants, OpenAIStore(store.db), jobs, models, files_max_bytes=2048, max_rows=10)
    client = TestClient(TestServer(build_app(front, 8192, batches)))
    await client.start_server()
    try:
        yield Setup(client, store, published)
    finally:
        await client.close()
        await store.close()


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    async with serving(tmp_path) as serve:
        yield serve


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


CHAT = {"model": "g", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_upload_is_checked_line_by_line_and_bounded(setup: Setup) -> None:
    reply = await setup.upload(line("a", CHAT) + "\n" + line("b", {**CHAT, "temperature": "hot"}) + "\n")
    error = (await reply.json())["error"]
    assert reply.status == 400 and "Line 2" in error["message"] and error["param"] == "body.temperature"
    reply = await setup.upload("\n".join(line(str(i), CHAT) for i in range(40)))
    assert reply.status == 413 and (await reply.json())["error"]["code"] == "file_too_large"
    reply = await setup.upload(line("a", CHAT), purpose="fine-tune")
    assert reply.status == 400 and (await reply.json())["error"]["param"] == "purpose"
    reply = await setup.upload(line("a", CHAT), headers={"Authorization": "Bearer sk-wrong"})
    assert reply.status == 401


async def test_files_are_per_tenant(setup: Setup) -> None:
    content = line("a", CHAT) + "\n"
    stored = FileObject.model_validate(await (await setup.upload(content)).json())
    assert stored.purpose == "batch" and stored.bytes == len(content) and stored.filename == "in.jsonl"
    assert (await setup.client.get(f"/v1/files/{stored.id}", headers=DEMO)).status == 200
    assert await (await setup.client.get(f"/v1/files/{stored.id}/content", headers=DEMO)).read() == content.encode()
    listed = await (await setup.client.get("/v1/files", headers=DEMO)).json()
    assert [f["id"] for f in listed["data"]] == [stored.id] and listed["has_more"] is False
    for path in (f"/v1/files/{stored.id}", f"/v1/files/{stored.id}/content"):
        assert (await setup.client.get(path, headers=PRIVATE)).status == 404
    assert (await setup.client.delete(f"/v1/files/{stored.id}", headers=PRIVATE)).status == 404
    assert (await (await setup.batch(stored.id, headers=PRIVATE)).json())["error"]["param"] == "input_file_id"
    assert (await (await setup.client.get("/v1/files", headers=PRIVATE)).json())["data"] == []
    deleted = await setup.client.delete(f"/v1/files/{stored.id}", headers=DEMO)
    assert deleted.status == 200 and (await deleted.json()) == {"id": stored.id, "object": "file", "deleted": True}


async def test_a_batch_is_a_job_and_its_results_become_files(setup: Setup) -> None:
    content = "\n".join([line("one", CHAT), line("two", CHAT), line("bad", {**CHAT, "model": "nope"})])
    file_id = (await (await setup.upload(content)).json())["id"]
    created = await setup.batch(file_id)
    batch = Batch.model_validate(await created.json())
    assert created.status == 200 and batch.status == "validating" and batch.input_file_id == file_id and batch.metadata == {"run": "t"}
    assert batch.request_counts is not None and batch.request_counts.total == 3 and batch.output_file_id is None
    [admitted] = setup.published
    job = admitted.job  # under its tenant's name, without the key it was created with
    assert (admitted.tenant, admitted.text_logging, job.api_key) == ("demo", True, "")
    assert job.job_id == batch.id and [r.custom_id for r in job.rows] == ["one", "two", "bad"]
    assert (await setup.client.get(f"/v1/batches/{batch.id}", headers=PRIVATE)).status == 404

    # What the job worker does with it.
    await setup.store.accept(batch.id, "demo", "", ["one", "two", "bad"], 86400.0)
    progress = Batch.model_validate(await (await setup.client.get(f"/v1/batches/{batch.id}", headers=DEMO)).json())
    assert progress.status == "in_progress"
    for custom_id in ("one", "two"):
        await setup.store.finish_row(
            jobs_pb2.RowResult(
                job_id=batch.id, custom_id=custom_id, output=f"hi {custom_id}", finish_reason=types_pb2.FINISH_REASON_STOP, usage=USAGE
            )
        )
    await setup.store.finish_row(
        jobs_pb2.RowResult(job_id=batch.id, custom_id="bad", error=jobs_pb2.RowError(code="INVALID_ARGUMENT", message="unknown model 'nope'"))
    )
    await setup.store.summary_told(batch.id)

    done = Batch.model_validate(await (await setup.client.get(f"/v1/batches/{batch.id}", headers=DEMO)).json())
    assert done.status == "completed" and done.completed_at is not None
    assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    assert done.output_file_id and done.error_file_id
    output = (await (await setup.client.get(f"/v1/files/{done.output_file_id}/content", headers=DEMO)).read()).decode()
    records = [json.loads(x) for x in output.splitlines()]
    assert [r["custom_id"] for r in records] == ["one", "two"]
    assert ChatCompletion.model_validate(records[0]["response"]["body"]).choices[0].message.content == "hi one"
    errors = [
        json.loads(x) for x in (await (await setup.client.get(f"/v1/files/{done.error_file_id}/content", headers=DEMO)).read()).decode().splitlines()
    ]
    # Refused as the endpoint refuses it: the HTTP error, in `response` (OpenAI's `error` is for non-HTTP errors).
    assert [(e["custom_id"], e["response"]["status_code"], e["response"]["body"]["error"]["code"], e["error"]) for e in errors] == [
        ("bad", 400, "invalid_argument", None)
    ]
    assert (await setup.client.get(f"/v1/files/{done.output_file_id}", headers=PRIVATE)).status == 404
    again = Batch.model_validate(await (await setup.client.get(f"/v1/batches/{batch.id}", headers=DEMO)).json())
    assert (again.output_file_id, again.error_file_id) == (done.output_file_id, done.error_file_id)
    cancel = await setup.client.post(f"/v1/batches/{batch.id}/cancel", headers=DEMO)
    # Not retried by OpenAI's clients (they retry a 409 otherwise): the batch will never be cancellable.
    assert cancel.status == 409 and cancel.headers["x-should-retry"] == "false"


async def test_cancel_list_and_refusals(setup: Setup) -> None:
    file_id = (await (await setup.upload(line("a", CHAT))).json())["id"]
    first = (await (await setup.batch(file_id)).json())["id"]
    second = (await (await setup.batch(file_id)).json())["id"]
    assert (await setup.client.post(f"/v1/batches/{first}/cancel", headers=PRIVATE)).status == 404
    cancelled = Batch.model_validate(await (await setup.client.post(f"/v1/batches/{first}/cancel", headers=DEMO)).json())
    assert cancelled.status == "cancelled" and cancelled.cancelling_at is not None and cancelled.cancelled_at is not None
    page = await (await setup.client.get("/v1/batches?limit=1", headers=DEMO)).json()
    assert [b["id"] for b in page["data"]] == [second] and page["has_more"] and page["last_id"] == second
    rest = await (await setup.client.get(f"/v1/batches?limit=5&after={second}", headers=DEMO)).json()
    assert [b["id"] for b in rest["data"]] == [first] and not rest["has_more"]
    assert (await setup.client.get("/v1/batches?limit=0", headers=DEMO)).status == 400
    mismatch = await setup.batch(file_id, endpoint="/v1/completions")
    assert mismatch.status == 400 and (await mismatch.json())["error"]["param"] == "endpoint"
    embeddings = (await (await setup.upload(line("e", {"model": "e", "input": "x", "dimensions": 5}, "/v1/embeddings"))).json())["id"]
    wrong = await setup.batch(embeddings, endpoint="/v1/embeddings")
    assert wrong.status == 400 and "dimensions=5" in (await wrong.json())["error"]["message"]
    unknown = (await (await setup.upload(line("u", {"model": "nope", "input": "x", "dimensions": 5}, "/v1/embeddings"))).json())["id"]
    assert (await setup.batch(unknown, endpoint="/v1/embeddings")).status == 200  # the row fails when it runs, as any unknown model's
    missing = await setup.batch("file-nope")
    assert missing.status == 404
    assert len(setup.published) == 3


async def test_malformed_uploads_and_queries_are_4xx(setup: Setup) -> None:
    client = setup.client
    boundary = "b"
    headers = {**DEMO, "Content-Type": f"multipart/form-data; boundary={boundary}"}
    part = b'--b\r\nContent-Disposition: form-data; name="file"; filename="%s"\r\n\r\n%s\r\n--b--\r\n'
    # A part header aiohttp's parser refuses (a control character), a body without its boundary,
    # a file name that is not UTF-8.
    for body in (part % (b"\x01", line("a", CHAT).encode()), b"no boundary here", part % (b"\xed\xa0\x80", line("a", CHAT).encode())):
        reply = await client.post("/v1/files", data=body, headers=headers)
        assert reply.status == 400 and (await reply.json())["error"]["param"] == "file", await reply.text()
    # A digit that int() refuses ("²".isdigit() is True).
    for path in ("/v1/files?limit=%C2%B2", "/v1/batches?limit=%C2%B2"):
        reply = await client.get(path, headers=DEMO)
        assert reply.status == 400 and (await reply.json())["error"]["param"] == "limit"


async def test_a_json_body_python_cannot_read_is_a_400_not_a_500(setup: Setup) -> None:
    """json.loads raises a plain ValueError, no JSONDecodeError, for an integer over 4,300 digits."""
    body = b'{"input_file_id": "file-1", "endpoint": "/v1/chat/completions", "completion_window": "24h", "n": ' + b"1" * 5000 + b"}"
    reply = await setup.client.post("/v1/batches", data=body, headers={**DEMO, "Content-Type": "application/json"})
    assert reply.status == 400 and (await reply.json())["error"]["code"] == "invalid_json"


async def test_a_file_line_whose_custom_id_no_job_can_carry_is_refused_at_upload_naming_it(setup: Setup) -> None:
    for custom_id in ("x" * 225, "a\x00b"):
        reply = await setup.upload(line("ok", CHAT) + "\n" + line(custom_id, CHAT) + "\n")
        error = (await reply.json())["error"]
        assert reply.status == 400 and error["message"].startswith("Line 2 of the batch file") and error["param"] == "custom_id"
    assert (await setup.upload(line("x" * 224, CHAT))).status == 200  # the longest that fits beside the batch id


async def test_a_batch_over_the_job_message_bound_is_413_naming_it_and_nothing_is_recorded(tmp_path: Path) -> None:
    """A batch is one AdmittedJob message; RabbitMQ 4 closes the channel on one over its
    max_message_size (16 MiB), which the publisher took for a lost connection and retried forever."""
    async with serving(tmp_path, max_message_bytes=1024) as setup:
        long = {**CHAT, "messages": [{"role": "user", "content": "x" * 300}]}
        file_id = (await (await setup.upload("\n".join(line(f"r{i}", long) for i in range(4)))).json())["id"]
        reply = await setup.batch(file_id)
        error = (await reply.json())["error"]
        assert reply.status == 413 and error["param"] == "input_file_id"
        assert (
            "over the limit of 1024 bytes (SLUICE_GATEWAY_JOBS_MAX_MESSAGE_BYTES)" in error["message"] and "split the input file" in error["message"]
        )
        assert setup.published == [] and (await (await setup.client.get("/v1/batches", headers=DEMO)).json())["data"] == []
        with contextlib.closing(sqlite3.connect(tmp_path / "jobs.sqlite3")) as db:
            assert db.execute("SELECT COUNT(*) FROM jobs").fetchone() == (0,)


async def test_the_batch_exists_before_its_job_is_handed_to_the_broker(tmp_path: Path) -> None:
    """Written after the job's submit, the batch was missing for a job that ran whenever the
    answer was not given: a 503, a client gone, a database error in between."""
    at_publish: list[list[tuple[str, ...]]] = []

    def publish(admitted: jobs_pb2.AdmittedJob) -> None:
        # What another connection to the database sees at the moment the job is handed over.
        with contextlib.closing(sqlite3.connect(tmp_path / "jobs.sqlite3")) as db:
            at_publish.append(db.execute("SELECT batch_id FROM openai_batches").fetchall())

    async with serving(tmp_path, publish) as setup:
        file_id = (await (await setup.upload(line("a", CHAT))).json())["id"]
        created = await setup.batch(file_id)
        assert created.status == 200 and at_publish == [[((await created.json())["id"],)]]


async def test_a_batch_the_broker_has_not_confirmed_yet_is_answered_validating_not_503(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 503 had OpenAI's clients create the batch again under a new id while the first one's job
    was still sent by the publisher: two runs, one of them no /v1/batches call showed."""
    monkeypatch.setattr(jobs_api, "SUBMIT_CONFIRM_WAIT_S", 0.1)
    confirms: list[asyncio.Future[None]] = []

    def publish(admitted: jobs_pb2.AdmittedJob) -> asyncio.Future[None]:
        confirms.append(asyncio.get_running_loop().create_future())  # the broker has not confirmed it yet
        return confirms[-1]

    async with serving(tmp_path, publish) as setup:
        file_id = (await (await setup.upload(line("a", CHAT))).json())["id"]
        created = await setup.batch(file_id)
        batch = Batch.model_validate(await created.json())
        assert created.status == 200 and batch.status == "validating" and "retry-after" not in created.headers
        listed = await (await setup.client.get("/v1/batches", headers=DEMO)).json()
        assert [b["id"] for b in listed["data"]] == [batch.id] and len(confirms) == 1
        confirms[0].set_result(None)  # confirmed later: the job runs as any other


async def test_a_batch_the_broker_refuses_is_failed_saying_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused at once: answered failed. Refused after the answer (validating): failed then, not a
    window later by the sweep."""
    monkeypatch.setattr(jobs_api, "SUBMIT_CONFIRM_WAIT_S", 0.1)
    confirms: list[asyncio.Future[None]] = []

    def publish(admitted: jobs_pb2.AdmittedJob) -> asyncio.Future[None]:
        confirms.append(asyncio.get_running_loop().create_future())
        if len(confirms) == 1:
            confirms[-1].set_exception(MessageRejected("the broker refused it: Basic.Nack"))
        return confirms[-1]

    async with serving(tmp_path, publish) as setup:
        file_id = (await (await setup.upload(line("a", CHAT))).json())["id"]
        refused = Batch.model_validate(await (await setup.batch(file_id)).json())
        assert refused.status == "failed" and refused.errors is not None and refused.errors.data
        assert "not admitted: the broker refused it" in (refused.errors.data[0].message or "")
        later = Batch.model_validate(await (await setup.batch(file_id)).json())
        assert later.status == "validating"
        confirms[1].set_exception(MessageRejected("the broker refused it: Basic.Nack"))
        for _ in range(100):
            now = Batch.model_validate(await (await setup.client.get(f"/v1/batches/{later.id}", headers=DEMO)).json())
            if now.status == "failed":
                break
            await asyncio.sleep(0.02)
        assert now.status == "failed"


async def test_a_cancelled_batchs_rows_never_run_are_error_lines(setup: Setup) -> None:
    """The job store keeps no result for a cancelled row: they were in neither file."""
    file_id = (await (await setup.upload("\n".join(line(c, CHAT) for c in ("ran", "b", "c")))).json())["id"]
    batch_id = (await (await setup.batch(file_id)).json())["id"]
    await setup.store.accept(batch_id, "demo", "", ["ran", "b", "c"], 86400.0)
    await setup.store.finish_row(jobs_pb2.RowResult(job_id=batch_id, custom_id="ran", output="hi", finish_reason=types_pb2.FINISH_REASON_STOP))
    cancelled = Batch.model_validate(await (await setup.client.post(f"/v1/batches/{batch_id}/cancel", headers=DEMO)).json())
    assert cancelled.status == "cancelled" and cancelled.output_file_id and cancelled.error_file_id
    errors = (await (await setup.client.get(f"/v1/files/{cancelled.error_file_id}/content", headers=DEMO)).read()).decode()
    records = [json.loads(x) for x in errors.splitlines()]
    assert [(r["custom_id"], r["response"], r["error"]["code"]) for r in records] == [("b", None, "batch_cancelled"), ("c", None, "batch_cancelled")]
    assert all(set(r) == {"id", "custom_id", "response", "error"} and r["id"].startswith("batch_req_") for r in records)
    output = (await (await setup.client.get(f"/v1/files/{cancelled.output_file_id}/content", headers=DEMO)).read()).decode()
    assert [json.loads(x)["custom_id"] for x in output.splitlines()] == ["ran"]


async def test_a_batch_whose_files_cannot_be_made_does_not_fail_the_list(setup: Setup, tmp_path: Path) -> None:
    ids = []
    for custom_id in ("one", "two"):
        file_id = (await (await setup.upload(line(custom_id, CHAT))).json())["id"]
        batch_id = (await (await setup.batch(file_id)).json())["id"]
        await setup.store.accept(batch_id, "demo", "", [custom_id], 86400.0)
        await setup.store.finish_row(
            jobs_pb2.RowResult(job_id=batch_id, custom_id=custom_id, output="hi", finish_reason=types_pb2.FINISH_REASON_STOP)
        )
        await setup.store.summary_told(batch_id)
        ids.append((batch_id, file_id))
    # The first batch's input file no longer reads as one (as a file accepted by older rules).
    with contextlib.closing(sqlite3.connect(tmp_path / "jobs.sqlite3")) as db, db:
        db.execute("UPDATE openai_files SET content = ? WHERE file_id = ?", (b"{not json", ids[0][1]))
    with capture_logs() as logs:
        reply = await setup.client.get("/v1/batches", headers=DEMO)
    listed = {b["id"]: b for b in (await reply.json())["data"]}
    assert reply.status == 200 and set(listed) == {ids[0][0], ids[1][0]}
    # Logged with its traceback (an unexpected failure: only its repr was logged).
    (failed,) = [e for e in logs if e["event"] == "batch_files_failed"]
    assert failed["batch_id"] == ids[0][0] and isinstance(failed["exc_info"], Exception)
    assert listed[ids[0][0]]["status"] == "completed" and "output_file_id" not in listed[ids[0][0]]
    assert listed[ids[1][0]]["output_file_id"]


async def test_a_file_is_parsed_off_the_event_loop_at_upload_and_at_batch_create(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsing compiles each line's constraint: on the event loop, a large file held every HTTP and
    gRPC stream of the gateway for a minute. Another request is answered while one parses."""
    parsing, answered = threading.Event(), threading.Event()
    real = batch_http.parse_batch_file

    def slow(content: bytes, max_lines: int) -> Any:
        parsing.set()
        # On the loop, nothing else could run until this returns: the wait would time out.
        assert answered.wait(5), "no other request was answered while the file was parsed"
        return real(content, max_lines)

    async def meanwhile(started: asyncio.Future[Any]) -> Any:
        await asyncio.to_thread(parsing.wait, 5)
        assert (await setup.client.get("/v1/files", headers=DEMO)).status == 200
        answered.set()
        reply = await started
        parsing.clear()
        answered.clear()
        return reply

    monkeypatch.setattr(batch_http, "parse_batch_file", slow)
    uploaded = await meanwhile(asyncio.ensure_future(setup.upload(line("a", CHAT))))
    assert uploaded.status == 200, await uploaded.text()
    created = await meanwhile(asyncio.ensure_future(setup.batch((await uploaded.json())["id"])))
    assert created.status == 200, await created.text()


async def test_an_input_file_is_not_deleted_while_its_batch_still_needs_it(setup: Setup) -> None:
    """The result files are shaped from the input file's requests: deleted before they were made,
    the batch read completed with neither output_file_id nor error_file_id, for good."""
    file_id = (await (await setup.upload(line("one", CHAT))).json())["id"]
    batch_id = (await (await setup.batch(file_id)).json())["id"]
    await setup.store.accept(batch_id, "demo", "", ["one"], 86400.0)
    refused = await setup.client.delete(f"/v1/files/{file_id}", headers=DEMO)
    error = (await refused.json())["error"]
    assert refused.status == 409 and refused.headers["x-should-retry"] == "false"
    assert batch_id in error["message"] and (error["code"], error["param"]) == ("file_in_use", "file_id")
    assert (await setup.client.get(f"/v1/files/{file_id}", headers=DEMO)).status == 200
    # Ended but never read yet: its files are made from the input first, then the input goes.
    await setup.store.finish_row(jobs_pb2.RowResult(job_id=batch_id, custom_id="one", output="hi", finish_reason=types_pb2.FINISH_REASON_STOP))
    await setup.store.summary_told(batch_id)
    deleted = await setup.client.delete(f"/v1/files/{file_id}", headers=DEMO)
    assert deleted.status == 200 and (await setup.client.get(f"/v1/files/{file_id}", headers=DEMO)).status == 404
    done = Batch.model_validate(await (await setup.client.get(f"/v1/batches/{batch_id}", headers=DEMO)).json())
    assert done.status == "completed" and done.output_file_id
    output = await (await setup.client.get(f"/v1/files/{done.output_file_id}/content", headers=DEMO)).read()
    assert [json.loads(x)["custom_id"] for x in output.decode().splitlines()] == ["one"]
    # Another tenant's delete of it is still a 404, not a 409 naming the batch.
    other = (await (await setup.upload(line("two", CHAT))).json())["id"]
    await setup.batch(other)
    assert (await setup.client.delete(f"/v1/files/{other}", headers=PRIVATE)).status == 404


async def test_the_file_list_takes_openais_limit_and_order(setup: Setup) -> None:
    """GET /v1/files (openai-openapi's listFiles): limit 1 to 10,000, default 10,000; order by
    created_at, asc or desc, default desc. Capped at 100, a client paging by has_more saw the rest
    only with `after`; order was ignored."""
    upstream = {p["name"]: p["schema"] for p in json.loads((FIXTURES / "openai_list_files_parameters.json").read_text())["parameters"]}
    assert upstream["limit"]["default"] == MAX_FILES_LIMIT and (upstream["order"]["default"], upstream["order"]["enum"]) == ("desc", ["asc", "desc"])
    store = OpenAIStore(setup.store.db)
    ids = [(await store.create_file("demo", "batch", f"{i}.jsonl", b"x", now=100.0 + i)).file_id for i in range(120)]
    listed = await (await setup.client.get("/v1/files", headers=DEMO)).json()
    assert [f["id"] for f in listed["data"]] == ids[::-1] and not listed["has_more"]
    oldest = await (await setup.client.get(f"/v1/files?order=asc&limit={MAX_FILES_LIMIT}", headers=DEMO)).json()
    assert [f["id"] for f in oldest["data"]] == ids and oldest["first_id"] == ids[0]
    page = await (await setup.client.get(f"/v1/files?order=asc&limit=2&after={ids[0]}", headers=DEMO)).json()
    assert [f["id"] for f in page["data"]] == ids[1:3] and page["has_more"]
    newest = await (await setup.client.get("/v1/files?order=desc&limit=1", headers=DEMO)).json()
    assert [f["id"] for f in newest["data"]] == [ids[-1]]
    for query, param in ((f"limit={MAX_FILES_LIMIT + 1}", "limit"), ("limit=0", "limit"), ("order=sideways", "order")):
        reply = await setup.client.get(f"/v1/files?{query}", headers=DEMO)
        assert reply.status == 400 and (await reply.json())["error"]["param"] == param, query
    # The batch list keeps OpenAI's own bounds for it (1 to 100).
    assert (await setup.client.get("/v1/batches?limit=101", headers=DEMO)).status == 400


async def test_a_list_where_a_name_belongs_is_a_400_naming_it_not_a_500(setup: Setup) -> None:
    """A list or an object tested against a dict raised TypeError (unhashable): 500 internal_error."""
    reply = await setup.upload(json.dumps({"custom_id": "a", "method": "POST", "url": ["/v1/chat/completions"], "body": CHAT}))
    error = (await reply.json())["error"]
    assert reply.status == 400 and error["param"] == "url" and error["message"].startswith("Line 1 of the batch file")
    file_id = (await (await setup.upload(line("a", CHAT))).json())["id"]
    for field in ("endpoint", "completion_window"):
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", field: [{"24h": 1}]}
        reply = await setup.client.post("/v1/batches", json=body, headers=DEMO)
        assert reply.status == 400 and (await reply.json())["error"]["param"] == field


async def test_an_upload_of_several_file_parts_is_refused_not_the_last_kept(setup: Setup) -> None:
    form = FormData()
    form.add_field("purpose", "batch")
    for custom_id in ("a", "b"):
        form.add_field("file", line(custom_id, CHAT).encode(), filename=f"{custom_id}.jsonl", content_type="application/jsonl")
    reply = await setup.client.post("/v1/files", data=form, headers=DEMO)
    assert reply.status == 400 and (await reply.json())["error"]["param"] == "file"
    assert (await (await setup.client.get("/v1/files", headers=DEMO)).json())["data"] == []
