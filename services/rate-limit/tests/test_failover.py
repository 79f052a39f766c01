"""Redis unreachable: a timeout, the circuit breaker, and each budget's failure policy."""

from __future__ import annotations

import time

from conftest import free_port

from sluice_rate_limit.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from sluice_rate_limit.budgets import Budget, Check, Kind, Policy
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
    await backend.settle(decisions[0].lease_id, 0)
    assert backend.breaker.state == OPEN  # no Redis call was waited for once open
    await backend.close()
