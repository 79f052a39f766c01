"""The vocabulary of admission decisions, free of gRPC and of any storage.

A decision is made against a list of `Check`s, one per budget that applies to the request
(the tenant's four budgets for that model, then the model's global capacity). Both backends,
in-memory and Redis, evaluate the same list with the same rule, all or nothing: either every
check admits and every one is charged, or nothing is charged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


# The largest limit (limits file) and used token count (Commit) accepted: exact in a double (the
# Lua scripts' numbers, the pace's arithmetic), well inside int64 (protobuf, Redis's HINCRBY).
MAX_AMOUNT = 2**53


class Budget(enum.IntEnum):
    """Mirrors sluice.ratelimit.v1.Budget (same numbers)."""

    REQUESTS_PER_MINUTE = 1
    TOKENS_PER_MINUTE = 2
    REQUESTS_IN_FLIGHT = 3
    TOKENS_IN_FLIGHT = 4
    MODEL_CAPACITY = 5


BUDGET_NAMES = {
    Budget.REQUESTS_PER_MINUTE: "requests_per_minute",
    Budget.TOKENS_PER_MINUTE: "tokens_per_minute",
    Budget.REQUESTS_IN_FLIGHT: "requests_in_flight",
    Budget.TOKENS_IN_FLIGHT: "tokens_in_flight",
    Budget.MODEL_CAPACITY: "model_capacity",
}


class Kind(enum.Enum):
    WINDOW = "w"  # counted over a sliding window (per minute)
    GAUGE = "g"  # held while the lease lives (in flight)


class Policy(enum.Enum):
    """What a budget does when the shared backend cannot be reached."""

    OPEN = "open"  # admit against a local limit of limit / replicas
    CLOSED = "closed"  # refuse


@dataclass(slots=True)
class Check:
    budget: Budget
    kind: Kind
    # Storage key, unique per budget, tenant and model (without the backend's prefix).
    key: str
    limit: int
    # What this request costs against the budget: requests or reserved tokens.
    cost: int
    # Capacity kept for interactive traffic: bulk is admitted only while it leaves this much
    # (minus what interactive already uses) free.
    floor: int = 0
    # Windows only: the most that may be admitted at once before admissions are paced at
    # limit / window (see sliding_window.py); 0 or >= limit: no pacing.
    burst: int = 0
    # True for token budgets: Commit refunds the unused part of the reservation.
    refundable: bool = False
    policy: Policy = Policy.CLOSED
    # The configuration name of the budget ("tokens_per_minute", ...), for metrics and logs.
    name: str = ""


@dataclass(slots=True)
class BudgetState:
    budget: Budget
    limit: int
    remaining: int
    # When remaining returns to limit if nothing else is admitted.
    reset_after_s: float
    name: str = ""


@dataclass
class Decision:
    allowed: bool
    lease_id: str = ""
    # Unix time, seconds.
    lease_expires_at: float = 0.0
    # How long the lease lives from the decision: the asked TTL capped at the server's maximum.
    lease_ttl_s: float = 0.0
    states: list[BudgetState] = field(default_factory=list)
    denied_by: Budget | None = None
    denied_name: str = ""
    retry_after_s: float = 0.0
    shadow: bool = False
    degraded: bool = False
    reason: str = ""
    # Denied because the request alone costs more than the budget's limit: never admissible.
    exceeds_limit: bool = False


class LeaseNotFound(LookupError):
    """The lease was settled already, or expired."""


class BackendUnavailable(RuntimeError):
    """The shared backend could not be reached in time. `sent`: the call went out before it failed
    (a timeout, a connection lost), so the backend may still have done it."""

    def __init__(self, message: str, sent: bool = False) -> None:
        super().__init__(message)
        self.sent = sent
