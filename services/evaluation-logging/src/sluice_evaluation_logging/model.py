"""The record model: what evaluation-logging stores and how it is asked for it, without storage.

A record is one CompletionEvent's columns, its serialized event and its scores; `RecordFilter` is
the one filter type of the query side, from the request (the tenant asked for) to the store (the
tenant it is scoped to, see queries.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice_evaluation_logging.evaluators.base import ScoreResult


@dataclass(frozen=True)
class RecordRow:
    event_id: str
    tenant: str
    model: str
    priority_class: int
    request_id: str
    finish_reason: int
    error_code: str
    input_tokens: int
    output_tokens: int
    latency_ms: float
    ttft_ms: float
    started_at: float
    finished_at: float
    text_logged: bool
    event: bytes
    scores: tuple[ScoreResult, ...] = ()
    stored_at: float = 0.0
    # Names of the scores to compute later (a pending marker each, stored with the record).
    pending: tuple[str, ...] = ()
    # Of input_tokens, those the engine served from its prefix cache (Usage.cached_tokens).
    cached_tokens: int = 0
    # The W3C trace id the event's message carried (empty: none).
    trace_id: str = ""
    # The request's end user and metadata pairs (CompletionEvent.user and metadata), queryable.
    user: str = ""
    metadata: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class PendingItem:
    """A claimed pending score: the record's serialized event, and how often it was claimed."""

    event_id: str
    event: bytes
    attempts: int


@dataclass(frozen=True)
class Threshold:
    name: str
    min_value: float | None = None
    max_value: float | None = None
    passed: bool | None = None


@dataclass(frozen=True)
class RecordFilter:
    """Which records a query or summary covers. `tenant` empty means the caller's own; the store is
    only ever handed a filter whose tenant queries.py has scoped to the caller."""

    tenant: str = ""
    model: str = ""
    start: float | None = None
    end: float | None = None
    finish_reason: int = 0
    thresholds: tuple[Threshold, ...] = ()
    # Only the records of this end user (non-empty), and whose metadata has every one of these pairs.
    user: str = ""
    metadata: tuple[tuple[str, str], ...] = ()


@dataclass
class SummaryData:
    """Rows for summaries: per record (tenant, model, finish_reason, error_code, latency, ttft, in,
    out, cached in); per (tenant, model, score name) the database's aggregates (count not skipped,
    sum of values not skipped, passed not skipped, skipped, min and max not skipped: None if none)."""

    records: list[tuple[Any, ...]] = field(default_factory=list)
    scores: list[tuple[Any, ...]] = field(default_factory=list)
