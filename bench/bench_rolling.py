"""`make bench-rolling`: a rolling restart of gateway, inference-adapter and evaluation-logging
while 32 chat streams run, as a cluster rolls a deploy: two processes of each (the launcher's
`service_replicas`), restarted one at a time (SIGTERM, wait for its exit, start it, wait until it
serves), gateways first, then adapters, then evaluation-logging. One triton-local, rate-limit and
the job worker stay up.

The client is what docs/operators/configuration.md recommends for several gateways: one channel naming every gateway,
round robin over those whose gRPC health says SERVING (a draining gateway gets no new stream).
32 workers each send one stream after another (the demo key, greedy, MAX_TOKENS each); a stream
refused by the rate limiter (RESOURCE_EXHAUSTED) is retried after its RetryInfo, as bench-load's
client does. Every stream is counted in one phase, by when it was in flight (`phase_of`):

  before   ended before the first SIGTERM (BEFORE_S of steady load: the baseline, same client, same run)
  during   in flight at some time from the first SIGTERM until the last restarted process serves
           again, those already running at the first SIGTERM included
  after    sent once every restarted process served again

  rolling_streams_failed  streams in flight during the rolling restart that ended in an error, or without a finish reason
  rolling_events_lost     streams that ended with a finish reason (either phase) whose completion
                          event is not in the evaluation store LOST_WAIT_S after the load stopped
  TTFT p50/p99            stream sent -> first token, before vs during (inclusive percentiles, never
                          past the slowest stream; before 2026-12-07 the exclusive method, which
                          reaches past it when a phase has fewer than 99 streams)
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from bench_load import retry_after_s  # the RetryInfo a well-behaved client waits for
from sluice_stack import Stack, StackPorts

MODEL = "smollm2-135m-instruct"
AUTH = (("authorization", "Bearer sk-sluice-demo"),)
STREAMS = int(os.environ.get("BENCH_STREAMS", "32"))
MAX_TOKENS = int(os.environ.get("BENCH_MAX_TOKENS", "48"))
BEFORE_S = float(os.environ.get("BENCH_BEFORE_S", "40"))
LOST_WAIT_S = 120.0
ROLL_ORDER = ("gateway", "inference-adapter", "evaluation-logging")
# A client of several gateways: round robin over those whose health says SERVING.
CLIENT_OPTIONS = [
    ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}})),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


@dataclass
class Stream:
    # time.monotonic() when it was sent and when it ended.
    sent_at: float
    ended_at: float = 0.0
    ttft_s: float | None = None
    request_id: str = ""
    finished: bool = False
    error: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.error) or not self.finished


def phase_of(stream: Stream, rolling: tuple[float, float]) -> str:
    """'before' when it ended before the rolling restart began (the first SIGTERM), 'after' when it
    was sent once it was over, 'during' when it was in flight at any time of it: a stream sent
    before the first SIGTERM and cut by it is the restart's failure, not the baseline's."""
    began, ended = rolling
    if stream.ended_at < began:
        return "before"
    if stream.sent_at >= ended:
        return "after"
    return "during"


def failed_during(streams: list[Stream], rolling: tuple[float, float]) -> int:
    """rolling_streams_failed: streams in flight during the rolling restart that failed."""
    return sum(1 for s in streams if phase_of(s, rolling) == "during" and s.failed)


async def one_stream(stub: gateway_pb2_grpc.GatewayServiceStub, worker: int) -> Stream:
    request = gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content=f"Write a short note to friend number {worker}.")],
        sampling=types_pb2.SamplingParams(max_tokens=MAX_TOKENS),
    )
    stream, sent = Stream(time.monotonic()), time.perf_counter()
    try:
        return await _receive(stub, request, stream, sent)
    finally:
        stream.ended_at = time.monotonic()


async def _receive(stub: gateway_pb2_grpc.GatewayServiceStub, request: gateway_pb2.GenerateRequest, stream: Stream, sent: float) -> Stream:
    while True:
        try:
            # wait_for_ready: a stream sent while no gateway is ready to this channel (one back from its
            # restart, not reconnected yet; the next draining) waits for one, as the docs advise clients.
            async for response in stub.Generate(request, metadata=AUTH, timeout=300, wait_for_ready=True):
                stream.request_id = stream.request_id or response.request_id
                if stream.ttft_s is None and response.text:
                    stream.ttft_s = time.perf_counter() - sent
                if response.finish_reason:
                    stream.finished = response.finish_reason != types_pb2.FINISH_REASON_ERROR
            if not stream.finished:
                stream.error = "ended without a finish reason"
            return stream
        except grpc.aio.AioRpcError as error:
            delay = retry_after_s(error) if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
            if delay is None or stream.ttft_s is not None:
                stream.error = f"{error.code().name}: {error.details()}"
                return stream
            await asyncio.sleep(delay)


class Load:
    """STREAMS workers sending streams back to back."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.streams: list[Stream] = []
        self._stop = threading.Event()

    async def _worker(self, stub: gateway_pb2_grpc.GatewayServiceStub, worker: int) -> None:
        while not self._stop.is_set():
            self.streams.append(await one_stream(stub, worker))

    async def _run(self) -> None:
        async with grpc.aio.insecure_channel(self.target, options=CLIENT_OPTIONS) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            await asyncio.gather(*(self._worker(stub, worker) for worker in range(STREAMS)))

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=asyncio.run, args=(self._run(),), daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()


def roll(stack: Stack) -> list[tuple[str, float, float]]:
    """Restarts every replica of each service in ROLL_ORDER, one at a time; (name, the SIGTERM's
    time.monotonic(), seconds until it served again) each."""
    took = []
    for service in ROLL_ORDER:
        for name in stack.replica_names(service):
            process, started = stack.service(name), time.monotonic()
            process.terminate()
            assert process.process is not None
            try:
                code = process.process.wait(180)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"{name} did not exit within 180 s of SIGTERM:\n{process.log_tail(40)}") from None
            process.start_ready(300)
            took.append((name, started, time.monotonic() - started))
            print(f"  {name}: exited {code} after its drain, serving again after {took[-1][2]:.1f} s", flush=True)
    return took


def stored(stack: Stack, request_ids: set[str]) -> set[str]:
    db = sqlite3.connect(f"file:{stack.run_dir / 'evallog.sqlite3'}?mode=ro", uri=True, timeout=30)
    try:
        found = set()
        ids = sorted(request_ids)
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            marks = ",".join("?" * len(chunk))
            found |= {row[0] for row in db.execute(f"SELECT request_id FROM records WHERE request_id IN ({marks})", chunk)}
        return found
    finally:
        db.close()


def percentile(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    # Inclusive: the exclusive method extrapolates past the largest sample when there are fewer than 99.
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> int:
    # BENCH_RUN_DIR keeps the services' logs (a temporary folder otherwise).
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = os.environ.get("BENCH_RUN_DIR") or scratch
        stack = Stack(
            run_dir=Path(run_dir), ports=StackPorts.ephemeral(), service_replicas=2,
            amqp_prefix=f"sluice-bench-rolling-{uuid.uuid4().hex[:8]}",
        )  # fmt: skip
        print("starting two processes each of gateway, inference-adapter and evaluation-logging ...", flush=True)
        stack.start()
        try:
            load = Load(stack.gateway_target)
            thread = load.start()
            time.sleep(BEFORE_S)
            print(f"rolling restart under {STREAMS} streams:", flush=True)
            began = time.monotonic()
            took = roll(stack)
            rolling = (began, time.monotonic())
            load.stop()
            thread.join(600)
            ended = [s for s in load.streams if s.finished]
            request_ids = {s.request_id for s in ended}
            deadline = time.monotonic() + LOST_WAIT_S
            while (missing := request_ids - stored(stack, request_ids)) and time.monotonic() < deadline:
                time.sleep(1)
        finally:
            stack.stop()
    report(load.streams, rolling, missing, took)
    return 0


def failures_by_restart(streams: list[Stream], took: list[tuple[str, float, float]]) -> dict[str, int]:
    """Failed streams by the restart they ended in (its SIGTERM until it served again), else
    'between': which service's restart a client felt."""
    counts: dict[str, int] = {}
    for s in (s for s in streams if s.failed):
        name = next((n for n, at, took_s in took if at <= s.ended_at <= at + took_s), "between")
        counts[name] = counts.get(name, 0) + 1
    return counts


def report(streams: list[Stream], rolling: tuple[float, float], missing: set[str], took: list[tuple[str, float, float]]) -> None:
    phases = {phase: [s for s in streams if phase_of(s, rolling) == phase] for phase in ("before", "during", "after")}
    for phase, mine in phases.items():
        if not mine:
            continue
        failed = [s for s in mine if s.failed]
        ttfts = [s.ttft_s for s in mine if s.finished and s.ttft_s is not None]
        print(
            f"{phase:>6}: {len(mine)} streams, {len(failed)} failed, TTFT p50 {percentile(ttfts, 50) * 1000:.0f} ms p99 {percentile(ttfts, 99) * 1000:.0f} ms",
            flush=True,
        )
        for error in sorted({s.error for s in failed})[:5]:
            print(f"        {error}", flush=True)
    if by_restart := failures_by_restart(phases["during"], took):
        print("failed streams by the restart they ended in: " + ", ".join(f"{n} {c}" for n, c in by_restart.items()), flush=True)
    before = [s.ttft_s for s in phases["before"] if s.finished and s.ttft_s is not None]
    during = [s.ttft_s for s in phases["during"] if s.finished and s.ttft_s is not None]
    print(f"BENCH rolling_restarts {len(took)}")
    print(f"BENCH rolling_seconds {sum(t for _, _, t in took):.1f}")
    print(f"BENCH rolling_streams_during {len(phases['during'])}")
    print(f"BENCH rolling_streams_failed {failed_during(streams, rolling)}")
    print(f"BENCH rolling_events_lost {len(missing)}")
    print(f"BENCH rolling_ttft_p99_before_ms {percentile(before, 99) * 1000:.0f}")
    print(f"BENCH rolling_ttft_p99_during_ms {percentile(during, 99) * 1000:.0f}")
    print(f"BENCH rolling_ttft_p99_during_vs_before {percentile(during, 99) / percentile(before, 99):.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
