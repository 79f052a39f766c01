"""rate-limit, the real service in its own processes: the acceptance criteria of the in-memory backend.

These tests start their own rate-limit replicas with their own limits file and a short window
(10 s instead of a minute) and talk to them over gRPC; nothing is mocked.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2
from sluice.ratelimit.v1 import ratelimit_pb2, ratelimit_pb2_grpc

from conftest import wait_for
from ratelimit_support import acquire_request, hammer, max_any_window, start_ratelimit, window_extremes

WINDOW_S = 10.0
LIMITS = """
[tenants.heavy]
tokens_per_minute = 40000

[tenants.refund]
tokens_per_minute = 1000
burst = 1.0

[tenants.expiry]
requests_in_flight = 1

[tenants.renewed]
requests_in_flight = 1

[tenants.mixed]
tokens_per_minute = 10000
interactive_floor = 0.3
"""


@pytest.fixture(scope="module")
def limiter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    run_dir = tmp_path_factory.mktemp("ratelimit")
    limits = run_dir / "limits.toml"
    limits.write_text(LIMITS)
    process, address = start_ratelimit(run_dir, "rate-limit-e2e", limits, window_s=str(WINDOW_S), reload_interval_s="0.2")
    yield address, limits
    process.stop()


@pytest.fixture()
def stub(limiter: tuple[str, Path]) -> Iterator[ratelimit_pb2_grpc.RateLimitServiceStub]:
    with grpc.insecure_channel(limiter[0]) as channel:
        yield ratelimit_pb2_grpc.RateLimitServiceStub(channel)


@pytest.mark.parametrize("loop", ["open", "closed"])
def test_oversubscribed_tokens_hold_the_limit_in_every_sliding_window(limiter, loop: str) -> None:
    """open: 12x the limit offered by independent clients (calls at evenly spaced times, 20-200 tokens
    each, whatever the answers). closed: 24 callers as fast as this machine lets them (~30x)."""
    limit, seconds = 40000, 2.3 * WINDOW_S
    rate = 12 * limit / WINDOW_S / 110 if loop == "open" else None
    load = asyncio.run(hammer([limiter[0]], "heavy", "m", seconds, rate=rate))
    offered_per_window = load.offered_tokens / (load.ended - load.started) * WINDOW_S
    assert offered_per_window >= 10 * limit, f"only {offered_per_window / limit:.1f}x oversubscribed"
    first = load.admitted[0][0]
    # No window of the period, anywhere (edges included), ever holds more than the limit.
    assert max_any_window(load.admitted, WINDOW_S) <= limit
    # Once the first window has filled, every window holds the limit within 3%.
    low, high = window_extremes(load.admitted, WINDOW_S, first, load.ended - 0.05)
    print(f"oversubscription {offered_per_window / limit:.1f}x; admitted per {WINDOW_S:.0f}s window: {low}..{high} of {limit}")
    assert 0.97 * limit <= low <= high <= limit


def test_a_refund_is_usable_at_once(stub) -> None:
    first = stub.Acquire(acquire_request("refund", "m", 800), timeout=5)
    assert first.allowed
    assert not stub.Acquire(acquire_request("refund", "m", 500), timeout=5).allowed
    committed = stub.Commit(ratelimit_pb2.CommitRequest(lease_id=first.lease_id, used_tokens=100), timeout=5)
    assert committed.budgets[0].remaining == 900
    assert stub.Acquire(acquire_request("refund", "m", 500), timeout=5).allowed


def test_an_expired_lease_frees_its_capacity(stub) -> None:
    held = stub.Acquire(acquire_request("expiry", "m", 10, ttl_s=3), timeout=5)
    assert held.allowed
    denied = stub.Acquire(acquire_request("expiry", "m", 10), timeout=5)
    assert not denied.allowed and denied.denied_by == ratelimit_pb2.BUDGET_REQUESTS_IN_FLIGHT
    assert denied.retry_after.ToNanoseconds() > 0
    # Never committed: once its TTL has passed the lease expires and its place is free again.
    wait_for(lambda: stub.Acquire(acquire_request("expiry", "m", 10, ttl_s=1), timeout=5).allowed, "the lease to expire")
    with pytest.raises(grpc.RpcError) as caught:
        stub.Commit(ratelimit_pb2.CommitRequest(lease_id=held.lease_id, used_tokens=1), timeout=5)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_renewed_lease_keeps_its_place_past_its_first_expiry(stub) -> None:
    held = stub.Acquire(acquire_request("renewed", "m", 10, ttl_s=1.5), timeout=5)
    assert held.allowed and held.lease_ttl.ToNanoseconds() == 1_500_000_000
    for _ in range(3):  # 3 s in all: twice the first TTL
        time.sleep(1.0)
        renewed = stub.Renew(
            ratelimit_pb2.RenewRequest(lease_id=held.lease_id, lease_ttl=duration_pb2.Duration(seconds=1, nanos=500_000_000)), timeout=5
        )
        assert renewed.lease_ttl.ToNanoseconds() == 1_500_000_000
    assert not stub.Acquire(acquire_request("renewed", "m", 10, ttl_s=1), timeout=5).allowed  # still in flight
    capped = stub.Renew(ratelimit_pb2.RenewRequest(lease_id=held.lease_id, lease_ttl=duration_pb2.Duration(seconds=100_000)), timeout=5)
    assert capped.lease_ttl.seconds == 600  # the server's maximum
    stub.Commit(ratelimit_pb2.CommitRequest(lease_id=held.lease_id, used_tokens=10), timeout=5)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Renew(ratelimit_pb2.RenewRequest(lease_id=held.lease_id), timeout=5)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert stub.Acquire(acquire_request("renewed", "m", 10, ttl_s=1), timeout=5).allowed


def test_bulk_saturating_a_tenant_leaves_the_interactive_floor(limiter) -> None:
    limit, floor = 10000, 3000

    async def scenario() -> tuple[int, int]:
        bulk = asyncio.create_task(hammer([limiter[0]], "mixed", "m", 2.0, workers=8, cost=(200, 400), bulk=True))
        await asyncio.sleep(1.0)  # bulk has taken everything it may by now
        async with grpc.aio.insecure_channel(limiter[0]) as channel:
            stub = ratelimit_pb2_grpc.RateLimitServiceStub(channel)
            interactive = 0
            for _ in range(12):
                reply = await stub.Acquire(acquire_request("mixed", "m", 500), timeout=5)
                interactive += 500 if reply.allowed else 0
        load = await bulk
        return load.admitted_tokens, interactive

    bulk_tokens, interactive_tokens = asyncio.run(scenario())
    assert bulk_tokens <= limit - floor
    assert interactive_tokens >= floor


def test_a_malformed_limits_file_is_rejected_and_the_old_limits_stay(limiter, stub) -> None:
    address, limits = limiter
    before = stub.GetUsage(ratelimit_pb2.GetUsageRequest(), timeout=5)
    assert before.limits_error == ""
    replace_file(limits, LIMITS.replace("tokens_per_minute = 1000", "tokens_per_minute = 'a lot'") + "\n[tenants.expiry\n")
    deadline = time.monotonic() + 10
    while (usage := stub.GetUsage(ratelimit_pb2.GetUsageRequest(), timeout=5)).limits_error == "":
        assert time.monotonic() < deadline, "the bad file was not noticed"
        time.sleep(0.1)
    assert "TOML" in usage.limits_error
    assert usage.limits_version == before.limits_version
    # the old limits are in force: tenant "refund" still has 1000 tokens per window
    assert not stub.Acquire(acquire_request("refund", "m", 1001), timeout=5).allowed
    # a good file is applied
    replace_file(limits, LIMITS.replace("tokens_per_minute = 1000", "tokens_per_minute = 5000"))
    deadline = time.monotonic() + 10
    while (usage := stub.GetUsage(ratelimit_pb2.GetUsageRequest(), timeout=5)).limits_version == before.limits_version:
        assert time.monotonic() < deadline, "the good file was not applied"
        time.sleep(0.1)
    assert usage.limits_error == ""
    assert stub.Acquire(acquire_request("refund", "m", 1001), timeout=5).allowed


def replace_file(path: Path, text: str) -> None:
    """Writes `text` to `path` in one step, as an operator's tooling would: the service, re-reading
    the file every 0.2 s, must never see it half written (an empty file is valid TOML)."""
    staged = path.with_suffix(".staged")
    staged.write_text(text)
    os.replace(staged, path)
