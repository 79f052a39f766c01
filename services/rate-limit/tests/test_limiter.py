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


async def test_denials_are_counted_per_tenant_and_budget_shadow_ones_not() -> None:
    from prometheus_client import REGISTRY

    def denials(tenant: str) -> float:
        labels = {"tenant": tenant, "budget": "requests_per_minute"}
        return REGISTRY.get_sample_value("sluice_ratelimit_tenant_denials_total", labels) or 0.0

    rl = limiter("[tenants.counted]\nrequests_per_minute = 1\nburst = 1.0\n[tenants.shadowed]\nrequests_per_minute = 1\nburst = 1.0\nshadow = true\n")
    before = denials("counted"), denials("shadowed")
    for tenant in ("counted", "shadowed"):
        for _ in range(3):
            await rl.acquire(tenant, "m", True, 1, 10)
    assert (denials("counted") - before[0], denials("shadowed") - before[1]) == (2, 0)


async def test_lease_ttl_is_capped_and_bad_input_is_rejected() -> None:
    rl = limiter("[defaults]\nrequests_in_flight = 5\n")
    decision = await rl.acquire("a", "m", True, 1, 10, lease_ttl_s=3600)
    assert decision.lease_expires_at - FakeClock().now == pytest.approx(60)
    assert decision.lease_ttl_s == 60  # the caller learns it was capped, and renews
    short = await rl.acquire("a", "m", True, 1, 10, lease_ttl_s=5)
    assert short.lease_ttl_s == 5
    await rl.release(short.lease_id)
    with pytest.raises(InvalidArgument):
        await rl.acquire("", "m", True, 1, 10)
    with pytest.raises(InvalidArgument):
        await rl.acquire("a", "m", True, 1, -1)
    with pytest.raises(NotFound):
        await rl.commit("nope", 1)
    await rl.commit(decision.lease_id, 5)
    rows = await rl.usage("a")
    assert rows[0][0] == "a" and rows[0][2][0].remaining == 5


async def test_a_request_larger_than_a_whole_limit_is_refused_as_such() -> None:
    rl = limiter("[tenants.a]\ntokens_per_minute = 1000\nburst = 1.0\n")
    too_large = await rl.acquire("a", "m", True, 1, 1001)
    assert not too_large.allowed and too_large.exceeds_limit and too_large.denied_name == "tokens_per_minute"
    assert "costs 1001" in too_large.reason and "whole limit is 1000" in too_large.reason
    # Nothing was charged: a request that fits the limit exactly is still admitted.
    fits = await rl.acquire("a", "m", True, 1, 1000)
    assert fits.allowed and not fits.exceeds_limit
    # Denied for now (the window is spent), not for ever: told when to retry.
    later = await rl.acquire("a", "m", True, 1, 10)
    assert not later.allowed and not later.exceeds_limit and later.retry_after_s > 0


async def test_bulk_work_larger_than_what_the_floor_leaves_it_is_refused_as_such() -> None:
    """Bulk is admitted only while it leaves the interactive floor: a bulk request costing more than
    the limit less the floor could never be admitted, yet was told to retry, and a job row retried
    it for ever. Interactive work of the same cost is admitted."""
    rl = limiter("[tenants.a]\ntokens_per_minute = 1000\nburst = 1.0\ninteractive_floor = 0.25\n")
    never = await rl.acquire("a", "m", False, 1, 751)
    assert not never.allowed and never.exceeds_limit and never.denied_name == "tokens_per_minute"
    assert "250 of it kept for interactive traffic: bulk work gets at most 750" in never.reason
    fits = await rl.acquire("a", "m", False, 1, 750)
    assert fits.allowed and not fits.exceeds_limit
    rl = limiter("[tenants.a]\ntokens_per_minute = 1000\nburst = 1.0\ninteractive_floor = 0.25\n")
    assert (await rl.acquire("a", "m", True, 1, 751)).allowed


def test_the_reply_of_a_too_large_request_has_no_retry_after() -> None:
    from sluice_rate_limit.budgets import Budget, Decision
    from sluice_rate_limit.servicer import acquire_response

    reply = acquire_response(Decision(allowed=False, denied_by=Budget.TOKENS_PER_MINUTE, exceeds_limit=True))
    assert reply.exceeds_limit and not reply.HasField("retry_after")
    paced = acquire_response(Decision(allowed=False, denied_by=Budget.TOKENS_PER_MINUTE, retry_after_s=2.0))
    assert not paced.exceeds_limit and paced.retry_after.seconds == 2


async def test_a_renewal_is_capped_like_an_acquire_and_an_unknown_lease_is_not_found() -> None:
    rl = limiter("[defaults]\nrequests_in_flight = 5\n")
    decision = await rl.acquire("a", "m", True, 1, 10, lease_ttl_s=30)
    expires_at, ttl = await rl.renew(decision.lease_id, 3600)
    assert ttl == 60 and expires_at - FakeClock().now == pytest.approx(60)
    assert (await rl.renew(decision.lease_id, 5))[1] == 5
    assert (await rl.renew(decision.lease_id))[1] == 60  # unset: the maximum
    await rl.commit(decision.lease_id, 5)
    with pytest.raises(NotFound, match="already settled, or expired"):
        await rl.renew(decision.lease_id, 5)
    with pytest.raises(InvalidArgument):
        await rl.renew("", 5)


async def test_used_tokens_are_bounded_and_an_overshoot_is_paced_for_one_window_at_most() -> None:
    """A Commit of 10**15 tokens was paced for all of them: the next Acquire was told to retry in
    1.5e12 s, beyond what a protobuf Duration holds. Beyond 2**53 a Commit is refused."""
    from sluice_rate_limit.servicer import acquire_response

    rl = limiter("[tenants.a]\ntokens_per_minute = 1000\nburst = 0.1\n")
    lease = await rl.acquire("a", "m", True, 1, 10)
    with pytest.raises(InvalidArgument, match=r"used_tokens: must be at most 2\*\*53"):
        await rl.commit(lease.lease_id, 2**53 + 1)
    await rl.commit(lease.lease_id, 10**15)
    denied = await rl.acquire("a", "m", True, 1, 10)
    assert not denied.allowed and 0 < denied.retry_after_s <= 10.0 + 0.1  # one window (10 s) at most
    assert acquire_response(denied).retry_after.seconds <= 10
