"""What every evaluator shares: its input (a CompletionEvent), its settings, its result."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sluice.common.v1 import types_pb2
from sluice.evallog.v1.events_pb2 import CompletionEvent

FINISHED = (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH)


@dataclass(frozen=True)
class ScoreResult:
    name: str
    value: float
    passed: bool
    detail: str = ""
    skipped: bool = False
    # An evaluator that raised: its traceback (text, so that it crosses from a pool worker), which
    # the service logs and counts (evaluators.report_failures). Never stored; no part of equality.
    error: str = field(default="", compare=False, repr=False)


@dataclass(frozen=True)
class EvalSettings:
    latency_slo_ms: float = 30_000.0
    ttft_slo_ms: float = 2_000.0
    repetition_ngram: int = 4
    repetition_max_ratio: float = 0.5
    similarity_sample_rate: float = 0.1
    similarity_min: float = 0.2
    # reference_similarity: the output-to-reference cosine that passes.
    reference_similarity_min: float = 0.5


class EmbeddingsUnavailable(Exception):
    """The embedding backend does not serve embeddings (UNIMPLEMENTED) or cannot now (UNAVAILABLE).

    `retryable`: the backend may answer later (UNAVAILABLE, a deadline, a full queue); False when it
    does not serve embeddings at all (UNIMPLEMENTED), so waiting would not help."""

    def __init__(self, reason: str = "", retryable: bool = False) -> None:
        super().__init__(reason)
        self.retryable = retryable


class EmbeddingsTimedOut(EmbeddingsUnavailable):
    """The backend did not answer within the deadline (DEADLINE_EXCEEDED): retryable, but perhaps
    only with less to embed per call, so a caller that batches may split before trying again."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason, retryable=True)


class Embedder(Protocol):
    async def embed(self, texts: Sequence[str]) -> list[list[float]]: ...


@dataclass(frozen=True)
class Deferred:
    """An evaluator's answer when its score is computed later, off the consume path: the store
    keeps a durable pending marker for (event, name) with the record, and a background task
    (similarity_worker.py) writes the score and clears the marker."""

    name: str


@dataclass(frozen=True)
class EvalContext:
    settings: EvalSettings
    embedder: Embedder | None = None
    # The consumer sets this: an evaluator that would wait on a model answers Deferred instead.
    defer_model_calls: bool = False


def finished(event: CompletionEvent) -> bool:
    """The generation ran to its end (stop or length), as opposed to cancelled or failed."""
    return event.finish_reason in FINISHED and not event.error_code


def has_text(event: CompletionEvent) -> bool:
    return event.text_logged


def prompt_text(event: CompletionEvent) -> str:
    if event.prompt:
        return event.prompt
    return "\n".join(message.content for message in event.messages if message.role == "user")


def skipped(name: str, detail: str) -> ScoreResult:
    return ScoreResult(name=name, value=0.0, passed=False, detail=detail, skipped=True)
