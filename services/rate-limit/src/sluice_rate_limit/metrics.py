"""The rate limiter's Prometheus metrics."""

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

DECISIONS = Counter(
    "sluice_ratelimit_decisions_total",
    "Acquire decisions by result (allowed, denied, shadow_denied, unavailable) and the budget that refused.",
    ["result", "budget"],
)
# Per tenant, denials only: tenants are the configured few that the gateway authenticates, and
# allowed decisions (the hot path) stay unlabelled. Dashboards show who is being refused.
TENANT_DENIALS = Counter(
    "sluice_ratelimit_tenant_denials_total",
    "Acquire calls denied (enforced, not shadow), by tenant and the budget that refused.",
    ["tenant", "budget"],
)
NEAR_LIMIT = Counter("sluice_ratelimit_near_limit_total", "Admissions that left less than 10% of a budget remaining.", ["budget"])
SHADOW_DENIALS = Counter("sluice_ratelimit_shadow_denials_total", "Requests shadow mode admitted that enforcement would have refused.", ["budget"])
BACKEND_SECONDS = Histogram(
    "sluice_ratelimit_backend_seconds",
    "Time of one backend operation (one Redis round trip for the redis backend).",
    ["backend", "op"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
)
BACKEND_ERRORS = Counter("sluice_ratelimit_backend_errors_total", "Failed or timed-out backend operations.", ["backend", "op"])
ORPHANED_LEASES = Counter(
    "sluice_ratelimit_orphaned_leases_released_total",
    "Leases Redis granted to an acquire whose reply was lost (its timeout), released after Redis answered again.",
)
FALLBACKS = Counter(
    "sluice_ratelimit_fallback_decisions_total",
    "Decisions made against the local fail-open limit (limit / replicas) while Redis was unreachable.",
    ["result"],
)
CIRCUIT_OPEN = Gauge("sluice_ratelimit_circuit_open", "1 while the circuit breaker in front of Redis is open.")
LEASES_EXPIRED = Counter("sluice_ratelimit_leases_expired_total", "Leases never settled, freed at expiry.")
LEASES_RENEWED = Counter(
    "sluice_ratelimit_leases_renewed_total",
    "Renew calls by result: renewed, or unknown (the lease was settled or had expired: the call stopped counting in flight).",
    ["result"],
)
LEASES_SETTLED = Counter(
    "sluice_ratelimit_leases_settled_total",
    "Leases settled, by how: commit, release, abandoned (granted after its caller's deadline had passed), unknown (no such lease).",
    ["how"],
)
REFUNDED_TOKENS = Counter("sluice_ratelimit_refunded_tokens_total", "Reserved tokens given back at commit.")
RELOADS = Counter("sluice_ratelimit_limits_reloads_total", "Limits file reloads by result (applied, rejected).", ["result"])


_children: dict[tuple[Any, tuple[str, ...]], Any] = {}


def child(metric: Any, *labels: str) -> Any:
    """`metric.labels(*labels)`, kept: labels() validates and locks, and the decision path asks for
    several children per decision, thousands of times a second. Label values are budget names,
    backends and outcomes: a bounded set."""
    found = _children.get((metric, labels))
    if found is None:
        found = _children[(metric, labels)] = metric.labels(*labels)
    return found
