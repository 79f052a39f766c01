"""One record per gateway stream: its timings and token counts, kept once and read by everyone.

The InferencePath makes a StreamRecord when a generation arrives; its GenerateStream updates it once
per chunk (`observe`), and three readers take what they need from it, so that a stream is counted
once, on one clock:

- the rate-limit commit (admission.Ticket.settle): the tokens used are the adapter's final usage
  when it reported one, else the estimated input plus the completion tokens counted from the chunks;
- the CompletionEvent (completion_events.CompletionTracker.build): the wall-clock start, the text
  (only for a tenant that logs text: otherwise it is never even kept), the final chunk, and, for a
  stream that ended without one, the gateway's own timings and counted tokens;
- the default deadline's rolling p99s (default_deadline.DefaultDeadline.observe_stream): `timing`.

Every interval is measured on time.monotonic, from the request's arrival at the gateway; the
wall clock is read once, for the event's timestamps. Plain domain logic: chunks are read by their
fields (text, token_count, usage, finish_reason), no transport import.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamRecord:
    """What one stream did: when it arrived, its first token and last chunk came, what it produced."""

    # Monotonic seconds of the request's arrival; every time below is on the same clock.
    arrived_at: float = field(default_factory=time.monotonic)
    # Wall-clock seconds of the arrival, for the event's started_at.
    started_wall: float = field(default_factory=time.time)
    # Whether the text is kept (the tenant logs text and events are on).
    keep_text: bool = False
    first_token_at: float | None = None
    last_chunk_at: float | None = None
    # Completion tokens counted from the chunks' token_count (every choice's).
    completion_tokens: int = 0
    # The adapter's usage (sluice.common.v1.Usage) when a chunk reported one: the request's final.
    usage: Any = None
    # The text the event records (choice 0's), when kept.
    parts: list[str] = field(default_factory=list)
    # The request's final chunk (its finish reason, usage and timings), once it came.
    final: Any = None

    def observe(self, chunk: Any, *, text: str | None = None, done: bool | None = None, now: float | None = None) -> None:
        """One chunk of the stream (with n choices, the request's merged one: usage only on its
        last). `text`: what the event records of it (default: its own text); `done`: whether it
        ends the request (default: it has a finish reason); `now`: its monotonic arrival time."""
        now = time.monotonic() if now is None else now
        self.last_chunk_at = now
        if self.first_token_at is None and (chunk.text or chunk.token_count):
            self.first_token_at = now
        self.completion_tokens += chunk.token_count
        if chunk.HasField("usage"):
            self.usage = chunk.usage
        text = chunk.text if text is None else text
        if text and self.keep_text:
            self.parts.append(text)
        if chunk.finish_reason if done is None else done:
            self.final = chunk

    @property
    def tokens(self) -> int:
        """The completion tokens: the adapter's count when it reported usage, else those counted."""
        return self.usage.completion_tokens if self.usage is not None else self.completion_tokens

    def used_tokens(self, estimated_input_tokens: int) -> int:
        """What the rate-limit commit charges: the reported usage, or, without one (cancelled,
        failed, or an adapter that does not count), the input's estimate plus the counted tokens.
        An empty usage is no usage: every call uses at least one token, and committing 0 would
        refund the whole reservation of work that was done."""
        if self.usage is not None:
            used = int(self.usage.total_tokens or self.usage.prompt_tokens + self.usage.completion_tokens)
            if used > 0:
                return used
        return estimated_input_tokens + self.completion_tokens

    def timing(self, cut: bool = False, now: float | None = None) -> tuple[float | None, int, float]:
        """(seconds from arrival to the first token, None when none came; completion tokens;
        seconds from arrival to the last chunk, or to now when the stream was cut off or sent nothing)."""
        if cut or self.last_chunk_at is None:
            end = time.monotonic() if now is None else now
        else:
            end = self.last_chunk_at
        first = None if self.first_token_at is None else self.first_token_at - self.arrived_at
        return first, self.tokens, end - self.arrived_at
