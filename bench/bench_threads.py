"""`make bench-threads`: which engine thread policy the local stack should run, measured with
`make bench-load`'s 32-stream chat load on the stack as `make run` starts it, on a quiet box and
beside one busy process (a `while True` loop at normal priority, as a build or a test run would be).

llama.cpp's CPU threads meet at each of the hundreds of barriers in a step. Built with OpenMP (the
default build) they spin there; a thread that loses its core holds up the others until it runs
again, so a step on a shared box can take seconds. The policies, each on a stack of its own:

  adaptive  triton-local's default: libgomp's default wait, and fewer threads while another process
            takes cores (SLUICE_TRITON_LOCAL_ADAPTIVE_THREADS, engine/thread_governor.py)
  brief     every usable CPU always, a spin of 1,000 rounds then sleep (GOMP_SPINCOUNT=1000): the
            default before adaptive threads
  default   every usable CPU always, libgomp's default wait: spin about 3 ms at a barrier
            (GOMP_SPINCOUNT 300,000), then sleep; the default before this benchmark (an empty
            OMP_WAIT_POLICY is libgomp's "not set", and keeps triton-local from setting it)
  spin      every usable CPU, OMP_WAIT_POLICY=ACTIVE: threads spin at a barrier until released
  passive   every usable CPU, OMP_WAIT_POLICY=PASSIVE: threads sleep at a barrier at once
  one       1 engine thread: no barrier to wait at
  pool      every usable CPU, llama.cpp's own thread pool instead of OpenMP (a build without OpenMP:
            BENCH_GGML_POOL_LIB names the folder of its libllama.so; skipped when unset)

Per policy and condition: tokens/s of the streams that finished, TTFT p50/p99, streams that failed
(the adapter cuts a stream whose next token is later than its gap timeout). Both conditions run on
the same stack, quiet first; the policies run in turn, then again in the reverse order, and each
figure is the better of its two rounds (this box is shared: the better round is the one less
disturbed by others). Prints `BENCH threads_<policy>_<condition>_tokens_per_s` and friends, and
`BENCH threads_busy_vs_quiet_<policy>`: the share of its quiet tokens/s a policy keeps beside a busy process.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench_load import percentile, stack_run
from sluice_stack import Stack, StackPorts

STREAMS = int(os.environ.get("BENCH_STREAMS", "32"))
CPUS = len(os.sched_getaffinity(0))
FIXED = {"SLUICE_TRITON_LOCAL_THREADS": str(CPUS), "SLUICE_TRITON_LOCAL_ADAPTIVE_THREADS": "false"}
POLICIES: dict[str, dict[str, str]] = {
    "adaptive": {"SLUICE_TRITON_LOCAL_THREADS": str(CPUS)},
    "brief": {**FIXED, "GOMP_SPINCOUNT": "1000"},
    "default": {**FIXED, "OMP_WAIT_POLICY": ""},
    "spin": {**FIXED, "OMP_WAIT_POLICY": "ACTIVE"},
    "passive": {**FIXED, "OMP_WAIT_POLICY": "PASSIVE"},
    "one": {"SLUICE_TRITON_LOCAL_THREADS": "1"},
}
if os.environ.get("BENCH_GGML_POOL_LIB"):
    POLICIES["pool"] = {**FIXED, "LLAMA_CPP_LIB_PATH": os.environ["BENCH_GGML_POOL_LIB"]}
# BENCH_POLICIES=adaptive,brief measures some of them.
if os.environ.get("BENCH_POLICIES"):
    POLICIES = {name: POLICIES[name] for name in os.environ["BENCH_POLICIES"].split(",")}


@dataclass(frozen=True)
class Figures:
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    failed: int

    def better(self, other: Figures | None) -> Figures:
        return self if other is None or self.tokens_per_s >= other.tokens_per_s else other


def measure(address: str) -> Figures:
    ok, wall, failed = asyncio.run(stack_run(address, STREAMS))
    if not ok:
        return Figures(0.0, float("nan"), float("nan"), failed)
    ttfts = [r.ttft_s for r in ok]
    return Figures(sum(r.completion_tokens for r in ok) / wall, percentile(ttfts, 50), percentile(ttfts, 99), failed)


def busy_process() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def run_policy(name: str, env: dict[str, str]) -> dict[str, Figures]:
    with tempfile.TemporaryDirectory() as run_dir:
        stack = Stack(run_dir=Path(run_dir), ports=StackPorts.ephemeral(), extra_env={"triton-local": env})
        stack.start()
        try:
            quiet = measure(stack.gateway_address)
            busy = busy_process()
            try:
                loaded = measure(stack.gateway_address)
            finally:
                busy.kill()
                busy.wait()
        finally:
            stack.stop()
    for condition, figures in (("quiet", quiet), ("busy", loaded)):
        print(
            f"  {name:<8} {condition:<5} {figures.tokens_per_s:6.1f} tok/s, TTFT p50 {figures.ttft_p50_s * 1000:5.0f} ms"
            f" p99 {figures.ttft_p99_s * 1000:5.0f} ms, {figures.failed} failed",
            flush=True,
        )
    return {"quiet": quiet, "busy": loaded}


def main() -> int:
    print(f"{STREAMS} chat streams on the local stack per policy, {CPUS} usable CPUs; policies: {', '.join(POLICIES)}", flush=True)
    best: dict[tuple[str, str], Figures] = {}
    order = list(POLICIES)
    for round_order in (order, order[::-1]):
        for name in round_order:
            for condition, figures in run_policy(name, POLICIES[name]).items():
                best[(name, condition)] = figures.better(best.get((name, condition)))
    print()
    for (name, condition), figures in best.items():
        print(f"BENCH threads_{name}_{condition}_tokens_per_s {figures.tokens_per_s:.1f} tok/s")
        print(f"BENCH threads_{name}_{condition}_ttft_p50 {figures.ttft_p50_s * 1000:.0f} ms")
        print(f"BENCH threads_{name}_{condition}_ttft_p99 {figures.ttft_p99_s * 1000:.0f} ms")
        print(f"BENCH threads_{name}_{condition}_failed {figures.failed} streams")
    for name in POLICIES:
        quiet, busy = best[(name, "quiet")].tokens_per_s, best[(name, "busy")].tokens_per_s
        print(f"BENCH threads_busy_vs_quiet_{name} {busy / quiet if quiet else 0.0:.2f} x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
