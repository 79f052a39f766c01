"""OpenAI's Files and Batch APIs on the HTTP front (routes registered in http.build_app).

    POST   /v1/files                 multipart (purpose "batch", file: JSONL), each line checked
    GET    /v1/files, /v1/files/{id}, /v1/files/{id}/content;  DELETE /v1/files/{id}
    POST   /v1/batches               a bulk job through the JobsPort's submit (JobsApi: same validation, store,
                                     worker fleet, states and counts as gRPC SubmitJob)
    GET    /v1/batches, /v1/batches/{id};  POST /v1/batches/{id}/cancel

Thin: authentication and the body are http_input's, as for the other routes; the error shapes the _errors
middleware's (http); the mapping is batches, the state store (in the job store's database).
A batch's row is written once its job is recorded and before the job is handed to the broker, so
that every job that runs is a batch /v1/batches shows. A batch's output and error files are made
from its stored RowResults the first time it is read settled (off the event loop), then served
like any file.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError
from sluice.common.v1 import types_pb2
from sluice.jobs.v1 import jobs_pb2

from sluice_gateway.jobs_port import MAX_PAGE_SIZE, JobsPort, JobTooLarge, SubmitNotConfirmed
from sluice_gateway.path.model_catalog import ModelCatalog, UnknownModel
from sluice_gateway.openai_front.batches import (
    BatchLine,
    batch_object,
    check_endpoint,
    job_request,
    parse_batch_file,
    parse_create,
    result_file_ids,
    result_files,
    settled,
    status_of,
)
from sluice_gateway.openai_front.errors import OpenAIError
from sluice_gateway.openai_front.replies import check_dimensions
from sluice_gateway.openai_front.requests import EmbeddingCall
from sluice_gateway.openai_front.store import MAX_FILES_LIMIT, MAX_LIST_LIMIT, FileInUse, OpenAIStore, StoredBatch, new_id
from sluice_common.tenants import Tenant, TenantDirectory
from sluice_gateway.openai_front.http_input import authenticate, json_body
from sluice_common.utf8 import is_valid_text

log = structlog.stdlib.get_logger("sluice.gateway.http")

PURPOSES = ("batch",)
_CHUNK = 64 * 1024


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, content_type="application/json")


def _limit(request: web.Request, default: int = 20, most: int = MAX_LIST_LIMIT) -> int:
    raw = request.query.get("limit")
    if raw is None:
        return default
    # isascii: str.isdigit also holds for digits int() refuses, such as "²".
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= most:
        raise OpenAIError(400, f"limit must be an integer from 1 to {most}, got {raw!r}", param="limit", code="invalid_value")
    return int(raw)


def _ascending(request: web.Request) -> bool:
    """OpenAI's `order` of a file list: desc (newest first, the default) or asc."""
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise OpenAIError(400, f"order must be asc or desc, got {order!r}", param="order", code="invalid_value")
    return order == "asc"


async def _parse(content: bytes, max_lines: int) -> list[BatchLine]:
    """The file's lines, parsed on a thread: each line's structured-output constraint is compiled,
    and on the event loop a large file held every other HTTP and gRPC stream for a minute."""
    return await asyncio.to_thread(parse_batch_file, content, max_lines)


def _list(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page; first_id and last_id (optional, not nullable in OpenAI's schema) only when it has items."""
    page: dict[str, Any] = {"object": "list", "data": data, "has_more": has_more}
    if data:
        page.update(first_id=data[0]["id"], last_id=data[-1]["id"])
    return page


def _api_key(request: web.Request) -> str:
    """The key the tenant authenticated with: the job carries it to JobsPort.submit, which checks it
    is the tenant's and drops it (no key crosses the broker)."""
    return request.headers.get("Authorization", "")[len("Bearer ") :].strip()


@dataclass
class BatchFront:
    tenants: TenantDirectory
    store: OpenAIStore
    jobs: JobsPort
    models: ModelCatalog
    files_max_bytes: int
    max_rows: int

    # ---- files

    async def create_file(self, request: web.Request) -> web.Response:
        tenant = authenticate(self.tenants, request)
        if not request.content_type.startswith("multipart/"):
            raise OpenAIError(
                400, "Upload a file as multipart/form-data with the fields purpose and file.", param="file", code="invalid_content_type"
            )
        try:
            purpose, filename, content = await self._read_upload(request)
        except (HttpProcessingError, ValueError) as exc:
            # aiohttp's multipart reader: a malformed part header (InvalidHeader), a body that does
            # not start with its boundary (ValueError).
            raise OpenAIError(400, f"The multipart body could not be read: {exc}", param="file", code="invalid_multipart") from None
        if purpose is None:
            raise OpenAIError(400, "Missing required parameter: 'purpose'.", param="purpose", code="missing_required_parameter")
        if purpose not in PURPOSES:
            raise OpenAIError(
                400,
                f"purpose must be one of {', '.join(PURPOSES)} (Sluice stores batch input files only), got {purpose!r}",
                param="purpose",
                code="invalid_value",
            )
        if content is None:
            raise OpenAIError(400, "Missing required parameter: 'file'.", param="file", code="missing_required_parameter")
        lines = await _parse(content, self.max_rows)  # a bad line: 400 naming it
        stored = await self.store.create_file(tenant.name, purpose, filename or "upload.jsonl", content)
        log.info("file_stored", tenant=tenant.name, file_id=stored.file_id, bytes=stored.bytes, lines=len(lines))
        return _json(stored.to_openai())

    async def _read_upload(self, request: web.Request) -> tuple[str | None, str | None, bytes | None]:
        """The purpose field and the file part, read chunk by chunk up to files_max_bytes (413
        past it) rather than with the JSON endpoints' body limit."""
        reader = await request.multipart()
        purpose: str | None = None
        filename: str | None = None
        content: bytes | None = None
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.read(decode=True)).decode("utf-8", "replace").strip()
            elif part.name == "file":
                if content is not None:  # the last would silently win
                    raise OpenAIError(400, "Upload one file per request: the body has more than one file part.", param="file", code="invalid_value")
                filename = part.filename
                if filename is not None and not is_valid_text(filename):
                    raise OpenAIError(400, "The file's name is not UTF-8 text.", param="file", code="invalid_value")
                content = await self._bounded(part)
            else:
                await part.release()
        return purpose, filename, content

    async def _bounded(self, part: BodyPartReader) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while chunk := await part.read_chunk(_CHUNK):
            size += len(chunk)
            if size > self.files_max_bytes:
                raise OpenAIError(
                    413,
                    f"The file is larger than the limit of {self.files_max_bytes} bytes (SLUICE_GATEWAY_FILES_MAX_BYTES).",
                    param="file",
                    code="file_too_large",
                )
            chunks.append(chunk)
        return b"".join(chunks)

    async def _file(self, tenant: Tenant, file_id: str) -> Any:
        stored = await self.store.get_file(tenant.name, file_id)
        if stored is None:
            raise OpenAIError(404, f"No such File object: {file_id}", param="id", code="not_found")
        return stored

    async def get_file(self, request: web.Request) -> web.Response:
        tenant = authenticate(self.tenants, request)
        return _json((await self._file(tenant, request.match_info["file_id"])).to_openai())

    async def file_content(self, request: web.Request) -> web.Response:
        tenant = authenticate(self.tenants, request)
        file_id = request.match_info["file_id"]
        content = await self.store.file_content(tenant.name, file_id)
        if content is None:
            raise OpenAIError(404, f"No such File object: {file_id}", param="id", code="not_found")
        return web.Response(body=content, content_type="application/octet-stream")

    async def list_files(self, request: web.Request) -> web.Response:
        tenant = authenticate(self.tenants, request)
        limit = _limit(request, default=MAX_FILES_LIMIT, most=MAX_FILES_LIMIT)
        page = await self.store.list_files(tenant.name, limit, request.query.get("after"), request.query.get("purpose"), _ascending(request))
        return _json(_list([f.to_openai() for f in page.items], page.has_more))

    async def delete_file(self, request: web.Request) -> web.Response:
        tenant = authenticate(self.tenants, request)
        file_id = request.match_info["file_id"]
        for batch in await self.store.pending_batches(tenant.name, file_id):
            await self._current(tenant, batch)  # a settled batch makes its result files now, from this file
        try:
            deleted = await self.store.delete_file(tenant.name, file_id)
        except FileInUse as exc:
            # Its results are shaped from its requests: deleted now, the batch would end without them.
            # Not retried by OpenAI's clients (they retry a 409 otherwise): it changes only when the batch ends.
            raise OpenAIError(
                409,
                f"File {file_id} is the input file of batch {exc.batch_id}, which has not ended yet; delete the file once"
                " the batch has completed, failed, expired or been cancelled.",
                param="file_id",
                code="file_in_use",
                headers={"x-should-retry": "false"},
            ) from None
        if not deleted:
            raise OpenAIError(404, f"No such File object: {file_id}", param="id", code="not_found")
        return _json({"id": file_id, "object": "file", "deleted": True})

    # ---- batches

    async def create_batch(self, request: web.Request) -> web.Response:
        tenant = authenticate(self.tenants, request)
        create = parse_create(await json_body(request))
        structlog.contextvars.bind_contextvars(tenant=tenant.name)
        source = await self.store.get_file(tenant.name, create.input_file_id)
        content = await self.store.file_content(tenant.name, create.input_file_id)
        if source is None or content is None:
            raise OpenAIError(404, f"No such File object: {create.input_file_id}", param="input_file_id", code="not_found")
        if source.purpose != "batch":
            raise OpenAIError(
                400,
                f"File {source.file_id} has purpose {source.purpose}; a batch needs a file uploaded with purpose batch.",
                param="input_file_id",
                code="invalid_value",
            )
        lines = await _parse(content, self.max_rows)
        check_endpoint(lines, create.endpoint)
        self._check_dimensions(lines)
        batch = StoredBatch(
            new_id("batch_"), tenant.name, create.endpoint, create.input_file_id, create.completion_window, create.metadata,
            time.time(), None, None, None, False,
        )  # fmt: skip

        async def record_batch(job: jobs_pb2.Job) -> None:
            # Between the job's record and its hand-over to the broker: written after, the row was
            # missing for a job that ran when the answer never came (a 503, a client gone, an error).
            await self.store.create_batch(batch)

        # JobsPort.submit (JobsApi's): validate_job, the job store, the exchange the job workers consume.
        try:
            job = await self.jobs.submit(
                tenant, job_request(batch.batch_id, _api_key(request), lines, create.completion_window), on_recorded=record_batch
            )
        except JobTooLarge as exc:
            raise OpenAIError(
                413,
                f"The batch's {len(lines)} requests come to {exc.size} bytes as one job, over the limit of {exc.limit} bytes"
                " (SLUICE_GATEWAY_JOBS_MAX_MESSAGE_BYTES); split the input file into smaller files, one batch each.",
                param="input_file_id",
                code="batch_too_large",
            ) from None
        except SubmitNotConfirmed as exc:
            # The batch exists, and its job is the publisher's, which keeps sending it until the
            # broker confirms it (and spills it at a stop): answered as it stands, validating. A 503
            # would have OpenAI's clients create the batch again, under a new id: a second run.
            log.warning("batch_not_yet_confirmed", batch_id=batch.batch_id, reason=exc.message)
            job = exc.job
        log.info("batch_created", batch_id=batch.batch_id, input_file_id=create.input_file_id, rows=len(lines), status=status_of(job))
        return _json(self._object(batch, job))

    def _check_dimensions(self, lines: list[BatchLine]) -> None:
        """As the synchronous /v1/embeddings: a dimensions other than the model's is refused (here
        when the batch is created, naming the line, rather than row by row later)."""
        for line in lines:
            call = line.call
            if isinstance(call, EmbeddingCall) and call.dimensions is not None:
                try:
                    model = self.models.get(call.request.model, types_pb2.MODEL_KIND_EMBEDDING)
                except UnknownModel:
                    continue  # as any line naming an unknown model: that row fails when it runs
                check_dimensions(call, model, param="body.dimensions", line=line.line)

    def _object(self, batch: StoredBatch, job: Any) -> dict[str, Any]:
        return batch_object(
            batch.batch_id, batch.endpoint, batch.input_file_id, batch.completion_window, batch.metadata, batch.created_at,
            batch.cancelling_at, job, batch.output_file_id, batch.error_file_id,
        )  # fmt: skip

    async def _batch(self, tenant: Tenant, batch_id: str) -> StoredBatch:
        batch = await self.store.get_batch(tenant.name, batch_id)
        if batch is None:
            raise OpenAIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
        return batch

    async def _current(self, tenant: Tenant, batch: StoredBatch, listing: bool = False) -> dict[str, Any]:
        """The Batch object now; the first read of a settled batch makes its output/error files. In
        a list, a batch whose files cannot be made is shown without them (its own GET says why),
        rather than failing the list of every other batch."""
        job = await self.jobs.get(tenant, batch.batch_id)
        if settled(job) and not batch.files_made:
            try:
                await self._make_files(tenant, batch, int(job.updated_at.seconds), status_of(job) == "cancelled")
            except Exception as exc:  # noqa: BLE001 - one batch's failure is not the list's
                if not listing:
                    raise
                log.error("batch_files_failed", batch_id=batch.batch_id, error=repr(exc), exc_info=exc)
                return self._object(batch, job)
            batch = await self._batch(tenant, batch.batch_id)
        return self._object(batch, job)

    async def _make_files(self, tenant: Tenant, batch: StoredBatch, created: int, cancelled: bool) -> None:
        content = await self.store.file_content(tenant.name, batch.input_file_id)
        if content is None:
            # The input file was deleted: the results stay listable over gRPC, but without the
            # requests the bodies cannot be shaped as their endpoint answers.
            log.warning("batch_input_file_gone", batch_id=batch.batch_id, input_file_id=batch.input_file_id)
            await self.store.set_result_files(batch.batch_id, None, None)
            return
        results = []
        token = ""
        while True:
            page, token = await self.jobs.list_results(tenant, batch.batch_id, MAX_PAGE_SIZE, token)
            results.extend(page)
            if not token:
                break
        # Parsing the file and shaping every line is CPU work as large as the batch: on a thread,
        # not on the event loop that serves every other request and stream.
        output, errors = await asyncio.to_thread(_result_files, batch.batch_id, content, results, created, cancelled)
        output_id, error_id = result_file_ids(batch.batch_id)
        for file_id, data, name in ((output_id, output, "output"), (error_id, errors, "errors")):
            if data:
                await self.store.create_file(tenant.name, "batch_output", f"{batch.batch_id}_{name}.jsonl", data, file_id)
        await self.store.set_result_files(batch.batch_id, output_id if output else None, error_id if errors else None)
        log.info("batch_files_made", batch_id=batch.batch_id, output_lines=output.count(b"\n"), error_lines=errors.count(b"\n"))

    async def get_batch(self, request: web.Request) -> web.Response:
        tenant = authenticate(self.tenants, request)
        return _json(await self._current(tenant, await self._batch(tenant, request.match_info["batch_id"])))

    async def list_batches(self, request: web.Request) -> web.Response:
        tenant = authenticate(self.tenants, request)
        page = await self.store.list_batches(tenant.name, _limit(request), request.query.get("after"))
        return _json(_list([await self._current(tenant, batch, listing=True) for batch in page.items], page.has_more))

    async def cancel_batch(self, request: web.Request) -> web.Response:
        tenant = authenticate(self.tenants, request)
        batch = await self._batch(tenant, request.match_info["batch_id"])
        status = status_of(await self.jobs.get(tenant, batch.batch_id))
        if status in ("completed", "failed", "expired", "finalizing"):
            # x-should-retry: OpenAI's clients retry a 409 otherwise, and this one never changes.
            raise OpenAIError(
                409,
                f"Cannot cancel a batch with status {status}.",
                param="batch_id",
                code="batch_not_cancellable",
                headers={"x-should-retry": "false"},
            )
        if status_of(await self.jobs.cancel(tenant, batch.batch_id)) in ("cancelling", "cancelled"):
            await self.store.mark_cancelling(batch.batch_id)
        return _json(await self._current(tenant, await self._batch(tenant, batch.batch_id)))


def _result_files(batch_id: str, content: bytes, results: list[jobs_pb2.RowResult], created: int, cancelled: bool) -> tuple[bytes, bytes]:
    """The output and error files of a settled batch (BatchFront._make_files runs it on a thread)."""
    # No row bound here: the batch was accepted already (a setting lowered since must not lose it).
    lines = parse_batch_file(content, len(content))
    return result_files(batch_id, lines, results, created, cancelled)
