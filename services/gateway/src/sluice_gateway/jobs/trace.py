"""A bulk job as one trace: the job message's span, a span per row, a span per row attempt.

The producer's W3C trace context (`traceparent` in the JobRequest message's headers; the gateway's
SubmitJob puts its own there) is the parent of the worker's "process <jobs queue>" span; each row
message published from it carries that span's context, so every row's "sluice.job.row" span is in
the job's trace, and each attempt at the row ("sluice.job.row_attempt", numbered; a failed one
ends in error with the exception recorded) is a child of its row's span: retries show as sibling
attempts. The generation of an attempt (generation_trace) is the attempt's child.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from sluice.jobs.v1 import jobs_pb2

from sluice_common import tracing


def job_span(message: Any, queue: str) -> contextlib.AbstractContextManager[Any]:
    return tracing.consumer_span(
        f"process {queue}",
        message.headers,
        {"messaging.system": "rabbitmq", "messaging.operation": "process", "messaging.destination.name": queue,
         "messaging.message.id": message.message_id or ""},
    )  # fmt: skip


def row_span(message: Any, queue: str) -> contextlib.AbstractContextManager[Any]:
    headers = message.headers or {}
    return tracing.consumer_span(
        "sluice.job.row",
        headers,
        {"messaging.system": "rabbitmq", "messaging.destination.name": queue,
         "sluice.job_id": str(headers.get("x-sluice-job-id", "")), "sluice.custom_id": str(headers.get("x-sluice-custom-id", "")),
         "sluice.redelivered": bool(message.redelivered)},
    )  # fmt: skip


@contextlib.contextmanager
def attempt_span(task: jobs_pb2.RowTask, number: int, timeout_s: float) -> Iterator[Any]:
    with tracing.span(
        "sluice.job.row_attempt",
        {"sluice.job_id": task.job_id, "sluice.custom_id": task.row.custom_id, "sluice.attempt": number, "sluice.deadline_s": timeout_s},
    ) as span:
        yield span


def with_trace_context(headers: dict[str, Any]) -> dict[str, Any]:
    """Message headers plus the current trace context (while tracing is on)."""
    return tracing.inject_headers(headers)
