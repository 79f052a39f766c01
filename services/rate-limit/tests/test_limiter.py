"""The RateLimiter: shadow mode, validation, unknown leases."""

from __future__ import annotations

import pytest
from conftest import FakeClock

from sluice_common.errors import InvalidArgument, NotFound
from sluice_rate_limit.limiter import RateLimiter
from sluice_rate_limit.limits import parse_limits
from sluice_rate_limit.memory_backend import MemoryBackend


def limiter(text: str) -> RateLimiter:
    limits = parse_limits(text)
    return RateLimiter(lambda: limits, MemoryBackend(10.0, clock=FakeClock()), max_lease_ttl_s=60)


async def test_shadow_mode_decides_and_records_but_never_denies() -> None:
    rl = limiter("[tenants.a]\nrequests_per_minute = 2\nburst = 1.0\nshadow = true\n")
    decisions = [await rl.acquire("a", "m", True, 1, 10) for _ in range(4)]
    assert all(d.allowed for d in decisions)
    assert [d.shadow for d in decisions] == [False, False, True, True]
    assert decisions[3].lease_id == "" and decisions[3].denied_name == "requests_per_minute"


async def test_enforced_denial_and_unlimited_tenant() -> None:
    rl = limiter("[tenants.a]\nrequests_per_minute = 1\nburst = 1.0\n")
    assert (await rl.acquire("a", "m", True, 1, 10)).allowed
    assert not (await rl.acquire("a", "m", True, 1, 10)).allowed
    unlimited = await rl.acquire("b", "m", True, 1, 10)
    assert unlimited.allowed and unlimited.lease_id == ""


async def test_lease_ttl_is_capped_and_bad_input_is_rejected() -> None:
    rl = limiter("[defaults]\nrequests_in_flight = 5\n")
    decision = await rl.acquire("a", "m", True, 1, 10, lease_ttl_s=3600)
    assert decision.lease_expires_at - FakeClock().now == pytest.approx(60)
    with pytest.raises(InvalidArgument):
        await rl.acquire("", "m", True, 1, 10)
    with pytest.raises(InvalidArgument):
        await rl.acquire("a", "m", True, 1, -1)
    with pytest.raises(NotFound):
        await rl.commit("nope", 1)
    await rl.commit(decision.lease_id, 5)
    rows = await rl.usage("a")
    assert rows[0][0] == "a" and rows[0][2][0].remaining == 5
