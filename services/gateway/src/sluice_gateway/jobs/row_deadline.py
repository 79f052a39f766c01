"""A bulk row's deadline, from what this worker's recent rows took and the row's own max_tokens.

The same rule as the gateway's default deadline (default_deadline.py: multiplier x (p99 time to
first token + max_tokens x p99 time per token), or multiplier x p99 for an embedding), kept apart:
bulk rows wait behind interactive traffic, so their p99s are their own. The bounds are
WORKER_ROW_TIMEOUT_FLOOR_S and WORKER_ROW_TIMEOUT_CEILING_S (25 minutes: bulk work may be long, a
1,024-token row on a busy CPU replica needs minutes; within RabbitMQ's default consumer timeout).

Warm-up (fewer rows seen than the default deadline's MIN_SAMPLES): nothing trustworthy is observed
yet, and this process serves no interactive requests whose p99s it could borrow (those are another
process's, and they understate bulk rows anyway). So a row gets WORKER_ROW_TIMEOUT_S (enough for a
short row's queueing and first token), or, when longer, multiplier x (the first-token time seen so
far + max_tokens x a per-token time assumed on the slow side): WORKER_ROW_WARMUP_PER_TOKEN_S, or the
per-token time seen so far if that is slower. A long row is then not cut during warm-up, and a
short one's deadline (and rate-limit lease) stays short.

A row attempt cut off by its deadline gets twice that deadline next (capped at the ceiling), in
the next delivery of the row's message too when the worker handed it back in between (the cut rides
in its headers: worker.RetryChain); one cut off at the ceiling is not tried again (another attempt
would get no longer). `expected_s`
is what the row is expected to take at worst, for the worker to refuse a row that cannot finish
within what is left of its job's completion window.

Why not the fixed WORKER_ROW_TIMEOUT_S alone: a row's rate-limit lease lives for its deadline plus
a margin, and a worker that dies (SIGKILL, OOM) never settles its leases, so they hold the tenant's
in-flight budget until they expire: 150 s for 2-token rows with 120 s. No transport import here.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.jobs.v1 import jobs_pb2

from sluice_common.adaptive_timeout import TimeoutPolicy
from sluice_gateway.config import SharedSettings, WorkerSettings
from sluice_gateway.path.default_deadline import DefaultDeadline


# A cut-off row's next deadline over the one that cut it: doubling reaches the ceiling in a few
# attempts (the 30 s floor to the 1,500 s ceiling in 7: 30, 60, 120, 240, 480, 960, 1,500 s), and the attempts
# before the ceiling's waste less than the ceiling twice over in all. Not the deadline multiplier, which may be 1.
RETRY_GROWTH = 2.0


@dataclass(frozen=True)
class RowTiming:
    """What one completed attempt took: seconds to its first token (None: an embedding, or no
    token came), the tokens it generated, and its whole duration."""

    first_token_s: float | None
    tokens: int
    total_s: float


@dataclass(frozen=True)
class WarmUp:
    """What a row gets before enough rows have been seen: `deadline_s` at least, and for a
    generation `per_token_s` assumed for each of its max_tokens."""

    deadline_s: float
    per_token_s: float


class RowDeadlines:
    def __init__(self, policy: TimeoutPolicy, default_max_tokens: int, warm_up: WarmUp) -> None:
        self._deadline = DefaultDeadline(policy)
        self._default_max_tokens = default_max_tokens
        self._warm_up = warm_up

    @classmethod
    def for_settings(cls, shared: SharedSettings, worker: WorkerSettings) -> RowDeadlines:
        warm_up = WarmUp(worker.row_timeout_s, worker.row_warmup_per_token_s)
        return cls(worker.row_timeout_policy(shared.default_deadline_policy()), shared.default_max_tokens, warm_up)

    @property
    def policy(self) -> TimeoutPolicy:
        return self._deadline.policy

    def _max_tokens(self, row: jobs_pb2.JobRow) -> int:
        return row.generate.sampling.max_tokens or self._default_max_tokens

    def expected_s(self, row: jobs_pb2.JobRow, cut_at_s: float | None = None) -> float | None:
        """What the row is expected to take at worst (the p99 rule, before the multiplier); None
        while nothing trustworthy is known. An attempt cut off at `cut_at_s` did not finish in
        that long: the row needs at least that."""
        if row.WhichOneof("body") == "embed":
            expected = self._deadline.expected_embed()
        else:
            expected = self._deadline.expected_generate(self._max_tokens(row))
        if cut_at_s is None:
            return expected
        return max(expected or 0.0, cut_at_s)

    def for_row(self, row: jobs_pb2.JobRow, cut_at_s: float | None = None) -> float:
        """Seconds the row's next attempt may take; `cut_at_s`: the deadline that cut off its last
        attempt (the next one gets twice that, within the ceiling)."""
        expected = self.expected_s(row)
        if expected is not None:
            deadline = self.policy.clamp(self.policy.multiplier * expected)
        else:
            deadline = self._warm_up_deadline(row)
        if cut_at_s is not None:
            deadline = max(deadline, min(self.policy.ceiling_s, RETRY_GROWTH * cut_at_s))
        return deadline

    def _warm_up_deadline(self, row: jobs_pb2.JobRow) -> float:
        if row.WhichOneof("body") == "embed":
            return self.policy.clamp(self._warm_up.deadline_s)
        seen = self._deadline.p99s()  # over fewer rows than trusted: the slowest seen so far
        per_token = max(self._warm_up.per_token_s, seen["per_token"] or 0.0)
        long_row = self.policy.multiplier * ((seen["ttft"] or 0.0) + self._max_tokens(row) * per_token)
        return self.policy.clamp(max(self._warm_up.deadline_s, long_row))

    def at_ceiling(self, deadline_s: float) -> bool:
        """A deadline no later attempt could exceed."""
        return deadline_s >= self.policy.ceiling_s

    def observe(self, row: jobs_pb2.JobRow, timing: RowTiming) -> None:
        """A completed attempt, or one its deadline cut off: then what it saw counts (a censored
        sample), so a real slowdown lengthens the next deadlines instead of cutting every row."""
        if row.WhichOneof("body") == "embed":
            self._deadline.observe_embed(timing.total_s)
        else:
            self._deadline.observe_stream(timing.first_token_s, timing.tokens, timing.total_s)
