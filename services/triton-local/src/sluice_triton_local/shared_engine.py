"""The process's one engine, shared by the step model and the self-batching generate model."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sluice_triton_local import metrics
from sluice_common.sampling import Sampling
from sluice_triton_local.engine.step_engine import StepEngine
from sluice_triton_local.engine.rows import DecodeRow, PrefillRow, ReleaseRow, Row, RowResult

WARMUP_QUESTION = "Which city is the capital of France?"


# Told each step's results of a round, and whether it was the round's last.
OnStep = Callable[[list[RowResult], bool], None]

# Standard logging: Triton's image runs this module without structlog (triton-local renders it).
log = logging.getLogger("sluice.triton_local.engine")


class EngineThread:
    """The one thread every step runs on, and how much work waits for it: a round in flight ends
    early when other work waits (another adapter's round, the generate model's or the variant's step)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-engine")
        self._lock = threading.Lock()
        self._waiting = 0

    @property
    def waiting(self) -> int:
        return self._waiting

    def submit(self, work: Callable[..., Any], *args: Any, counted: bool = True) -> Future[Any]:
        """Queues work; `counted` work ends a round in flight early while it waits."""
        if not counted:
            return self._executor.submit(work, *args)
        with self._lock:
            self._waiting += 1

        def run() -> Any:
            with self._lock:
                self._waiting -= 1
            return work(*args)

        return self._executor.submit(run)

    def shutdown(self) -> None:
        """Runs the work already queued, then stops the thread: later work is refused (RuntimeError)."""
        self._executor.shutdown(wait=True)


class SharedEngine:
    """Runs every step on one thread of its own and records the model metrics.

    One thread serializes the steps (the KV slots are not thread-safe), and it keeps llama.cpp's
    OpenMP team to one: each thread that enters an OpenMP region gets a team of its own, and two
    teams on two cores slow each other down (measured: a batch-1 step took 16-20 ms instead of
    8 ms once the warm-up had run on another thread than the steps). Warm up through it too.
    """

    def __init__(self, engine: StepEngine, variant_of: SharedEngine | None = None) -> None:
        self._engine = engine
        # A second variant of the model (variant.py) steps on the main engine's thread, for the
        # reason above (one OpenMP team; the two models' steps take turns), counts its tokens
        # apart and leaves the slot gauges, which describe the main model, alone.
        self._variant = variant_of is not None
        self._owner: EngineThread = variant_of._owner if variant_of is not None else EngineThread()
        self._owners: set[str] = set()
        self._reclaimed = 0
        self._prefills, self._prefix_hits, self._reused_tokens, self._host_restores = 0, 0, 0, 0
        # Sequences a release request named while a round may be stepping them, and the rounds
        # (numbered as submitted) that end after their current step because a caller asked the
        # round in flight to (see round()): those submitted before the ask, the one in flight and
        # the following rounds queued behind it.
        self._releasing: set[int] = set()
        self._asks_lock = threading.Lock()
        self._rounds_submitted = 0
        self._end_through = 0
        self._closed = False

    @property
    def active_slots(self) -> int:
        return self._engine.active_slots

    @property
    def context_length(self) -> int:
        return self._engine.context_length

    @property
    def vocab_size(self) -> int:
        return self._engine.vocab_size

    def count_tokens(self, text: str) -> int:
        return self._engine.count_tokens(text)

    def apply_chat_template(self, messages: list[tuple[str, str]]) -> str:
        return self._engine.apply_chat_template(messages)

    def encode(self, text: str) -> list[int]:
        return self._engine.encode(text)

    def encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        return self._engine.encode_chat(messages)

    def _report_owners(self) -> None:
        holding = self._engine.slots_by_owner()
        # An owner is an adapter process (host/pid): one that holds nothing now is dropped, not kept
        # at 0, or every adapter restart would leave a series for the life of this process.
        for owner in self._owners - holding.keys():
            metrics.SLOTS_BY_OWNER.remove(owner)
        for owner, slots in holding.items():
            metrics.SLOTS_BY_OWNER.labels(owner=owner).set(slots)
        self._owners = set(holding)
        reclaimed = self._engine.slots_reclaimed_total
        if reclaimed > self._reclaimed:
            described = list(self._engine.reclaimed_recently)
            self._engine.reclaimed_recently.clear()
            log.warning(
                "slots_reclaimed: %d sequences nobody stepped within the lease (%s); slots held now: %s",
                reclaimed - self._reclaimed,
                "; ".join(described),
                holding,
            )
        metrics.SLOTS_RECLAIMED.inc(reclaimed - self._reclaimed)
        self._reclaimed = reclaimed

    def _report_prefix_cache(self) -> None:
        engine = self._engine
        prefills, hits = engine.prefills_total - self._prefills, engine.prefix_hits_total - self._prefix_hits
        metrics.PREFIX_CACHE_LOOKUPS.labels(result="hit").inc(hits)
        metrics.PREFIX_CACHE_LOOKUPS.labels(result="miss").inc(prefills - hits)
        metrics.PREFIX_CACHE_REUSED_TOKENS.inc(engine.cached_tokens_total - self._reused_tokens)
        metrics.PREFIX_CACHE_SLOTS.set(engine.cached_slots)
        metrics.PREFIX_CACHE_HOST_BYTES.set(engine.host_prefix_bytes)
        metrics.PREFIX_CACHE_HOST_RESTORES.inc(engine.host_restores_total - self._host_restores)
        self._host_restores = engine.host_restores_total
        self._prefills, self._prefix_hits, self._reused_tokens = engine.prefills_total, engine.prefix_hits_total, engine.cached_tokens_total

    def close(self) -> None:
        """Ends the engine: the work already queued on its thread runs first, then its model's
        memory is freed (StepEngine.close), and later steps and rounds fail (RuntimeError). The main
        engine's thread stops with it; a variant, which steps on its main engine's thread, frees its
        model on that thread (close a variant before its main engine)."""

        def close_model() -> None:
            self._closed = True
            self._engine.close()

        if self._variant:
            self._owner.submit(close_model, counted=False).result()
        else:
            self._owner.shutdown()
            close_model()

    def step(self, rows: list[Row]) -> list[RowResult]:
        return self._owner.submit(self._step, rows).result()

    def round(self, rows: list[Row], steps: int, on_step: OnStep, preempts: bool = True, interruptible: bool = False) -> Future[None]:
        """Up to `steps` engine steps for one request (a multi-step round): the rows given, then one
        decode row for each sequence of theirs still running, until every one has finished or the
        round has run its steps. `on_step` gets each step's results as they are made, on the
        engine's thread. A sequence named by `release_soon` meanwhile is released at the round's
        next step instead of decoded, so a cancelled stream stops within one step; after
        `end_round_soon` the round ends with its current step, so that new arrivals join; and it
        ends there too when other work waits for the engine (another adapter's round, the generate
        model's step), which so waits one step, not a whole round. A round that does not `preempt`
        (a release request, which the round in flight applies itself, or a caller's next round sent
        while its current one runs) waits without ending one; an end-round ask made before it
        started ends it too, after its first step (it was planned without what the ask was for),
        while a preempting round is planned after such an ask and runs on. An `interruptible` round's
        steps may be stopped midway by `interrupt_soon`."""
        with self._asks_lock:
            self._rounds_submitted += 1
            number = self._rounds_submitted
        return self._owner.submit(self._round, number, rows, steps, on_step, preempts, interruptible, counted=preempts)

    def release_soon(self, seq_ids: list[int]) -> None:
        """Marks sequences a release request is about to release, for a round now stepping them."""
        with self._asks_lock:
            self._releasing.update(seq_ids)

    def end_round_soon(self) -> None:
        """Asks the round in flight, if any, to end after its current step (prefills wait)."""
        with self._asks_lock:
            self._end_through = self._rounds_submitted

    def interrupt_soon(self) -> None:
        """As end_round_soon, and the step in progress stops midway when its round is interruptible
        (StepEngine.step says what its rows answer then); when no step is computing, the next one
        to start stops before it computes if it is interruptible and starts soon (the ask may have
        come before its round, llamacpp_model.ASK_KEPT_S), and its round ends there.
        What an interactive arrival asks of a round of bulk work, so that its prefill does not wait
        for a bulk step (tens of milliseconds on a CPU) to end."""
        self.end_round_soon()
        metrics.INTERRUPT_ASKS.labels(found="step" if self._engine.interrupt(keep=True) else "none").inc()

    def _round(self, number: int, rows: list[Row], steps: int, on_step: OnStep, preempts: bool, interruptible: bool) -> None:
        with self._asks_lock:
            if preempts:  # an ask that came before it was for rounds that have ended
                self._end_through = min(self._end_through, number - 1)
            # A following round was sent before its caller released some of its sequences.
            rows = [ReleaseRow(row.seq_id) if isinstance(row, DecodeRow) and row.seq_id in self._releasing else row for row in rows]
        for done in range(1, steps + 1):
            stopped_before = self._engine.steps_interrupted_total
            results = self._step(rows, interruptible)
            # A stopped step ends its round, as the ask that stopped it asked, also when the ask
            # reached the engine before the round did (it could not end a round not yet submitted).
            stopped = self._engine.steps_interrupted_total > stopped_before
            rows = self._next_rows(number, rows, results) if done < steps and not stopped else []
            on_step(results, not rows)
            if not rows:
                metrics.ROUND_STEPS.observe(done)
                return

    def _next_rows(self, number: int, rows: list[Row], results: list[RowResult]) -> list[Row]:
        running = [r.seq_id for row, r in zip(rows, results) if not isinstance(row, ReleaseRow) and not r.finish_reason]
        with self._asks_lock:
            # Release requests still queued release theirs after the round.
            if number <= self._end_through or self._owner.waiting:
                return []
            released = self._releasing.intersection(running)
            self._releasing -= released
        metrics.RELEASED_MID_ROUND.inc(len(released))
        return [ReleaseRow(s) if s in released else DecodeRow(s) for s in running]

    def _step(self, rows: list[Row], interruptible: bool = False) -> list[RowResult]:
        if self._closed:  # a variant's work queued after its close: its model's memory is gone
            raise RuntimeError("the engine is closed")
        released = [row.seq_id for row in rows if isinstance(row, ReleaseRow)]
        if released:
            with self._asks_lock:
                self._releasing.difference_update(released)
        started = time.perf_counter()
        engine = self._engine
        before, deferred, interrupted = engine.tokens_generated_total, engine.prefills_deferred_total, engine.steps_interrupted_total
        results = engine.step(rows, interruptible)
        metrics.STEPS_INTERRUPTED.inc(engine.steps_interrupted_total - interrupted)
        if self._variant:
            metrics.VARIANT_TOKENS_GENERATED.inc(self._engine.tokens_generated_total - before)
            return results
        metrics.TOKENS_GENERATED.inc(self._engine.tokens_generated_total - before)
        metrics.PREFILLS_DEFERRED.inc(self._engine.prefills_deferred_total - deferred)
        metrics.ACTIVE_SLOTS.set(self._engine.active_slots)
        metrics.ENGINE_THREADS_IN_USE.set(self._engine.threads_in_use)
        self._report_owners()
        self._report_prefix_cache()
        metrics.STEP_ROWS.observe(len(rows))
        metrics.STEP_SECONDS.observe(time.perf_counter() - started)
        return results


def warm_up(engine: StepEngine | SharedEngine) -> str:
    """One greedy generation so that the first real request does not pay for cold caches."""
    return greedy_text(engine, WARMUP_QUESTION, max_tokens=8)


def greedy_text(engine: StepEngine | SharedEngine, question: str, max_tokens: int) -> str:
    """The greedy answer to one user question, generated in slot 0 (which is released after)."""
    prompt = engine.apply_chat_template([("user", question)])
    results = engine.step([PrefillRow(0, prompt, Sampling(max_tokens=max_tokens))])
    text = results[0].text
    while not results[0].finish_reason:
        results = engine.step([DecodeRow(0)])
        text += results[0].text
    engine.step([ReleaseRow(0)])
    return text
