"""Engines co-located on one machine: PROCESSES step engines decoding at once, each with THREADS
llama.cpp threads, as several triton-local replicas on one host run. Prints one JSON line: per
process, the decode steps and tokens completed in the window and the step times' p50 and p99.

    services/triton-local/.venv/bin/python bench/engine/colocated.py PROCESSES THREADS SECONDS BATCH

Every process loads its engine first; the clock starts for all of them together (one shared
event) and stops after SECONDS; a step that ends after it is not counted. Each process decodes BATCH sequences of up to 40 tokens (the same
chat prompt, greedy), starting a new batch when one ends; only tokens of finished steps count.
bench/bench_colocated.py runs it with the cores split between the processes and with every
process taking every core.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

MAX_TOKENS = 40
PROMPT = "Write a long story about a river."
LOAD_TIMEOUT_S = 300


def _engine_process(threads: int, seconds: float, batch: int, loaded: Queue, start: Event, results: Queue) -> None:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from sluice_common.sampling import Sampling
    from sluice_triton_local.engine.step_engine import StepEngine
    from sluice_triton_local.engine.rows import DecodeRow, PrefillRow, ReleaseRow
    from sluice_triton_local.model_files import smollm2_gguf

    engine = StepEngine(str(smollm2_gguf()), max_slots=batch, max_context=512, threads=threads)
    prompt = engine.apply_chat_template([("user", PROMPT)])
    loaded.put(os.getpid())
    start.wait()
    step_seconds: list[float] = []
    tokens = 0
    first_seq = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seqs = range(first_seq, first_seq + batch)
        first_seq += batch
        engine.step([PrefillRow(s, prompt, Sampling(max_tokens=MAX_TOKENS)) for s in seqs])
        live = list(seqs)
        while live and time.monotonic() < end:
            started = time.perf_counter()
            outcomes = engine.step([DecodeRow(s) for s in live])
            if time.monotonic() > end:
                break  # finished after the window: not counted
            step_seconds.append(time.perf_counter() - started)
            tokens += sum(1 for o in outcomes if o.token_id >= 0)
            live = [s for s, o in zip(live, outcomes) if not o.finish_reason]
        engine.step([ReleaseRow(s) for s in seqs])
    step_seconds.sort()
    results.put(
        {
            "steps": len(step_seconds),
            "tokens": tokens,
            "p50_ms": 1000 * step_seconds[len(step_seconds) // 2] if step_seconds else None,
            "p99_ms": 1000 * step_seconds[min(len(step_seconds) - 1, int(len(step_seconds) * 0.99))] if step_seconds else None,
        }
    )


def run(processes: int, threads: int, seconds: float, batch: int) -> list[dict[str, float]]:
    context = multiprocessing.get_context("spawn")
    loaded, results, start = context.Queue(), context.Queue(), context.Event()
    workers = [context.Process(target=_engine_process, args=(threads, seconds, batch, loaded, start, results)) for _ in range(processes)]
    for worker in workers:
        worker.start()
    for _ in workers:
        loaded.get(timeout=LOAD_TIMEOUT_S)
    start.set()
    measured = [results.get(timeout=seconds + LOAD_TIMEOUT_S) for _ in workers]
    for worker in workers:
        worker.join()
    return measured


if __name__ == "__main__":
    processes, threads, seconds, batch = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(run(processes, threads, seconds, batch)))
