"""A bulk row's deadline, from what this worker's recent rows took.

The same rule as the gateway's default deadline (default_deadline.py: multiplier x (p99 time to
first token + max_tokens x p99 time per token), or multiplier x p99 for an embedding), kept apart:
bulk rows wait behind interactive traffic, so their p99s are their own. WORKER_ROW_TIMEOUT_S is the
ceiling (and the deadline until enough rows have been seen), WORKER_ROW_TIMEOUT_FLOOR_S the floor.

Why not the fixed WORKER_ROW_TIMEOUT_S alone: a row's rate-limit lease lives for its deadline plus
a margin, and a worker that dies (SIGKILL, OOM) never settles its leases, so they hold the tenant's
in-flight budget until they expire: 150 s for 2-token rows with 120 s. No transport import here.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.jobs.v1 import jobs_pb2

from sluice_common.adaptive_timeout import TimeoutPolicy
from sluice_gateway.default_deadline import DefaultDeadline


@dataclass(frozen=True)
class RowTiming:
    """What one completed attempt took: seconds to its first token (None: an embedding, or no
    token came), the tokens it generated, and its whole duration."""

    first_token_s: float | None
    tokens: int
    total_s: float


class RowDeadlines:
    def __init__(self, policy: TimeoutPolicy, default_max_tokens: int) -> None:
        self._deadline = DefaultDeadline(policy)
        self._default_max_tokens = default_max_tokens

    def for_row(self, row: jobs_pb2.JobRow) -> float:
        """Seconds the row's next attempt may take."""
        if row.WhichOneof("body") == "embed":
            return self._deadline.for_embed()
        return self._deadline.for_generate(row.generate.sampling.max_tokens or self._default_max_tokens)

    def observe(self, row: jobs_pb2.JobRow, timing: RowTiming) -> None:
        """A completed attempt, or one its deadline cut off: then what it saw counts (a censored
        sample), so a real slowdown lengthens the next deadlines instead of cutting every row."""
        if row.WhichOneof("body") == "embed":
            self._deadline.observe_embed(timing.total_s)
        else:
            self._deadline.observe_stream(timing.first_token_s, timing.tokens, timing.total_s)
