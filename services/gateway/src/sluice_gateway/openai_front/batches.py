"""OpenAI's Batch API <-> Sluice's bulk jobs: the plain mapping (no HTTP, no grpc).

- a batch input file (JSONL, one `{"custom_id", "method": "POST", "url", "body"}` per line) is
  checked line by line with the HTTP front's own converters (requests.parse_chat,
  parse_completion, parse_embeddings): a bad line is a 400 naming its line number;
- its lines become one JobRequest (a JobRow per line: GenerateRow / EmbedRow), which the JobsPort's submit
  validates, records and hands to the job workers like any other job;
- the job (jobs_pb2.Job) is answered as OpenAI's Batch object (same state names: the job's states
  mirror OpenAI's);
- once the job is settled, its stored RowResults become the output file (one line per answered
  row, its body exactly what the synchronous endpoint answers) and the error file (one line per
  failed row: the HTTP error the endpoint would have answered, in `response`; or, for a row that
  failed outside any request, and per row a cancelled batch never ran, `response: null`,
  `error: {code, message}`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.jobs.v1 import jobs_pb2

from sluice_common.finish_reasons import finish_reason_enum_name
from sluice_common.jsonl import jsonl_lines
from sluice_gateway.jobs_port import MAX_MESSAGE_ID_BYTES
from sluice_gateway.openai_front.choices import ChoiceState
from sluice_gateway.openai_front.errors import OpenAIError, generation_failed, invalid, status_error
from sluice_gateway.openai_front.replies import Completion, embeddings_reply, finish_reason
from sluice_gateway.openai_front.requests import (
    EmbeddingCall,
    GenerationCall,
    check_metadata,
    check_text,
    memoised_checks,
    parse_chat,
    parse_completion,
    parse_embeddings,
)
from sluice_gateway.openai_front.store import new_id

Call = GenerationCall | EmbeddingCall
PARSERS: dict[str, Callable[[dict[str, Any]], Call]] = {
    "/v1/chat/completions": parse_chat,
    "/v1/completions": parse_completion,
    "/v1/embeddings": parse_embeddings,
}
# OpenAI accepts only "24h".
COMPLETION_WINDOWS = {"24h": 86400}
_LINE_FIELDS = {"custom_id", "method", "url", "body"}
_CREATE_FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata"}

_STATES = {
    jobs_pb2.JOB_STATE_VALIDATING: "validating",
    jobs_pb2.JOB_STATE_IN_PROGRESS: "in_progress",
    jobs_pb2.JOB_STATE_FINALIZING: "finalizing",
    jobs_pb2.JOB_STATE_COMPLETED: "completed",
    jobs_pb2.JOB_STATE_FAILED: "failed",
    jobs_pb2.JOB_STATE_EXPIRED: "expired",
    jobs_pb2.JOB_STATE_CANCELLING: "cancelling",
    jobs_pb2.JOB_STATE_CANCELLED: "cancelled",
}
_TERMINAL = ("completed", "failed", "expired", "cancelled")
# A row's results go to the job workers' reply queue with "<batch id>/<custom id>" as their AMQP
# message id (at most MAX_MESSAGE_ID_BYTES): the job layer refuses a longer custom id, so a file's
# line is refused for it first, naming the line.
MAX_CUSTOM_ID_BYTES = MAX_MESSAGE_ID_BYTES - len(new_id("batch_")) - 1
# JSON's whitespace: a line of only these is blank (str.strip would also take U+2028 and the like).
_JSON_SPACE = " \t\r"
# Row failures that are OpenAI's non-HTTP errors, by the code OpenAI's batches give them
# (batch_expired: not run within the completion window; request_timeout: the model call timed out).
# Any other code is a gRPC status name, written as the HTTP error the endpoint answers for it. The
# jobs' own codes (jobs.job: EXPIRED, TOO_LONG_FOR_WINDOW, a row deadline's DEADLINE_EXCEEDED),
# spelled here as the fronts never import the jobs.
_ERROR_CODES = {"EXPIRED": "batch_expired", "TOO_LONG_FOR_WINDOW": "batch_expired", "DEADLINE_EXCEEDED": "request_timeout"}


@dataclass(frozen=True)
class BatchLine:
    line: int  # 1-based, as an editor shows it
    custom_id: str
    url: str
    call: Call


def _line_error(line: int, message: str, param: str | None = None, code: str | None = "invalid_batch_line") -> OpenAIError:
    return OpenAIError(400, f"Line {line} of the batch file: {message}", param=param, code=code)


def _parse_line(number: int, text: str) -> BatchLine:
    try:
        document = json.loads(text)
    except ValueError as exc:
        # JSONDecodeError, or the plain ValueError of an integer over Python's 4,300 digits.
        raise _line_error(number, f"not valid JSON ({exc})") from None
    except RecursionError:
        raise _line_error(number, "the JSON is nested too deeply") from None
    if not isinstance(document, dict):
        raise _line_error(number, "each line must be a JSON object with custom_id, method, url and body")
    try:
        check_text(document)
    except OpenAIError as exc:
        raise _line_error(number, exc.message, exc.param, exc.code) from None
    for name in document:
        if name not in _LINE_FIELDS:
            raise _line_error(number, f"unknown field {name!r}; a line has custom_id, method, url and body", name)
    custom_id = document.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _line_error(number, "custom_id must be a non-empty string", "custom_id")
    if "\x00" in custom_id:
        raise _line_error(number, "custom_id must not contain U+0000 (NUL): the job store cannot keep it", "custom_id")
    if len(custom_id.encode()) > MAX_CUSTOM_ID_BYTES:
        raise _line_error(
            number,
            f"custom_id is {len(custom_id.encode())} bytes (UTF-8), over the limit of {MAX_CUSTOM_ID_BYTES}:"
            " a result carries the batch id and custom_id as its message id",
            "custom_id",
        )
    if document.get("method") != "POST":
        raise _line_error(number, f'method must be "POST", got {document.get("method")!r}', "method")
    url = document.get("url")
    if not isinstance(url, str) or url not in PARSERS:
        raise _line_error(number, f"url must be one of {', '.join(PARSERS)}, got {url!r}", "url")
    body = document.get("body")
    if not isinstance(body, dict):
        raise _line_error(number, "body must be a JSON object (the request the url takes)", "body")
    try:
        call = PARSERS[url](body)
    except OpenAIError as exc:
        raise _line_error(number, exc.message, f"body.{exc.param}" if exc.param else "body", exc.code) from None
    if isinstance(call, GenerationCall) and call.prompt_requests:
        raise _line_error(number, "a batch line takes one prompt; put each prompt on its own line", "body.prompt", "invalid_value")
    if isinstance(call, GenerationCall) and call.options.stream:
        raise _line_error(number, "stream is not supported in a batch; omit it or send false", "body.stream", "unsupported_parameter")
    if isinstance(call, EmbeddingCall) and call.request.HasField("truncate_prompt_tokens"):
        # A job's EmbedRow carries no truncation: refused here rather than dropped (its inputs would
        # then be refused at run time for their length, or embedded as asked only by chance).
        raise _line_error(
            number,
            "truncate_prompt_tokens is not supported in a batch; omit it (or send null) and keep each input within the model's maximum",
            "body.truncate_prompt_tokens",
            "unsupported_parameter",
        )
    return BatchLine(number, custom_id, url, call)


def parse_batch_file(content: bytes, max_lines: int) -> list[BatchLine]:
    """Every line of a batch input file, or a 400 naming the first bad one. Blank lines (a
    trailing newline) are skipped; custom ids are unique in a file. Lines end at LF only (a CR
    before it is dropped): str.splitlines would also cut at U+2028, U+2029 and U+0085, which JSON
    allows raw inside a string."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OpenAIError(400, f"The batch file is not UTF-8 text: {exc}", param="file", code="invalid_file") from None
    with memoised_checks():  # lines sharing a schema or pattern compile it once
        lines = _parse_lines(text, max_lines)
    if not lines:
        raise OpenAIError(400, "The batch file has no requests: one JSON object per line.", param="file", code="empty_file")
    return lines


def _parse_lines(text: str, max_lines: int) -> list[BatchLine]:
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(jsonl_lines(text), start=1):
        if not raw.strip(_JSON_SPACE):
            continue
        line = _parse_line(number, raw)
        if line.custom_id in seen:
            raise _line_error(
                number, f"custom_id {line.custom_id!r} is already used on line {seen[line.custom_id]}; custom ids are unique", "custom_id"
            )
        seen[line.custom_id] = number
        lines.append(line)
        if len(lines) > max_lines:
            raise OpenAIError(
                400, f"The batch file has more than {max_lines} requests, the most one batch may hold.", param="file", code="too_many_requests"
            )
    return lines


@dataclass(frozen=True)
class CreateBatch:
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None


def parse_create(body: dict[str, Any]) -> CreateBatch:
    """POST /v1/batches' body."""
    for name in body:
        if name not in _CREATE_FIELDS:
            raise invalid(name, f"Unrecognized request argument supplied: {name}", "unknown_parameter")
    input_file_id = body.get("input_file_id")
    if not isinstance(input_file_id, str) or not input_file_id:
        raise invalid("input_file_id", "input_file_id must be the id of an uploaded file (purpose batch)", "missing_required_parameter")
    endpoint = body.get("endpoint")
    if not isinstance(endpoint, str) or endpoint not in PARSERS:
        raise invalid("endpoint", f"endpoint must be one of {', '.join(PARSERS)}, got {endpoint!r}", "invalid_value")
    window = body.get("completion_window")
    if not isinstance(window, str) or window not in COMPLETION_WINDOWS:
        raise invalid("completion_window", f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}, got {window!r}", "invalid_value")
    return CreateBatch(input_file_id, endpoint, window, check_metadata(body.get("metadata")))


def check_endpoint(lines: Iterable[BatchLine], endpoint: str) -> None:
    """OpenAI runs one endpoint per batch: every line's url must be it."""
    for line in lines:
        if line.url != endpoint:
            raise OpenAIError(
                400,
                f"Line {line.line} of the input file has url {line.url}, but the batch's endpoint is {endpoint}; every line must use the batch's endpoint.",
                param="endpoint",
                code="invalid_value",
            )


def job_row(line: BatchLine) -> jobs_pb2.JobRow:
    """The converted request as a job row (the worker runs it as the synchronous endpoint would)."""
    row = jobs_pb2.JobRow(custom_id=line.custom_id)
    if isinstance(line.call, EmbeddingCall):
        row.embed.CopyFrom(jobs_pb2.EmbedRow(model=line.call.request.model, inputs=line.call.request.inputs))
        return row
    request = line.call.request
    row.generate.CopyFrom(
        jobs_pb2.GenerateRow(
            model=request.model,
            messages=request.messages,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            response_format=request.response_format,
            tool_use=request.tool_use if request.HasField("tool_use") else None,
            user=request.user,
            metadata=request.metadata,
        )  # fmt: skip
    )
    return row


def job_request(batch_id: str, api_key: str, lines: list[BatchLine], completion_window: str) -> jobs_pb2.JobRequest:
    job = jobs_pb2.JobRequest(job_id=batch_id, api_key=api_key, rows=[job_row(line) for line in lines])
    job.completion_window.FromSeconds(COMPLETION_WINDOWS[completion_window])
    return job


# ---- the Batch object


def status_of(job: jobs_pb2.Job) -> str:
    return _STATES.get(job.state, "validating")


def settled(job: jobs_pb2.Job) -> bool:
    """Ended, and no row will be stored any more (an expired job stores its last rows late)."""
    status = status_of(job)
    return status in _TERMINAL and (status != "expired" or job.completed_rows + job.failed_rows >= job.total_rows)


def _seconds(timestamp: Any) -> int | None:
    return int(timestamp.seconds) if timestamp.seconds or timestamp.nanos else None


def batch_object(
    batch_id: str,
    endpoint: str,
    input_file_id: str,
    completion_window: str,
    metadata: dict[str, str] | None,
    created_at: float,
    cancelling_at: float | None,
    job: jobs_pb2.Job,
    output_file_id: str | None = None,
    error_file_id: str | None = None,
) -> dict[str, Any]:
    """openai.types.Batch. The job store keeps when a job was last changed, not when it entered
    each state, so a terminal state's time is the job's updated_at, and in_progress_at and
    finalizing_at are never known. What is not known or not set is omitted: OpenAI's schema has
    these fields optional and not nullable."""
    status = status_of(job)
    ended = _seconds(job.updated_at)
    reply: dict[str, Any] = {
        "id": batch_id,
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": completion_window,
        "status": status,
        "output_file_id": output_file_id,
        "error_file_id": error_file_id,
        "created_at": int(created_at),
        "in_progress_at": None,
        "expires_at": _seconds(job.expires_at),
        "finalizing_at": None,
        "completed_at": ended if status == "completed" else None,
        "failed_at": ended if status == "failed" else None,
        "expired_at": ended if status == "expired" else None,
        "cancelling_at": int(cancelling_at) if cancelling_at is not None else None,
        "cancelled_at": ended if status == "cancelled" else None,
        "request_counts": {"total": job.total_rows, "completed": job.completed_rows, "failed": job.failed_rows},
        "metadata": metadata,
    }
    if status == "failed" and job.error:
        reply["errors"] = {"object": "list", "data": [{"code": "batch_failed", "message": job.error, "param": None, "line": None}]}
    return {name: value for name, value in reply.items() if value is not None}


# ---- output and error files


def result_file_ids(batch_id: str) -> tuple[str, str]:
    """The output and error files' ids, derived from the batch's: two gateways making them at once
    store the same files."""
    suffix = batch_id.removeprefix("batch_")
    return f"file-{suffix}-output", f"file-{suffix}-errors"


def _request_ids(batch_id: str, custom_id: str) -> tuple[str, str]:
    """A line's id, and a request id for a result stored before results carried theirs; stable
    across reads of the file."""
    digest = hashlib.sha256(f"{batch_id}/{custom_id}".encode()).hexdigest()[:24]
    return f"batch_req_{digest}", f"req_{digest}"


def choice_states(call: GenerationCall, choices: Iterable[jobs_pb2.RowChoice]) -> list[ChoiceState]:
    states = []
    for choice in choices:
        state = ChoiceState(choice.index, [choice.text], finish_reason(call, choice.finish_reason))
        state.chat_entries = list(choice.logprobs)
        state.tool_calls = list(choice.tool_calls)
        if call.echo:
            state.completion.offset = len(call.request.prompt)
        state.completion.add(list(choice.logprobs))
        states.append(state)
    return states


def response_body(call: Call, result: jobs_pb2.RowResult, request_id: str, created: int) -> dict[str, Any] | None:
    """What the synchronous endpoint would have answered; None when the generation did not finish."""
    if isinstance(call, EmbeddingCall):
        reply = gateway_pb2.EmbedResponse(embeddings=result.embeddings)
        if result.HasField("usage"):
            reply.usage.CopyFrom(result.usage)
        return embeddings_reply(call, reply)
    finish = finish_reason(call, result.finish_reason)
    if finish is None:
        return None
    usage: types_pb2.Usage | None = result.usage if result.HasField("usage") else None
    if result.choices:  # n > 1 or logprobs: every choice, with its logprobs
        return Completion(call, request_id, created=created).whole(choice_states(call, result.choices), None, usage)
    only = ChoiceState(0, [result.output], finish, tool_calls=list(result.tool_calls))
    return Completion(call, request_id, created=created).whole([only], None, usage)


def result_files(
    batch_id: str, lines: list[BatchLine], results: Iterable[jobs_pb2.RowResult], created: int, cancelled: bool = False
) -> tuple[bytes, bytes]:
    """(output JSONL, error JSONL), in the input file's order. In a cancelled batch, a line without
    a result was never run (the job store keeps no result for a cancelled row): an error line,
    code batch_cancelled, as OpenAI's."""
    by_id = {line.custom_id: line for line in lines}
    outputs: dict[str, str] = {}
    errors: dict[str, str] = {}
    for result in results:
        line = by_id.get(result.custom_id)
        if line is None:
            continue
        line_id, stable_request_id = _request_ids(batch_id, result.custom_id)
        # The id the row ran under finds its evaluation record and its log lines.
        request_id = result.request_id or stable_request_id
        body = None if result.HasField("error") else response_body(line.call, result, request_id, created)
        if body is not None:
            record = {
                "id": line_id,
                "custom_id": result.custom_id,
                "response": {"status_code": 200, "request_id": request_id, "body": body},
                "error": None,
            }
            outputs[result.custom_id] = json.dumps(record)
            continue
        errors[result.custom_id] = _failure_line(line_id, result, request_id)
    if cancelled:
        for line in lines:
            if line.custom_id not in outputs and line.custom_id not in errors:
                line_id = _request_ids(batch_id, line.custom_id)[0]
                error = {"code": "batch_cancelled", "message": "The batch was cancelled before this request was run."}
                errors[line.custom_id] = _error_line(line_id, line.custom_id, error)
    order = [line.custom_id for line in lines]
    return _jsonl(outputs, order), _jsonl(errors, order)


def _failure_line(line_id: str, result: jobs_pb2.RowResult, request_id: str) -> str:
    """A failed row. One the endpoint would have answered with an HTTP error (refused, no replica,
    an internal error, a generation that did not finish) is that answer, as OpenAI writes it:
    `response: {status_code, request_id, body: {"error": ...}}` with the HTTP front's own status and
    body. One that failed outside any request (OpenAI's non-HTTP errors: not run within the window,
    cut by the row deadline) is `response: null, error: {code, message}`."""
    code = result.error.code
    if code in _ERROR_CODES:
        return _error_line(line_id, result.custom_id, {"code": _ERROR_CODES[code], "message": result.error.message})
    if result.HasField("error"):
        answer = status_error(code, result.error.message)
    else:
        answer = generation_failed(f"The generation did not finish ({finish_reason_enum_name(result.finish_reason)}).")
    response = {"status_code": answer.status, "request_id": request_id, "body": answer.body()}
    return json.dumps({"id": line_id, "custom_id": result.custom_id, "response": response, "error": None})


def _error_line(line_id: str, custom_id: str, error: dict[str, str]) -> str:
    return json.dumps({"id": line_id, "custom_id": custom_id, "response": None, "error": error})


def _jsonl(records: dict[str, str], order: list[str]) -> bytes:
    return "".join(records[custom_id] + "\n" for custom_id in order if custom_id in records).encode()
