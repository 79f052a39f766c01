"""`make bench-colocated`: two triton-local engines on one machine, cores split vs every core each.

Several replicas on one host (the local stack's two triton-locals, or pods without CPU limits on
one node) each defaulted to every core the process may use. llama.cpp's threads spin at each of a
step's barriers, so when the replicas' threads together outnumber the cores, a thread that loses
its core holds the others until it runs again. The sides, both two engine processes decoding at
once in triton-local's environment (bench/engine/colocated.py says how):

  split       each engine THREADS = cores // 2 (what the stack now sets, and the advice to operators)
  all_cores   each engine THREADS = cores (the old default on a shared host)

Same model, prompt, batch and window on both sides; the window's clock starts when every engine has
loaded; only steps finished within it count. ROUNDS alternating rounds (which side goes first
alternates), each side's median kept. Ends with `BENCH colocated_split_vs_all_cores_tokens_per_s`
(target >= 1.0) and each side's decode-step p99.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess

from sluice_stack import REPO_ROOT

PROCESSES = 2
CORES = len(os.sched_getaffinity(0))
SECONDS = float(os.environ.get("BENCH_SECONDS", "20"))
BATCH = int(os.environ.get("BENCH_BATCH", "2"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
PYTHON = REPO_ROOT / "services" / "triton-local" / ".venv" / "bin" / "python"
SIDES = {"split": max(1, CORES // PROCESSES), "all_cores": CORES}


def measure(threads: int) -> dict[str, float]:
    command = [str(PYTHON), str(REPO_ROOT / "bench" / "engine" / "colocated.py"), str(PROCESSES), str(threads), str(SECONDS), str(BATCH)]
    proc = subprocess.run(command, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"), capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    engines = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "tokens_per_s": sum(e["tokens"] for e in engines) / SECONDS,
        "p50_ms": max(e["p50_ms"] or 0.0 for e in engines),
        "p99_ms": max(e["p99_ms"] or 0.0 for e in engines),
    }


def main() -> int:
    print(f"{PROCESSES} engines on {CORES} cores, batch {BATCH}, {SECONDS:g} s windows, {ROUNDS} alternating rounds", flush=True)
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for round_index in range(ROUNDS):
        order = list(SIDES) if round_index % 2 == 0 else list(reversed(SIDES))
        for side in order:
            result = measure(SIDES[side])
            runs[side].append(result)
            print(
                f"round {round_index + 1} {side:<9} ({SIDES[side]} threads each): {result['tokens_per_s']:7.1f} tok/s,"
                f" step p50 {result['p50_ms']:7.1f} ms, p99 {result['p99_ms']:7.1f} ms",
                flush=True,
            )
    median = {side: {key: statistics.median(r[key] for r in results) for key in results[0]} for side, results in runs.items()}
    split, every = median["split"], median["all_cores"]
    ratio = split["tokens_per_s"] / every["tokens_per_s"] if every["tokens_per_s"] else float("inf")
    print(
        f"BENCH colocated_split_vs_all_cores_tokens_per_s {ratio:.2f} x (target >= 1.0; {split['tokens_per_s']:.1f} vs {every['tokens_per_s']:.1f} tok/s)"
    )
    print(f"BENCH colocated_step_p99_ms split {split['p99_ms']:.1f} all_cores {every['p99_ms']:.1f}")
    return 0 if ratio >= 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
