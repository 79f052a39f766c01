"""Scoring completions on request (EvalLogService.ScoreCompletions, used by `sluice eval`): the
registered evaluators, plus the reference-based ones for items that carry a reference. Nothing is
stored. The same evaluator modules as the consumer's, never a copy: a comparison scores exactly
what production logging scores.

Differences from the consume path, on purpose: similarity runs on every item (a comparison
needs all of them, not a 10% sample) and is awaited here rather than deferred, since the caller
is waiting for the scores anyway."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import ModuleType

from prometheus_client import Counter

from sluice_common.errors import InvalidArgument, ResourceExhausted
from sluice_evaluation_logging.evaluators import (
    EVALUATORS,
    REFERENCE_EVALUATORS,
    Offload,
    evaluate_batch,
    evaluate_references,
)
from sluice_evaluation_logging.evaluators.base import CompletionEvent, Deferred, EvalContext, ScoreResult
from sluice_evaluation_logging.records import non_finite_timing

# Bounds one call's work: each item may cost up to two Embed calls of two texts (similarity and
# reference_similarity); at ~200 texts/s on a CPU a thousand items are ~20 s. Callers page.
MAX_ITEMS = 1000
# Bounds one item's text (characters of its output, its reference, its prompt, each message): the
# CPU-heavy evaluators scan the whole output in the pool the consumer shares (~0.2 ms per KB each),
# so one call must not hold it for long. An answer of 32k tokens is ~128 KiB.
MAX_TEXT_CHARS = 256 * 1024

SCORED_ITEMS = Counter("sluice_evallog_scored_items_total", "Completions scored on request (ScoreCompletions).")
SCORE_CALLS_REFUSED = Counter(
    "sluice_evallog_score_calls_refused_total", "ScoreCompletions calls refused: their tenant had SCORE_MAX_CONCURRENT_PER_TENANT in flight."
)
# What a refused call's RetryInfo says: about one call of `sluice eval` (64 items, ~1 s).
SCORE_RETRY_AFTER_S = 1.0


class ScoreSlots:
    """How many ScoreCompletions calls each tenant may have in flight (SLUICE_EVALLOG_SCORE_MAX_CONCURRENT_PER_TENANT).

    A call's items (up to MAX_ITEMS) cost up to two Embed calls each, sent to the shared adapter as
    this service's own tenant in the bulk class, and the CPU-heavy evaluators run in the pool the
    consumer shares: no key may run more than `per_tenant` such calls at once. One more is refused
    at once with RESOURCE_EXHAUSTED and RetryInfo, not queued (a queue would hold the caller's
    connection and memory as well). One event loop: the count needs no lock.
    """

    def __init__(self, per_tenant: int) -> None:
        self.per_tenant = per_tenant
        self._in_flight: dict[str, int] = {}

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    @contextmanager
    def admit(self, tenant: str) -> Iterator[None]:
        held = self.in_flight(tenant)
        if held >= self.per_tenant:
            SCORE_CALLS_REFUSED.inc()
            raise ResourceExhausted(
                f"this tenant already has {held} ScoreCompletions calls in flight, at most {self.per_tenant}: retry when one has ended",
                retry_after_s=SCORE_RETRY_AFTER_S,
                quota_subject="evallog.score_calls_per_tenant",
            )
        self._in_flight[tenant] = held + 1
        try:
            yield
        finally:
            left = self._in_flight[tenant] - 1
            if left:
                self._in_flight[tenant] = left
            else:
                del self._in_flight[tenant]


@dataclass(frozen=True)
class ScoreInput:
    event: CompletionEvent
    # Empty: none, and the reference-based evaluators do not apply.
    reference: str = ""


@dataclass(frozen=True)
class EvaluatorInfo:
    name: str
    higher_is_better: bool
    description: str


def _describe(module: ModuleType) -> EvaluatorInfo:
    doc = (module.__doc__ or "").strip().split("\n\n")[0]
    return EvaluatorInfo(module.NAME, bool(module.HIGHER_IS_BETTER), " ".join(doc.split()))


def evaluator_infos() -> list[EvaluatorInfo]:
    """Every evaluator a scored item may get, with the direction of its value."""
    return [_describe(module) for module in (*EVALUATORS, *REFERENCE_EVALUATORS)]


def validate(items: Sequence[ScoreInput]) -> None:
    if not items:
        raise InvalidArgument("items", "no completions to score")
    if len(items) > MAX_ITEMS:
        raise InvalidArgument("items", f"{len(items)} items in one call; at most {MAX_ITEMS}: send them in several calls")
    for index, item in enumerate(items):
        if not item.event.text_logged:
            raise InvalidArgument(f"items[{index}].event.text_logged", "must be true: the evaluators score the output text")
        # The consumer refuses such an event (the latency evaluators would score NaN): so does this.
        if (timing := non_finite_timing(item.event)) is not None:
            raise InvalidArgument(f"items[{index}].event.timings.{timing[0]}", f"not a finite number ({timing[1]})")
        texts = {"event.output": item.event.output, "event.prompt": item.event.prompt, "reference": item.reference}
        texts.update({f"event.messages[{i}].content": message.content for i, message in enumerate(item.event.messages)})
        for name, text in texts.items():
            if len(text) > MAX_TEXT_CHARS:
                raise InvalidArgument(f"items[{index}].{name}", f"{len(text)} characters; at most {MAX_TEXT_CHARS} per text")


def scoring_context(ctx: EvalContext) -> EvalContext:
    """The consumer's context, with similarity on every item and awaited (see the module docstring)."""
    return replace(ctx, settings=replace(ctx.settings, similarity_sample_rate=1.0), defer_model_calls=False)


async def score_items(items: Sequence[ScoreInput], ctx: EvalContext, offload: Offload | None = None) -> list[list[ScoreResult]]:
    """Each item's scores: the registered evaluators' (EVALUATORS order), then the reference-based ones."""
    validate(items)
    ctx = scoring_context(ctx)
    base = await evaluate_batch([item.event for item in items], ctx, offload)
    with_reference = await evaluate_references([(item.event, item.reference) for item in items], ctx)
    SCORED_ITEMS.inc(len(items))
    # defer_model_calls is off, so no evaluator answers Deferred; the filter keeps the type honest.
    return [[s for s in scores if not isinstance(s, Deferred)] + extra for scores, extra in zip(base, with_reference, strict=True)]
