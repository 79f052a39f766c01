"""`make bench-rounds-ahead`: the adapter's rounds sent ahead (SLUICE_ADAPTER_ROUNDS_AHEAD) against
each round sent when the one before has ended, on this machine's cores.

Two stacks side by side, the same but for that setting (triton-local's prefix cache off on both, so
that every request prefills alike), take bench-peer's client and load in alternating order over
`BENCH_ROUNDS` rounds: streamed chat through the OpenAI front, a new connection per request,
temperature 0.7, 64 tokens, at 1 stream (`BENCH_SEQUENTIAL_REQUESTS`, 8) and 8 streams (16 requests).
Sent ahead, a round's request travels while the engine computes the round before instead of while
it waits for it: the engine never idles between rounds, but the request's CPU is taken from its
steps where they share the cores.

  BENCH rounds_ahead_vs_after_tokens_per_s_streams1   tokens/s ratio, ahead on against off
  BENCH rounds_ahead_vs_after_tokens_per_s_streams8
  BENCH rounds_ahead_minus_after_ttft_p50_ms_streams1 TTFT p50 difference
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import uuid
from pathlib import Path

from bench_peer import DEMO_KEY, Load, Phase, Server, figures, run_rounds, running
from sluice_stack import Stack, StackPorts

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "4"))
LOADS = (Load("streams1", int(os.environ.get("BENCH_SEQUENTIAL_REQUESTS", "8")), 1), Load("streams8", 16, 8))
AHEAD, AFTER = "ahead", "after"


def stack(run_dir: Path, name: str, ahead: bool) -> Stack:
    return Stack(
        run_dir=run_dir / name,
        ports=StackPorts.ephemeral(),
        amqp_prefix=f"sluice-bench-ahead-{uuid.uuid4().hex[:8]}",
        extra_env={
            "triton-local": {"SLUICE_TRITON_LOCAL_PREFIX_CACHE": "false"},
            "inference-adapter": {"SLUICE_ADAPTER_ROUNDS_AHEAD": str(ahead).lower()},
        },
    )


def report(phases: dict[tuple[str, str], list[Phase]]) -> list[str]:
    lines = []
    for load in LOADS:
        ahead, after = figures(phases[(AHEAD, load.name)]), figures(phases[(AFTER, load.name)])
        lines.append(
            f"{load.name}: ahead {ahead.tokens_per_s:.1f} tok/s, TTFT p50 {ahead.ttft_p50_ms:.1f} ms ({ahead.ok} ok, {ahead.failed} failed);"
            f" after {after.tokens_per_s:.1f} tok/s, TTFT p50 {after.ttft_p50_ms:.1f} ms ({after.ok} ok, {after.failed} failed)"
        )
        lines.append(f"BENCH rounds_ahead_vs_after_tokens_per_s_{load.name} {ahead.tokens_per_s / after.tokens_per_s:.3f} x")
        if load.concurrency == 1:
            lines.append(f"BENCH rounds_ahead_minus_after_ttft_p50_ms_{load.name} {ahead.ttft_p50_ms - after.ttft_p50_ms:.1f} ms")
    return lines


def main() -> int:
    keep = os.environ.get("BENCH_RUN_DIR")
    with contextlib.ExitStack() as exits:
        run_dir = Path(keep) if keep else Path(exits.enter_context(tempfile.TemporaryDirectory(prefix="bench-ahead-")))
        stacks = {AHEAD: stack(run_dir, AHEAD, True), AFTER: stack(run_dir, AFTER, False)}
        for each in stacks.values():
            exits.enter_context(running(each))
        demo = {"Authorization": f"Bearer {DEMO_KEY}"}
        servers = {side: Server(f"{each.openai_base_url}/chat/completions", demo) for side, each in stacks.items()}
        phases = run_rounds(servers, (AHEAD, AFTER), LOADS, ROUNDS)
        for line in report(phases):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
