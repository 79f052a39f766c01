"""`make bench-load`: many concurrent chat streams through the gateway, on the stack as `make run`
starts it (triton-local, inference-adapter, rate-limit, evaluation-logging, gateway and its job
worker, with their default settings), beside the engine alone at the same batch bound.

For each of 16, 32 and 64 streams, all sent at once (grpc.aio, one channel, the demo key): chat
prompts of mixed lengths, sampling on (temperature 0.7, a seed per stream), MAX_TOKENS each.
A stream the rate limiter refuses (RESOURCE_EXHAUSTED; the demo tenant holds 32 requests in
flight) is retried after the RetryInfo delay, as a well-behaved client does; its time to first
token counts from its first attempt. Only streams that ended with a finish reason count.

  tokens/s   completion tokens of the successful streams (the usage the gateway reports) over
             the wall time from the first request sent to the last stream ended
  TTFT       first attempt sent -> first token received, p50 and p99

The engine side runs the same 32 prompts, sampling settings and max_tokens through StepEngine in
a process of its own (triton-local's environment), built as triton-local builds its engine
(`step_engine_for` with triton-local's config, BENCH_STACK_ENV's triton-local settings included:
its engine threads and their barrier wait, adaptive threads, prefix cache and its host store,
prefill budget, KV slots), batch bound the adapter's MAX_BATCH_SIZE (at most those slots): all
prompts prefilled as room allows, then decoded step by step, clock from the first step to the
last, counting the tokens of the sequences that finished "stop" or "length". Before its clock it
serves, untimed, what the stack's engine has served before its 32-stream load: triton-local's own
warm-up, the client's warm-up request before each load ("Say hi.", the same sampling) and the
earlier loads' prompts (the 16-stream load's are the first 16 of the 32), so that both prefix
caches hold the same prompts. Until 2026-12-07 the engine side had none of triton-local's
settings but its threads and context (no prefix cache, prefill budget or adaptive threads) and
started its clock cold, while the stack's cache held the 16-stream load's prompts. `load_stack_vs_engine_streams32` is the stack's
tokens/s over the engine's (target >= 0.8). The two sides run one after the other, engine first
and last (its best kept), stack in between. TTFT percentiles are inclusive (they never reach past
the slowest stream).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from sluice_stack import REPO_ROOT, Stack, StackPorts

MODEL = "smollm2-135m-instruct"
AUTH = (("authorization", "Bearer sk-sluice-demo"),)
# Settings to try instead of the defaults, per service: '{"triton-local": {"SLUICE_TRITON_LOCAL_THREADS": "1"}}'.
# The engine side runs with triton-local's.
STACK_ENV: dict[str, dict[str, str]] = json.loads(os.environ.get("BENCH_STACK_ENV", "{}"))
STREAMS = [int(s) for s in os.environ.get("BENCH_STREAMS", "16,32,64").split(",")]
MAX_TOKENS = int(os.environ.get("BENCH_MAX_TOKENS", "64"))
TEMPERATURE = 0.7
TOPICS = ["rivers", "the moon", "a lighthouse", "bread", "winter", "trains", "bees", "an old clock"]
ASKS = [
    "Write a short poem about {}.",
    "Explain in a few sentences how {} work, for a child.",
    "Tell me a story about {} that has a surprising ending, with a named hero and a clear beginning, middle and end.",
    "List five facts about {}.",
]


def prompts(n: int) -> list[str]:
    """n chat prompts of mixed lengths (about 10 to 30 words), the same for every run."""
    return [ASKS[i % len(ASKS)].format(TOPICS[(i // len(ASKS)) % len(TOPICS)]) for i in range(n)]


@dataclass
class Outcome:
    ttft_s: float
    completion_tokens: int
    ended_at: float
    retries: int


def retry_after_s(error: grpc.aio.AioRpcError) -> float | None:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    for detail in status.details if status else []:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None


async def one_stream(stub: gateway_pb2_grpc.GatewayServiceStub, question: str, seed: int) -> Outcome | None:
    request = gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content=question)],
        sampling=types_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=seed),
    )
    sent = time.perf_counter()
    retries = 0
    while True:
        first: float | None = None
        try:
            async for response in stub.Generate(request, metadata=AUTH, timeout=600):
                if first is None and response.text:
                    first = time.perf_counter()
                if response.finish_reason:
                    if response.finish_reason == types_pb2.FINISH_REASON_ERROR:
                        return None
                    return Outcome((first or time.perf_counter()) - sent, response.usage.completion_tokens, time.perf_counter(), retries)
            return None
        except grpc.aio.AioRpcError as error:
            delay = retry_after_s(error) if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
            if delay is None or first is not None:
                print(f"  stream failed: {error.code().name} {error.details()}", flush=True)
                return None
            retries += 1
            await asyncio.sleep(delay)


async def stack_run(address: str, n: int) -> tuple[list[Outcome], float, int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        await one_stream(stub, "Say hi.", 0)  # warm the channel and every hop once
        started = time.perf_counter()
        results = await asyncio.gather(*(one_stream(stub, q, 1000 + i) for i, q in enumerate(prompts(n))))
    ok = [r for r in results if r is not None]
    wall = (max(r.ended_at for r in ok) - started) if ok else float("nan")
    return ok, wall, len(results) - len(ok)


def engine_run(n: int, max_batch: int) -> dict[str, float]:
    """The engine alone on n prompts (ENGINE_SIDE), after the loads the stack runs before its n-stream one."""
    python = REPO_ROOT / "services" / "triton-local" / ".venv" / "bin" / "python"
    history = [prompts(m) for m in STREAMS[: STREAMS.index(n)]] if n in STREAMS else []
    script = ENGINE_SIDE.format(
        prompts=json.dumps(prompts(n)), history=json.dumps(history), max_tokens=MAX_TOKENS, temperature=TEMPERATURE, max_batch=max_batch
    )
    env = {**os.environ, **STACK_ENV.get("triton-local", {})}
    proc = subprocess.run([str(python), "-c", script], env=env, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"engine side failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Runs in triton-local's environment with its settings (TritonLocalConfig, from SLUICE_TRITON_LOCAL_*),
# its engine built and warmed up as triton-local's main() does it; then, untimed, the requests the
# stack's engine has served before the load compared (the client's "Say hi." warm-up before each
# load, and the earlier loads' prompts), so that both prefix caches hold the same prompts.
ENGINE_SIDE = """
import json, os, time
from sluice_common.config import load_config
from sluice_triton_local.__main__ import default_thread_waits, step_engine_for
from sluice_triton_local.config import ENV_PREFIX, TritonLocalConfig
from sluice_triton_local.model_files import smollm2_gguf
config = load_config(TritonLocalConfig, ENV_PREFIX)
# As triton-local's main() before the engine loads: one BLAS thread, llama.cpp's barrier wait.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
default_thread_waits(os.environ, config.adaptive_threads)
from sluice_triton_local.engine import DecodeRow, PrefillRow, Sampling
from sluice_triton_local.shared_engine import warm_up
engine = step_engine_for(config, config.gguf_path or str(smollm2_gguf()), config.max_slots)
bound = min({max_batch}, config.max_slots)

def generate(questions, first_seed):
    # (tokens of the sequences that finished "stop" or "length", wall s from the first step to the last, failed)
    waiting = [(first_seed + i, engine.apply_chat_template([("user", q)])) for i, q in enumerate(questions)]
    live, made, finished = [], {{}}, {{}}
    started = time.perf_counter()
    while waiting or live:
        room = bound - len(live)
        joining, waiting = waiting[:room], waiting[room:]
        rows = [DecodeRow(s) for s in live] + [
            PrefillRow(s, p, Sampling(max_tokens={max_tokens}, temperature={temperature}, seed=s)) for s, p in joining
        ]
        results = engine.step(rows)
        for r in results:
            made[r.seq_id] = made.get(r.seq_id, 0) + (r.token_id >= 0)
            if r.finish_reason:
                finished[r.seq_id] = r.finish_reason
        live = [r.seq_id for r in results if not r.finish_reason]
    wall_s = time.perf_counter() - started
    ok = [s for s, reason in finished.items() if reason in ("stop", "length")]
    return sum(made[s] for s in ok), wall_s, len(questions) - len(ok)

warm_up(engine)  # triton-local's own, before it serves
for earlier in {history}:  # untimed: what the stack's engine served before this load
    generate(["Say hi."], 0)
    generate(earlier, 1000)
generate(["Say hi."], 0)  # the stack client's warm-up request before the load
tokens, wall_s, failed = generate({prompts}, 1000)
print(json.dumps({{"tokens": tokens, "wall_s": wall_s, "failed": failed,
                  "threads": config.engine_threads(), "slots": config.max_slots, "batch_bound": bound}}))
"""


def histogram_totals(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram, all label sets together."""
    total = count = 0.0
    with urllib.request.urlopen(url, timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(f"{name}_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith(f"{name}_count"):
                count += float(line.rsplit(" ", 1)[1])
    return total, count


def counter_total(url: str, name: str) -> float:
    """A Prometheus counter's value, all label sets together."""
    with urllib.request.urlopen(url, timeout=5) as response:
        return sum(float(line.rsplit(" ", 1)[1]) for line in response.read().decode().splitlines() if line.startswith((f"{name} ", f"{name}{{")))


def step_times(stack: Stack) -> dict[str, tuple[float, float]]:
    """Where a step's time goes: the engine's own step, and the adapter's round trip to Triton."""
    return {
        "engine": histogram_totals(stack.metrics_url("triton-local"), "sluice_triton_local_step_seconds"),
        "adapter": histogram_totals(stack.metrics_url("inference-adapter"), "sluice_adapter_step_seconds"),
    }


def percentile(values: list[float], q: int) -> float:
    """Inclusive: the exclusive method extrapolates past the largest sample when there are fewer than 99."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def adapter_max_batch() -> int:
    """The adapter's default MAX_BATCH_SIZE, read in its own environment."""
    python = REPO_ROOT / "services" / "inference-adapter" / ".venv" / "bin" / "python"
    script = "from sluice_inference_adapter.config import AdapterConfig; print(AdapterConfig().max_batch_size)"
    return int(subprocess.run([str(python), "-c", script], capture_output=True, text=True, check=True).stdout)


def main() -> int:
    max_batch = int(STACK_ENV.get("inference-adapter", {}).get("SLUICE_ADAPTER_MAX_BATCH_SIZE", "0")) or adapter_max_batch()
    engine_runs = [engine_run(32, max_batch)]
    first = engine_runs[0]
    print(
        f"engine alone, 32 prompts, batch bound {first['batch_bound']} ({first['slots']} KV slots, {first['threads']} threads, as triton-local's):"
        f" {first['tokens'] / first['wall_s']:.1f} tok/s, {first['failed']} failed",
        flush=True,
    )
    figures: dict[int, tuple[float, float, float, int, int]] = {}
    with tempfile.TemporaryDirectory() as run_dir:
        stack = Stack(run_dir=Path(run_dir), ports=StackPorts.ephemeral(), extra_env=STACK_ENV)
        print("starting the stack as `make run` does ...", flush=True)
        stack.start()
        try:
            for n in STREAMS:
                before = step_times(stack)
                ok, wall, failed = asyncio.run(stack_run(stack.gateway_address, n))
                after = step_times(stack)
                (engine_s, steps), (round_trip_s, _) = ((after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in ("engine", "adapter"))
                tokens = sum(r.completion_tokens for r in ok)
                ttfts = [r.ttft_s for r in ok]
                retries = sum(r.retries for r in ok)
                figures[n] = (tokens / wall, percentile(ttfts, 50), percentile(ttfts, 99), failed, retries)
                print(
                    f"{n:>3} streams: {tokens / wall:7.1f} tok/s, TTFT p50 {figures[n][1]:.2f} s p99 {figures[n][2]:.2f} s,"
                    f" {failed} failed, {retries} retries after RESOURCE_EXHAUSTED",
                    flush=True,
                )
                print(
                    f"     {steps:.0f} steps: engine busy {engine_s / wall:.0%} of the wall time; a step"
                    f" {engine_s / max(steps, 1) * 1000:.1f} ms in the engine, {round_trip_s / max(steps, 1) * 1000:.1f} ms"
                    " adapter -> Triton round trip",
                    flush=True,
                )
        finally:
            stack.stop()
    engine_runs.append(engine_run(32, max_batch))
    engine_tps = max(r["tokens"] / r["wall_s"] for r in engine_runs)
    print(f"engine alone again: {engine_runs[1]['tokens'] / engine_runs[1]['wall_s']:.1f} tok/s, {engine_runs[1]['failed']} failed (best kept)\n")
    for n, (tps, p50, p99, failed, _) in figures.items():
        print(f"BENCH load_streams{n}_tokens_per_s {tps:.1f} tok/s")
        print(f"BENCH load_streams{n}_ttft_p50 {p50 * 1000:.0f} ms")
        print(f"BENCH load_streams{n}_ttft_p99 {p99 * 1000:.0f} ms")
        print(f"BENCH load_streams{n}_failed {failed} streams")
    print(f"BENCH load_engine_alone_streams32_tokens_per_s {engine_tps:.1f} tok/s")
    if 32 in figures:
        print(f"BENCH load_stack_vs_engine_streams32 {figures[32][0] / engine_tps:.2f} x (target >= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
