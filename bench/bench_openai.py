"""`make bench-openai`: the gateway's OpenAI-compatible HTTP front, driven by a third-party load
tool (NVIDIA's aiperf, its own env in bench/openai-tool), against the same load over the gRPC API,
through the same gateway process of one stack as `make run` starts it.

Two loads, each the same on both sides: bench-load's chat prompts of mixed lengths, temperature
0.7 and a seed per request (so both sides sample the same tokens: the gateway has no ignore_eos;
the completion tokens of each side are printed to show they match), at most `concurrency` in
flight (a new request is sent when one ends: aiperf's concurrency bound; `concurrency` grpc.aio
workers on one channel on the gRPC side), sent on the same grid of PACER_RATE ticks per second
(aiperf's pacing, see http_phase; the gRPC side's Pacer), so both offer the same arrivals.

  latency   LATENCY_REQUESTS requests one at a time, max_tokens LATENCY_MAX_TOKENS: the time to
            first token without queueing behind other requests, where what the front itself adds
            is not lost in the engine's batching noise. `openai_http_minus_grpc_ttft_p50` is its.
  load      LOAD_REQUESTS requests at concurrency LOAD_CONCURRENCY, max_tokens LOAD_MAX_TOKENS:
            tokens/s of the stack through each front. `openai_http_vs_grpc_tokens_per_s` is its.

Before its clock each side warms its connections with `concurrency` requests at that concurrency
(aiperf's warmup phase; the same first requests on gRPC), so neither pays connection setup in the
figures. ROUNDS rounds, each with one HTTP and one gRPC phase of each load, the order alternating
(HTTP first in odd rounds, gRPC first in even ones), so the noise of a shared 2-core machine falls
on both sides alike; a side's figures pool all its rounds.

  TTFT       request sent -> first response carrying text (aiperf's time_to_first_token from its
             per-request profile_export.jsonl; the gRPC side takes time.perf_counter() the same
             way), p50 and p99 over the succeeded requests
  tokens/s   completion tokens of the succeeded requests (the usage the gateway reports; aiperf
             reads it from the last SSE chunk with --use-server-token-count) over the phase's
             wall time, first request sent -> last request ended, the phases of a side summed
  gateway CPU  the gateway process's CPU time (user+system, /proc) over the whole phase, its
             warmup requests included, per completion token of the measured requests: what each
             front costs the gateway beside what it costs the clock (a ratio, not an absolute)
  front time   one at a time: the client's mean TTFT minus the adapter's (arrival at the adapter ->
             first token, its sluice_adapter_time_to_first_token_seconds over the phase, the one
             warmup request included; under load the warmup wave would skew it, so it is not shown):
             the time spent in the client, the gateway and the hops, without the engine's share,
             which moves with whatever else the 2 cores run

Only succeeded requests count (HTTP: 200 without an error event; gRPC: a finish reason other than
ERROR); failures are printed and counted. BENCH_RUN_DIR keeps the services' logs and aiperf's
artifacts (a temporary folder otherwise).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import grpc
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from bench_load import histogram_totals, prompts  # bench-load's chat prompts of mixed lengths
from sluice_stack import REPO_ROOT, Stack, StackPorts

MODEL = "smollm2-135m-instruct"
DEMO_KEY = "sk-sluice-demo"
AUTH = (("authorization", f"Bearer {DEMO_KEY}"),)
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
LATENCY_REQUESTS = int(os.environ.get("BENCH_LATENCY_REQUESTS", "48"))
LATENCY_MAX_TOKENS = int(os.environ.get("BENCH_LATENCY_MAX_TOKENS", "4"))
# The demo tenant admits 32 requests in flight: the load stays below, so none is refused.
LOAD_CONCURRENCY = int(os.environ.get("BENCH_LOAD_CONCURRENCY", "8"))
LOAD_REQUESTS = int(os.environ.get("BENCH_LOAD_REQUESTS", "32"))
LOAD_MAX_TOKENS = int(os.environ.get("BENCH_LOAD_MAX_TOKENS", "32"))
TEMPERATURE = 0.7
TOOL_DIR = REPO_ROOT / "bench" / "openai-tool"
AIPERF = TOOL_DIR / ".venv" / "bin" / "aiperf"
# aiperf's send attempts per second (the gRPC side keeps the same grid): a freed slot waits at most
# 1/PACER_RATE s for its next request, and requests freed together go out 1/PACER_RATE s apart.
PACER_RATE = 200


@dataclass(frozen=True)
class Load:
    name: str
    requests: int
    concurrency: int
    max_tokens: int

    def asks(self) -> list[tuple[str, int]]:
        """(prompt, seed) of each request, in the order both sides send them."""
        return [(p, 1000 + i) for i, p in enumerate(prompts(self.requests))]


LOADS = (
    Load("latency", LATENCY_REQUESTS, 1, LATENCY_MAX_TOKENS),
    Load("load", LOAD_REQUESTS, LOAD_CONCURRENCY, LOAD_MAX_TOKENS),
)


@dataclass
class Outcome:
    """One succeeded request; times in seconds, on one clock per phase."""

    ttft_s: float
    tokens: int
    started: float
    ended: float
    prompt_tokens: int | None = None  # the usage's, where the side reports it (bench-peer prints their mean)


@dataclass
class Phase:
    side: str
    load: str
    ok: list[Outcome]
    failed: int
    gateway_cpu_s: float = 0.0
    adapter_ttft_s: float = 0.0  # mean over the phase

    @property
    def wall_s(self) -> float:
        return max(o.ended for o in self.ok) - min(o.started for o in self.ok) if self.ok else float("nan")

    @property
    def tokens(self) -> int:
        return sum(o.tokens for o in self.ok)


# --- HTTP: aiperf -------------------------------------------------------------------------------


def write_dataset(load: Load, path: Path) -> Path:
    """aiperf's single_turn JSONL, sent in file order (sequential sampling): each line's max tokens
    (output_length, sent as max_completion_tokens) and sampling fields (extra, merged into the body)."""
    with path.open("w") as out:
        for prompt, seed in load.asks():
            line = {"text": prompt, "output_length": load.max_tokens, "extra": {"temperature": TEMPERATURE, "seed": seed}}
            out.write(json.dumps(line) + "\n")
    return path


def write_tokenizer(out_dir: Path) -> Path:
    """aiperf loads a Hugging Face tokenizer even when it counts tokens from usage, and no model hub
    is reachable: the tokenizer inside our model's GGUF, converted (bench/openai-tool/gguf_tokenizer.py)."""
    python = REPO_ROOT / "services" / "triton-local" / ".venv" / "bin" / "python"
    gguf = subprocess.run(
        [str(python), "-c", "from sluice_triton_local.model_files import smollm2_gguf; print(smollm2_gguf())"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    tool_python = TOOL_DIR / ".venv" / "bin" / "python"
    subprocess.run([str(tool_python), str(TOOL_DIR / "gguf_tokenizer.py"), gguf, str(out_dir)], capture_output=True, check=True)
    return out_dir


def http_phase(base_url: str, load: Load, dataset: Path, tokenizer: Path, artifacts: Path) -> Phase:
    command = [
        str(AIPERF), "profile",
        "--model", MODEL, "--url", base_url.removesuffix("/v1"), "--endpoint-type", "chat", "--streaming",
        "--api-key", DEMO_KEY,
        "--input-file", str(dataset), "--custom-dataset-type", "single_turn", "--dataset-sampling-strategy", "sequential",
        "--request-count", str(load.requests), "--concurrency", str(load.concurrency),
        # aiperf's pure concurrency mode (interval 0) spins a core while every slot is busy (its
        # timing manager retries in a tight loop), which on 2 cores starves the stack; a rate far
        # above what the stack serves keeps the concurrency bound and sleeps between tries instead.
        "--request-rate", str(PACER_RATE), "--arrival-pattern", "constant",
        "--warmup-request-count", str(load.concurrency), "--warmup-concurrency", str(load.concurrency),
        "--use-server-token-count", "--tokenizer", str(tokenizer),
        # The fewest processes on a 2-core machine; no GPU here, and no server metrics to scrape.
        "--workers-max", "1", "--record-processors", "1", "--no-gpu-telemetry", "--no-server-metrics",
        "--ui", "none", "--random-seed", "0", "--artifact-dir", str(artifacts),
    ]  # fmt: skip
    log_path = artifacts.with_suffix(".log")
    with log_path.open("w") as log:
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=900, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"aiperf failed ({proc.returncode}); its output: {log_path}")
    return read_records(artifacts / "profile_export.jsonl", load)


def read_records(path: Path, load: Load) -> Phase:
    """aiperf's per-request records of the profiling phase (its warmup records are left out)."""
    ok, failed = [], 0
    for line in path.read_text().splitlines():
        record = json.loads(line)
        meta, metrics = record["metadata"], record["metrics"]
        if meta["benchmark_phase"] != "profiling":
            continue
        if record.get("error") or "time_to_first_token" not in metrics or "usage_completion_tokens" not in metrics:
            failed += 1
            print(f"  http request failed: {record.get('error')}", flush=True)
            continue
        ok.append(
            Outcome(
                ttft_s=metrics["time_to_first_token"]["value"] / 1000,
                tokens=int(metrics["usage_completion_tokens"]["value"]),
                started=meta["request_start_ns"] / 1e9,
                ended=meta["request_end_ns"] / 1e9,
            )
        )
    return Phase("http", load.name, ok, failed)


# --- gRPC: grpc.aio -----------------------------------------------------------------------------


def grpc_requests(load: Load) -> list[gateway_pb2.GenerateRequest]:
    """What the HTTP front makes of aiperf's bodies (openai_requests.parse_chat)."""
    return [
        gateway_pb2.GenerateRequest(
            model=MODEL,
            messages=[types_pb2.ChatMessage(role="user", content=prompt)],
            sampling=types_pb2.SamplingParams(max_tokens=load.max_tokens, temperature=TEMPERATURE, top_p=1.0, seed=seed),
        )
        for prompt, seed in load.asks()
    ]


class Pacer:
    """At most one send per tick of a fixed PACER_RATE grid, as aiperf's constant-rate loop issues
    them: both sides offer the same arrivals. Without it the gRPC side sent the 8 requests of a
    wave in one instant, and they queued in the gateway's event loop (tens of ms of TTFT that the
    HTTP side, spread 5 ms apart, never paid)."""

    def __init__(self) -> None:
        self.interval = 1 / PACER_RATE
        self.start = time.perf_counter()
        self.next_tick = self.start

    async def wait(self) -> None:
        now = time.perf_counter()
        grid = self.start + math.ceil((now - self.start) / self.interval) * self.interval
        tick = max(self.next_tick, grid)
        self.next_tick = tick + self.interval
        if tick > now:
            await asyncio.sleep(tick - now)


async def one_grpc(stub: gateway_pb2_grpc.GatewayServiceStub, request: gateway_pb2.GenerateRequest) -> Outcome | None:
    first: float | None = None
    started = time.perf_counter()
    try:
        async for response in stub.Generate(request, metadata=AUTH, timeout=600):
            if first is None and response.text:
                first = time.perf_counter()
            if response.finish_reason:
                if response.finish_reason == types_pb2.FINISH_REASON_ERROR or first is None:
                    break
                return Outcome(first - started, response.usage.completion_tokens, started, time.perf_counter())
    except grpc.aio.AioRpcError as error:
        print(f"  grpc request failed: {error.code().name} {error.details()}", flush=True)
        return None
    print("  grpc request failed: it ended without text, or without a finish reason other than ERROR", flush=True)
    return None


async def run_bounded(
    stub: gateway_pb2_grpc.GatewayServiceStub, requests: list[gateway_pb2.GenerateRequest], concurrency: int
) -> list[Outcome | None]:
    """`concurrency` workers taking the requests in order: the next is sent when one ends, on the
    next free tick of the pacer (aiperf's)."""
    results: list[Outcome | None] = [None] * len(requests)
    order = count()
    pacer = Pacer()

    async def worker() -> None:
        while (index := next(order)) < len(requests):
            await pacer.wait()
            results[index] = await one_grpc(stub, requests[index])

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def grpc_phase(address: str, load: Load) -> Phase:
    requests = grpc_requests(load)  # built before the clock, as aiperf builds its payloads
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        await run_bounded(stub, requests[: load.concurrency], load.concurrency)  # warmup, as aiperf's
        results = await run_bounded(stub, requests, load.concurrency)
    ok = [r for r in results if r is not None]
    return Phase("grpc", load.name, ok, len(results) - len(ok))


# --- figures ------------------------------------------------------------------------------------


def process_cpu_s(pid: int) -> float:
    """user + system CPU seconds of a process so far (/proc/<pid>/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


ADAPTER_TTFT = "sluice_adapter_time_to_first_token_seconds"


def measured(stack: Stack, run: Callable[[], Phase]) -> Phase:
    gateway_pid = stack.service("gateway").process.pid  # type: ignore[union-attr]
    cpu_before = process_cpu_s(gateway_pid)
    ttft_before = histogram_totals(stack.metrics_url("inference-adapter"), ADAPTER_TTFT)
    phase = run()
    phase.gateway_cpu_s = process_cpu_s(gateway_pid) - cpu_before
    ttft_after = histogram_totals(stack.metrics_url("inference-adapter"), ADAPTER_TTFT)
    phase.adapter_ttft_s = (ttft_after[0] - ttft_before[0]) / max(ttft_after[1] - ttft_before[1], 1)
    return phase


def front_ms(phase: Phase) -> float:
    """The client's mean TTFT minus the adapter's: client, gateway and hops, not the engine."""
    return (statistics.fmean(o.ttft_s for o in phase.ok) - phase.adapter_ttft_s) * 1000 if phase.ok else float("nan")


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


@dataclass
class Side:
    ttft_p50_ms: float
    ttft_p99_ms: float
    tokens_per_s: float
    tokens: int
    ok: int
    failed: int
    gateway_cpu_us_per_token: float
    front_ms: float


def side_figures(phases: list[Phase]) -> Side:
    ttfts = [o.ttft_s * 1000 for p in phases for o in p.ok]
    tokens = sum(p.tokens for p in phases)
    wall = sum(p.wall_s for p in phases if p.ok)
    nan = float("nan")
    return Side(
        percentile(ttfts, 50) if ttfts else nan,
        percentile(ttfts, 99) if ttfts else nan,
        tokens / wall if wall else nan,
        tokens,
        sum(len(p.ok) for p in phases),
        sum(p.failed for p in phases),
        sum(p.gateway_cpu_s for p in phases) / tokens * 1e6 if tokens else nan,
        statistics.fmean(front_ms(p) for p in phases),
    )


def describe(phase: Phase) -> str:
    ttfts = [o.ttft_s * 1000 for o in phase.ok]
    p50 = percentile(ttfts, 50) if ttfts else float("nan")
    return (
        f"{phase.load:>7} {phase.side:>4}: {len(phase.ok)} ok, {phase.failed} failed, {phase.tokens} tokens in"
        f" {phase.wall_s:.2f} s = {phase.tokens / phase.wall_s:.1f} tok/s, TTFT p50 {p50:.1f} ms,"
        f" gateway CPU {phase.gateway_cpu_s:.2f} s"
        # Only one at a time: under load the warmup wave, in the adapter's mean, skews it.
        + (f", adapter TTFT mean {phase.adapter_ttft_s * 1000:.1f} ms, front {front_ms(phase):.1f} ms" if phase.load == "latency" else "")
    )


def run_rounds(stack: Stack, run_dir: Path) -> dict[tuple[str, str], list[Phase]]:
    tokenizer = write_tokenizer(run_dir / "tokenizer")
    datasets = {load.name: write_dataset(load, run_dir / f"openai-{load.name}.jsonl") for load in LOADS}
    phases: dict[tuple[str, str], list[Phase]] = {(load.name, side): [] for load in LOADS for side in ("http", "grpc")}
    for round_ in range(1, ROUNDS + 1):
        for load in LOADS:
            for side in ("http", "grpc") if round_ % 2 else ("grpc", "http"):
                if side == "http":
                    artifacts = run_dir / f"aiperf-{load.name}-round{round_}"
                    run = lambda: http_phase(stack.openai_base_url, load, datasets[load.name], tokenizer, artifacts)  # noqa: B023, E731
                else:
                    run = lambda: asyncio.run(grpc_phase(stack.gateway_address, load))  # noqa: B023, E731
                phase = measured(stack, run)
                phases[(load.name, side)].append(phase)
                print(f"round {round_} {describe(phase)}", flush=True)
    return phases


def report(phases: dict[tuple[str, str], list[Phase]]) -> None:
    figures = {key: side_figures(value) for key, value in phases.items()}
    print()
    for load in LOADS:
        http, grpc_ = figures[(load.name, "http")], figures[(load.name, "grpc")]
        print(
            f"{load.name} ({load.requests} requests x {ROUNDS} rounds, concurrency {load.concurrency}, max_tokens"
            f" {load.max_tokens}): succeeded http {http.ok} grpc {grpc_.ok}; completion tokens http {http.tokens}"
            f" grpc {grpc_.tokens}; gateway CPU per token http {http.gateway_cpu_us_per_token:.0f} us"
            f" grpc {grpc_.gateway_cpu_us_per_token:.0f} us"
            + (
                f"; front time (client TTFT - adapter TTFT, means) http {http.front_ms:.1f} ms grpc {grpc_.front_ms:.1f} ms"
                if load.name == "latency"
                else ""
            )
        )
    print()
    latency = {side: figures[("latency", side)] for side in ("http", "grpc")}
    load = {side: figures[("load", side)] for side in ("http", "grpc")}
    for side in ("http", "grpc"):
        print(f"BENCH openai_{side}_ttft_p50 {latency[side].ttft_p50_ms:.1f} ms")
        print(f"BENCH openai_{side}_ttft_p99 {latency[side].ttft_p99_ms:.1f} ms")
    for side in ("http", "grpc"):
        print(f"BENCH openai_{side}_streams{LOAD_CONCURRENCY}_ttft_p50 {load[side].ttft_p50_ms:.1f} ms")
        print(f"BENCH openai_{side}_streams{LOAD_CONCURRENCY}_ttft_p99 {load[side].ttft_p99_ms:.1f} ms")
        print(f"BENCH openai_{side}_tokens_per_s {load[side].tokens_per_s:.1f} tok/s")
        print(f"BENCH openai_{side}_gateway_cpu_per_token {load[side].gateway_cpu_us_per_token:.0f} us")
    for side in ("http", "grpc"):
        print(f"BENCH openai_{side}_front_ms {latency[side].front_ms:.1f} ms")
    for side in ("http", "grpc"):
        failed = sum(figures[(name.name, side)].failed for name in LOADS)
        print(f"BENCH openai_{side}_failed {failed} requests")
    print(f"BENCH openai_http_minus_grpc_ttft_p50 {latency['http'].ttft_p50_ms - latency['grpc'].ttft_p50_ms:.1f} ms (target <= 2)")
    print(f"BENCH openai_http_vs_grpc_tokens_per_s {load['http'].tokens_per_s / load['grpc'].tokens_per_s:.3f} x (target >= 0.95)")


def main() -> int:
    if not AIPERF.exists():
        raise SystemExit(f"{AIPERF} is missing: `make bench-openai` installs it (bench/openai-tool, uv sync --locked)")
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(os.environ.get("BENCH_RUN_DIR") or scratch)
        run_dir.mkdir(parents=True, exist_ok=True)
        stack = Stack(run_dir=run_dir, ports=StackPorts.ephemeral(), amqp_prefix=f"sluice-bench-openai-{uuid.uuid4().hex[:8]}")
        print(f"starting the stack as `make run` does; then {ROUNDS} rounds over HTTP (aiperf) and gRPC, alternating ...", flush=True)
        stack.start()
        try:
            phases = run_rounds(stack, run_dir)
        finally:
            stack.stop()
    report(phases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
