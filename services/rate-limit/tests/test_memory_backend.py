"""The in-memory backend's own bookkeeping (the shared rules are in test_backends.py)."""

from __future__ import annotations

from conftest import FakeClock

from sluice_rate_limit.budgets import Budget, Check, Kind
from sluice_rate_limit.memory_backend import MemoryBackend


def rif(limit: int) -> Check:
    return Check(Budget.REQUESTS_IN_FLIGHT, Kind.GAUGE, "t:a:rif", limit, 1, name="requests_in_flight")


async def test_settled_leases_do_not_pile_up_in_the_expiry_heap_and_live_ones_still_expire() -> None:
    clock = FakeClock()
    backend = MemoryBackend(60.0, clock=clock)
    expired: list[int] = []
    backend._on_expired = expired.append
    held = [(await backend.acquire([rif(1000)], True, 30, False, "m")).lease_id for _ in range(3)]
    for _ in range(20_000):  # a busy minute: each lease settled long before its expiry
        decision = await backend.acquire([rif(1000)], True, 600, False, "m")
        await backend.settle(decision.lease_id, 0)
    # bounded by what is in flight (3), not by the 20,000 settled in the last 600 s
    assert len(backend._expiries) <= 2 * 3 + 1024 + 1
    clock.now += 31
    assert (await backend.acquire([rif(3)], True, 30, False, "m")).allowed  # the 3 held ones expired
    assert sum(expired) == 3
    assert all(lease not in backend._leases for lease in held)
