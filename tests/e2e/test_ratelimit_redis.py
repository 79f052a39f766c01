"""rate-limit on Redis: two replicas hold one global limit; Redis stopped mid-test applies the policy.

The replicas are our own processes; the global-limit test uses the shared Redis on 6379 under a
key prefix of its own, the outage test a redis-server of its own that it kills (never the shared one).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import grpc
import pytest
import redis
from sluice.ratelimit.v1 import ratelimit_pb2, ratelimit_pb2_grpc

from ratelimit_support import acquire_request, hammer, max_any_window, start_ratelimit, window_extremes

WINDOW_S = 10.0
SHARED_REDIS = "redis://127.0.0.1:6379/0"


def test_two_replicas_on_redis_hold_one_global_limit(tmp_path: Path) -> None:
    limit = 40000
    limits = tmp_path / "limits.toml"
    limits.write_text(f"[tenants.global]\ntokens_per_minute = {limit}\n")
    prefix = f"sluice-e2e-rl-{uuid.uuid4().hex[:8]}"
    # On this shared 2-core machine a starved event loop now and then sees a Redis call pass the
    # 100 ms timeout; a breaker that opens after 3 of them would make this a test of the outage
    # policy (the next test's subject) instead of the global limit.
    settings = dict(backend="redis", redis_url=SHARED_REDIS, redis_prefix=prefix, replicas="2", window_s=str(WINDOW_S), breaker_failures="50")
    first, address_1 = start_ratelimit(tmp_path, "rate-limit-a", limits, **settings)
    try:
        second, address_2 = start_ratelimit(tmp_path, "rate-limit-b", limits, **settings)
        try:
            load = asyncio.run(hammer([address_1, address_2], "global", "m", 2.3 * WINDOW_S, rate=12 * limit / WINDOW_S / 110))
        finally:
            second.stop()
    finally:
        first.stop()
        client = redis.Redis.from_url(SHARED_REDIS)
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)
    assert max_any_window(load.admitted, WINDOW_S) <= limit
    low, high = window_extremes(load.admitted, WINDOW_S, load.admitted[0][0], load.ended - 0.05)
    print(f"two replicas: admitted per {WINDOW_S:.0f}s window {low}..{high} of {limit}; degraded answers {load.degraded}")
    assert 0.97 * limit <= low <= high <= limit


@pytest.fixture()
def own_redis(tmp_path: Path):  # type: ignore[no-untyped-def]
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    # A unix socket rather than a TCP port probed free, which another process could take first
    # (a short directory: socket paths are limited to ~100 bytes).
    sockets = Path(tempfile.mkdtemp(prefix="sluice-redis-"))
    path = sockets / "redis.sock"

    def start() -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", str(path), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(unix_socket_path=str(path), socket_timeout=0.5).ping()
                return process
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    state = {"process": start()}

    class Handle:
        url = f"unix://{path}?db=0"

        @staticmethod
        def kill() -> None:
            state["process"].kill()
            state["process"].wait()

        @staticmethod
        def restart() -> None:
            state["process"] = start()

    yield Handle
    if state["process"].poll() is None:
        state["process"].kill()
        state["process"].wait()
    shutil.rmtree(sockets, ignore_errors=True)


LIMITS = """
[failure_policy]
requests_per_minute = "closed"
requests_in_flight = "open"

[tenants.strict]
requests_per_minute = 1000
burst = 1.0

[tenants.lenient]
requests_in_flight = 4
"""


def test_redis_stopped_mid_test_applies_each_budgets_policy_within_the_deadline(tmp_path: Path, own_redis) -> None:
    limits = tmp_path / "limits.toml"
    limits.write_text(LIMITS)
    replica, address = start_ratelimit(
        tmp_path, "rate-limit-outage", limits, backend="redis", redis_url=own_redis.url, replicas="2", breaker_open_s="1.0"
    )
    try:
        with grpc.insecure_channel(address) as channel:
            stub = ratelimit_pb2_grpc.RateLimitServiceStub(channel)
            healthy = stub.Acquire(acquire_request("strict", "m", 10), timeout=2)
            assert healthy.allowed and not healthy.degraded
            lenient = stub.Acquire(acquire_request("lenient", "m", 10), timeout=2)
            assert lenient.allowed and not lenient.degraded

            own_redis.kill()
            deadline_s, slowest = 0.5, 0.0
            strict_replies, lenient_replies = [], []
            for _ in range(20):
                for tenant, replies in (("strict", strict_replies), ("lenient", lenient_replies)):
                    started = time.perf_counter()
                    replies.append(stub.Acquire(acquire_request(tenant, "m", 10), timeout=deadline_s))  # raises past it
                    slowest = max(slowest, time.perf_counter() - started)
            assert slowest < deadline_s
            # fail-closed: refused, marked degraded
            assert all(not r.allowed and r.degraded for r in strict_replies)
            assert strict_replies[0].denied_by == ratelimit_pb2.BUDGET_REQUESTS_PER_MINUTE
            # fail-open: the local limit is 4 / 2 replicas = 2 in flight
            assert [r.allowed for r in lenient_replies[:3]] == [True, True, False]
            assert all(r.degraded for r in lenient_replies)
            # a local lease settles locally
            stub.Commit(ratelimit_pb2.CommitRequest(lease_id=lenient_replies[0].lease_id, used_tokens=1), timeout=deadline_s)

            own_redis.restart()  # an empty Redis: the breaker probes it and decisions go back to it
            deadline = time.monotonic() + 10
            while (reply := stub.Acquire(acquire_request("strict", "m", 10), timeout=deadline_s)).degraded:
                assert time.monotonic() < deadline, "decisions did not go back to Redis"
                time.sleep(0.2)
            assert reply.allowed
    finally:
        replica.stop()
