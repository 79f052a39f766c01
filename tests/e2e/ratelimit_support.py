"""Helpers of the rate-limit end-to-end tests: own replicas, a load generator, window arithmetic."""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import duration_pb2
from sluice.common.v1 import types_pb2
from sluice.ratelimit.v1 import ratelimit_pb2, ratelimit_pb2_grpc

from sluice_stack import ServiceProcess
from sluice_stack.launcher import RATELIMIT_PORT_ENV

LEASE_TTL_S = 120.0


def start_ratelimit(run_dir: Path, name: str, limits_file: Path, **env: str) -> tuple[ServiceProcess, str]:
    """A rate-limit replica of our own, on ports it binds itself; returns it and its address."""
    settings = {
        "PYTHONUNBUFFERED": "1",
        "SLUICE_RATELIMIT_PORT": "0",
        "SLUICE_RATELIMIT_METRICS_PORT": "0",
        "SLUICE_RATELIMIT_LIMITS_FILE": str(limits_file),
        "SLUICE_RATELIMIT_LOG_LEVEL": "WARNING",
        **{f"SLUICE_RATELIMIT_{key.upper()}": value for key, value in env.items()},
    }
    process = ServiceProcess(name, "sluice_rate_limit", settings, run_dir / f"{name}.log", project="rate-limit", port_env=RATELIMIT_PORT_ENV)
    process.start_ready(60)
    return process, process.address


def acquire_request(tenant: str, model: str, tokens: int, bulk: bool = False, ttl_s: float = LEASE_TTL_S) -> ratelimit_pb2.AcquireRequest:
    return ratelimit_pb2.AcquireRequest(
        tenant=tenant,
        model=model,
        priority_class=types_pb2.PRIORITY_CLASS_BULK if bulk else types_pb2.PRIORITY_CLASS_INTERACTIVE,
        requests=1,
        reserved_tokens=tokens,
        lease_ttl=duration_pb2.Duration(nanos=int((ttl_s % 1) * 1e9), seconds=int(ttl_s)),
    )


@dataclass
class Load:
    """What a hammering run offered and what was admitted, by server-side admission time."""

    offered_tokens: int = 0
    calls: int = 0
    # Acquire answers made without Redis, and commits that failed (the lease then expires)
    degraded: int = 0
    commit_errors: int = 0
    admitted: list[tuple[float, int]] = field(default_factory=list)
    # client-side time of every call
    call_times: list[float] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0

    @property
    def admitted_tokens(self) -> int:
        return sum(cost for _, cost in self.admitted)


async def hammer(
    addresses: list[str],
    tenant: str,
    model: str,
    seconds: float,
    workers: int = 24,
    cost: tuple[int, int] = (20, 200),
    bulk: bool = False,
    seed: int = 1,
    rate: float | None = None,
) -> Load:
    """Acquire calls, each admission committed in full.

    rate=None: closed loop, `workers` callers as fast as they can. rate=N: open loop, N calls per
    second at evenly spaced times whatever the answers (independent clients arriving), at most
    `workers` in flight.
    """
    load = Load(started=time.time())
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [ratelimit_pb2_grpc.RateLimitServiceStub(c) for c in channels]
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds

    async def call(stub: ratelimit_pb2_grpc.RateLimitServiceStub, tokens: int) -> None:
        load.offered_tokens += tokens
        load.calls += 1
        load.call_times.append(time.time())
        reply = await stub.Acquire(acquire_request(tenant, model, tokens, bulk), timeout=5)
        load.degraded += reply.degraded
        if reply.allowed:
            # the server's admission time: expiry minus the lease's time to live
            load.admitted.append((reply.lease_expires_at.ToNanoseconds() / 1e9 - LEASE_TTL_S, tokens))
            try:
                await stub.Commit(ratelimit_pb2.CommitRequest(lease_id=reply.lease_id, used_tokens=tokens), timeout=5)
            except grpc.aio.AioRpcError:
                load.commit_errors += 1

    async def worker(index: int) -> None:
        stub = stubs[index % len(stubs)]
        while time.monotonic() < deadline:
            await call(stub, rng.randint(*cost))

    async def paced() -> None:
        assert rate is not None
        slots = asyncio.Semaphore(workers)
        tasks: set[asyncio.Task[None]] = set()
        begin = time.monotonic()
        index = 0

        async def one(stub: ratelimit_pb2_grpc.RateLimitServiceStub, tokens: int) -> None:
            async with slots:
                await call(stub, tokens)

        while (at := begin + index / rate) < deadline:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            task = asyncio.create_task(one(stubs[index % len(stubs)], rng.randint(*cost)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            index += 1
        await asyncio.gather(*tasks)

    if rate is None:
        await asyncio.gather(*(worker(i) for i in range(workers)))
    else:
        await paced()
    load.ended = time.time()
    for channel in channels:
        await channel.close()
    load.admitted.sort()
    return load


def window_extremes(admitted: list[tuple[float, int]], window_s: float, start: float, end: float, step: float = 0.01) -> tuple[int, int]:
    """Smallest and largest total admitted in [s, s + window_s) for s from start while s + window_s <= end."""
    times = [at for at, _ in admitted]
    prefix = [0]
    for _, cost in admitted:
        prefix.append(prefix[-1] + cost)
    low, high = None, 0
    s = start
    while s + window_s <= end:
        total = prefix[bisect.bisect_left(times, s + window_s)] - prefix[bisect.bisect_left(times, s)]
        low = total if low is None else min(low, total)
        high = max(high, total)
        s += step
    assert low is not None, "the run was shorter than one window"
    return low, high


def max_any_window(admitted: list[tuple[float, int]], window_s: float) -> int:
    """The most admitted in any window of length window_s (windows starting at each admission)."""
    times = [at for at, _ in admitted]
    prefix = [0]
    for _, cost in admitted:
        prefix.append(prefix[-1] + cost)
    return max(prefix[bisect.bisect_left(times, at + window_s)] - prefix[i] for i, at in enumerate(times))
