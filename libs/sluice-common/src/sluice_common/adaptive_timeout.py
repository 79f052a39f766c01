"""Timeouts that follow the observed latency: about twice a rolling p99, within a floor and a ceiling.

A fixed timeout is either too long (a stuck call holds a slot for a minute) or too short (a busy
hour fails healthy calls). The usual advice is a timeout of about twice the observed p99, which a
fixed setting cannot follow as the load changes. So:

- `RollingQuantile` keeps the last `window` samples (count-bounded: memory is fixed, and a load
  change moves the quantile within `window` samples, up or down) in arrival order and in sorted
  order. Adding a sample is a binary search plus one list insert and one delete (a memmove of at
  most `window` pointers: microseconds at a window of a few thousand); reading the quantile is one
  index. No unbounded list, no sort per read.
- `TimeoutPolicy` is the operator's part: multiplier, floor, ceiling, window, warm-up samples.
- `AdaptiveTimeout` = one rolling quantile + a policy: `current()` is `multiplier x p99`, clamped
  to [floor, ceiling], and the ceiling itself until `min_samples` samples have been seen (with too
  few samples a p99 is a guess; the ceiling is the old fixed behaviour, never tighter).

A call that timed out is recorded as a sample of the limit it exceeded (`observe_timeout`): it took
at least that long, and leaving it out would bias the p99 low. This also keeps a real slowdown
from failing every call for ever: once more than 1% of the window timed out, the p99 reaches the
limit and the next limit is `multiplier` times higher, so the limit climbs geometrically to the
new normal (or the ceiling) instead of staying below it.

No transport or metrics import: services wire gauges and counters around it.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass


class RollingQuantile:
    """The `q`-quantile (nearest rank) of the last `window` samples."""

    def __init__(self, window: int, q: float = 0.99) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 0 < q <= 1:
            raise ValueError(f"q must be in (0, 1], got {q}")
        self._q = q
        self._arrivals: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []

    def add(self, value: float) -> None:
        if math.isnan(value):
            return  # a NaN would poison the order for the whole window
        if len(self._arrivals) == self._arrivals.maxlen:
            oldest = self._arrivals[0]
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._arrivals.append(value)  # drops the oldest from the deque when full
        bisect.insort(self._sorted, value)

    def __len__(self) -> int:
        return len(self._sorted)

    def value(self) -> float | None:
        """None while empty."""
        n = len(self._sorted)
        if n == 0:
            return None
        return self._sorted[max(0, math.ceil(self._q * n) - 1)]


@dataclass(frozen=True)
class TimeoutPolicy:
    """How a timeout follows its p99: `multiplier x p99` within [floor_s, ceiling_s]; `ceiling_s`
    until `min_samples` of the last `window` samples have been seen."""

    multiplier: float = 2.0
    floor_s: float = 1.0
    ceiling_s: float = 60.0
    window: int = 1000
    min_samples: int = 50

    def problems(self, multiplier: str, floor: str, ceiling: str, window: str, min_samples: str) -> list[str]:
        """What is wrong with these values, each naming its variable (the arguments: their names)."""
        found = []
        if not self.multiplier >= 1:
            found.append(f"{multiplier} must be >= 1 (a timeout below the p99 fails healthy calls), got {self.multiplier}")
        if not 0 < self.floor_s <= self.ceiling_s:
            found.append(f"{floor} must be > 0 and <= {ceiling}, got {self.floor_s} and {self.ceiling_s}")
        if self.window < 1:
            found.append(f"{window} must be >= 1, got {self.window}")
        if not 1 <= self.min_samples <= max(1, self.window):
            found.append(f"{min_samples} must be in [1, {window}], got {self.min_samples}")
        return found

    def clamp(self, seconds: float) -> float:
        return min(self.ceiling_s, max(self.floor_s, seconds))


class AdaptiveTimeout:
    """`multiplier x` the rolling p99 of what `observe` was told, clamped (see the module)."""

    def __init__(self, policy: TimeoutPolicy, q: float = 0.99) -> None:
        self.policy = policy
        self._quantile = RollingQuantile(policy.window, q)
        self._current = policy.ceiling_s

    def observe(self, seconds: float) -> None:
        """One completed call's duration."""
        self._quantile.add(seconds)
        self._refresh()

    def observe_timeout(self, limit_s: float) -> None:
        """A call that exceeded `limit_s`: it took at least that long (a censored sample)."""
        self.observe(limit_s)

    @property
    def samples(self) -> int:
        return len(self._quantile)

    @property
    def p99(self) -> float | None:
        return self._quantile.value()

    @property
    def warmed_up(self) -> bool:
        return self.samples >= self.policy.min_samples

    def current(self) -> float:
        """The timeout to use now, in seconds."""
        return self._current

    def _refresh(self) -> None:
        p99 = self._quantile.value()
        if p99 is None or not self.warmed_up:
            self._current = self.policy.ceiling_s
        else:
            self._current = self.policy.clamp(self.policy.multiplier * p99)
