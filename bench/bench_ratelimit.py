"""`make bench-ratelimit`: Acquire+Commit decisions per second and latency, against a raw grpc.aio echo.

One client process drives, in turn and with the same code (grpc.aio, CONCURRENCY callers on one
channel, closed loop):
  echo     a raw grpc.aio server (no interceptor, no protobuf) that returns the request bytes;
           one "decision" = two echo calls, the same two round trips as Acquire + Commit, whose
           client builds, serializes and parses the same messages inside the clock
  memory   rate-limit with the in-memory backend
  redis    rate-limit with the Redis backend (the shared Redis on 6379, a key prefix of its own)
Each server is its own process, as in production. Every decision checks every budget of
config/limits.toml's shape (the tenant's four budgets and the model's two capacity budgets), all
allowed, and commits a smaller usage than reserved (a refund).

Ends with `BENCH <name> <value> <unit>` lines. Targets: memory >= 0.8x the echo's decisions/s,
redis >= 0.5x.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc
from sluice.common.v1 import types_pb2
from sluice.ratelimit.v1 import ratelimit_pb2, ratelimit_pb2_grpc

from sluice_stack import REPO_ROOT, ServiceProcess

CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", "16"))
SECONDS = float(os.environ.get("BENCH_SECONDS", "5"))
WARMUP_S = 1.0
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
MODEL = "smollm2-135m-instruct"
LIMITS = f"""
[defaults]
requests_per_minute = 1000000000
tokens_per_minute = 1000000000000
requests_in_flight = 1000000
tokens_in_flight = 1000000000
interactive_floor = 0.25

[models."{MODEL}"]
requests_in_flight = 1000000
tokens_in_flight = 1000000000
"""
ECHO_METHOD = "/bench.Echo/Echo"


def echo_server() -> None:
    """The baseline: grpc.aio, one generic unary handler, bytes in, the same bytes out; on a port
    it binds itself, printed once it serves."""

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler("bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def acquire_request(worker: int) -> ratelimit_pb2.AcquireRequest:
    return ratelimit_pb2.AcquireRequest(
        tenant=f"bench-{worker % 4}",
        model=MODEL,
        priority_class=types_pb2.PRIORITY_CLASS_INTERACTIVE,
        requests=1,
        reserved_tokens=600,
        request_id=uuid.uuid4().hex,
    )


async def drive(address: str, kind: str) -> tuple[float, list[float]]:
    """Decisions per second and each decision's latency (s), CONCURRENCY callers for SECONDS."""
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(address) as channel:
        if kind == "echo":
            call = channel.unary_unary(ECHO_METHOD)

            # The same messages built and parsed inside the clock as on the rate-limit side.
            async def decide(worker: int) -> None:
                reply = ratelimit_pb2.AcquireRequest.FromString(await call(acquire_request(worker).SerializeToString(), timeout=5))
                commit = ratelimit_pb2.CommitRequest(lease_id=reply.request_id, used_tokens=200)
                ratelimit_pb2.CommitRequest.FromString(await call(commit.SerializeToString(), timeout=5))
        else:
            stub = ratelimit_pb2_grpc.RateLimitServiceStub(channel)

            async def decide(worker: int) -> None:
                reply = await stub.Acquire(acquire_request(worker), timeout=5)
                assert reply.allowed, reply
                await stub.Commit(ratelimit_pb2.CommitRequest(lease_id=reply.lease_id, used_tokens=200), timeout=5)

        async def worker(index: int, until: float, record: bool) -> int:
            done = 0
            while time.perf_counter() < until:
                started = time.perf_counter()
                await decide(index)
                if record:
                    latencies.append(time.perf_counter() - started)
                done += 1
            return done

        warm_until = time.perf_counter() + WARMUP_S
        await asyncio.gather(*(worker(i, warm_until, False) for i in range(CONCURRENCY)))
        started = time.perf_counter()
        counts = await asyncio.gather(*(worker(i, started + SECONDS, True) for i in range(CONCURRENCY)))
        elapsed = time.perf_counter() - started
    return sum(counts) / elapsed, latencies


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def start_ratelimit(run_dir: Path, name: str, limits: Path, **env: str) -> tuple[ServiceProcess, str]:
    settings = {
        "SLUICE_RATELIMIT_PORT": "0",
        "SLUICE_RATELIMIT_METRICS_PORT": "0",
        "SLUICE_RATELIMIT_LIMITS_FILE": str(limits),
        **{f"SLUICE_RATELIMIT_{k.upper()}": v for k, v in env.items()},
    }
    process = ServiceProcess(name, "sluice_rate_limit", settings, run_dir / f"{name}.log", project="rate-limit")
    process.start_ready(60)
    return process, process.address


def main() -> int:
    if sys.argv[1:] == ["--echo-server"]:
        echo_server()
        return 0
    run_dir = Path(tempfile.mkdtemp(prefix="sluice-bench-ratelimit-"))
    limits = run_dir / "limits.toml"
    limits.write_text(LIMITS)
    prefix = f"sluice-bench-{uuid.uuid4().hex[:8]}"
    echo = subprocess.Popen([sys.executable, __file__, "--echo-server"], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    processes: list[ServiceProcess] = []
    results: dict[str, tuple[float, list[float]]] = {}
    try:
        memory, memory_address = start_ratelimit(run_dir, "rate-limit-memory", limits)
        processes.append(memory)
        redis_rl, redis_address = start_ratelimit(run_dir, "rate-limit-redis", limits, backend="redis", redis_url=REDIS_URL, redis_prefix=prefix)
        processes.append(redis_rl)
        echo_port = int(echo.stdout.readline())  # printed once it serves
        # Interleaved (echo, memory, redis, twice) so that the shared machine's noise hits all alike.
        for round_index in range(2):
            for kind, address in (("echo", f"127.0.0.1:{echo_port}"), ("memory", memory_address), ("redis", redis_address)):
                rate, latencies = asyncio.run(drive(address, kind))
                print(
                    f"round {round_index + 1} {kind:<6} {rate:8.0f} decisions/s  p50 {percentile(latencies, 50) * 1000:.2f} ms"
                    f"  p99 {percentile(latencies, 99) * 1000:.2f} ms",
                    flush=True,
                )
                best = results.get(kind)
                if best is None or rate > best[0]:
                    results[kind] = (rate, latencies)
    finally:
        for process in processes:
            process.stop()
        echo.terminate()
        echo.wait()
        try:
            import redis

            client = redis.Redis.from_url(REDIS_URL)
            keys = list(client.scan_iter(f"{prefix}:*"))
            if keys:
                client.delete(*keys)
        except Exception as exc:  # noqa: BLE001 - cleanup only
            print(f"warning: could not remove the benchmark's Redis keys: {exc}", file=sys.stderr)
    print(f"(client: {CONCURRENCY} callers, {SECONDS:.0f} s per run, best of 2 interleaved rounds; one decision = 2 RPCs)")
    for kind, (rate, latencies) in results.items():
        print(f"BENCH ratelimit_{kind}_decisions_per_s {rate:.0f} decisions/s")
        print(f"BENCH ratelimit_{kind}_latency_p50 {percentile(latencies, 50) * 1000:.3f} ms")
        print(f"BENCH ratelimit_{kind}_latency_p99 {percentile(latencies, 99) * 1000:.3f} ms")
    echo_rate = results["echo"][0]
    print(f"BENCH ratelimit_memory_vs_echo {results['memory'][0] / echo_rate:.2f} x (target >= 0.8)")
    print(f"BENCH ratelimit_redis_vs_echo {results['redis'][0] / echo_rate:.2f} x (target >= 0.5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
