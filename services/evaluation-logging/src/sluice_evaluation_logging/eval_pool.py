"""The CPU-heavy evaluators (evaluators.CPU_HEAVY) of a batch, run in worker processes, off the loop.

Inline, a batch of 256 events with outputs of a few KB spends 200-400 ms in repetition, pii and
json_validity on the event loop: every delivery, ack, heartbeat and query waits that long. Here
the batch's serialized events (the consumer's message bodies as received; protobuf bytes, ~2 us
per KB to make where there are none), split into one chunk per worker process
(one task per chunk, not per event, so pickling and the round trip are paid once per chunk), and
evaluated in a `ProcessPoolExecutor` while the loop stays free; the cheap evaluators run on the
loop meanwhile. The scores are exactly those of inline evaluation (the same code, evaluators
`_run`, on the same events).

- Spawned workers (not forked: this process has grpc's and prometheus's threads), started and
  warmed up (imports done) off the loop at `start`; they ignore SIGINT (a terminal's Ctrl-C reaches
  the whole process group: the service drains, its workers must not die under it) and run at a
  lower CPU priority, so storing, acking and queries win the CPU from background evaluation.
- A worker that dies (killed, out of memory, a crash in C code) breaks the pool
  (`BrokenProcessPool`): the batch stays with the consumer, unacked, the pool is recreated and the
  batch's chunks are sent again. After `max_attempts` broken pools on the same batch (an event that
  crashes a worker every time) the heavy scores of that batch are recorded as skipped with the
  reason (for every CPU-heavy evaluator: which would have applied is not known without running
  them), so one poison event cannot stop consumption; its record is still stored.
- No timeout: an evaluator that never returns (a pathological regex) holds its worker and the
  consumer's batch; the pool's pending-chunks gauge and the batch time show it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool

import structlog
from prometheus_client import Counter, Gauge, Histogram

from sluice_evaluation_logging.evaluators import CPU_HEAVY, HeavyScores, evaluate_heavy_chunk
from sluice_evaluation_logging.evaluators.base import EvalSettings, ScoreResult, skipped

log = structlog.stdlib.get_logger("sluice.evallog.pool")

POOL_PENDING = Gauge("sluice_evallog_eval_pool_pending_chunks", "Chunks sent to the evaluation pool and not yet answered (its queue).")
POOL_SECONDS = Histogram(
    "sluice_evallog_eval_pool_seconds",
    "From sending a batch's chunks to the evaluation pool to having all their scores.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
POOL_RESTARTS = Counter("sluice_evallog_eval_pool_restarts_total", "Evaluation pools recreated after a worker process died.")
POOL_GAVE_UP = Counter(
    "sluice_evallog_eval_pool_skipped_events_total", "Events whose CPU-heavy scores were skipped: their chunk broke the pool every try."
)

CRASHED_DETAIL = "skipped: evaluator process crashed"
# Workers yield the CPU to the service's own process (storing, acking, queries) when both want it.
WORKER_NICE = 10


def _init_worker() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(WORKER_NICE)
    except OSError:  # not allowed here: same priority then
        pass


class EvalPool:
    """`evaluate` fits evaluators.evaluate_batch's `offload`."""

    def __init__(self, processes: int, max_attempts: int = 3, retry_delay_s: float = 0.2) -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.processes = processes
        self._max_attempts = max_attempts
        self._retry_delay_s = retry_delay_s
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        self._replacing: asyncio.Future[concurrent.futures.ProcessPoolExecutor] | None = None
        # The worker processes' ids (logs, tests).
        self.pids: tuple[int, ...] = ()

    async def start(self) -> None:
        """Starts the workers and waits until each has imported the evaluators (off the loop: a
        spawn is a fork-exec and an interpreter start, ~0.5-1 s)."""
        await self._ensure_executor()

    def _new_executor(self) -> tuple[concurrent.futures.ProcessPoolExecutor, tuple[int, ...]]:
        # Runs in a thread: ProcessPoolExecutor spawns its processes from the submitting thread.
        executor = concurrent.futures.ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker)
        # As many warm-up tasks at once as workers: each is spawned and imports what chunks need.
        warm = [executor.submit(evaluate_heavy_chunk, [], EvalSettings()) for _ in range(self.processes)]
        for future in warm:
            future.result()
        return executor, tuple(executor._processes or ())  # type: ignore[attr-defined]

    async def _ensure_executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._executor is not None:
            return self._executor
        # Concurrent batches that found the pool broken wait for one replacement.
        if self._replacing is None:
            self._replacing = asyncio.ensure_future(self._replace())
        return await asyncio.shield(self._replacing)

    async def _replace(self) -> concurrent.futures.ProcessPoolExecutor:
        try:
            started = time.monotonic()
            executor, pids = await asyncio.to_thread(self._new_executor)
            self._executor, self.pids = executor, pids
            log.info("eval_pool_started", processes=self.processes, pids=list(pids), seconds=round(time.monotonic() - started, 3))
            return executor
        finally:
            self._replacing = None

    def _discard(self, executor: concurrent.futures.ProcessPoolExecutor) -> None:
        if self._executor is executor:
            self._executor = None
            POOL_RESTARTS.inc()
            executor.shutdown(wait=False, cancel_futures=True)

    async def evaluate(self, serialized: Sequence[bytes], settings: EvalSettings) -> HeavyScores:
        """The CPU-heavy scores of the serialized events, in order, from one task per chunk."""
        size = -(-len(serialized) // self.processes)  # ceil: one chunk per worker
        chunks = [list(serialized[i : i + size]) for i in range(0, len(serialized), size)]
        for attempt in range(1, self._max_attempts + 1):
            executor = await self._ensure_executor()
            started = time.perf_counter()
            POOL_PENDING.inc(len(chunks))
            try:
                answers = await self._send(executor, chunks, settings)
            finally:
                POOL_PENDING.dec(len(chunks))
            broken = [a for a in answers if isinstance(a, BrokenProcessPool)]
            if not broken:
                for answer in answers:
                    if isinstance(answer, BaseException):
                        raise answer
                POOL_SECONDS.observe(time.perf_counter() - started)
                return _merge(answers)  # type: ignore[arg-type]
            # A worker died: none of this batch is acked; a new pool takes the chunks again.
            self._discard(executor)
            log.error(
                "eval_pool_broken",
                error=str(broken[0]),
                events=len(serialized),
                attempt=attempt,
                max_attempts=self._max_attempts,
            )
            if attempt < self._max_attempts:
                await asyncio.sleep(self._retry_delay_s * attempt)
        POOL_GAVE_UP.inc(len(serialized))
        log.error("eval_pool_gave_up", events=len(serialized), detail=CRASHED_DETAIL)
        crashed = [skipped(e.NAME, CRASHED_DETAIL) for e in CPU_HEAVY]
        return [[*crashed] for _ in serialized], {}

    @staticmethod
    async def _send(
        executor: concurrent.futures.ProcessPoolExecutor, chunks: list[list[bytes]], settings: EvalSettings
    ) -> list[HeavyScores | BaseException]:
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[HeavyScores]] = []
        try:
            for chunk in chunks:
                futures.append(loop.run_in_executor(executor, evaluate_heavy_chunk, chunk, settings))
        except BrokenProcessPool as exc:  # a worker died while the pool was idle: submit refuses
            for future in futures:
                future.cancel()
            return [exc]
        return await asyncio.gather(*futures, return_exceptions=True)

    async def close(self) -> None:
        if self._replacing is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._replacing)
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, True, cancel_futures=True)


def _merge(answers: Sequence[HeavyScores]) -> HeavyScores:
    scores: list[list[ScoreResult | None]] = []
    seconds: dict[str, float] = {}
    for chunk_scores, chunk_seconds in answers:
        scores.extend(chunk_scores)
        for name, spent in chunk_seconds.items():
            seconds[name] = seconds.get(name, 0.0) + spent
    return scores, seconds
