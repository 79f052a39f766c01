"""Bulk jobs, the plain part: the producer contract, validation, running one row, retry policy.

No AMQP and no gRPC server here (the worker and the servicer are the transports); unit-tested
directly. A producer publishes a JobRequest to the exchange `<prefix>.jobs` with routing key `job`,
as protobuf (`application/x-protobuf`) or as its JSON mapping (`application/json`, field names
either as in the .proto or lowerCamelCase); its api_key is checked once, at intake
(authenticate_job). The gateway publishes the jobs it admitted there too, as AdmittedJob: the
tenant's name, no key. Both then pass validate_job. Results go to `reply_to` in the same content type,
published to the default exchange with reply_to as the routing key: so reply_to must not name one of
Sluice's own queues (under the AMQP prefix) nor a broker-reserved `amq.` one (forbidden_reply_to).
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import dataclass

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.jobs.v1 import jobs_pb2

from sluice_common.amqp import PROTOBUF
from sluice_common.errors import Unauthenticated
from sluice_gateway.config import MAX_COMPLETION_WINDOW_S
from sluice_gateway.jobs_port import MAX_ID_LENGTH, MAX_MESSAGE_ID_BYTES
from sluice_gateway.path.inference_path import InferencePath
from sluice_gateway.jobs.row_deadline import RowTiming
from sluice_common.tenants import Tenant, TenantDirectory

JSON = "application/json"
# MAX_ID_LENGTH and MAX_MESSAGE_ID_BYTES are the jobs port's: the Batch API checks a file's custom ids against them too.
SUMMARY_SUFFIX = "/summary"
# PostgreSQL's text cannot hold NUL (its store keeps one as U+FFFD): an id with one would not be
# the id its results and summary are found by.
NUL = "\x00"
NUL_IN_ID = "{field} must not contain U+0000 (NUL): the job store cannot keep it"
# The error code of a row whose job's completion window ended before the row ran.
EXPIRED_CODE = "EXPIRED"
# The error code of a row not run because it is expected to take longer than what was left of its
# job's completion window (it would have finished late, or been cut off and retried, for nothing).
TOO_LONG_CODE = "TOO_LONG_FOR_WINDOW"

# RESOURCE_EXHAUSTED: the shared allowance says "later"; wait as told and try again, without limit.
PACED = frozenset({"RESOURCE_EXHAUSTED"})
# Transient: back off exponentially (capped, with jitter) a few times in-process, then give the
# message back to the broker, which counts deliveries; past the limit the row is dead-lettered.
TRANSIENT = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "INTERNAL", "UNKNOWN", "CANCELLED"})


class JobRejected(Exception):
    """A job message that cannot be accepted at all; told to its reply_to as a JobRejection (the
    worker never tells one to a forbidden_reply_to). `field`: the JobRequest field at fault, for
    SubmitJob's INVALID_ARGUMENT ("" when it is the job as a whole)."""

    def __init__(self, reason: str, job_id: str = "", reply_to: str = "", tenant: str = "", field: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.job_id = job_id
        # A name AMQP cannot carry as a routing key is not replied to: publishing to it would fail
        # on every redelivery. The rejection is still logged, and stored when the job is known.
        self.reply_to = reply_to if _routable(reply_to) else ""
        self.tenant = tenant
        self.field = field


def _routable(reply_to: str) -> bool:
    return len(reply_to.encode()) <= MAX_MESSAGE_ID_BYTES


# Queue names a reply_to may not name. Replies go to the default exchange with reply_to as the routing
# key, which reaches any queue of that name: under the service's own prefix are Sluice's internal
# queues (`<prefix>.jobs.rows`, `<prefix>.jobs.requests`, `<prefix>.jobs.dead`,
# `<prefix>.evallog.completions`, ...), where a tenant's RowResult would be read as Sluice's own
# message; `amq.` names are the broker's (reserved; server-named queues, direct reply-to).
RESERVED_QUEUE_PREFIX = "amq."


def forbidden_reply_to(reply_to: str, amqp_prefix: str) -> str:
    """Why `reply_to` may not be replied to ("" when it may): a name under `<amqp_prefix>.` or
    `amq.`. Refused at validation (validate_job) and, for messages already in flight, by the worker
    before each reply."""
    if amqp_prefix and reply_to.startswith(f"{amqp_prefix}."):
        return (
            f"reply_to {reply_to!r} names a queue under {amqp_prefix + '.'!r}, the prefix of Sluice's own queues"
            " (SLUICE_GATEWAY_AMQP_PREFIX): name a queue of your own outside it"
        )
    if reply_to.startswith(RESERVED_QUEUE_PREFIX):
        return f"reply_to {reply_to!r} names a queue under {RESERVED_QUEUE_PREFIX!r}, which the broker reserves: declare a named queue of your own"
    return ""


class PoisonRow(Exception):
    """A row that can never run: dead-lettered at once, reported failed, the job goes on."""


def code_of(exc: BaseException) -> str:
    """The gRPC status name of a SluiceError or a grpc.aio.AioRpcError (no grpc import here)."""
    code = getattr(exc, "code", None)
    if callable(code):
        code = code()
    name = getattr(code, "name", code)
    return name if isinstance(name, str) and name else "INTERNAL"


def message_of(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    if callable(details):
        return str(details() or "")
    return str(getattr(exc, "message", "") or exc)


def backoff_s(attempt: int, base_s: float = 0.25, cap_s: float = 10.0, rng: random.Random | None = None, least_share: float = 0.0) -> float:
    """Jittered exponential backoff: uniform in [least_share x full, full], full = min(cap, base * 2^attempt)
    (least_share 0: full jitter)."""
    full = min(cap_s, base_s * (2**attempt))
    return (rng or random).uniform(least_share * full, full)


def paced_delay_s(retry_after_s: float, rng: random.Random | None = None) -> float:
    """RESOURCE_EXHAUSTED's RetryInfo plus up to 25% jitter, so that workers do not retry in step."""
    return max(0.01, retry_after_s) * (1.0 + 0.25 * (rng or random).random())


# ---- the producer contract


def _salvage(body: bytes) -> tuple[str, str]:
    """job_id and reply_to from a JSON body that did not parse as a JobRequest (for the rejection)."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return "", ""
    if not isinstance(document, dict):
        return "", ""
    job_id = document.get("job_id", document.get("jobId", ""))
    reply_to = document.get("reply_to", document.get("replyTo", ""))
    return (job_id if isinstance(job_id, str) else ""), (reply_to if isinstance(reply_to, str) else "")


def parse_job(body: bytes, content_type: str, reply_to_property: str = "") -> jobs_pb2.JobRequest:
    """A JobRequest from an AMQP body (JSON or protobuf); JobRejected with a reason otherwise.
    The message's reply_to property is used when the body names none."""
    job = jobs_pb2.JobRequest()
    kind = (content_type or "").split(";")[0].strip().lower()
    try:
        if kind == JSON or (not kind and body[:1] in (b"{", b" ", b"\n")):
            json_format.Parse(body.decode("utf-8"), job)
        elif kind in (PROTOBUF, "application/protobuf", "application/octet-stream", ""):
            job.ParseFromString(body)
        else:
            raise JobRejected(f"unsupported content type {content_type!r}: use {JSON} or {PROTOBUF}", reply_to=reply_to_property)
    except (json_format.ParseError, DecodeError, UnicodeDecodeError, ValueError) as exc:
        job_id, reply_to = _salvage(body)
        raise JobRejected(f"the body is not a JobRequest: {exc}", job_id, reply_to or reply_to_property) from None
    if not job.reply_to:
        job.reply_to = reply_to_property
    return job


# The AMQP message types of the job queue. Sluice's own start with SLUICE_TYPES; a producer's
# JobRequest may carry any other type, or none (the producer contract never asked for one).
REQUEST_TYPE = jobs_pb2.JobRequest.DESCRIPTOR.full_name
ADMITTED_TYPE = jobs_pb2.AdmittedJob.DESCRIPTOR.full_name
SLUICE_TYPES = "sluice."
_PROTOBUF_TYPES = (PROTOBUF, "application/protobuf", "application/octet-stream", "")


def job_message_type(message_type: str) -> str | None:
    """What a message on the job queue is, by its AMQP type: ADMITTED_TYPE (the gateway's),
    REQUEST_TYPE (a producer's JobRequest), or None: a Sluice type this worker does not know (a
    newer gateway's, or a misrouted message), which must be neither misread nor dropped."""
    if message_type == ADMITTED_TYPE:
        return ADMITTED_TYPE
    if message_type == REQUEST_TYPE or not message_type.startswith(SLUICE_TYPES):
        return REQUEST_TYPE
    return None


def parse_admitted(body: bytes, content_type: str, reply_to_property: str = "") -> tuple[jobs_pb2.JobRequest, Tenant]:
    """The job and tenant of an AdmittedJob (protobuf, as the gateway publishes it); JobRejected
    otherwise. Not authenticated: the gateway did that, and the broker is inside the trust boundary
    (as for RowTasks, which name their tenant too)."""
    if (content_type or "").split(";")[0].strip().lower() not in _PROTOBUF_TYPES:
        raise JobRejected(f"unsupported content type {content_type!r} for an AdmittedJob: use {PROTOBUF}", reply_to=reply_to_property)
    try:
        admitted = jobs_pb2.AdmittedJob.FromString(body)
    except DecodeError as exc:
        raise JobRejected(f"the body is not an AdmittedJob: {exc}", reply_to=reply_to_property) from None
    job = admitted.job
    if not job.reply_to:
        job.reply_to = reply_to_property
    if not admitted.tenant:
        raise JobRejected("tenant: an AdmittedJob names its tenant", job.job_id, job.reply_to)
    return job, Tenant(admitted.tenant, admitted.text_logging)


# A JSON body's api_key field, in either spelling of the JSON mapping, for a body that does not parse.
_JSON_API_KEY = re.compile(rb'("(?:api_key|apiKey)"\s*:\s*)"(?:[^"\\]|\\.)*"')
_API_KEY_FIELDS = ("api_key", "apiKey")


def without_api_key(body: bytes, content_type: str, message_type: str, tenants: TenantDirectory) -> bytes | None:
    """A job message's body with its producer's api_key taken out, for the copy the worker
    dead-letters; None when there is none to take out (the body is kept as it is).

    JSON (never Sluice's own: the gateway publishes protobuf): the top-level `api_key` (or
    `apiKey`) removed, everything else as it was; a body that does not parse has the field's value
    blanked in place. Protobuf: read as a JobRequest and its api_key cleared (fields it does not
    know are kept) only when the message's type names a JobRequest or the value is a key a tenant
    holds: field 2 of another message (an AdmittedJob's tenant, a newer gateway's type) is not a
    key, and must not be cut out of a message meant to be replayed."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind == JSON or (not kind and body.lstrip()[:1] == b"{"):
        try:
            document = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            redacted = _JSON_API_KEY.sub(rb'\1""', body)
            return redacted if redacted != body else None
        if not isinstance(document, dict) or not any(name in document for name in _API_KEY_FIELDS):
            return None
        return json.dumps({name: value for name, value in document.items() if name not in _API_KEY_FIELDS}).encode()
    if kind not in _PROTOBUF_TYPES:
        return None
    job = jobs_pb2.JobRequest()
    try:
        job.ParseFromString(body)
    except DecodeError:
        return None
    if not job.api_key:
        return None
    if not message_type.endswith(f".{jobs_pb2.JobRequest.DESCRIPTOR.name}"):
        try:
            tenants.authenticate(f"Bearer {job.api_key}")
        except Unauthenticated:
            return None
    job.ClearField("api_key")
    return job.SerializeToString()


def format_duration(seconds: float) -> str:
    """For messages people read: 3600 -> "1h", 5400 -> "1h30m", 1.5 -> "1.5s", 86400 -> "1d"."""
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    days, rest = divmod(round(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = ((days, "d"), (hours, "h"), (minutes, "m"), (secs, "s"))
    return "".join(f"{value}{unit}" for value, unit in parts if value)


def completion_window_s(job: jobs_pb2.JobRequest, default_s: float) -> float:
    """The job's own completion window, or the gateway's default when it sets none."""
    if not job.HasField("completion_window"):
        return default_s
    # Not ToTimedelta(): that overflows on absurd values, which validate_job must reject instead.
    return job.completion_window.seconds + job.completion_window.nanos / 1e9


def authenticate_job(job: jobs_pb2.JobRequest, tenants: TenantDirectory) -> Tenant:
    """The tenant whose key a JobRequest carries, or JobRejected. A producer's key is checked
    here once, at intake; it never goes further (RowTasks and AdmittedJobs carry the tenant's name)."""
    try:
        return tenants.authenticate(f"Bearer {job.api_key}")
    except Unauthenticated as exc:
        raise JobRejected(f"api_key: {exc.message}", job.job_id, job.reply_to) from None


def validate_job(job: jobs_pb2.JobRequest, tenant: str, max_rows: int, amqp_prefix: str = "sluice") -> None:
    """Every check but the key's, for a job of `tenant` (already authenticated), or JobRejected:
    a reply_to too long to route or naming a queue of Sluice's (under `amqp_prefix`) or the
    broker's (forbidden_reply_to), no id, no rows, too many, custom ids missing or repeated, a
    completion window not in (0, 7 days]."""

    def reject(reason: str, tenant: str = "") -> JobRejected:
        return JobRejected(reason, job.job_id, job.reply_to, tenant)

    if not _routable(job.reply_to):
        raise JobRejected(
            f"reply_to is over {MAX_MESSAGE_ID_BYTES} bytes (UTF-8): AMQP routes a reply by that name, at most {MAX_MESSAGE_ID_BYTES} bytes",
            job.job_id, job.reply_to, tenant, field="reply_to",
        )  # fmt: skip
    if forbidden := forbidden_reply_to(job.reply_to, amqp_prefix):
        # Not told to that reply_to either (JobRejected's reply_to is cleared): the worker's _reject.
        raise JobRejected(forbidden, job.job_id, "", tenant, field="reply_to")
    if not job.job_id or len(job.job_id) > MAX_ID_LENGTH:
        raise reject(f"job_id is required (1 to {MAX_ID_LENGTH} characters)")
    if NUL in job.job_id:
        raise reject(NUL_IN_ID.format(field="job_id"))
    if len((job.job_id + SUMMARY_SUFFIX).encode()) > MAX_MESSAGE_ID_BYTES:
        raise reject(
            f"job_id is over {MAX_MESSAGE_ID_BYTES - len(SUMMARY_SUFFIX)} bytes (UTF-8); the job's summary carries"
            f' "<job_id>{SUMMARY_SUFFIX}" as its AMQP message id'
        )
    if not job.rows:
        raise reject("rows: a job needs at least one row", tenant)
    if len(job.rows) > max_rows:
        raise reject(f"rows: {len(job.rows)} rows, at most {max_rows} per job", tenant)
    seen: set[str] = set()
    for index, row in enumerate(job.rows):
        if not row.custom_id or len(row.custom_id) > MAX_ID_LENGTH:
            raise reject(f"rows[{index}].custom_id is required (1 to {MAX_ID_LENGTH} characters)", tenant)
        if NUL in row.custom_id:
            raise reject(NUL_IN_ID.format(field=f"rows[{index}].custom_id"), tenant)
        if row.custom_id in seen:
            raise reject(f"rows[{index}].custom_id {row.custom_id!r} is repeated: custom ids are unique in a job", tenant)
        if len(f"{job.job_id}/{row.custom_id}".encode()) > MAX_MESSAGE_ID_BYTES:
            raise reject(
                f"rows[{index}].custom_id: job_id and custom_id together are over {MAX_MESSAGE_ID_BYTES - 1} bytes"
                ' (UTF-8); results carry "<job_id>/<custom_id>" as their AMQP message id',
                tenant,
            )
        seen.add(row.custom_id)
    window = completion_window_s(job, default_s=MAX_COMPLETION_WINDOW_S)
    if not 0 < window <= MAX_COMPLETION_WINDOW_S:
        raise reject(
            f"completion_window: {window:g}s; it must be more than 0s and at most {MAX_COMPLETION_WINDOW_S:.0f}s"
            f' ({format_duration(MAX_COMPLETION_WINDOW_S)}), e.g. "86400s"',
            tenant,
        )


def row_tasks(job: jobs_pb2.JobRequest, tenant: Tenant, content_type: str, only: set[str] | None = None) -> list[jobs_pb2.RowTask]:
    reply_type = JSON if (content_type or "").split(";")[0].strip().lower() == JSON else PROTOBUF
    return [
        jobs_pb2.RowTask(
            job_id=job.job_id,
            tenant=tenant.name,
            row=row,
            reply_to=job.reply_to,
            text_logging=tenant.text_logging,
            reply_content_type=reply_type,
        )  # fmt: skip
        for row in job.rows
        if only is None or row.custom_id in only
    ]


def encode_reply(message: jobs_pb2.RowResult | jobs_pb2.JobRejection | jobs_pb2.Job, content_type: str) -> bytes:
    if content_type == JSON:
        return json_format.MessageToJson(message, preserving_proto_field_name=True, indent=None).encode()
    return message.SerializeToString()


def failed_result(task: jobs_pb2.RowTask, code: str, message: str, request_id: str = "") -> jobs_pb2.RowResult:
    return jobs_pb2.RowResult(
        job_id=task.job_id,
        custom_id=task.row.custom_id,
        error=jobs_pb2.RowError(code=code, message=message[:2000]),
        request_id=request_id,
    )


def expired_result(task: jobs_pb2.RowTask, window_s: float | None) -> jobs_pb2.RowResult:
    """A row that never ran because its job's completion window ended first."""
    window = f" ({format_duration(window_s)})" if window_s else ""
    return failed_result(
        task,
        EXPIRED_CODE,
        f"the job's completion window{window} ended before this row ran; submit the row again in a new job,"
        " or give the job a longer completion_window",
    )


def too_long_for_window(
    task: jobs_pb2.RowTask,
    expected_s: float | None,
    expires_at: float | None,
    now: float,
    window_s: float | None = None,
    grace_s: float = 0.0,
) -> jobs_pb2.RowResult | None:
    """The row's failed result when it is expected to take (`expected_s`, at worst) longer than
    what is left of its job's completion window (ending at `expires_at`) plus `grace_s`; None when
    it fits, or when either is unknown (a worker that has seen too few rows refuses none). The
    grace: rows running when a window ends still finish, and a short row ending seconds late is
    worth its result; refusing is for rows that would run on long after the job's end."""
    if expected_s is None or expires_at is None or expected_s <= expires_at - now + grace_s:
        return None
    window = f" ({format_duration(window_s)})" if window_s else ""
    return failed_result(
        task,
        TOO_LONG_CODE,
        f"not run: this row is expected to take up to {format_duration(expected_s)} (its max_tokens at the p99 pace of"
        f" recent rows) and {format_duration(max(0.0, expires_at - now))} was left of the job's completion window{window};"
        " submit it again with a lower max_tokens or in a job with a longer completion_window",
    )


def cut_at_ceiling_result(task: jobs_pb2.RowTask, deadline_s: float, request_id: str) -> jobs_pb2.RowResult:
    """A row its deadline cut off at the ceiling: not retried, since no attempt gets longer."""
    return failed_result(
        task,
        "DEADLINE_EXCEEDED",
        f"the row ran past {format_duration(deadline_s)}, the longest a row attempt may take"
        " (SLUICE_GATEWAY_WORKER_ROW_TIMEOUT_CEILING_S); not retried, as another attempt would get no longer:"
        " submit it again with a lower max_tokens",
        request_id,
    )


# ---- running one row through the interactive path, in the bulk class


@dataclass
class RowRun:
    result: jobs_pb2.RowResult
    latency_s: float
    # requests per second the lease's requests-per-minute budget allows (/ 60), when it has one.
    allowed_rate_per_s: float | None = None
    # What the attempt took, for the worker's row deadlines (row_deadline.py).
    timing: RowTiming | None = None


def generate_request(row: jobs_pb2.GenerateRow) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model=row.model,
        messages=row.messages,
        prompt=row.prompt,
        prompt_token_ids=row.prompt_token_ids,
        sampling=row.sampling,
        response_format=row.response_format,
        priority_class=types_pb2.PRIORITY_CLASS_BULK,
        tool_use=row.tool_use if row.HasField("tool_use") else None,
        user=row.user,
        metadata=row.metadata,
    )


async def run_row(
    path: InferencePath,
    task: jobs_pb2.RowTask,
    request_id: str,
    timeout_s: float,
) -> RowRun:
    """One attempt. Raises PoisonRow, SluiceError (validation, admission) or the adapter's RpcError.
    The path publishes the row's CompletionEvent (job id and custom id set) when it completes."""
    row = task.row
    body = row.WhichOneof("body")
    started = time.perf_counter()
    tenant = Tenant(task.tenant, task.text_logging)
    if body == "generate":
        request = generate_request(row.generate)
        parts: list[str] = []
        rate = None
        final = None
        async with path.generate(tenant, request, request_id, timeout_s, row=(task.job_id, row.custom_id)) as stream:
            rate = _allowed_rate(stream.ticket.requests_per_minute)
            sampling = request.sampling
            choices = [jobs_pb2.RowChoice(index=i) for i in range(max(1, sampling.n))]
            async for chunk in stream:
                choice = choices[stream.index]
                choice.text += chunk.text
                choice.logprobs.extend(chunk.logprobs)
                if stream.index == 0:
                    parts.append(chunk.text)
                if chunk.finish_reason:
                    choice.finish_reason = chunk.finish_reason
                    choice.tool_calls.extend(stream.tool_calls(stream.index))
                    final = chunk
        result = jobs_pb2.RowResult(job_id=task.job_id, custom_id=row.custom_id, output="".join(parts), request_id=request_id)
        result.tool_calls.extend(choices[0].tool_calls)
        if len(choices) > 1 or sampling.HasField("logprobs"):
            result.choices.extend(choices)
        if final is not None:
            result.finish_reason = final.finish_reason
            result.usage.CopyFrom(final.usage)
        return RowRun(result, time.perf_counter() - started, rate, RowTiming(*stream.timing()))
    if body == "embed":
        request_embed = gateway_pb2.EmbedRequest(model=row.embed.model, inputs=row.embed.inputs, priority_class=types_pb2.PRIORITY_CLASS_BULK)
        reply, ticket = await path.embed_with_ticket(tenant, request_embed, request_id, timeout_s)
        result = jobs_pb2.RowResult(
            job_id=task.job_id, custom_id=row.custom_id, embeddings=reply.embeddings, usage=reply.usage, request_id=request_id
        )
        latency = time.perf_counter() - started
        return RowRun(result, latency, _allowed_rate(ticket.requests_per_minute), RowTiming(None, 0, latency))
    raise PoisonRow("the row has neither a generate nor an embed body")


def _allowed_rate(requests_per_minute: float | None) -> float | None:
    """Rows per second the requests-per-minute budget allows; None without one (not the
    x-ratelimit-limit-requests header, which then holds the in-flight limit)."""
    return requests_per_minute / 60.0 if requests_per_minute else None


def is_paced(exc: BaseException) -> bool:
    """RESOURCE_EXHAUSTED with a time to retry; without one (a request larger than the whole
    allowance) no wait can admit the row, so it fails instead."""
    return code_of(exc) in PACED and getattr(exc, "retry_after_s", 1.0) is not None


def retry_after_of(exc: BaseException) -> float:
    return float(getattr(exc, "retry_after_s", 1.0) or 1.0)
