"""From a CompletionEvent to a stored record, and from stored rows to summaries.

`otel_attributes` names an event's fields as the OpenTelemetry GenAI semantic conventions do
(gen_ai.request.model, gen_ai.usage.input_tokens, ...); the log lines and `sluice logs --json`
use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import events_pb2

from sluice_common.finish_reasons import finish_reason_name
from sluice_evaluation_logging.evaluators.base import Deferred, ScoreResult
from sluice_evaluation_logging.model import RecordRow, SummaryData


class PoisonMessage(ValueError):
    """A message that can never become a record; it goes to the dead-letter queue with this reason."""


def decode_event(body: bytes, content_type: str | None) -> events_pb2.CompletionEvent:
    event = events_pb2.CompletionEvent()
    kind = (content_type or "application/x-protobuf").split(";")[0].strip().lower()
    try:
        if kind == "application/x-protobuf":
            event.ParseFromString(body)
        elif kind == "application/json":
            json_format.Parse(body.decode("utf-8"), event)
        else:
            raise PoisonMessage(f"unsupported content type {content_type!r}")
    except (DecodeError, json_format.ParseError, UnicodeDecodeError) as exc:
        raise PoisonMessage(f"not a sluice.evallog.v1.CompletionEvent ({kind}): {exc}") from None
    if not event.event_id:
        raise PoisonMessage("CompletionEvent without event_id")
    if not event.tenant:
        raise PoisonMessage("CompletionEvent without tenant")
    if len(event.event_id) > 200:
        raise PoisonMessage("event_id longer than 200 characters")
    _check_finite_timings(event)
    return event


def _check_finite_timings(event: events_pb2.CompletionEvent) -> None:
    found = non_finite_timing(event)
    if found is not None:
        raise PoisonMessage(f"timings.{found[0]} is not a finite number ({found[1]})")


def non_finite_timing(event: events_pb2.CompletionEvent) -> tuple[str, float] | None:
    """The first of the event's timings that is NaN or infinite (its field name and value), if any.

    Protobuf takes NaN and +-Infinity for a double (JSON "NaN"), but no duration is either, and
    SQLite stores NaN as NULL, which the NOT NULL latency columns refuse: the batch would never
    store. The consumer dead-letters such an event; ScoreCompletions refuses it (INVALID_ARGUMENT)."""
    for descriptor, value in event.timings.ListFields():
        if isinstance(value, float) and not math.isfinite(value):
            return descriptor.name, value
    return None


def _epoch(timestamp: Any) -> float:
    return timestamp.seconds + timestamp.nanos / 1e9


def event_bytes(body: bytes, content_type: str | None, event: events_pb2.CompletionEvent) -> bytes:
    """The serialized CompletionEvent: the message body itself when it already is one (protobuf),
    so that it is not serialized a second time; the parsed event serialized for JSON."""
    kind = (content_type or "application/x-protobuf").split(";")[0].strip().lower()
    return bytes(body) if kind == "application/x-protobuf" else event.SerializeToString()


def to_row(
    event: events_pb2.CompletionEvent,
    scores: Iterable[ScoreResult | Deferred],
    serialized: bytes | None = None,
    trace_id: str = "",
) -> RecordRow:
    """The record to store; a Deferred evaluator result becomes a pending marker, stored with it."""
    stored: list[ScoreResult] = []
    pending: list[str] = []
    for s in scores:
        if isinstance(s, Deferred):
            pending.append(s.name)
        else:
            stored.append(s)
    finished_at = _epoch(event.finished_at) if event.HasField("finished_at") else 0.0
    return RecordRow(
        event_id=event.event_id,
        tenant=event.tenant,
        model=event.model,
        priority_class=event.priority_class,
        request_id=event.request_id,
        finish_reason=event.finish_reason,
        error_code=event.error_code,
        input_tokens=event.usage.prompt_tokens,
        output_tokens=event.usage.completion_tokens,
        cached_tokens=event.usage.cached_tokens,
        latency_ms=event.timings.total_time_ms,
        ttft_ms=event.timings.time_to_first_token_ms,
        started_at=_epoch(event.started_at) if event.HasField("started_at") else finished_at,
        finished_at=finished_at,
        text_logged=event.text_logged,
        event=serialized if serialized is not None else event.SerializeToString(),
        scores=tuple(stored),
        pending=tuple(pending),
        trace_id=trace_id,
        user=event.user,
        metadata=tuple(sorted(event.metadata.items())),
    )


def otel_attributes(event: events_pb2.CompletionEvent) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat" if event.messages or not event.prompt else "text_completion",
        "gen_ai.request.model": event.model,
        "gen_ai.response.id": event.request_id,
        "gen_ai.response.finish_reasons": [finish_reason_name(event.finish_reason)],
        "gen_ai.usage.input_tokens": event.usage.prompt_tokens,
        # Part of input_tokens, as the conventions have it (and Usage.cached_tokens is).
        "gen_ai.usage.cache_read.input_tokens": event.usage.cached_tokens,
        "gen_ai.usage.output_tokens": event.usage.completion_tokens,
        "gen_ai.request.max_tokens": event.sampling.max_tokens,
        "gen_ai.server.time_to_first_token": event.timings.time_to_first_token_ms / 1000,
        "gen_ai.server.request.duration": event.timings.total_time_ms / 1000,
        "sluice.tenant": event.tenant,
        "sluice.event_id": event.event_id,
    }
    if event.error_code:
        attributes["error.type"] = event.error_code
    return attributes


# ---- summaries


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of already sorted values (q in [0, 100])."""
    if not sorted_values:
        return 0.0
    rank = (len(sorted_values) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


@dataclass
class ScoreStats:
    name: str
    count: int = 0
    total: float = 0.0
    passed: int = 0
    skipped: int = 0
    low: float = math.inf
    high: float = -math.inf


@dataclass
class GroupSummary:
    tenant: str
    model: str
    count: int = 0
    errors: int = 0
    cancelled: int = 0
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    scores: dict[str, ScoreStats] = field(default_factory=dict)

    @property
    def error_rate(self) -> float:
        return self.errors / self.count if self.count else 0.0

    def latency(self, q: float) -> float:
        return percentile(self.latencies, q)

    def ttft(self, q: float) -> float:
        return percentile(self.ttfts, q)


def summarize(data: SummaryData) -> list[GroupSummary]:
    groups: dict[tuple[str, str], GroupSummary] = {}
    for tenant, model, finish, error_code, latency, ttft, tokens_in, tokens_out, tokens_cached in data.records:
        group = groups.setdefault((tenant, model), GroupSummary(tenant, model))
        group.count += 1
        if error_code or finish == types_pb2.FINISH_REASON_ERROR:
            group.errors += 1
        elif finish == types_pb2.FINISH_REASON_CANCELLED:
            group.cancelled += 1
        else:
            group.latencies.append(float(latency))
            if ttft:
                group.ttfts.append(float(ttft))
        group.input_tokens += int(tokens_in)
        group.output_tokens += int(tokens_out)
        group.cached_tokens += int(tokens_cached)
    for tenant, model, name, count, total, passed, skip, low, high in data.scores:
        group = groups.setdefault((tenant, model), GroupSummary(tenant, model))
        group.scores[name] = ScoreStats(
            name,
            count=int(count),
            total=float(total),
            passed=int(passed),
            skipped=int(skip),
            low=math.inf if low is None else float(low),
            high=-math.inf if high is None else float(high),
        )
    for group in groups.values():
        group.latencies.sort()
        group.ttfts.sort()
    return sorted(groups.values(), key=lambda g: (g.tenant, g.model))
