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


async def test_a_wall_clock_stepped_back_neither_refuses_tenants_nor_misdates_leases() -> None:
    """On time.time, an hour's step back left every window entry an hour in the future: the
    tenant's whole per-minute budget stayed spent for that hour."""
    from sluice_rate_limit.budgets import Budget as B

    ticks, wall = FakeClock(500.0), FakeClock(1_000_000.0)
    backend = MemoryBackend(60.0, clock=ticks, wall_clock=wall)
    rpm = Check(B.REQUESTS_PER_MINUTE, Kind.WINDOW, "t:a:rpm", 2, 1, name="requests_per_minute")
    for _ in range(2):
        assert (await backend.acquire([rpm], True, 30, False, "m")).allowed
    wall.now -= 3600  # NTP steps the wall clock back an hour; the monotonic clock goes on
    ticks.now += 61
    decision = await backend.acquire([rpm], True, 30, False, "m")
    assert decision.allowed  # the window moved on with the monotonic clock
    assert decision.lease_expires_at == wall.now + 30  # dated on the wall clock, as callers read it
    assert await backend.renew(decision.lease_id, 45) == wall.now + 45


def test_the_default_clocks_are_monotonic_for_windows_and_wall_for_expiries() -> None:
    import time

    backend = MemoryBackend(60.0)
    assert backend._clock is time.monotonic and backend._wall_clock is time.time
