"""The adaptive bound on bulk rows in flight: Little's-law start, AIMD on throttling and latency,
increases only while the bound is in use."""

from __future__ import annotations

import asyncio

from sluice_gateway.jobs.concurrency import FAILED, OK, THROTTLED, AdaptiveConcurrency


def ok(c: AdaptiveConcurrency, latency_s: float) -> None:
    """A successful completion while the bound is full (rows wait at the gate)."""
    c.observe(latency_s, OK, in_flight=c.bound)


def test_starts_from_littles_law_once_rate_and_latency_are_known() -> None:
    c = AdaptiveConcurrency(initial=4)
    c.observe(2.0, OK, allowed_rate_per_s=10.0)  # 10 rows/s x 2 s = 20 in flight, x1.2 headroom
    assert c.started_from_littles_law
    assert c.limit == 24.0
    assert c.history[-1][2] == "littles_law"


def test_additive_increase_while_latency_is_steady() -> None:
    c = AdaptiveConcurrency(initial=4)
    for _ in range(40):
        ok(c, 1.0)
    assert 8 < c.limit < 12  # ~ +1 per `limit` completions


def test_throttling_decreases_but_never_below_the_littles_law_target() -> None:
    c = AdaptiveConcurrency(initial=4)
    c.observe(1.0, OK, allowed_rate_per_s=5.0)  # target 6
    for _ in range(20):
        ok(c, 1.0)
    high = c.limit
    c.observe(0.1, THROTTLED)
    assert c.limit < high
    for _ in range(100):
        for _ in range(c.window):
            ok(c, 1.0)
        c.observe(0.1, THROTTLED)
    assert c.limit == c.littles_law_target() == 6.0


def test_a_burst_of_denials_decreases_once_per_window() -> None:
    c = AdaptiveConcurrency(initial=40)
    for _ in range(50):  # rows already in flight when the allowance ran out, denied together
        c.observe(0.1, THROTTLED)
    assert c.limit == 40 * c.decrease
    for _ in range(c.window):
        ok(c, 1.0)
    c.observe(0.1, THROTTLED)
    assert c.limit < 40 * c.decrease


def _windows(c: AdaptiveConcurrency, latencies: list[float]) -> None:
    for latency in latencies:
        for _ in range(c.window):
            ok(c, latency)


def test_latency_backs_off_only_on_a_sustained_rise_of_the_window_p90() -> None:
    c = AdaptiveConcurrency(initial=20)
    _windows(c, [0.5, 0.5])
    grown = c.limit
    # Noise: single slow rows, and one slow window, never move the bound down.
    for _ in range(3):
        for _ in range(c.window - 1):
            ok(c, 0.5)
        ok(c, 5.0)
    _windows(c, [3.0, 0.5])
    assert c.limit >= grown
    assert "latency" not in [reason for _, _, reason in c.history]
    before = c.limit
    _windows(c, [3.0, 3.0, 3.0])  # the backend is queueing: three slow windows in a row
    assert c.limit < before
    assert c.history[-1][2] == "latency"


def test_latency_never_takes_the_bound_below_littles_law() -> None:
    c = AdaptiveConcurrency(initial=4)
    c.observe(1.0, OK, allowed_rate_per_s=10.0)  # 10/s x 1 s x 1.2 = 12
    for _ in range(30):
        ok(c, 0.01)  # a few outliers-low would collapse a min-based target; a median does not
        _windows(c, [1.0])
    _windows(c, [4.0] * 30)  # sustained slowness; the allowance now needs 10/s x 4 s x 1.2 = 48
    assert c.limit >= c.littles_law_target() == 48.0


def test_failures_do_not_move_the_bound_and_limits_hold() -> None:
    c = AdaptiveConcurrency(initial=4, minimum=2, maximum=5)
    c.observe(1.0, FAILED)
    assert c.limit == 4
    c.observe(1.0, OK, allowed_rate_per_s=1000.0)
    assert c.limit == 5
    c.allowed_rate_per_s = None
    for _ in range(100):
        c.observe(0.1, THROTTLED)
        _windows(c, [0.1])
    assert c.limit == 2


def test_no_increase_while_the_bound_is_not_in_use() -> None:
    # make bench-jobs: denied rows sleep without a slot, so few are in flight while every
    # completion succeeds at flat latency; the bound must not climb to its maximum meanwhile.
    c = AdaptiveConcurrency(initial=4, maximum=64)
    for _ in range(2000):
        c.observe(1.0, OK, in_flight=1)
    assert c.limit == 4
    assert [reason for _, _, reason in c.history] == ["initial"]
    # At least half the bound in flight counts as in use (the completing row included).
    c.observe(1.0, OK, in_flight=2)
    assert c.limit == 4.25


def test_an_unused_bound_settles_near_twice_the_rows_in_use() -> None:
    c = AdaptiveConcurrency(initial=4, maximum=64)
    for _ in range(2000):
        c.observe(1.0, OK, in_flight=6)
    assert 12 <= c.limit <= 13  # grows while 6 >= limit / 2, then stops


def test_a_saturated_bound_still_grows_to_its_maximum() -> None:
    c = AdaptiveConcurrency(initial=4, maximum=64)
    for _ in range(5000):
        ok(c, 1.0)
    assert c.limit == 64


async def test_release_judges_use_by_the_rows_in_flight_at_the_gate() -> None:
    alone = AdaptiveConcurrency(initial=8)
    for _ in range(100):  # one row at a time: 1 in flight of 8
        await alone.acquire()
        await alone.release(1.0, OK)
    assert alone.limit == 8
    busy = AdaptiveConcurrency(initial=8)
    for _ in range(100):  # the gate full: every completion sees the bound in use
        while busy.in_flight < busy.bound:
            await busy.acquire()
        await busy.release(1.0, OK)
    assert busy.limit > 8


async def test_the_gate_admits_at_most_the_bound() -> None:
    c = AdaptiveConcurrency(initial=2)
    await c.acquire()
    await c.acquire()
    third = asyncio.create_task(c.acquire())
    await asyncio.sleep(0.05)
    assert not third.done() and c.in_flight == 2
    await c.release(0.1, FAILED)
    await asyncio.wait_for(third, 1)
    assert c.in_flight == 2
