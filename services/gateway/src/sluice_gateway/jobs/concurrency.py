"""How many bulk rows a job worker runs at once: Little's law to start, AIMD to adapt.

The allowance itself is held by the rate-limit service (shared by every worker and by interactive
traffic); this bound only decides how many rows one worker keeps asking for. Too few and the
allowance goes unused while rows wait on the model; too many and rows only collect
RESOURCE_EXHAUSTED and queue in the adapter, raising everybody's latency.

- Start (Little's law): once the first row has completed and its lease told the allowed rate
  (the requests-per-minute budget), limit = rate x observed latency x headroom: the number of rows
  that must be in flight for completions to keep pace with the allowance.
- Additive increase: each completed row adds 1/limit (about +1 per round trip), except while the
  latency window is slow, in the window after a decrease for RESOURCE_EXHAUSTED, and while the
  bound is not in use. A success says something about the bound only when the bound was what held
  rows back; rows that wait out RESOURCE_EXHAUSTED give their slot back while they sleep, so
  completions keep succeeding at flat latency with few slots taken, and without this rule the
  bound climbed to its maximum and meant nothing. The "application-limited" rule of Netflix
  concurrency-limits' AIMDLimit (`inflight * 2 >= limit`) and of TCP's congestion window
  validation (RFC 7661: pipeACK >= cwnd / 2): increase only when, at the completion, at least
  `in_use_share` (1/2) of the bound is in flight, counting the completing row. Why a half and
  not "full": demand on the gate comes in bursts (rows that slept out a denial wake together, a
  new job's rows arrive at once), so the bound should keep some room above the rows of the moment
  instead of being pinned to them, and a fractional limit must be able to grow past its integer
  bound; a bound less than half used, though, could be halved without holding back a single row.
  So an unused bound settles at about twice the rows in flight, and only a bound that the gate
  actually enforces climbs towards `maximum`.
- Multiplicative decrease, on RESOURCE_EXHAUSTED (at most once per `window` completions, so a
  burst of denials for rows that were already in flight counts once), and on latency only when
  the p90 of `window` consecutive completions exceeds `latency_tolerance` x the lowest window p90
  seen recently for `sustain` windows in a row: one slow row, or one noisy second on a shared
  box, never moves the bound down.
- Neither takes the limit below the Little's-law bound (allowed rate x the median latency of the
  latest window x headroom): the goal is rows completed per minute, and that needs rate x latency
  rows in flight even if some of them are told to wait.

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
    # Completions per latency window, and how many windows in a row must be slow to decrease.
    window: int = 16
    sustain: int = 3
    # The "best window p90" forgets windows older than this (load changes, so does the floor).
    min_window_s: float = 60.0
    # Additive increase only when at least this share of the bound is in flight at a completion.
    in_use_share: float = 0.5
    limit: float = field(init=False)
    in_flight: int = field(init=False, default=0)
    latency_s: float | None = field(init=False, default=None)
    allowed_rate_per_s: float | None = field(init=False, default=None)
    started_from_littles_law: bool = field(init=False, default=False)
    # (monotonic time, limit, reason) at each change, for metrics and the benchmark.
    history: list[tuple[float, float, str]] = field(init=False, default_factory=list)
    _samples: list[float] = field(init=False, default_factory=list)
    _best: list[tuple[float, float]] = field(init=False, default_factory=list)
    _slow_windows: int = field(init=False, default=0)
    _since_throttle_decrease: int = field(init=False, default=1 << 30)
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
        # Observed before the slot is freed: in_flight still counts the completing row.
        self.observe(latency_s, outcome, allowed_rate_per_s)
        condition = self._condition()
        async with condition:
            self.in_flight = max(0, self.in_flight - 1)
            condition.notify_all()

    # ---- the policy (synchronous, for tests)

    def littles_law_target(self) -> float | None:
        """allowed rate x latency x headroom; the latency is the median of the latest window (the
        first sample until a window is full), robust to the outliers of a noisy box."""
        if self.allowed_rate_per_s is None or self.latency_s is None:
            return None
        return max(self.minimum, min(self.maximum, self.allowed_rate_per_s * self.latency_s * self.headroom))

    def _set(self, value: float, reason: str) -> None:
        value = max(self.minimum, min(self.maximum, value))
        if math.floor(value) != math.floor(self.limit) or reason == "littles_law":
            self.history.append((time.monotonic(), value, reason))
        self.limit = value

    def _decrease(self, reason: str) -> None:
        floor = self.littles_law_target() or self.minimum
        if self.limit > floor:
            self._set(max(floor, self.limit * self.decrease), reason)

    def _close_window(self, now: float) -> bool:
        """Ends a window of completions; True when latency has been in a sustained rise."""
        ordered = sorted(self._samples)
        self._samples.clear()
        self.latency_s = ordered[len(ordered) // 2]
        p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
        self._best = [(t, v) for t, v in self._best if now - t < self.min_window_s]
        best = min((v for _, v in self._best), default=p90)
        self._best.append((now, p90))
        self._slow_windows = self._slow_windows + 1 if p90 > self.latency_tolerance * best else 0
        if self._slow_windows >= self.sustain:
            self._slow_windows = 0
            return True
        return False

    def in_use(self, in_flight: int) -> bool:
        """Whether the bound was in use at a completion with `in_flight` rows (the completing one
        included): only then does a success argue for a larger bound."""
        return in_flight >= self.in_use_share * self.limit

    def observe(self, latency_s: float, outcome: str, allowed_rate_per_s: float | None = None, in_flight: int | None = None) -> None:
        """One completion. `in_flight`: rows in flight at it, the completing one included
        (default: the gate's count, which `release` reads before freeing the slot)."""
        now = time.monotonic()
        if allowed_rate_per_s:
            self.allowed_rate_per_s = allowed_rate_per_s
        if outcome == THROTTLED:
            # Rows already in flight when the allowance ran out are denied together: one decrease
            # per window of completions, not one per denial.
            if self._since_throttle_decrease >= self.window:
                self._since_throttle_decrease = 0
                self._decrease("throttled")
            return
        if outcome != OK:
            return
        busy = self.in_flight if in_flight is None else in_flight
        self._since_throttle_decrease += 1
        if self.latency_s is None:
            self.latency_s = latency_s
        self._samples.append(latency_s)
        rising = len(self._samples) >= self.window and self._close_window(now)
        if not self.started_from_littles_law:
            target = self.littles_law_target()
            if target is not None:
                self.started_from_littles_law = True
                self._set(target, "littles_law")
                return
        if rising:
            self._decrease("latency")
        elif self._slow_windows == 0 and self._since_throttle_decrease > self.window and self.in_use(busy):
            # No increase in the window after a throttling decrease, nor while latency rises, nor
            # while the bound is not what limits the rows (application-limited).
            self._set(self.limit + 1.0 / self.limit, "increase")
        floor = self.littles_law_target()
        if floor is not None and self.limit < floor:
            self._set(floor, "littles_law")
