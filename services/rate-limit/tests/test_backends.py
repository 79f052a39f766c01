"""One suite for both backends: the in-memory one and the Lua scripts on the real Redis."""

from __future__ import annotations

import pytest

from sluice_rate_limit.budgets import Budget, Check, Kind, LeaseNotFound


def tpm(limit: int, cost: int, floor: int = 0, key: str = "t:a:tpm") -> Check:
    return Check(Budget.TOKENS_PER_MINUTE, Kind.WINDOW, key, limit, cost, floor, refundable=True, name="tokens_per_minute")


def rpm(limit: int, floor: int = 0) -> Check:
    return Check(Budget.REQUESTS_PER_MINUTE, Kind.WINDOW, "t:a:rpm", limit, 1, floor, name="requests_per_minute")


def rif(limit: int, floor: int = 0) -> Check:
    return Check(Budget.REQUESTS_IN_FLIGHT, Kind.GAUGE, "t:a:rif", limit, 1, floor, name="requests_in_flight")


def tif(limit: int, cost: int) -> Check:
    return Check(Budget.TOKENS_IN_FLIGHT, Kind.GAUGE, "t:a:tif", limit, cost, name="tokens_in_flight")


async def test_admits_up_to_the_limit_then_names_the_budget_and_when_to_retry(harness) -> None:
    backend = harness.backend
    for _ in range(3):
        decision = await backend.acquire([rpm(5), tpm(1000, 300)], True, 30, False, "m")
        assert decision.allowed and decision.lease_id
    assert decision.states[1].remaining == 100
    denied = await backend.acquire([rpm(5), tpm(1000, 300)], True, 30, False, "m")
    assert not denied.allowed
    assert denied.denied_by == Budget.TOKENS_PER_MINUTE
    assert 0 < denied.retry_after_s <= 2.2
    # nothing was charged by the denial: all or nothing
    assert (await backend.peek([rpm(5)], "m"))[0].remaining == 2


async def test_refund_at_commit_is_usable_at_once(harness) -> None:
    backend = harness.backend
    first = await backend.acquire([tpm(1000, 800)], True, 30, False, "m")
    assert not (await backend.acquire([tpm(1000, 500)], True, 30, False, "m")).allowed
    states = await backend.settle(first.lease_id, 100)  # used 100 of 800: 700 back
    assert states[0].remaining == 900
    assert (await backend.acquire([tpm(1000, 500)], True, 30, False, "m")).allowed


async def test_release_refunds_the_whole_reservation_and_using_more_charges_more(harness) -> None:
    backend = harness.backend
    lease = await backend.acquire([tpm(1000, 400)], True, 30, False, "m")
    await backend.settle(lease.lease_id, None)
    assert (await backend.peek([tpm(1000, 0)], "m"))[0].remaining == 1000
    lease = await backend.acquire([tpm(1000, 100)], True, 30, False, "m")
    await backend.settle(lease.lease_id, 250)  # the estimate was low: the truth is charged
    assert (await backend.peek([tpm(1000, 0)], "m"))[0].remaining == 750


async def test_in_flight_is_freed_by_commit_and_a_settled_lease_is_gone(harness) -> None:
    backend = harness.backend
    lease = await backend.acquire([rif(1), tif(100, 60)], True, 30, False, "m")
    denied = await backend.acquire([rif(1), tif(100, 60)], True, 30, False, "m")
    assert not denied.allowed
    assert denied.denied_by in (Budget.REQUESTS_IN_FLIGHT, Budget.TOKENS_IN_FLIGHT)
    await backend.settle(lease.lease_id, 10)
    with pytest.raises(LeaseNotFound):
        await backend.settle(lease.lease_id, 10)
    assert (await backend.acquire([rif(1), tif(100, 60)], True, 30, False, "m")).allowed


async def test_an_expired_lease_frees_its_capacity(harness) -> None:
    backend = harness.backend
    lease = await backend.acquire([rif(1)], True, 0.3, False, "m")
    assert not (await backend.acquire([rif(1)], True, 0.3, False, "m")).allowed
    await harness.advance(0.4)
    assert (await backend.acquire([rif(1)], True, 30, False, "m")).allowed
    with pytest.raises(LeaseNotFound):
        await backend.settle(lease.lease_id, 0)


async def test_a_renewed_lease_holds_its_capacity_past_its_first_expiry(harness) -> None:
    backend = harness.backend
    lease = await backend.acquire([rif(1)], True, 0.3, False, "m")
    await harness.advance(0.15)
    renewed = await backend.renew(lease.lease_id, 0.6)
    assert renewed > lease.lease_expires_at + 0.2
    await harness.advance(0.3)  # past the first expiry, before the renewed one
    assert not (await backend.acquire([rif(1)], True, 0.3, False, "m")).allowed
    await harness.advance(0.5)
    assert (await backend.acquire([rif(1)], True, 30, False, "m")).allowed
    with pytest.raises(LeaseNotFound):  # expired: a renewal cannot bring it back
        await backend.renew(lease.lease_id, 0.6)


async def test_a_settled_lease_cannot_be_renewed(harness) -> None:
    backend = harness.backend
    lease = await backend.acquire([rif(1)], True, 30, False, "m")
    await backend.settle(lease.lease_id, 0)
    with pytest.raises(LeaseNotFound):
        await backend.renew(lease.lease_id, 30)
    assert (await backend.acquire([rif(1)], True, 30, False, "m")).allowed


async def test_window_capacity_comes_back_after_the_window(harness) -> None:
    backend = harness.backend
    assert (await backend.acquire([rpm(1)], True, 30, False, "m")).allowed
    denied = await backend.acquire([rpm(1)], True, 30, False, "m")
    assert not denied.allowed and denied.retry_after_s <= 2.11
    await harness.advance(denied.retry_after_s + 0.05)
    assert (await backend.acquire([rpm(1)], True, 30, False, "m")).allowed


async def test_bulk_never_pushes_interactive_below_its_floor(harness) -> None:
    backend = harness.backend
    bulk = 0
    while (await backend.acquire([tpm(1000, 100, floor=300)], False, 30, False, "m")).allowed:
        bulk += 1
    assert bulk == 7  # 1000 - floor 300
    for _ in range(3):
        assert (await backend.acquire([tpm(1000, 100, floor=300)], True, 30, False, "m")).allowed
    assert not (await backend.acquire([tpm(1000, 100, floor=300)], True, 30, False, "m")).allowed


async def test_models_are_separate(harness) -> None:
    backend = harness.backend
    assert (await backend.acquire([rpm(1)], True, 30, False, "m1")).allowed
    assert (await backend.acquire([rpm(1)], True, 30, False, "m2")).allowed
    assert not (await backend.acquire([rpm(1)], True, 30, False, "m1")).allowed


def paced_tpm(limit: int, cost: int, burst: int, floor: int = 0) -> Check:
    return Check(Budget.TOKENS_PER_MINUTE, Kind.WINDOW, "t:a:tpm", limit, cost, floor, refundable=True, burst=burst, name="tokens_per_minute")


async def test_pacing_lets_the_burst_through_then_the_rate(harness) -> None:
    backend = harness.backend
    # 1000 tokens per 2 s = 1 token per 2 ms; a burst of 100 tokens at once
    admitted = 0
    while (await backend.acquire([paced_tpm(1000, 25, burst=100)], False, 30, False, "m")).allowed:
        admitted += 25
    assert admitted == 100
    denied = await backend.acquire([paced_tpm(1000, 25, burst=100)], False, 30, False, "m")
    assert not denied.allowed and 0 < denied.retry_after_s <= 0.06
    await harness.advance(denied.retry_after_s + 0.01)
    assert (await backend.acquire([paced_tpm(1000, 25, burst=100)], False, 30, False, "m")).allowed


async def test_a_request_bigger_than_the_burst_goes_through_when_nothing_is_owed(harness) -> None:
    backend = harness.backend
    lease = await backend.acquire([paced_tpm(1000, 400, burst=50)], True, 30, False, "m")
    assert lease.allowed
    assert not (await backend.acquire([paced_tpm(1000, 10, burst=50)], False, 30, False, "m")).allowed
    await backend.settle(lease.lease_id, 0)  # the refund pays the pace back too
    assert (await backend.acquire([paced_tpm(1000, 10, burst=50)], False, 30, False, "m")).allowed


async def test_interactive_may_go_into_debt_by_its_floor(harness) -> None:
    backend = harness.backend
    while (await backend.acquire([paced_tpm(1000, 20, burst=100, floor=300)], False, 30, False, "m")).allowed:
        pass  # bulk keeps the pace saturated
    for _ in range(10):
        assert (await backend.acquire([paced_tpm(1000, 20, burst=100, floor=300)], True, 30, False, "m")).allowed


async def test_a_bulk_retry_after_waits_for_the_floor_that_leaving_interactive_entries_reopen(harness) -> None:
    backend = harness.backend
    assert (await backend.acquire([tpm(1000, 300, floor=300)], True, 30, False, "m")).allowed  # interactive covers the floor
    await harness.advance(0.3)
    assert (await backend.acquire([tpm(1000, 600, floor=300)], False, 30, False, "m")).allowed
    denied = await backend.acquire([tpm(1000, 200, floor=300)], False, 30, False, "m")
    assert not denied.allowed
    # When the interactive 300 leaves (1.7 s), bulk must leave the floor free again: 600 + 200 + 300
    # is still over 1000. Only the bulk 600 leaving (2.0 s) lets it in.
    assert 1.9 <= denied.retry_after_s <= 2.01, denied.retry_after_s
    await harness.advance(denied.retry_after_s + 0.02)
    assert (await backend.acquire([tpm(1000, 200, floor=300)], False, 30, False, "m")).allowed


async def test_the_pace_owed_for_commits_far_over_their_reservation_outlives_the_window_alike(harness) -> None:
    """One overshoot is paced for at most a whole limit's worth (one window): it used to be paced
    for all of it (a commit of 10**15 tokens owed 1.5e12 s in memory). And Redis kept the debt only
    as long as the window's keys (window + 1 s), so it forgot what memory still owed: the keys now
    live as long as the debt."""
    backend = harness.backend
    check = paced_tpm(1000, 100, burst=100, floor=500)  # 1 token per 2 ms; interactive may owe 1 s
    first = await backend.acquire([check], True, 30, False, "m")
    second = await backend.acquire([check], True, 30, False, "m")
    assert first.allowed and second.allowed  # 0.4 s owed
    await backend.settle(first.lease_id, 3000)  # 2900 over: +2 s owed (a whole limit), not +5.8 s
    await backend.settle(second.lease_id, 3000)  # 4.4 s owed
    await harness.advance(3.5)  # the log's entries have left, the window's keys' old TTL has passed
    denied = await backend.acquire([check], False, 30, False, "m")
    assert not denied.allowed and denied.denied_by == Budget.TOKENS_PER_MINUTE
    assert 0.7 <= denied.retry_after_s <= 0.91, denied.retry_after_s
    await harness.advance(denied.retry_after_s + 0.05)
    assert (await backend.acquire([check], False, 30, False, "m")).allowed


async def test_leases_expired_beyond_one_sweep_batch_are_freed_and_cannot_be_settled(harness) -> None:
    """The Redis sweep freed 64 expired leases a call: the rest still counted in flight, and a
    settle found one of them and settled it (the memory backend: unknown lease)."""
    backend = harness.backend
    leases = [await backend.acquire([rif(1000)], True, 0.5, False, "m") for _ in range(150)]
    assert all(lease.allowed for lease in leases)
    await harness.advance(0.6)
    with pytest.raises(LeaseNotFound):
        await backend.settle(leases[-1].lease_id, 0)
    assert (await backend.acquire([rif(10)], True, 30, False, "m")).allowed  # none counts in flight


async def test_models_whose_names_differ_in_braces_only_are_separate(harness) -> None:
    """Redis's hash tag turned `{` and `}` into `(` and `)`: a{b} and a(b) shared their budgets."""
    backend = harness.backend
    for model in ("a{b}", "a(b)", "a%7Bb%7D", "a{b"):
        assert (await backend.acquire([rpm(1)], True, 30, False, model)).allowed, model
    lease = await backend.acquire([rif(1)], True, 30, False, "a{b}")
    assert not (await backend.acquire([rpm(1)], True, 30, False, "a{b}")).allowed
    await backend.settle(lease.lease_id, 0)  # the lease id names its model
