"""Sliding-window budgets kept as a log of admissions (a sliding log with running totals).

Why not fixed windows: a fixed window resets its counter at the boundary, so a client can spend
the whole limit in the last second of one window and again in the first second of the next:
2x the limit in the period that straddles the boundary (the "double burst at the window edge").
Why not GCRA / a token bucket with a burst of the full limit: in any period it admits the burst
plus the refill, up to 2x the limit again, and a burst small enough to hold the limit within 3%
would refuse every request bigger than 3% of it (a 4k-token reservation against a 100k TPM budget).
Why not the interpolating two-window counter, or sub-window buckets: the first assumes the previous
window's traffic was uniform and overshoots when it was not; buckets free capacity up to one bucket
late, and under heavy oversubscription (the limit spent in the first tenth of a window) a window can
then hold 20% less than the limit unless the buckets are tiny.

So each admission is an entry (time, amount, interactive?) and the usage at time t is the sum of
the entries with time > t - window_s, kept as running totals: entries leave in time order, each
exactly window_s after it was admitted. The tokens admitted in ANY window of length window_s
therefore never exceed the limit, and a saturated window holds the limit minus less than one
request. Memory is one entry per admission in the window (a sorted set per budget in Redis).

Pacing: an exact log replays its bursts. If the limit was spent in the first 0.2 s of a window
(a burst of arrivals, or clients that stalled and caught up), the capacity comes back in one burst
window_s later, and clients that do not happen to be waiting at that instant leave it unused, so the
windows that end during the replay hold less than the limit. So admissions are also paced, as
OpenAI quantizes its limits: a GCRA (virtual scheduling) per budget lets `burst` through at once,
then `limit / window_s` per second. A request bigger than the burst is admitted when nothing is
owed (it goes into debt), so no request is refused forever; interactive requests may go deeper into
debt by the interactive floor, so bulk traffic that keeps the pace saturated cannot starve them.
With the log as a hard cap and bursts bounded, every window under sustained oversubscription holds
the limit within about `burst`. burst >= limit turns pacing off.

A refund (the unused part of a reservation) is taken out of the entry it was charged to, so it is
usable at once; if the entry has already left the window there is nothing to give back.

Interactive/bulk floor: the interactive part is totalled too. Interactive is admitted while
used + cost <= limit; bulk only while used + cost + max(0, floor - interactive_used) <= limit, so bulk
fills idle capacity but always leaves the floor to interactive. A denial's retry_after is when that
rule first admits as entries leave oldest first, both totals followed: for bulk, an interactive entry
that leaves frees nothing while interactive is under its floor (the reserve grows by what it covered).
The Redis Lua script implements the same rules (see redis_backend.py); the unit tests run one suite
against both.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def admits(used: int, interactive_used: int, cost: int, limit: int, floor: int, interactive: bool) -> bool:
    """The admission rule of every budget, windowed or in flight."""
    reserve = 0 if interactive else max(0, floor - interactive_used)
    return used + cost + reserve <= limit


class Entry:
    __slots__ = ("at", "amount", "interactive")

    def __init__(self, at: float, amount: int, interactive: bool) -> None:
        self.at = at
        self.amount = amount
        self.interactive = interactive


@dataclass
class SlidingWindow:
    """One budget's window: admissions in time order and their running totals."""

    window_s: float
    entries: deque[Entry] = field(default_factory=deque)
    total: int = 0
    interactive_total: int = 0
    # GCRA's theoretical arrival time: the pace is owed until then.
    tat: float = 0.0

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        entries = self.entries
        while entries and entries[0].at <= horizon:
            entry = entries.popleft()
            self.total -= entry.amount
            if entry.interactive:
                self.interactive_total -= entry.amount

    def pace_wait(self, now: float, cost: int, limit: int, burst: int, floor: int, interactive: bool) -> float:
        """0 when the pace admits `cost` now, else how long until it would."""
        if burst <= 0 or burst >= limit:
            return 0.0
        interval = self.window_s / limit
        debt = max(self.tat, now) - now
        tolerance = max(0.0, (burst - cost) * interval) + (floor * interval if interactive else 0.0)
        wait = debt - tolerance
        return wait if wait > 1e-9 else 0.0  # float noise is not a debt

    def pace(self, now: float, amount: int, limit: int) -> None:
        """Charges (amount > 0) or refunds (amount < 0) the pace. One charge owes at most a whole
        limit's worth (one window): a Commit far over its reservation is charged in full to the
        window's log, not paced for a multiple of the window."""
        if amount > 0:
            self.tat = max(self.tat, now) + min(amount, limit) * self.window_s / limit
        else:
            self.tat += amount * self.window_s / limit

    def usage(self, now: float) -> tuple[int, int]:
        self._trim(now)
        return self.total, self.interactive_total

    def add(self, now: float, amount: int, interactive: bool) -> Entry:
        self._trim(now)
        entry = Entry(now, amount, interactive)
        self.entries.append(entry)
        self.total += amount
        if interactive:
            self.interactive_total += amount
        return entry

    def refund(self, now: float, entry: Entry, amount: int) -> None:
        """Gives `amount` back to `entry` if it is still in the window."""
        self._trim(now)
        if entry.at <= now - self.window_s:
            return
        given = min(amount, entry.amount)
        entry.amount -= given
        self.total -= given
        if entry.interactive:
            self.interactive_total -= given

    def reset_after(self, now: float) -> float:
        self._trim(now)
        return max(0.0, self.entries[-1].at + self.window_s - now) if self.entries else 0.0

    def retry_after(self, now: float, cost: int, limit: int, floor: int, interactive: bool) -> float:
        """How long until `admits` would take `cost`: 0 if it does now, else until the entry whose
        leaving is enough. Entries leave oldest first; for bulk, each interactive one that leaves
        also gives back to the floor's reserve what it had covered, so both totals are followed."""
        self._trim(now)
        room = limit - cost  # used + reserve must fit in it
        used, interactive_used = self.total, self.interactive_total
        if used + (0 if interactive else max(0, floor - interactive_used)) <= room:
            return 0.0
        for entry in self.entries:
            used -= entry.amount
            if entry.interactive:
                interactive_used -= entry.amount
            if used + (0 if interactive else max(0, floor - interactive_used)) <= room:
                return max(0.0, entry.at + self.window_s - now)
        return self.window_s
