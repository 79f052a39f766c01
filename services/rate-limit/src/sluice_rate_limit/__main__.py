"""`python -m sluice_rate_limit`: admission decisions for every gateway replica."""

from __future__ import annotations

import structlog
from sluice.ratelimit.v1 import ratelimit_pb2, ratelimit_pb2_grpc

from sluice_common.bootstrap import run_service
from sluice_common.loop_lag import monitor_loop_lag
from sluice_common.server import create_server, serve_until_signal
from sluice_rate_limit.breaker import CircuitBreaker
from sluice_rate_limit.config import ENV_PREFIX, RateLimitConfig
from sluice_rate_limit.failover import FailoverBackend
from sluice_rate_limit.limiter import RateLimiter, on_expired
from sluice_rate_limit.limits import LimitsError, LimitsFile
from sluice_rate_limit.memory_backend import MemoryBackend
from sluice_rate_limit.redis_backend import RedisBackend
from sluice_rate_limit.servicer import RateLimitServicer

log = structlog.stdlib.get_logger("sluice.ratelimit")

SERVICE_NAME = ratelimit_pb2.DESCRIPTOR.services_by_name["RateLimitService"].full_name


def build_backend(config: RateLimitConfig):  # type: ignore[no-untyped-def]
    if config.backend == "memory":
        return MemoryBackend(config.window_s, on_expired=on_expired)
    primary = RedisBackend(config.redis_url, config.redis_prefix, config.window_s, config.redis_timeout_s, on_expired)
    breaker = CircuitBreaker(config.breaker_failures, config.breaker_open_s)
    return FailoverBackend(primary, breaker, config.replicas, config.redis_timeout_s)


async def serve(config: RateLimitConfig) -> None:
    try:
        limits = LimitsFile(config.limits_file)
    except (OSError, LimitsError) as exc:
        raise SystemExit(f"rate-limit: cannot load {ENV_PREFIX}LIMITS_FILE={config.limits_file}: {exc}") from None
    limiter = RateLimiter(limits, build_backend(config), config.max_lease_ttl_s)
    servicer = RateLimitServicer(limiter)

    def register(server):  # type: ignore[no-untyped-def]
        ratelimit_pb2_grpc.add_RateLimitServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    # Acquire and Commit run for every request of every service: their successful calls are
    # counted (sluice_rpc_*, sluice_ratelimit_decisions_total) and logged at debug; denials and
    # errors are logged.
    quiet = [f"/{SERVICE_NAME}/Acquire", f"/{SERVICE_NAME}/Commit"]
    running = await create_server(config.host, config.port, config.metrics_port, register, tls=config.server_tls(ENV_PREFIX), quiet_methods=quiet)
    running.supervisor.start("event-loop-lag", monitor_loop_lag)
    limiter.start_reloading(config.reload_interval_s, running.supervisor)
    log.info(
        "ready",
        backend=config.backend,
        limits_file=str(config.limits_file),
        limits_version=limits.current.version,
        window_s=config.window_s,
        replicas=config.replicas,
    )
    await serve_until_signal(running, config.shutdown_grace_s, limiter.stop)


def main() -> None:
    run_service("rate-limit", RateLimitConfig, ENV_PREFIX, serve)


if __name__ == "__main__":
    main()
