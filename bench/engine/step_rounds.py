"""The in-process side of `make bench-transport`: the step protocol's rounds driven on the engine
directly (step_protocol.start_round on a SharedEngine, as both Triton models call it), no Triton.

Run in triton-local's environment by bench/bench_transport.py. Reads one load per stdin line,
`<batch> <tokens> <steps per round>`, and answers each with one JSON line:
{"tokens": decode tokens, "seconds": wall time of the decode, "cpu_seconds": this process's CPU}.
The clock starts at the first response (the prefill's), as on the Triton sides.
"""

from __future__ import annotations

import json
import os
import queue
import resource
import sys
import time
from itertools import count

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from sluice_triton_local.__main__ import default_thread_waits  # noqa: E402

# Every side a fixed team of threads, waiting at barriers as triton-local's do without adaptive
# threads (bench_transport starts it so): the transport is measured, not the waits.
default_thread_waits(os.environ, adaptive_threads=False)

import numpy as np  # noqa: E402  (after the thread settings above)

from sluice_triton_local.engine.step_engine import StepEngine  # noqa: E402
from sluice_triton_local.model_files import gguf_path  # noqa: E402
from sluice_triton_local.shared_engine import SharedEngine, warm_up  # noqa: E402
from sluice_triton_local.step_protocol import DECODE, PREFILL, RELEASE, round_inputs, start_round  # noqa: E402

PROMPT = "Write a long story about a dragon and a knight who become friends."


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_load(engine: SharedEngine, seq_ids: list[int], tokens: int, steps: int) -> dict[str, float]:
    responses: queue.Queue[tuple[dict[str, np.ndarray], bool]] = queue.Queue()
    answer = lambda outputs, last: responses.put((outputs, last))  # noqa: E731
    body = json.dumps({"messages": [["user", PROMPT]], "max_tokens": tokens, "temperature": 0}).encode()
    cpu = _cpu_seconds()
    start_round(engine, round_inputs(PREFILL, seq_ids, [body] * len(seq_ids), steps), answer)
    live, started, decoded = set(seq_ids), None, 0
    while live:
        outputs, last = responses.get(timeout=120)
        if started is None:
            started = time.perf_counter()
        else:
            decoded += int((outputs["TOKEN_ID"] >= 0).sum())
        live -= {int(s) for s, finish in zip(outputs["ROW_SEQ_ID"], outputs["FINISH"]) if finish}
        if last and live:
            start_round(engine, round_inputs(DECODE, sorted(live), [b""] * len(live), steps), answer)
    seconds = time.perf_counter() - (started or time.perf_counter())
    cpu = _cpu_seconds() - cpu
    start_round(engine, round_inputs(RELEASE, seq_ids, [b""] * len(seq_ids), 1), lambda *_: None)
    return {"tokens": decoded, "seconds": seconds, "cpu_seconds": cpu}


def main() -> None:
    threads = int(os.environ.get("BENCH_THREADS", "2"))
    engine = SharedEngine(StepEngine(str(gguf_path()), max_slots=32, max_context=1024, prefix_cache=False, threads=threads))
    warm_up(engine)
    ids = count(1)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        batch, tokens, steps = (int(x) for x in line.split())
        print(json.dumps(run_load(engine, [next(ids) for _ in range(batch)], tokens, steps)), flush=True)


if __name__ == "__main__":
    main()
