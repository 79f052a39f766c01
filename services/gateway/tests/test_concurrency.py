"""The adaptive bound on bulk rows in flight: Little's-law start, AIMD on throttling and latency."""

from __future__ import annotations

import asyncio

from sluice_gateway.concurrency import FAILED, OK, THROTTLED, AdaptiveConcurrency


def test_starts_from_littles_law_once_rate_and_latency_are_known() -> None:
    c = AdaptiveConcurrency(initial=4)
    c.observe(2.0, OK, allowed_rate_per_s=10.0)  # 10 rows/s x 2 s = 20 in flight, x1.2 headroom
    assert c.started_from_littles_law
    assert c.limit == 24.0
    assert c.history[-1][2] == "littles_law"


def test_additive_increase_while_latency_is_steady() -> None:
    c = AdaptiveConcurrency(initial=4)
    for _ in range(40):
        c.observe(1.0, OK)
    assert 8 < c.limit < 12  # ~ +1 per `limit` completions


def test_throttling_decreases_but_never_below_the_littles_law_target() -> None:
    c = AdaptiveConcurrency(initial=4)
    c.observe(1.0, OK, allowed_rate_per_s=5.0)  # target 6
    for _ in range(20):
        c.observe(1.0, OK)
    high = c.limit
    c.observe(0.1, THROTTLED)
    assert c.limit < high
    for _ in range(100):
        for _ in range(c.window):
            c.observe(1.0, OK)
        c.observe(0.1, THROTTLED)
    assert c.limit == c.littles_law_target() == 6.0


def test_a_burst_of_denials_decreases_once_per_window() -> None:
    c = AdaptiveConcurrency(initial=40)
    for _ in range(50):  # rows already in flight when the allowance ran out, denied together
        c.observe(0.1, THROTTLED)
    assert c.limit == 40 * c.decrease
    for _ in range(c.window):
        c.observe(1.0, OK)
    c.observe(0.1, THROTTLED)
    assert c.limit < 40 * c.decrease


def _windows(c: AdaptiveConcurrency, latencies: list[float]) -> None:
    for latency in latencies:
        for _ in range(c.window):
            c.observe(latency, OK)


def test_latency_backs_off_only_on_a_sustained_rise_of_the_window_p90() -> None:
    c = AdaptiveConcurrency(initial=20)
    _windows(c, [0.5, 0.5])
    grown = c.limit
    # Noise: single slow rows, and one slow window, never move the bound down.
    for _ in range(3):
        for _ in range(c.window - 1):
            c.observe(0.5, OK)
        c.observe(5.0, OK)
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
        c.observe(0.01, OK)  # a few outliers-low would collapse a min-based target; a median does not
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
