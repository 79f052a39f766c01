"""rate-limit settings, from SLUICE_RATELIMIT_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sluice_common.config import ServerConfig, require

ENV_PREFIX = "SLUICE_RATELIMIT_"


@dataclass(frozen=True)
class RateLimitConfig(ServerConfig):
    port: int = 50071
    metrics_port: int = 9103
    # TOML file of limits (see config/limits.toml); re-read when it changes.
    limits_file: Path = Path("")
    reload_interval_s: float = 1.0
    # "memory" (one replica) or "redis" (several replicas, one global limit).
    backend: str = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "sluice:rl"
    # Every Redis call gives up after this long and the failure policy decides.
    redis_timeout_s: float = 0.1
    # Failures in a row that open the circuit breaker, and how long it stays open before a probe.
    breaker_failures: int = 3
    breaker_open_s: float = 2.0
    # Rate-limit replicas sharing the Redis: a fail-open budget falls back to limit / replicas.
    replicas: int = 1
    # The sliding window of the per-minute budgets (60 s; tests shorten it).
    window_s: float = 60.0
    # The longest a lease lives before it expires and frees its capacity.
    max_lease_ttl_s: float = 600.0

    def __post_init__(self) -> None:
        require(str(self.limits_file) not in ("", "."), f"{ENV_PREFIX}LIMITS_FILE is required: the TOML file of limits")
        require(self.limits_file.is_file(), f"{ENV_PREFIX}LIMITS_FILE={self.limits_file} does not exist")
        require(self.backend in ("memory", "redis"), f"{ENV_PREFIX}BACKEND must be memory or redis, got {self.backend!r}")
        require(0 < self.redis_timeout_s <= 0.1, f"{ENV_PREFIX}REDIS_TIMEOUT_S must be in (0, 0.1], got {self.redis_timeout_s}")
        require(self.breaker_failures >= 1, f"{ENV_PREFIX}BREAKER_FAILURES must be >= 1, got {self.breaker_failures}")
        require(self.breaker_open_s > 0, f"{ENV_PREFIX}BREAKER_OPEN_S must be > 0, got {self.breaker_open_s}")
        require(self.replicas >= 1, f"{ENV_PREFIX}REPLICAS must be >= 1, got {self.replicas}")
        require(self.window_s > 0, f"{ENV_PREFIX}WINDOW_S must be > 0, got {self.window_s}")
        require(self.max_lease_ttl_s > 0, f"{ENV_PREFIX}MAX_LEASE_TTL_S must be > 0, got {self.max_lease_ttl_s}")
        require(self.reload_interval_s > 0, f"{ENV_PREFIX}RELOAD_INTERVAL_S must be > 0, got {self.reload_interval_s}")
