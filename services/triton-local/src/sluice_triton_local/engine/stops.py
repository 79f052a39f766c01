"""Stop-sequence matching over a stream of text deltas."""

from __future__ import annotations

from collections.abc import Sequence


class StopFilter:
    """Withholds text that might be the start of a stop string.

    Invariant: the held-back text is the longest suffix of everything seen
    that is a proper prefix of some stop string. Any stop occurrence must
    therefore start inside the held-back text, so searching only there finds
    it, and nothing emitted can ever be part of a stop string.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        if not self._stops:
            return delta, False
        text = self._pending + delta
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._pending = ""
            return text[: min(hits)], True
        hold = self._held_suffix(text)
        self._pending = text[len(text) - hold :]
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """The sequence ended for another reason: held text is not a stop."""
        text, self._pending = self._pending, ""
        return text

    def _held_suffix(self, text: str) -> int:
        for k in range(min(len(text), self._max_hold), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
