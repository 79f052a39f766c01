"""How many bulk rows a job worker runs at once: Little's law to start, AIMD to adapt.

The allowance itself is held by the rate-limit service (shared by every worker and by interactive
traffic); this bound only decides how many rows one worker keeps asking for. Too few and the
allowance goes unused while rows wait on the model; too many and rows only collect
RESOURCE_EXHAUSTED and queue in the adapter, raising everybody's latency.

- Start (Little's law): once the first row has completed and its lease told the allowed rate
  (x-ratelimit-limit-requests per minute), limit = rate x observed latency x headroom: the number
  of rows that must be in flight for completions to keep pace with the allowance.
- Additive increase: each completed row adds 1/limit (about +1 per round trip) while latency is
  within `latency_tolerance` x the best latency seen recently.
- Multiplicative decrease: on RESOURCE_EXHAUSTED, and when latency grows past the tolerance
  (the backend is queueing, more rows in flight only add waiting). Neither takes the limit below
  the Little's-law target (with the best recent latency): the goal is rows completed per minute,
  and that needs rate x latency rows in flight even if some of them are told to wait.

Plain asyncio, no gRPC: unit-tested directly (tests/test_concurrency.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

OK, THROTTLED, FAILED = "ok", "throttled", "failed"


@dataclass
class AdaptiveConcurrency:
    initial: float = 4.0
    minimum: float = 1.0
    maximum: float = 256.0
    headroom: float = 1.2
    decrease: float = 0.9
    latency_tolerance: float = 2.0
    # Weight of a new sample in the latency average.
    smoothing: float = 0.2
    # The "best latency" forgets samples older than this (load changes, so does the floor).
    min_window_s: float = 30.0
    limit: float = field(init=False)
    in_flight: int = field(init=False, default=0)
    latency_s: float | None = field(init=False, default=None)
    allowed_rate_per_s: float | None = field(init=False, default=None)
    started_from_littles_law: bool = field(init=False, default=False)
    # (monotonic time, limit, reason) at each change, for metrics and the benchmark.
    history: list[tuple[float, float, str]] = field(init=False, default_factory=list)
    _best: list[tuple[float, float]] = field(init=False, default_factory=list)
    _changed: asyncio.Condition | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.limit = max(self.minimum, min(self.maximum, self.initial))
        self.history.append((time.monotonic(), self.limit, "initial"))

    # ---- the gate

    @property
    def bound(self) -> int:
        return max(1, math.floor(self.limit))

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def acquire(self) -> None:
        condition = self._condition()
        async with condition:
            await condition.wait_for(lambda: self.in_flight < self.bound)
            self.in_flight += 1

    async def release(self, latency_s: float, outcome: str, allowed_rate_per_s: float | None = None) -> None:
        self.observe(latency_s, outcome, allowed_rate_per_s)
        condition = self._condition()
        async with condition:
            self.in_flight = max(0, self.in_flight - 1)
            condition.notify_all()

    # ---- the policy (synchronous, for tests)

    def littles_law_target(self) -> float | None:
        """allowed rate x latency x headroom; the latency is the best seen recently (the no-load
        latency), so that queueing never feeds back into a higher target."""
        if self.allowed_rate_per_s is None or self.latency_s is None:
            return None
        latency = min((v for _, v in self._best), default=self.latency_s)
        return max(self.minimum, min(self.maximum, self.allowed_rate_per_s * latency * self.headroom))

    def _set(self, value: float, reason: str) -> None:
        value = max(self.minimum, min(self.maximum, value))
        if math.floor(value) != math.floor(self.limit) or reason == "littles_law":
            self.history.append((time.monotonic(), value, reason))
        self.limit = value

    def _best_latency(self, now: float, sample: float) -> float:
        self._best = [(t, v) for t, v in self._best if now - t < self.min_window_s]
        self._best.append((now, sample))
        return min(v for _, v in self._best)

    def observe(self, latency_s: float, outcome: str, allowed_rate_per_s: float | None = None) -> None:
        now = time.monotonic()
        if allowed_rate_per_s:
            self.allowed_rate_per_s = allowed_rate_per_s
        if outcome == THROTTLED:
            target = self.littles_law_target() or self.minimum
            self._set(max(target, self.limit * self.decrease), "throttled")
            return
        if outcome != OK:
            return
        self.latency_s = latency_s if self.latency_s is None else (1 - self.smoothing) * self.latency_s + self.smoothing * latency_s
        best = self._best_latency(now, latency_s)
        if not self.started_from_littles_law:
            target = self.littles_law_target()
            if target is not None:
                self.started_from_littles_law = True
                self._set(target, "littles_law")
                return
        if self.latency_s > self.latency_tolerance * best:
            # Queueing: fewer rows in flight, but never fewer than the allowance needs.
            floor = self.littles_law_target() or self.minimum
            if self.limit > floor:
                self._set(max(floor, self.limit * self.decrease), "latency")
        else:
            self._set(self.limit + 1.0 / self.limit, "increase")
