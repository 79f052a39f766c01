"""Redis unreachable: a timeout, the circuit breaker, and each budget's failure policy."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from conftest import REDIS_URL, delete_keys, free_port
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError

from sluice_rate_limit import failover
from sluice_rate_limit.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from sluice_rate_limit.budgets import BackendUnavailable, Budget, Check, Kind, Policy
from sluice_rate_limit.failover import FailoverBackend
from sluice_rate_limit.redis_backend import RedisBackend


def check(policy: Policy, limit: int = 10, budget: Budget = Budget.REQUESTS_PER_MINUTE) -> Check:
    return Check(budget, Kind.WINDOW, "t:a:rpm", limit, 1, policy=policy, name="requests_per_minute")


def dead_redis(replicas: int = 2) -> FailoverBackend:
    primary = RedisBackend(f"redis://127.0.0.1:{free_port()}/0", "test:dead", 10.0, timeout_s=0.1)
    return FailoverBackend(primary, CircuitBreaker(2, 0.5), replicas=replicas, timeout_s=0.1)


def test_breaker_opens_after_failures_and_probes_once_when_half_open() -> None:
    now = [0.0]
    breaker = CircuitBreaker(2, 1.0, clock=lambda: now[0])
    breaker.failure()
    assert breaker.state == CLOSED and breaker.allow()
    breaker.failure()
    assert breaker.state == OPEN and not breaker.allow()
    now[0] = 1.5
    assert breaker.allow() and breaker.state == HALF_OPEN
    assert not breaker.allow()  # one probe at a time
    breaker.failure()
    assert breaker.state == OPEN
    now[0] = 3.0
    assert breaker.allow()
    breaker.success()
    assert breaker.state == CLOSED


async def test_fail_closed_refuses_at_once_and_marks_the_decision_degraded() -> None:
    backend = dead_redis()
    started = time.perf_counter()
    decision = await backend.acquire([check(Policy.CLOSED)], True, 30, False, "m")
    assert time.perf_counter() - started < 0.5
    assert not decision.allowed and decision.degraded and decision.denied_by == Budget.REQUESTS_PER_MINUTE
    await backend.close()


async def test_fail_open_falls_back_to_limit_over_replicas_and_settles_locally() -> None:
    backend = dead_redis(replicas=2)
    decisions = [await backend.acquire([check(Policy.OPEN, limit=10)], True, 30, False, "m") for _ in range(7)]
    assert [d.allowed for d in decisions] == [True] * 5 + [False] * 2  # 10 / 2 replicas
    assert all(d.degraded for d in decisions)
    assert decisions[0].lease_id.startswith("local-")
    assert await backend.renew(decisions[0].lease_id, 60) > decisions[0].lease_expires_at  # local leases renew locally
    await backend.settle(decisions[0].lease_id, 0)
    assert backend.breaker.state == OPEN  # no Redis call was waited for once open
    await backend.close()


async def test_a_probe_that_ends_without_a_verdict_never_holds_the_breaker_half_open() -> None:
    """The half-open probe used to stay taken when it ended neither in success nor in failure: a
    Commit of a lease already settled (Redis answered, LeaseNotFound) or a caller cancelled at its
    own deadline. No call reached Redis again, and every fail-closed budget refused until a restart."""
    import asyncio
    import uuid

    import pytest
    from conftest import REDIS_URL, delete_keys

    from sluice_rate_limit.budgets import LeaseNotFound

    now = [0.0]
    prefix = f"test:rl:{uuid.uuid4().hex[:8]}"
    primary = RedisBackend(REDIS_URL, prefix, 10.0, timeout_s=0.1)
    backend = FailoverBackend(primary, CircuitBreaker(1, 1.0, clock=lambda: now[0]), replicas=1, timeout_s=0.5)
    try:
        backend.breaker.failure()  # Redis was unreachable a moment ago
        now[0] = 2.0
        with pytest.raises(LeaseNotFound):
            await backend.settle("a-lease-settled-long-ago.m", 0)  # the probe: Redis answers "unknown lease"
        assert backend.breaker.state == CLOSED

        backend.breaker.failure()
        now[0] = 4.0

        async def never_answers() -> None:
            await asyncio.Event().wait()

        probe = asyncio.create_task(backend._call("acquire", never_answers()))
        await asyncio.sleep(0.01)
        probe.cancel()  # the gateway gave up on its Acquire
        with pytest.raises(asyncio.CancelledError):
            await probe
        decision = await backend.acquire([check(Policy.CLOSED)], True, 30, False, "m")  # the next call probes Redis
        assert decision.allowed and not decision.degraded and backend.breaker.state == CLOSED
    finally:
        await delete_keys(prefix)
        await backend.close()


class SlowReply(RedisBackend):
    """Redis runs the script; its reply comes 0.3 s later, after the caller's timeout or cancel
    (the pipeline drops it)."""

    async def acquire(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        granted = asyncio.ensure_future(super().acquire(*args, **kwargs))
        await asyncio.sleep(0.3)
        return await granted


ONE_IN_FLIGHT = Check(Budget.REQUESTS_IN_FLIGHT, Kind.GAUGE, "t:a:rif", 1, 1, policy=Policy.CLOSED, name="requests_in_flight")


@contextlib.asynccontextmanager
async def slow_replies(timeout_s: float) -> AsyncIterator[tuple[SlowReply, FailoverBackend]]:
    """A failover backend over SlowReply on the real Redis, orphaned leases released 0.4 s on."""
    prefix = f"test:rl:{uuid.uuid4().hex[:8]}"
    primary = SlowReply(REDIS_URL, prefix, 10.0, timeout_s=0.1)
    backend = FailoverBackend(primary, CircuitBreaker(5, 0.5), replicas=1, timeout_s=timeout_s)
    saved = failover.ORPHAN_RELEASE_DELAYS_S
    failover.ORPHAN_RELEASE_DELAYS_S = (0.4,)
    try:
        yield primary, backend
    finally:
        failover.ORPHAN_RELEASE_DELAYS_S = saved
        await delete_keys(prefix)
        await backend.close()


async def freed_again(primary: SlowReply) -> bool:
    """Whether the one in-flight slot is free again within 10 s (the orphan released at Redis)."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        later = await RedisBackend.acquire(primary, [ONE_IN_FLIGHT], True, 600, False, "m")
        if later.allowed or asyncio.get_running_loop().time() > deadline:
            return later.allowed
        await asyncio.sleep(0.1)


async def test_a_lease_redis_granted_after_the_acquire_timed_out_is_released() -> None:
    """The timeout cancels the caller, not the script Redis already has: its lease held an
    in-flight slot for its whole TTL beside the decision made without Redis."""
    async with slow_replies(timeout_s=0.1) as (primary, backend):
        lost = await backend.acquire([ONE_IN_FLIGHT], True, 600, False, "m")
        assert not lost.allowed and lost.degraded  # decided without Redis: fail-closed
        assert await freed_again(primary)


async def test_a_lease_redis_granted_to_an_acquire_its_caller_cancelled_is_released() -> None:
    """The caller gave up (its deadline cancelled the handler) after Redis had the script."""
    async with slow_replies(timeout_s=1.0) as (primary, backend):
        caller = asyncio.ensure_future(backend.acquire([ONE_IN_FLIGHT], True, 600, False, "m"))
        await asyncio.sleep(0.15)  # the script has run at Redis; its reply is on its way
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        assert backend.breaker.state == CLOSED  # a caller gone says nothing about Redis
        assert await freed_again(primary)


async def test_a_script_error_is_redis_answering_not_redis_unreachable() -> None:
    """A Commit whose settle script failed ("value is not an integer") counted as Redis unreachable:
    three of them opened the circuit for every tenant. It fails that call alone now (INTERNAL)."""
    prefix = f"test:rl:{uuid.uuid4().hex[:8]}"
    primary = RedisBackend(REDIS_URL, prefix, 10.0, timeout_s=0.1)
    backend = FailoverBackend(primary, CircuitBreaker(1, 60.0), replicas=1, timeout_s=0.5)
    try:
        lease = await backend.acquire([check(Policy.CLOSED)], True, 30, False, "m")
        with pytest.raises(ResponseError):
            await backend.settle(lease.lease_id, 2**63 - 1)  # past the limiter's bound: what a bug would send
        assert backend.breaker.state == CLOSED
        other = await backend.acquire([check(Policy.CLOSED)], True, 30, False, "m")
        assert other.allowed and not other.degraded
        assert await backend.settle(lease.lease_id, 5)  # the failed settle changed nothing
    finally:
        await delete_keys(prefix)
        await backend.close()


async def test_error_replies_that_refuse_every_call_are_an_outage() -> None:
    """Out of memory, busy in a script, a read-only replica: Redis cannot decide, as if unreachable."""
    backend = FailoverBackend(RedisBackend(REDIS_URL, "test:unused", 10.0), CircuitBreaker(3, 60.0), replicas=1, timeout_s=0.5)

    async def fails(exc: Exception) -> None:
        raise exc

    for exc in (OutOfMemoryError("command not allowed"), ResponseError("BUSY Redis is busy running a script"), ReadOnlyError("replica")):
        with pytest.raises(BackendUnavailable):
            await backend._call("settle", fails(exc))
    assert backend.breaker.state == OPEN
    await backend.close()


async def test_expiries_of_local_leases_are_counted() -> None:
    expired: list[int] = []
    primary = RedisBackend(f"redis://127.0.0.1:{free_port()}/0", "test:dead", 10.0, timeout_s=0.1, on_expired=expired.append)
    backend = FailoverBackend(primary, CircuitBreaker(2, 0.5), replicas=1, timeout_s=0.1)
    local = await backend.acquire([check(Policy.OPEN)], True, 0.05, False, "m")
    assert local.lease_id.startswith("local-")
    await asyncio.sleep(0.1)
    await backend.acquire([check(Policy.OPEN)], True, 30, False, "m")
    assert expired == [1]
    await backend.close()
