"""Greedy decode throughput of triton-local's step engine, in triton-local's environment:

  services/triton-local/.venv/bin/python bench/engine/decode.py [gguf] [batch ...]

Prints one JSON line: {"engine": ..., "threads": ..., "load_s": ..., "batch1_tok_s": ..., ...}. The
engine's forward pass is llama.cpp unless ENGINE=numpy. ENGINE_THREADS sets llama.cpp's threads, 0
for the count triton-local gives its engine (TritonLocalConfig.engine_threads: the CPUs this process
may keep busy); without it OMP_NUM_THREADS does, which also sets BLAS's threads for numpy (read when
numpy is imported, hence a separate process). Each batch size's clock starts after one untimed
warm-up at that batch size (a prefill and WARM_UP_STEPS decode steps), so no figure pays for cold
caches or first allocations. `greedy_decode` is also gpu.py's measuring loop.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping

from sluice_common.sampling import Sampling
from sluice_triton_local.engine.step_engine import StepEngine
from sluice_triton_local.engine.rows import DecodeRow, PrefillRow, ReleaseRow, RowResult
from sluice_triton_local.model_files import gguf_path

# Decode steps of the untimed warm-up before each batch size's clock.
WARM_UP_STEPS = 4


def engine_threads(environ: Mapping[str, str]) -> int:
    """ENGINE_THREADS (0: as triton-local decides, TritonLocalConfig.engine_threads), else OMP_NUM_THREADS, else 1."""
    if "ENGINE_THREADS" in environ:
        from sluice_triton_local.config import TritonLocalConfig  # here: gpu.py imports this module for greedy_decode alone

        return TritonLocalConfig(threads=int(environ["ENGINE_THREADS"])).engine_threads()
    return int(environ.get("OMP_NUM_THREADS", "1"))


def measure(engine: StepEngine, batch: int, decode_steps: int = 32) -> float:
    """Decode tokens/s over `decode_steps` steps with `batch` sequences live
    (prefill excluded)."""
    prompt = engine.apply_chat_template([("user", "Write a long story about a dragon and a knight.")])
    return greedy_decode(engine, [prompt] * batch, decode_steps)[0]


# How a measured row may end: any other finish ("error", "busy", "stale") is work that failed.
FINISHED_OK = ("", "stop", "length")


def greedy_decode(engine: StepEngine, prompts: list[str], decode_steps: int) -> tuple[float, list[list[int]], float]:
    """Prefills one sequence per (templated) prompt in one step, then runs up to `decode_steps`
    greedy decode steps over the sequences still live. Returns decode tokens/s (the clock runs
    around the decode steps alone), each sequence's token ids, the prefill's token first, and the
    prefill step's prompt tokens/s (its tokens computed, the prefix cache's excluded). Raises when
    any row, in the prefill or a decode step, ends otherwise than "stop" or "length" (its slots
    released first), as gpu.py's step protocol side does: a failed row never leaves the batch
    silently, making the later steps' batch smaller than the one measured."""
    params = Sampling(max_tokens=decode_steps + 1, temperature=0.0)
    ids = list(range(10_000, 10_000 + len(prompts)))

    def check(results: list[RowResult], stage: str) -> None:
        if failed := [r for r in results if r.finish_reason not in FINISHED_OK]:
            engine.step([ReleaseRow(i) for i in ids])
            raise RuntimeError(f"{stage} failed: sequence {failed[0].seq_id} ended {failed[0].finish_reason}: {failed[0].error}")

    t0 = time.perf_counter()
    first = engine.step([PrefillRow(i, prompt, params) for i, prompt in zip(ids, prompts)])
    prefill_s = time.perf_counter() - t0
    check(first, "prefill")
    tokens = {r.seq_id: [r.token_id] for r in first}
    live = [r.seq_id for r in first if not r.finish_reason]
    done = 0
    t0 = time.perf_counter()
    for _ in range(decode_steps):
        if not live:
            break
        results = engine.step([DecodeRow(i) for i in live])
        check(results, "decode")
        for r in results:
            if r.token_id >= 0:
                tokens[r.seq_id].append(r.token_id)
                done += 1
        live = [r.seq_id for r in results if not r.finish_reason]
    elapsed = time.perf_counter() - t0
    engine.step([ReleaseRow(i) for i in ids])
    prefilled = sum(r.prompt_tokens - r.cached_tokens for r in first)
    return done / max(elapsed, 1e-9), [tokens[i] for i in ids], prefilled / max(prefill_s, 1e-9)


def main(argv: list[str]) -> None:
    path = argv[0] if argv and argv[0].endswith(".gguf") else gguf_path()
    batches = [int(a) for a in argv if not a.endswith(".gguf")] or [1, 8]
    threads = engine_threads(os.environ)
    t0 = time.perf_counter()
    engine = StepEngine(path, max_slots=max(batches), engine=os.environ.get("ENGINE", "llamacpp"), threads=threads)
    load_s = time.perf_counter() - t0
    out: dict[str, float | str] = {"engine": engine.engine, "threads": threads, "load_s": round(load_s, 2)}
    for b in batches:
        measure(engine, b, WARM_UP_STEPS)  # untimed: the same batch's prefill and first steps, before its clock
        out[f"batch{b}_tok_s"] = round(measure(engine, b), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
