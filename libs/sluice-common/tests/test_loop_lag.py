"""The event-loop lag monitor: an idle loop reads near zero, a blocked loop reads the block."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import Histogram

from sluice_common.loop_lag import LAG_BUCKETS, LOOP_LAG, LoopLagMonitor, quantile
from sluice_common.supervision import Supervisor, stop_tasks


def bucket_counts(histogram: Histogram) -> dict[float, float]:
    """Cumulative count per upper bound (le)."""
    (metric,) = histogram.collect()
    return {float(s.labels["le"]): s.value for s in metric.samples if s.name.endswith("_bucket")}


def test_quantile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert quantile(values, 0.99) == 99.0
    assert quantile(values, 1.0) == 100.0
    assert quantile(values, 0.5) == 50.0
    assert quantile([3.0], 0.99) == 3.0
    assert quantile([], 0.99) == 0.0


def test_the_metric_is_registered_with_fine_buckets_between_1_and_100_ms() -> None:
    assert LOOP_LAG._name == "sluice_event_loop_lag_seconds"  # type: ignore[attr-defined]
    assert len([b for b in LAG_BUCKETS if 0.001 <= b <= 0.1]) >= 10
    with pytest.raises(ValueError):
        LoopLagMonitor(0)


async def test_an_idle_loop_reads_low_and_a_blocked_loop_reads_the_block() -> None:
    histogram = Histogram("test_loop_lag_seconds", "test", buckets=LAG_BUCKETS, registry=None)
    monitor = LoopLagMonitor(0.005, histogram, keep=1000)
    # Started the way services start it: an owner task under a supervisor.
    task = Supervisor().start("event-loop-lag", monitor.run)
    try:
        await asyncio.sleep(0.3)
        idle = list(monitor.samples)
        assert len(idle) >= 20
        # Loose: this is a shared 2-core box; an idle loop is ~0-1 ms late.
        assert quantile(idle, 0.5) < 0.003, idle

        monitor.clear()
        time.sleep(0.08)  # the loop is blocked: the monitor's wakeup comes ~75+ ms late
        await asyncio.sleep(0.05)
        blocked = list(monitor.samples)
        assert max(blocked) >= 0.07, blocked
        # ... and stands for the ~15 wakeups the block swallowed: 75, 70, 65 ... ms (time-weighted).
        assert len([lag for lag in blocked if lag >= 0.04]) >= 6, blocked
    finally:
        await stop_tasks(task)
    counts = bucket_counts(histogram)
    assert counts[float("inf")] == len(idle) + len(blocked)
    # The blocked wakeups are above 50 ms, the idle ones mostly at or below 5 ms.
    assert counts[float("inf")] - counts[0.05] >= 4
    assert counts[0.005] >= 0.9 * len(idle)
