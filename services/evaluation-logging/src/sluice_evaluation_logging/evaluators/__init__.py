"""The evaluators: each a small module with NAME, HIGHER_IS_BETTER (which way its value is
better, for comparisons) and `evaluate(event, ctx)` (sync or async), returning a ScoreResult or
None when it does not apply. Add one by writing a module and listing it here.

Reference-based evaluators (REFERENCE_EVALUATORS) take `evaluate(event, reference, ctx)`: they
score completions sent with an expected answer (ScoreCompletions, `sluice eval`); completion
events from the gateway carry no reference, so the consumer never runs them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

import structlog
from prometheus_client import Counter, Histogram

from sluice_evaluation_logging.evaluators import (
    empty_output,
    exact_match,
    json_validity,
    latency_slo,
    pii,
    reference_similarity,
    repetition,
    similarity,
    stop_sequence,
    truncation,
    ttft_slo,
)
from sluice_evaluation_logging.evaluators.base import (
    CompletionEvent,
    Deferred,
    EvalContext,
    EvalSettings,
    ScoreResult,
    skipped,
)

EVALUATORS: tuple[ModuleType, ...] = (
    latency_slo,
    ttft_slo,
    truncation,
    empty_output,
    repetition,
    stop_sequence,
    json_validity,
    pii,
    similarity,
)

REFERENCE_EVALUATORS: tuple[ModuleType, ...] = (exact_match, reference_similarity)


# Evaluators whose cost grows with the output's length in Python-level work (tokenizing, regex
# scans, JSON parsing): about 30-200 us per KB of output here, against ~2 us per KB to serialize
# an event for a worker process. They declare CPU_HEAVY = True and, with a pool (eval_pool.py),
# run in worker processes; the others cost a few microseconds per event and stay on the loop.
# A CPU-heavy evaluator must be synchronous and use nothing of the context but its settings.
CPU_HEAVY: tuple[ModuleType, ...] = tuple(e for e in EVALUATORS if getattr(e, "CPU_HEAVY", False))

EVALUATOR_SECONDS = Histogram(
    "sluice_evallog_evaluator_seconds",
    "Time one batch spent in one evaluator (summed over its events; CPU-heavy ones in a worker process when pooled).",
    ["evaluator"],
    buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)

# evaluate_batch lets the loop run other callbacks every this many events: with the CPU-heavy
# evaluators offloaded a slice costs well under a millisecond; inline, the heavy ones make a
# slice tens of milliseconds (a few KB of output each), and one big output stalls the loop for
# its own whole evaluation: the reason for the pool.
YIELD_EVERY = 64

# What a synchronous evaluator returns; anything else is checked for being awaitable.
_SETTLED = (ScoreResult, Deferred, type(None))

log = structlog.stdlib.get_logger("sluice.evallog.evaluators")

# An evaluator that raises is recorded as skipped (the record is kept); counted here and logged
# with its traceback, in this process (a pool worker's failure comes back with its result).
EVALUATOR_ERRORS = Counter(
    "sluice_evallog_evaluator_errors_total",
    "Evaluator runs that raised (the score recorded as skipped with the error), by evaluator.",
    ["evaluator"],
)
for _evaluator in (*EVALUATORS, *REFERENCE_EVALUATORS):
    EVALUATOR_ERRORS.labels(_evaluator.NAME)  # 0 from the start: increase() sees the first failure

# At most one evaluator_failed line (with its traceback) per evaluator per this many seconds: a
# broken evaluator fails on every event, thousands a second. The next line says how many were not logged.
FAILURE_LOG_INTERVAL_S = 60.0
_last_logged: dict[str, tuple[float, int]] = {}  # evaluator -> (when its last line was, failures since)


def _failed(evaluator: ModuleType, exc: BaseException) -> ScoreResult:
    result = skipped(evaluator.NAME, f"skipped: evaluator failed: {type(exc).__name__}: {exc}")
    return dataclasses.replace(result, error="".join(traceback.format_exception(exc)).rstrip())


def report_failures(results: Iterable[object]) -> None:
    """Counts and logs (a warning with the traceback, rate-limited per evaluator) the results of
    evaluators that raised; the others are ignored."""
    for result in results:
        if not isinstance(result, ScoreResult) or not result.error:
            continue
        EVALUATOR_ERRORS.labels(result.name).inc()
        now = time.monotonic()
        last, unlogged = _last_logged.get(result.name, (None, 0))
        if last is not None and now - last < FAILURE_LOG_INTERVAL_S:
            _last_logged[result.name] = (last, unlogged + 1)
            continue
        _last_logged[result.name] = (now, 0)
        # `exception`: the key structlog's format_exc_info writes a traceback under.
        log.warning("evaluator_failed", evaluator=result.name, error=result.detail, unlogged_since_last=unlogged, exception=result.error)


def _run(evaluator: ModuleType, event: CompletionEvent, ctx: EvalContext) -> Any:
    """One evaluator on one event, inline or in a pool worker alike: one that raises is skipped
    (its traceback kept on the result for report_failures, in the service's own process)."""
    try:
        return evaluator.evaluate(event, ctx)
    except Exception as exc:  # noqa: BLE001 - one broken evaluator must not lose the record
        return _failed(evaluator, exc)


async def _settle(evaluator: ModuleType, pending: Awaitable[Any]) -> ScoreResult | None:
    try:
        return await pending  # type: ignore[no-any-return]
    except Exception as exc:  # noqa: BLE001 - one broken evaluator must not lose the record
        return _failed(evaluator, exc)


# One chunk's CPU-heavy scores: per event, one result (or None) per CPU_HEAVY evaluator in order;
# and the seconds each evaluator took over the chunk.
HeavyScores = tuple[list[list[ScoreResult | None]], dict[str, float]]

# Runs the CPU-heavy evaluators of a batch elsewhere (EvalPool.evaluate), given the events
# serialized: what crosses to a worker process is bytes, and the consumer already holds them.
Offload = Callable[[Sequence[bytes], EvalSettings], Awaitable[HeavyScores]]


def evaluate_heavy_chunk(serialized: Sequence[bytes], settings: EvalSettings) -> HeavyScores:
    """The CPU-heavy evaluators on serialized events: what a pool worker process runs per chunk."""
    ctx = EvalContext(settings)
    seconds = dict.fromkeys((e.NAME for e in CPU_HEAVY), 0.0)
    results: list[list[ScoreResult | None]] = []
    clock = time.perf_counter
    for blob in serialized:
        event = CompletionEvent()
        event.ParseFromString(blob)
        scores: list[ScoreResult | None] = []
        for evaluator in CPU_HEAVY:
            started = clock()
            result = _run(evaluator, event, ctx)
            seconds[evaluator.NAME] += clock() - started
            if type(result) not in _SETTLED:
                close = getattr(result, "close", None)
                if close is not None:  # a coroutine: never awaited here
                    close()
                result = _failed(evaluator, TypeError("a CPU-heavy evaluator must be synchronous"))
            scores.append(result)
        results.append(scores)
    return results, seconds


async def evaluate_batch(
    events: Sequence[CompletionEvent],
    ctx: EvalContext,
    offload: Offload | None = None,
    serialized: Sequence[bytes] | None = None,
) -> list[list[ScoreResult | Deferred]]:
    """Every applicable evaluator's scores for each event, in EVALUATORS order; one that raises is
    recorded as skipped with the error. The synchronous evaluators run in place; the asynchronous
    ones (similarity: an Embed call to the adapter) of the whole batch are awaited together, so a
    batch waits for one round of embeddings rather than one round trip per sampled event. With
    `ctx.defer_model_calls` (the consumer) similarity answers Deferred instead and nothing waits.

    With `offload` (the consumer's process pool) the CPU_HEAVY evaluators of the whole batch run
    there, started first so that the cheap ones run here meanwhile; the scores are the same.
    `serialized` is each event's protobuf bytes when the caller holds them (the consumer: the
    message bodies as received), handed to `offload` as they are; without them the events are
    serialized here for it."""
    heavy: asyncio.Future[HeavyScores] | None = None
    if offload is not None and events and CPU_HEAVY:
        if serialized is None:
            serialized = [event.SerializeToString() for event in events]
        elif len(serialized) != len(events):
            raise ValueError(f"{len(serialized)} serialized events for {len(events)} events")
        heavy = asyncio.ensure_future(offload(serialized, ctx.settings))
    try:
        return await _evaluate(events, ctx, heavy)
    finally:
        if heavy is not None and not heavy.done():
            heavy.cancel()


async def _evaluate(
    events: Sequence[CompletionEvent], ctx: EvalContext, heavy: asyncio.Future[HeavyScores] | None
) -> list[list[ScoreResult | Deferred]]:
    inline = [e for e in EVALUATORS if e not in CPU_HEAVY] if heavy is not None else list(EVALUATORS)
    seconds = dict.fromkeys((e.NAME for e in inline), 0.0)
    clock = time.perf_counter
    by_name: list[dict[str, Any]] = []
    pending: list[tuple[dict[str, Any], str, Awaitable[ScoreResult | None]]] = []
    for index, event in enumerate(events):
        if index and index % YIELD_EVERY == 0:
            await asyncio.sleep(0)  # other callbacks run between slices of the batch
        scores: dict[str, Any] = {}
        for evaluator in inline:
            started = clock()
            result = _run(evaluator, event, ctx)
            seconds[evaluator.NAME] += clock() - started
            if type(result) not in _SETTLED and inspect.isawaitable(result):
                pending.append((scores, evaluator.NAME, _settle(evaluator, result)))
            scores[evaluator.NAME] = result
        by_name.append(scores)
    if heavy is not None:
        heavy_scores, heavy_seconds = await heavy
        seconds.update(heavy_seconds)
        for scores, from_pool in zip(by_name, heavy_scores, strict=True):
            for evaluator, result in zip(CPU_HEAVY, from_pool, strict=True):
                scores[evaluator.NAME] = result
    if pending:
        settled = await asyncio.gather(*(awaitable for _, _, awaitable in pending))
        for (scores, name, _), result in zip(pending, settled, strict=True):
            scores[name] = result
    if events:
        for name, spent in seconds.items():
            EVALUATOR_SECONDS.labels(name).observe(spent)
    results = [[s for s in (scores[e.NAME] for e in EVALUATORS) if s is not None] for scores in by_name]
    for scores_of_event in results:
        report_failures(scores_of_event)
    return results


async def evaluate_all(event: CompletionEvent, ctx: EvalContext) -> list[ScoreResult | Deferred]:
    """Every applicable evaluator's score for one event (see evaluate_batch)."""
    return (await evaluate_batch([event], ctx))[0]


def _run_reference(evaluator: ModuleType, event: CompletionEvent, reference: str, ctx: EvalContext) -> Any:
    try:
        return evaluator.evaluate(event, reference, ctx)
    except Exception as exc:  # noqa: BLE001 - one broken evaluator must not lose the others' scores
        return _failed(evaluator, exc)


async def evaluate_references(items: Sequence[tuple[CompletionEvent, str]], ctx: EvalContext) -> list[list[ScoreResult]]:
    """The reference-based evaluators' scores for each (event, reference), in REFERENCE_EVALUATORS
    order; the asynchronous ones (reference_similarity: an Embed call) of all items awaited together."""
    by_item: list[dict[str, Any]] = []
    pending: list[tuple[dict[str, Any], str, Awaitable[ScoreResult | None]]] = []
    for index, (event, reference) in enumerate(items):
        if index and index % YIELD_EVERY == 0:
            await asyncio.sleep(0)
        scores: dict[str, Any] = {}
        for evaluator in REFERENCE_EVALUATORS:
            result = _run_reference(evaluator, event, reference, ctx)
            if type(result) not in _SETTLED and inspect.isawaitable(result):
                pending.append((scores, evaluator.NAME, _settle(evaluator, result)))
            scores[evaluator.NAME] = result
        by_item.append(scores)
    if pending:
        settled = await asyncio.gather(*(awaitable for _, _, awaitable in pending))
        for (scores, name, _), result in zip(pending, settled, strict=True):
            scores[name] = result
    results = [[s for s in (scores[e.NAME] for e in REFERENCE_EVALUATORS) if s is not None] for scores in by_item]
    for scores_of_item in results:
        report_failures(scores_of_item)
    return results
