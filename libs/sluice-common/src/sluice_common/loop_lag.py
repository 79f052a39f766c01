"""Event-loop lag: how late the event loop runs a callback that is due, as a Prometheus histogram.

Every service exports `sluice_event_loop_lag_seconds` (started from its __main__ under the
server's supervisor): a task sleeps `interval_s` and observes how much later than asked it woke
up. That lateness is what any callback that became ready meanwhile (a gRPC message, an AMQP
delivery, a timer) waited behind code that did not yield: CPU-bound work on the loop, a thread
holding the GIL, the process being descheduled. An idle loop reads about 0-1 ms (epoll's timeout
is rounded up to the millisecond).

A wakeup late by L also stands for the wakeups the stall swallowed: it records L, L - interval,
L - 2*interval, ... while above 0 (HdrHistogram's correction for coordinated omission, capped at
`MAX_BACKFILL` values). Without it a 400 ms stall would be one sample among the hundreds an idle
loop takes meanwhile, and a p99 would hide it; with it the histogram is time-weighted: it says
how long work that arrives at a random moment waits for the loop.

Why 250 ms: the cost is one timer wakeup per interval, and a wakeup of an asyncio loop costs
~200 us of CPU on the 2-core VMs this suite is measured on (a bare loop sleeping 50 ms in turn:
0.40% of a core; 200 ms: 0.15%), not the tens of microseconds first assumed. At 50 ms the five
services' monitors took ~2% of a core beside an engine whose two threads need both cores, about
0.25 ms of every token at one stream (bench-peer's streams1). 4 samples a second still give 240 a
minute, enough for a p99 over a scrape window; with the correction above a stall longer than the
interval is counted in full whatever the interval. A stall shorter than the interval is caught
when it covers a wakeup (with probability about stall/interval), recorded at the part of it left
after the wakeup, as a random arrival would meet it: the histogram stays time-weighted, with fewer
samples. Tests that need many samples in a few seconds pass a smaller interval and keep the raw
samples (`keep`).
"""

from __future__ import annotations

import asyncio
import collections
import math

from prometheus_client import Histogram

# Fine-grained from 0.5 ms to 100 ms (where "fine" turns into "users notice"), coarse above.
LAG_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
LOOP_LAG = Histogram(
    "sluice_event_loop_lag_seconds",
    "How late the event loop woke a task sleeping a fixed interval: the wait of any callback due meanwhile.",
    buckets=LAG_BUCKETS,
)

DEFAULT_INTERVAL_S = 0.25
# At most this many values recorded for one late wakeup (a 250 s stall at 250 ms): bounded work.
MAX_BACKFILL = 1000


class LoopLagMonitor:
    """`run` (an owner task) observes the loop's lag into `histogram` every `interval_s`; with
    `keep` > 0 the latest `keep` samples (seconds) are also kept in `samples` (tests, diagnostics)."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, histogram: Histogram = LOOP_LAG, keep: int = 0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._histogram = histogram
        self.samples: collections.deque[float] = collections.deque(maxlen=keep if keep > 0 else 0)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.interval_s
        keep = self.samples.maxlen
        while True:
            asked = loop.time()
            await asyncio.sleep(interval)
            # asyncio may run a timer up to its clock resolution early: never a negative lag.
            lag = max(0.0, loop.time() - asked - interval)
            self._observe(lag, keep)
            # The wakeups this stall swallowed would have been late by lag - interval, ...
            missed = min(int(lag / interval), MAX_BACKFILL)
            for k in range(1, missed + 1):
                self._observe(lag - k * interval, keep)

    def _observe(self, lag: float, keep: int | None) -> None:
        self._histogram.observe(lag)
        if keep:
            self.samples.append(lag)

    def clear(self) -> None:
        self.samples.clear()

    def quantile(self, q: float) -> float:
        """The q-quantile (nearest rank) of the kept samples; 0 when there are none."""
        return quantile(list(self.samples), q)


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile: the smallest value with at least q of the values at or below it."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


async def monitor_loop_lag(interval_s: float = DEFAULT_INTERVAL_S) -> None:
    """The one-liner for a service's __main__: `running.supervisor.start("event-loop-lag", monitor_loop_lag)`."""
    await LoopLagMonitor(interval_s).run()
