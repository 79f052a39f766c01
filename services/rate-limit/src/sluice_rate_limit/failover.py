"""Redis with a failure policy: a timeout on every call, a circuit breaker, fail-open or -closed per budget.

While Redis answers, every decision is made in Redis and nowhere else (never from local state
while the truth is in Redis). When a call fails or times out (or the breaker is open):
- if any budget of the request is fail-closed, the request is refused (degraded=True) with the
  time until the breaker probes again as retry_after;
- otherwise it is decided by a local in-memory limiter with each limit divided by the number of
  replicas (so the replicas together stay near the global limit), counted in
  sluice_ratelimit_fallback_decisions_total. Its leases start with "local-" and settle locally.
An error reply of the call's own (a script's error: a bug or a bad value) is Redis answering: that
call fails (INTERNAL), and the breaker counts it as an answer, not as Redis unreachable.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import structlog
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)

from sluice_rate_limit import metrics
from sluice_rate_limit.breaker import CircuitBreaker
from sluice_rate_limit.budgets import BackendUnavailable, BudgetState, Check, Decision, LeaseNotFound, Policy
from sluice_rate_limit.memory_backend import MemoryBackend
from sluice_rate_limit.redis_backend import RedisBackend

log = structlog.stdlib.get_logger("sluice.ratelimit.failover")

LOCAL_PREFIX = "local-"
_FAILURES = (RedisError, OSError, asyncio.TimeoutError)
# Error replies with which Redis refuses every call while it cannot serve (out of memory, a
# read-only replica, a cluster or master down or moving, busy in a long script, unable to persist
# or to reach its replicas, a script it lost, an ACL that denies the scripts): an outage, like a
# timeout (LOADING is a ConnectionError already). Any other error reply is Redis answering this
# call with its own error (a script's "value is not an integer": a bug or a bad value), which says
# nothing about Redis's health.
_OUTAGE_REPLIES = (OutOfMemoryError, ReadOnlyError, ClusterDownError, TryAgainError, AskError, NoScriptError, NoPermissionError)
_OUTAGE_CODES = ("BUSY ", "MISCONF ", "NOREPLICAS ")


def _outage(exc: BaseException) -> bool:
    if isinstance(exc, ResponseError) and not isinstance(exc, _OUTAGE_REPLIES):
        return str(exc).startswith(_OUTAGE_CODES)
    return True


# When to try settling a lease whose acquire lost its reply (seconds after the loss, then after
# each try that found Redis unreachable); past them the lease expires at its TTL.
ORPHAN_RELEASE_DELAYS_S = (0.5, 2.0, 8.0, 30.0)
ORPHAN_RELEASE_TIMEOUT_S = 1.0


class FailoverBackend:
    name = "redis"

    def __init__(
        self, primary: RedisBackend, breaker: CircuitBreaker, replicas: int, timeout_s: float, fallback: MemoryBackend | None = None
    ) -> None:
        self.primary = primary
        self.breaker = breaker
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.fallback = fallback or MemoryBackend(primary.window_s, on_expired=primary.on_expired, lease_prefix=LOCAL_PREFIX)
        self._orphans: set[asyncio.Task[None]] = set()

    async def _call(self, op: str, coro):  # type: ignore[no-untyped-def]
        if not self.breaker.allow():
            coro.close()
            raise BackendUnavailable("circuit open")
        started = time.perf_counter()
        try:
            # asyncio.timeout, not wait_for: wait_for wraps the call in a task of its own, which
            # costs a task and an event-loop turn on every decision.
            async with asyncio.timeout(self.timeout_s):
                result = await coro
        except _FAILURES as exc:
            metrics.child(metrics.BACKEND_ERRORS, "redis", op).inc()
            if not _outage(exc):
                # Redis answered: the breaker closes (or stays closed), and the call fails on its
                # own as an internal error, not as Redis unreachable (nor decided by the fallback).
                self._answered()
                raise
            was_open = self.breaker.state != "closed"
            self.breaker.failure()
            metrics.CIRCUIT_OPEN.set(1 if self.breaker.state == "open" else 0)
            if not was_open and self.breaker.state == "open":
                log.error("redis_circuit_open", error=repr(exc), open_s=self.breaker.open_s)
            raise BackendUnavailable(f"redis: {exc!r}", sent=True) from exc
        except asyncio.CancelledError:
            self.breaker.abandon()  # the caller went away (its own deadline): no verdict on Redis
            raise
        except Exception:
            self._answered()  # Redis answered, with the call's own error (a lease already settled)
            raise
        finally:
            metrics.child(metrics.BACKEND_SECONDS, "redis", op).observe(time.perf_counter() - started)
        self._answered()
        return result

    def _answered(self) -> None:
        if self.breaker.state != "closed":
            log.info("redis_circuit_closed")
        self.breaker.success()
        metrics.CIRCUIT_OPEN.set(0)

    async def acquire(self, checks: list[Check], interactive: bool, ttl_s: float, shadow: bool, tag: str = "") -> Decision:
        lease_id = self.primary.new_lease_id(tag)
        try:
            return await self._call("acquire", self.primary.acquire(checks, interactive, ttl_s, shadow, tag, lease_id))
        except BackendUnavailable as exc:
            reason = str(exc)
            if exc.sent:
                self._release_later(lease_id)
        except asyncio.CancelledError:
            self._release_later(lease_id)  # the caller gave up while Redis may have run the script
            raise
        closed = [c for c in checks if c.policy is Policy.CLOSED]
        if closed:
            metrics.child(metrics.FALLBACKS, "refused").inc()
            return Decision(
                allowed=False,
                denied_by=closed[0].budget,
                denied_name=closed[0].name,
                retry_after_s=max(self.breaker.retry_after(), 0.1),
                degraded=True,
                reason=f"{closed[0].name} is fail-closed and its backend is unreachable ({reason})",
            )
        scaled = [replace(c, limit=max(1, c.limit // self.replicas), floor=c.floor // self.replicas) for c in checks]
        decision = await self.fallback.acquire(scaled, interactive, ttl_s, shadow, tag)
        decision.degraded = True
        metrics.child(metrics.FALLBACKS, "allowed" if decision.allowed else "denied").inc()
        return decision

    def _release_later(self, lease_id: str) -> None:
        """An acquire whose reply was lost (the timeout cut it after Redis had the script) may have
        granted a lease nobody knows: it would hold its in-flight slots and tokens for its whole TTL,
        beside the decision made without Redis. Settled with nothing used, a few times until Redis
        answers; an unknown lease means the script never ran."""
        task = asyncio.get_running_loop().create_task(self._release_orphan(lease_id))
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    async def _release_orphan(self, lease_id: str) -> None:
        for delay_s in ORPHAN_RELEASE_DELAYS_S:
            await asyncio.sleep(delay_s)
            try:
                async with asyncio.timeout(ORPHAN_RELEASE_TIMEOUT_S):
                    await self.primary.settle(lease_id, 0)
            except LeaseNotFound:
                return
            except _FAILURES:
                continue
            metrics.ORPHANED_LEASES.inc()
            log.warning("orphaned_lease_released", lease_id=lease_id)
            return

    async def settle(self, lease_id: str, used_tokens: int | None) -> list[BudgetState]:
        if lease_id.startswith(LOCAL_PREFIX):
            return await self.fallback.settle(lease_id, used_tokens)
        return await self._call("settle", self.primary.settle(lease_id, used_tokens))

    async def renew(self, lease_id: str, ttl_s: float) -> float:
        if lease_id.startswith(LOCAL_PREFIX):
            return await self.fallback.renew(lease_id, ttl_s)
        return await self._call("renew", self.primary.renew(lease_id, ttl_s))

    async def peek(self, checks: list[Check], tag: str = "") -> list[BudgetState]:
        return await self._call("peek", self.primary.peek(checks, tag))

    async def close(self) -> None:
        for task in self._orphans:
            task.cancel()  # their leases expire at their TTL
        await asyncio.gather(*self._orphans, return_exceptions=True)
        await self.primary.close()
