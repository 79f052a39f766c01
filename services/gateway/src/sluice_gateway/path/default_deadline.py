"""The deadline of a request whose client set none (a gRPC call without a timeout, or any HTTP
request): derived from what recent requests took, so that a stuck call is freed but a slow hour is
not cut off.

A generation's total time scales with the tokens it makes, so a p99 of whole streams means little
(a 16-token answer and a 1,024-token one share it). Instead two rolling p99s are kept over
completed streams, both measured here at the gateway (admission, queueing and every hop included):

- time to first token (from the request's arrival at the gateway), and
- time per output token after the first ((last chunk - first token) / (tokens - 1)),

and a generation asking for up to `max_tokens` gets

    clamp(multiplier x (p99_ttft + max_tokens x p99_per_token), floor, ceiling)

An Embed gets `clamp(multiplier x p99_embed)` over completed Embed calls. Each is the ceiling until
`min_samples` requests of its kind have been seen. A stream the default deadline cut off still
tells what it saw: its time to first token (or the whole deadline, when none came: a censored
sample) and its time per token so far, so a real slowdown raises the next deadline instead of
cutting every request (sluice_common.adaptive_timeout).

A deadline the client set is always honoured as it is; the job worker gives its rows their own,
by the same rule over its own rows (row_deadline.py). No transport import here.
"""

from __future__ import annotations

from sluice_common.adaptive_timeout import RollingQuantile, TimeoutPolicy


class DefaultDeadline:
    def __init__(self, policy: TimeoutPolicy) -> None:
        self.policy = policy
        self._ttft = RollingQuantile(policy.window)
        self._per_token = RollingQuantile(policy.window)
        self._embed = RollingQuantile(policy.window)

    def _warm(self, *quantiles: RollingQuantile) -> bool:
        return all(len(q) >= self.policy.min_samples for q in quantiles)

    def expected_generate(self, max_tokens: int) -> float | None:
        """p99 time to first token + `max_tokens` x p99 time per token: what such a generation takes
        at worst, as recent ones went (the deadline is a multiple of it); None until warm."""
        ttft, per_token = self._ttft.value(), self._per_token.value()
        if ttft is None or per_token is None or not self._warm(self._ttft, self._per_token):
            return None
        return ttft + max(0, max_tokens) * per_token

    def expected_embed(self) -> float | None:
        """The p99 of Embed calls; None until warm."""
        embed = self._embed.value()
        return embed if embed is not None and self._warm(self._embed) else None

    def for_generate(self, max_tokens: int) -> float:
        """The deadline, in seconds from arrival, of a generation of up to `max_tokens` tokens."""
        expected = self.expected_generate(max_tokens)
        return self.policy.ceiling_s if expected is None else self.policy.clamp(self.policy.multiplier * expected)

    def for_embed(self) -> float:
        expected = self.expected_embed()
        return self.policy.ceiling_s if expected is None else self.policy.clamp(self.policy.multiplier * expected)

    def observe_stream(self, first_token_s: float | None, tokens: int, total_s: float) -> None:
        """A stream that ended (completed, or cut off by its default deadline at `total_s`):
        seconds from arrival to its first token (None: none came), and its tokens."""
        if first_token_s is None:
            self._ttft.add(total_s)  # it waited at least this long for a first token
            return
        self._ttft.add(first_token_s)
        if tokens > 1:
            self._per_token.add(max(0.0, total_s - first_token_s) / (tokens - 1))

    def observe_embed(self, seconds: float) -> None:
        self._embed.add(seconds)

    def p99s(self) -> dict[str, float | None]:
        """The rolling p99s the deadlines come from, by part (for the metrics)."""
        return {"ttft": self._ttft.value(), "per_token": self._per_token.value(), "embed": self._embed.value()}
