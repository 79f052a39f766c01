"""The in-memory backend: one replica's truth, in this process (the default).

Every method runs without an await between reading and writing, so on one event loop each
decision is atomic, like the Redis script.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sluice_common.request_context import new_unique_id
from sluice_rate_limit.budgets import BudgetState, Check, Decision, Kind, LeaseNotFound
from sluice_rate_limit.sliding_window import Entry, SlidingWindow, admits

# In-flight budgets free capacity when some lease settles, which cannot be predicted: a retry hint.
GAUGE_RETRY_S = 1.0
# A change in wall time less monotonic time beyond this is a step of the wall clock (NTP, a VM
# resumed), not the two clocks read a few microseconds apart.
WALL_STEP_S = 0.5


class _Gauge:
    __slots__ = ("total", "interactive")

    def __init__(self) -> None:
        self.total = 0
        self.interactive = 0


@dataclass
class _Lease:
    interactive: bool
    expires_at: float
    # (check, its window or gauge, its window entry: None for gauges)
    entries: list[tuple[Check, SlidingWindow | _Gauge, Entry | None]] = field(default_factory=list)


class MemoryBackend:
    name = "memory"

    def __init__(
        self,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_expired: Callable[[int], None] | None = None,
        lease_prefix: str = "",
        wall_clock: Callable[[], float] | None = None,
    ) -> None:
        """`clock` times the windows and expiries: monotonic, so a wall clock stepped back (NTP, a VM
        resumed) does not leave every window's entries in the future and its tenants refused for the
        step. `wall_clock` only dates the expiries the caller is told (Unix time): time.time with the
        default clock, else `clock` itself (a test's fake clock is both)."""
        self.window_s = window_s
        self._clock = clock
        self._wall_clock = wall_clock or (time.time if clock is time.monotonic else clock)
        # Wall time less this backend's clock: kept while it holds (so that the expiries told are
        # exactly as far apart as the decisions were), moved when the wall clock is stepped.
        self._wall_offset = self._wall_clock() - clock()
        self._on_expired = on_expired
        self._prefix = lease_prefix
        # tag -> key -> window or gauge
        self._stores: dict[str, dict[str, SlidingWindow | _Gauge]] = {}
        self._leases: dict[str, _Lease] = {}
        self._expiries: list[tuple[float, str]] = []

    def _stores_of(self, tag: str) -> dict[str, SlidingWindow | _Gauge]:
        stores = self._stores.get(tag)
        if stores is None:
            stores = self._stores[tag] = {}
        return stores

    def _store(self, stores: dict[str, SlidingWindow | _Gauge], check: Check) -> SlidingWindow | _Gauge:
        store = stores.get(check.key)
        if store is None:
            store = stores[check.key] = SlidingWindow(self.window_s) if check.kind is Kind.WINDOW else _Gauge()
        return store

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

    @staticmethod
    def _free_gauges(lease: _Lease) -> None:
        for check, store, _entry in lease.entries:
            if isinstance(store, _Gauge):
                store.total = max(0, store.total - check.cost)
                if lease.interactive:
                    store.interactive = max(0, store.interactive - check.cost)

    def _state(self, check: Check, store: SlidingWindow | _Gauge, now: float) -> BudgetState:
        # Runs for every budget of every decision (12 times per Acquire + Commit): one trim, no more.
        if isinstance(store, SlidingWindow):
            used, _ = store.usage(now)
            entries = store.entries
            reset = max(0.0, entries[-1].at + store.window_s - now) if entries else 0.0
        else:
            used, reset = store.total, 0.0
        return BudgetState(check.budget, check.limit, max(0, check.limit - used), reset, check.name)

    async def acquire(self, checks: list[Check], interactive: bool, ttl_s: float, shadow: bool, tag: str = "") -> Decision:
        now = self._clock()
        self._sweep(now)
        mine = self._stores_of(tag)
        stores = [self._store(mine, check) for check in checks]
        denied: Check | None = None
        retry = 0.0
        for check, store in zip(checks, stores):
            if isinstance(store, SlidingWindow):
                used, interactive_used = store.usage(now)
                pace = store.pace_wait(now, check.cost, check.limit, check.burst, check.floor, interactive)
            else:
                used, interactive_used, pace = store.total, store.interactive, 0.0
            if pace <= 0.0 and admits(used, interactive_used, check.cost, check.limit, check.floor, interactive):
                continue
            if isinstance(store, SlidingWindow):
                wait = max(pace, store.retry_after(now, check.cost, check.limit, check.floor, interactive))
            else:
                wait = GAUGE_RETRY_S
            if denied is None or wait > retry:
                denied, retry = check, wait
        if denied is not None:
            return Decision(
                allowed=False,
                states=[self._state(c, s, now) for c, s in zip(checks, stores)],
                denied_by=denied.budget,
                denied_name=denied.name,
                retry_after_s=retry,
                shadow=shadow,
            )
        lease = _Lease(interactive=interactive, expires_at=now + ttl_s)
        entries = lease.entries
        for check, store in zip(checks, stores):
            if isinstance(store, SlidingWindow):
                entries.append((check, store, store.add(now, check.cost, interactive)))
                if 0 < check.burst < check.limit:
                    store.pace(now, check.cost, check.limit)
            else:
                store.total += check.cost
                if interactive:
                    store.interactive += check.cost
                entries.append((check, store, None))
        # Every window was trimmed at `now` above and the last entry of each is the one just
        # added: the states are read off the charged totals, not by a second trim per budget.
        states = [
            BudgetState(c.budget, c.limit, max(0, c.limit - s.total), now + s.window_s - now if isinstance(s, SlidingWindow) else 0.0, c.name)
            for c, s in zip(checks, stores)
        ]
        # Not uuid4: os.urandom per decision; a random per-process prefix and a counter are as unique.
        lease_id = self._prefix + new_unique_id()
        self._leases[lease_id] = lease
        self._expire_at(lease.expires_at, lease_id)
        return Decision(allowed=True, lease_id=lease_id, lease_expires_at=self._wall(lease.expires_at), states=states)

    def _wall(self, at: float) -> float:
        """`at` (this backend's clock) as Unix time."""
        offset = self._wall_clock() - self._clock()
        if abs(offset - self._wall_offset) > WALL_STEP_S:
            self._wall_offset = offset
        return at + self._wall_offset

    def _expire_at(self, at: float, lease_id: str) -> None:
        expiries = self._expiries
        # A settled lease leaves its entry in the heap until its expiry (up to max_lease_ttl_s
        # later): at a thousand decisions a second that is most of a million stale entries.
        # Rebuilt from the live leases once the stale ones outnumber them, so the heap stays the
        # size of what is in flight (amortized: one rebuild per as many pushes as it drops).
        if len(expiries) > 2 * len(self._leases) + 1024:
            expiries = self._expiries = [(lease.expires_at, lid) for lid, lease in self._leases.items() if lid != lease_id]
            heapq.heapify(expiries)
        heapq.heappush(expiries, (at, lease_id))

    async def settle(self, lease_id: str, used_tokens: int | None) -> list[BudgetState]:
        """Commit (used_tokens known) or release (None: refund the whole reservation)."""
        now = self._clock()
        self._sweep(now)
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise LeaseNotFound(lease_id)
        self._free_gauges(lease)
        for check, store, entry in lease.entries:
            if entry is not None and check.refundable and isinstance(store, SlidingWindow):
                delta = check.cost - (used_tokens or 0)
                if delta > 0:
                    store.refund(now, entry, delta)
                elif delta < 0:  # used more than reserved: charge the truth
                    store.add(now, -delta, lease.interactive)
                if delta and 0 < check.burst < check.limit:
                    store.pace(now, -delta, check.limit)
        return [self._state(check, store, now) for check, store, _ in lease.entries]

    async def renew(self, lease_id: str, ttl_s: float) -> float:
        """A live lease's new expiry, `ttl_s` from now (LeaseNotFound once settled or expired)."""
        now = self._clock()
        self._sweep(now)
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound(lease_id)
        lease.expires_at = now + ttl_s
        # The earlier heap entry stays: _sweep skips an entry whose lease now expires later.
        self._expire_at(lease.expires_at, lease_id)
        return self._wall(lease.expires_at)

    async def peek(self, checks: list[Check], tag: str = "") -> list[BudgetState]:
        now = self._clock()
        self._sweep(now)
        mine = self._stores_of(tag)
        return [self._state(c, self._store(mine, c), now) for c in checks]

    def owns(self, lease_id: str) -> bool:
        return lease_id.startswith(self._prefix) if self._prefix else True

    async def close(self) -> None:
        return None
