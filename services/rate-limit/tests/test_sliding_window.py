"""The window arithmetic: no period ever admits more than the limit, and saturation stays near it."""

from __future__ import annotations

import random

from sluice_rate_limit.sliding_window import SlidingWindow, admits


def test_admits_rule_keeps_floor_for_interactive() -> None:
    # limit 100, floor 20, nothing interactive yet: bulk may use 80 at most.
    assert admits(70, 0, 10, 100, 20, interactive=False)
    assert not admits(71, 0, 10, 100, 20, interactive=False)
    # interactive may use everything
    assert admits(90, 0, 10, 100, 20, interactive=True)
    # once interactive uses its floor, bulk may use the rest
    assert admits(85, 20, 5, 100, 20, interactive=False)


def test_saturated_traffic_stays_within_limit_in_every_window() -> None:
    """11x oversubscription (a request every ms, 20-200 tokens, 110k tokens/s offered against
    10k tokens/s allowed): every sliding window holds the limit within -3%..0%."""
    rng = random.Random(7)
    window_s, limit = 10.0, 100_000
    window = SlidingWindow(window_s)
    admitted: list[tuple[float, int]] = []
    now = 0.0
    # offered load: 10x the limit, requests of 20..200 tokens
    offered = 0
    while now < 40.0:
        cost = rng.randint(20, 200)
        offered += cost
        used, _ = window.usage(now)
        if used + cost <= limit:
            window.add(now, cost, True)
            admitted.append((now, cost))
        now += 0.001
    # every window of length window_s that starts once the first window has filled
    start = window_s
    worst_high, worst_low = 0, limit
    assert offered >= 10 * limit * 40.0 / window_s
    while start + window_s <= 40.0:
        total = sum(cost for at, cost in admitted if start < at <= start + window_s)
        worst_high, worst_low = max(worst_high, total), min(worst_low, total)
        start += 0.1
    assert worst_high <= limit
    assert worst_low >= 0.97 * limit, worst_low


def test_no_double_burst_at_a_window_edge() -> None:
    window = SlidingWindow(10.0)
    window.add(9.99, 1000, True)  # the whole limit at the end of one "fixed window"
    assert window.usage(10.01)[0] == 1000  # a fixed window would have reset here
    assert window.usage(19.98)[0] == 1000
    assert window.usage(20.0)[0] == 0  # gone window_s after its admission


def test_refund_goes_back_to_its_entry_and_is_usable_at_once() -> None:
    window = SlidingWindow(10.0)
    entry = window.add(1.0, 500, False)
    window.add(2.0, 300, False)
    window.refund(3.0, entry, 400)
    assert window.usage(3.0) == (400, 0)
    window.refund(11.5, entry, 100)  # left the window already: nothing to give back
    assert window.usage(11.5) == (300, 0)


def test_retry_after_points_at_the_entry_that_frees_enough() -> None:
    window = SlidingWindow(10.0)
    window.add(0.5, 600, False)
    window.add(5.5, 400, False)
    assert window.retry_after(6.0, 100, 1000, 0, True) == 4.5
    assert window.retry_after(6.0, 700, 1000, 0, True) == 9.5
    assert window.retry_after(6.0, 1100, 1000, 0, True) == 10.0  # never: the whole window
    assert window.reset_after(6.0) == 9.5
    assert window.retry_after(11.0, 500, 1000, 0, True) == 0.0  # admitted now


def test_a_bulk_retry_after_counts_the_reserve_that_leaving_interactive_entries_reopen() -> None:
    window = SlidingWindow(10.0)
    window.add(0.5, 300, True)
    window.add(5.5, 600, False)
    # interactive: the first entry leaving is enough (600 + 200 <= 1000)
    assert window.retry_after(6.0, 200, 1000, 300, True) == 4.5
    # bulk: once the interactive 300 leaves, the floor is uncovered again (600 + 200 + 300 > 1000)
    assert window.retry_after(6.0, 200, 1000, 300, False) == 9.5
    assert not admits(600, 0, 200, 1000, 300, interactive=False)
    assert admits(0, 0, 200, 1000, 300, interactive=False)


def test_paced_window_holds_the_limit_when_arrivals_stall_and_catch_up() -> None:
    """A stalled client catching up in one burst: without pacing its replay leaves later windows
    short; with a 2% burst every window still holds the limit within 3%."""
    rng = random.Random(3)
    window_s, limit, burst = 10.0, 100_000, 2_000
    window = SlidingWindow(window_s)
    admitted: list[tuple[float, int]] = []
    now = 0.0
    while now < 40.0:
        # every second, a 50 ms stall, then the 50 queued requests at once
        stalled = (now % 1.0) < 0.05
        if not stalled:
            batch = 50 if (now % 1.0) < 0.051 else 1
            for _ in range(batch):
                cost = rng.randint(20, 200)
                used, _ = window.usage(now)
                if window.pace_wait(now, cost, limit, burst, 0, True) <= 0 and used + cost <= limit:
                    window.add(now, cost, True)
                    window.pace(now, cost, limit)
                    admitted.append((now, cost))
        now += 0.001
    start, low, high = window_s, limit, 0
    while start + window_s <= 40.0:
        total = sum(cost for at, cost in admitted if start < at <= start + window_s)
        low, high = min(low, total), max(high, total)
        start += 0.1
    assert high <= limit
    assert low >= 0.97 * limit, low
