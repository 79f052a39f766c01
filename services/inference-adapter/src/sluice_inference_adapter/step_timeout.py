"""The per-step timeout: how long one step request to Triton may take before its replica is
deemed stuck, following the pool's observed step durations (sluice_common.adaptive_timeout).

A step's duration depends on what it carries: a decode-only step costs about the same whatever the
load (one token per running sequence, batched), but a step that prefills a 2,000-token prompt costs
hundreds of decode steps on a CPU. One p99 over all steps would either fail long prefills (a
legitimate but rare step, below the 1% tail) or give every decode step the prefill's allowance. So
there are two rolling p99s:

- of decode-only steps' durations (seconds), and
- of prefill steps' duration per prefilled prompt token (seconds / token, the whole step's time
  charged to its prompt tokens: an over-estimate, on the safe side),

and the limit of a step that prefills `n` tokens is

    clamp(multiplier x (p99_decode + n x p99_prefill_per_token), floor, ceiling)

(for a decode-only step, n = 0: `multiplier x p99`). Each part is the ceiling until it has seen
`min_samples` samples.

One instance serves every replica of a model (the pool's p99, not each replica's): a replica that
turns slow then exceeds a limit set by its healthy peers and is failed, instead of raising its own
limit as it slows. With a single replica the pool's p99 is that replica's, and only the censored
samples of steps that timed out (adaptive_timeout.AdaptiveTimeout.observe_timeout) move it up.
"""

from __future__ import annotations

from sluice_common.adaptive_timeout import RollingQuantile, TimeoutPolicy


class StepTimeouts:
    def __init__(self, policy: TimeoutPolicy, model: str = "") -> None:
        self.policy = policy
        self.model = model
        self._decode = RollingQuantile(policy.window)
        self._per_prefill_token = RollingQuantile(policy.window)

    def limit(self, prefill_tokens: int = 0) -> float:
        """The timeout of a step that prefills `prefill_tokens` prompt tokens (0: decode only)."""
        policy = self.policy
        decode = self._decode.value()
        if decode is None or len(self._decode) < policy.min_samples:
            return policy.ceiling_s
        estimate = decode
        if prefill_tokens > 0:
            per_token = self._per_prefill_token.value()
            if per_token is None or len(self._per_prefill_token) < policy.min_samples:
                return policy.ceiling_s
            estimate += prefill_tokens * per_token
        return policy.clamp(policy.multiplier * estimate)

    def observe(self, seconds: float, prefill_tokens: int = 0) -> None:
        """A step that completed in `seconds`."""
        if prefill_tokens > 0:
            self._per_prefill_token.add(seconds / prefill_tokens)
        else:
            self._decode.add(seconds)

    def observe_timeout(self, limit_s: float, prefill_tokens: int = 0) -> None:
        """A step that exceeded `limit_s`: it took at least that long (a censored sample)."""
        self.observe(limit_s, prefill_tokens)

    @property
    def decode_p99(self) -> float | None:
        return self._decode.value()
