"""The in-memory backend: one replica's truth, in this process (the default).

Every method runs without an await between reading and writing, so on one event loop each
decision is atomic, like the Redis script.
"""

from __future__ import annotations

import heapq
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sluice_rate_limit.budgets import BudgetState, Check, Decision, Kind, LeaseNotFound
from sluice_rate_limit.sliding_window import Entry, SlidingWindow, admits

# In-flight budgets free capacity when some lease settles, which cannot be predicted: a retry hint.
GAUGE_RETRY_S = 1.0


@dataclass
class _Lease:
    interactive: bool
    expires_at: float
    # (check, its window entry; None for gauges)
    entries: list[tuple[Check, Entry | None]] = field(default_factory=list)


class MemoryBackend:
    name = "memory"

    def __init__(
        self,
        window_s: float,
        clock: Callable[[], float] = time.time,
        on_expired: Callable[[int], None] | None = None,
        lease_prefix: str = "",
    ) -> None:
        self.window_s = window_s
        self._clock = clock
        self._on_expired = on_expired
        self._prefix = lease_prefix
        self._windows: dict[str, SlidingWindow] = {}
        # key -> [total, interactive]
        self._gauges: dict[str, list[int]] = {}
        self._leases: dict[str, _Lease] = {}
        self._expiries: list[tuple[float, str]] = []

    def _window(self, key: str) -> SlidingWindow:
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = SlidingWindow(self.window_s)
        return window

    def _gauge(self, key: str) -> list[int]:
        return self._gauges.setdefault(key, [0, 0])

    def _sweep(self, now: float) -> None:
        expired = 0
        while self._expiries and self._expiries[0][0] <= now:
            _at, lease_id = heapq.heappop(self._expiries)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at <= now:
                del self._leases[lease_id]
                self._free_gauges(lease)
                expired += 1
        if expired and self._on_expired is not None:
            self._on_expired(expired)

    def _free_gauges(self, lease: _Lease) -> None:
        for check, _entry in lease.entries:
            if check.kind is Kind.GAUGE:
                gauge = self._gauge(check.key)
                gauge[0] = max(0, gauge[0] - check.cost)
                if lease.interactive:
                    gauge[1] = max(0, gauge[1] - check.cost)

    def _usage(self, check: Check, now: float) -> tuple[int, int]:
        if check.kind is Kind.WINDOW:
            return self._window(check.key).usage(now)
        total, interactive = self._gauge(check.key)
        return total, interactive

    def _state(self, check: Check, now: float) -> BudgetState:
        used, _ = self._usage(check, now)
        reset = self._window(check.key).reset_after(now) if check.kind is Kind.WINDOW else 0.0
        return BudgetState(check.budget, check.limit, max(0, check.limit - used), reset, check.name)

    async def acquire(
        self, checks: list[Check], interactive: bool, ttl_s: float, shadow: bool, tag: str = ""
    ) -> Decision:
        checks = [replace(c, key=f"{tag}|{c.key}") for c in checks]
        now = self._clock()
        self._sweep(now)
        denied: Check | None = None
        retry = 0.0
        for check in checks:
            used, interactive_used = self._usage(check, now)
            pace = 0.0
            if check.kind is Kind.WINDOW:
                pace = self._window(check.key).pace_wait(now, check.cost, check.limit, check.burst, check.floor, interactive)
            if pace <= 0.0 and admits(used, interactive_used, check.cost, check.limit, check.floor, interactive):
                continue
            if check.kind is Kind.WINDOW:
                reserve = 0 if interactive else max(0, check.floor - interactive_used)
                must_free = used + check.cost + reserve - check.limit
                wait = max(pace, self._window(check.key).retry_after(now, must_free) if must_free > 0 else 0.0)
            else:
                wait = GAUGE_RETRY_S
            if denied is None or wait > retry:
                denied, retry = check, wait
        if denied is not None:
            return Decision(
                allowed=False,
                states=[self._state(c, now) for c in checks],
                denied_by=denied.budget,
                denied_name=denied.name,
                retry_after_s=retry,
                shadow=shadow,
            )
        lease = _Lease(interactive=interactive, expires_at=now + ttl_s)
        for check in checks:
            entry = None
            if check.kind is Kind.WINDOW:
                window = self._window(check.key)
                entry = window.add(now, check.cost, interactive)
                if 0 < check.burst < check.limit:
                    window.pace(now, check.cost, check.limit)
            else:
                gauge = self._gauge(check.key)
                gauge[0] += check.cost
                if interactive:
                    gauge[1] += check.cost
            lease.entries.append((check, entry))
        lease_id = self._prefix + uuid.uuid4().hex
        self._leases[lease_id] = lease
        heapq.heappush(self._expiries, (lease.expires_at, lease_id))
        return Decision(
            allowed=True,
            lease_id=lease_id,
            lease_expires_at=lease.expires_at,
            states=[self._state(c, now) for c in checks],
        )

    async def settle(self, lease_id: str, used_tokens: int | None) -> list[BudgetState]:
        """Commit (used_tokens known) or release (None: refund the whole reservation)."""
        now = self._clock()
        self._sweep(now)
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise LeaseNotFound(lease_id)
        self._free_gauges(lease)
        for check, entry in lease.entries:
            if check.kind is Kind.WINDOW and check.refundable and entry is not None:
                delta = check.cost - (used_tokens or 0)
                window = self._window(check.key)
                paced = 0 < check.burst < check.limit
                if delta > 0:
                    window.refund(now, entry, delta)
                elif delta < 0:  # used more than reserved: charge the truth
                    window.add(now, -delta, lease.interactive)
                if paced and delta:
                    window.pace(now, -delta, check.limit)
        return [self._state(check, now) for check, _ in lease.entries]

    async def peek(self, checks: list[Check], tag: str = "") -> list[BudgetState]:
        checks = [replace(c, key=f"{tag}|{c.key}") for c in checks]
        now = self._clock()
        self._sweep(now)
        return [self._state(c, now) for c in checks]

    def owns(self, lease_id: str) -> bool:
        return lease_id.startswith(self._prefix) if self._prefix else True

    async def close(self) -> None:
        return None
