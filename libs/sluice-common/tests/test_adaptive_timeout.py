"""Rolling p99 and the timeout derived from it: warm-up, clamping, following the load both ways."""

from __future__ import annotations

import random

import pytest

from sluice_common.adaptive_timeout import AdaptiveTimeout, RollingQuantile, TimeoutPolicy


def test_the_quantile_is_the_nearest_rank_of_the_window() -> None:
    rolling = RollingQuantile(window=100)
    assert rolling.value() is None
    for value in random.Random(1).sample(range(1, 101), 100):
        rolling.add(float(value))
    assert rolling.value() == 99.0
    assert len(rolling) == 100
    median = RollingQuantile(window=3, q=0.5)
    for value in (5.0, 1.0, 3.0):
        median.add(value)
    assert median.value() == 3.0


def test_the_window_forgets_the_oldest_samples_and_stays_bounded() -> None:
    rolling = RollingQuantile(window=10)
    for value in range(1000):
        rolling.add(float(value))
    assert len(rolling) == 10
    # Only 990..999 are left: the p99 of ten is the largest.
    assert rolling.value() == 999.0
    rolling.add(float("nan"))  # ignored, never breaks the order
    assert len(rolling) == 10 and rolling.value() == 999.0


def test_duplicates_leave_the_window_one_at_a_time() -> None:
    rolling = RollingQuantile(window=3, q=1.0)
    for value in (7.0, 7.0, 1.0, 1.0, 1.0):
        rolling.add(value)
    assert rolling.value() == 1.0


def test_bad_windows_and_quantiles_are_refused() -> None:
    with pytest.raises(ValueError):
        RollingQuantile(window=0)
    with pytest.raises(ValueError):
        RollingQuantile(window=5, q=0.0)


def test_the_ceiling_holds_until_enough_samples() -> None:
    timeout = AdaptiveTimeout(TimeoutPolicy(multiplier=2.0, floor_s=0.01, ceiling_s=60.0, window=100, min_samples=20))
    assert timeout.current() == 60.0
    for _ in range(19):
        timeout.observe(0.1)
    assert not timeout.warmed_up
    assert timeout.current() == 60.0
    timeout.observe(0.1)
    assert timeout.warmed_up
    assert timeout.current() == pytest.approx(0.2)


def test_floor_and_ceiling_clamp() -> None:
    policy = TimeoutPolicy(multiplier=2.0, floor_s=1.0, ceiling_s=10.0, window=50, min_samples=5)
    fast = AdaptiveTimeout(policy)
    for _ in range(50):
        fast.observe(0.001)
    assert fast.current() == 1.0
    slow = AdaptiveTimeout(policy)
    for _ in range(50):
        slow.observe(30.0)
    assert slow.current() == 10.0


def test_the_timeout_follows_a_load_change_up_and_down() -> None:
    rng = random.Random(7)
    timeout = AdaptiveTimeout(TimeoutPolicy(multiplier=2.0, floor_s=0.001, ceiling_s=100.0, window=200, min_samples=20))
    for _ in range(200):
        timeout.observe(rng.uniform(0.05, 0.1))
    quiet = timeout.current()
    assert 0.19 <= quiet <= 0.2
    for _ in range(200):
        timeout.observe(rng.uniform(0.5, 1.0))  # a busy hour: steps ten times slower
    busy = timeout.current()
    assert 1.9 <= busy <= 2.0
    for _ in range(200):
        timeout.observe(rng.uniform(0.05, 0.1))
    assert timeout.current() == pytest.approx(quiet, rel=0.05)


def test_a_rare_outlier_does_not_move_the_p99_but_a_slow_one_percent_does() -> None:
    timeout = AdaptiveTimeout(TimeoutPolicy(multiplier=2.0, floor_s=0.001, ceiling_s=100.0, window=1000, min_samples=20))
    for i in range(1000):
        timeout.observe(30.0 if i % 500 == 0 else 0.1)  # 2 in 1000 stuck
    assert timeout.current() == pytest.approx(0.2)
    for i in range(1000):
        timeout.observe(5.0 if i % 50 == 0 else 0.1)  # 20 in 1000 slow: above 1%
    assert timeout.current() == pytest.approx(10.0)


def test_timeouts_raise_the_limit_when_more_than_one_percent_time_out() -> None:
    """A real slowdown must not fail every call for ever: timed-out calls count at their limit,
    so the limit climbs (x multiplier) until the slow calls fit under it."""
    timeout = AdaptiveTimeout(TimeoutPolicy(multiplier=2.0, floor_s=0.01, ceiling_s=100.0, window=100, min_samples=10))
    for _ in range(100):
        timeout.observe(0.1)
    true_latency = 1.0  # the new normal, 10x the old
    fired = 0
    for _ in range(200):
        limit = timeout.current()
        if true_latency > limit:
            fired += 1
            timeout.observe_timeout(limit)
        else:
            timeout.observe(true_latency)
    assert timeout.current() == pytest.approx(2.0)
    assert fired < 10


def test_policy_problems_name_the_variables() -> None:
    names = ("X_MULTIPLIER", "X_FLOOR_S", "X_CEILING_S", "X_WINDOW", "X_MIN_SAMPLES")
    assert TimeoutPolicy().problems(*names) == []
    found = TimeoutPolicy(multiplier=0.5, floor_s=5, ceiling_s=1, window=0, min_samples=3).problems(*names)
    assert [p.split()[0] for p in found] == ["X_MULTIPLIER", "X_FLOOR_S", "X_WINDOW", "X_MIN_SAMPLES"]
    assert TimeoutPolicy(window=10, min_samples=11).problems(*names) == ["X_MIN_SAMPLES must be in [1, X_WINDOW], got 11"]
