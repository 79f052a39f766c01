"""A circuit breaker in front of the shared backend.

closed: calls go through; `failure_threshold` failures in a row open it. open: calls do not even
try (the failure policy answers at once) for `open_s`. Then one call probes (half-open): success
(any answer from the backend) closes it, failure opens it again, and a probe abandoned without a
verdict lets the next call probe.
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 3, open_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self._clock = clock
        self.state = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False

    def allow(self) -> bool:
        if self.state == CLOSED:
            return True
        if self.state == OPEN and self._clock() >= self._opened_at + self.open_s:
            self.state = HALF_OPEN
            self._probing = False
        if self.state == HALF_OPEN and not self._probing:
            self._probing = True
            return True
        return False

    def success(self) -> None:
        self.state = CLOSED
        self._failures = 0
        self._probing = False

    def abandon(self) -> None:
        """A call that ended with no verdict on the backend (its caller went away): a probe it was
        is over, and the next call probes instead, so that the breaker never waits on one forever."""
        if self.state == HALF_OPEN:
            self._probing = False

    def failure(self) -> None:
        self._failures += 1
        if self.state == HALF_OPEN or self._failures >= self.failure_threshold:
            self.state = OPEN
            self._opened_at = self._clock()
            self._probing = False

    def retry_after(self) -> float:
        if self.state == OPEN:
            return max(0.0, self._opened_at + self.open_s - self._clock())
        return 0.0
