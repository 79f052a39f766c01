"""The admission service's domain logic: builds the checks of a request, decides, settles leases.

No grpc here: the servicer translates messages, this module raises SluiceErrors.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import structlog

from sluice_common.errors import InvalidArgument, NotFound, Unavailable
from sluice_common.supervision import Supervisor
from sluice_rate_limit import metrics
from sluice_rate_limit.budgets import MAX_AMOUNT, BackendUnavailable, BudgetState, Check, Decision, LeaseNotFound
from sluice_rate_limit.limits import Limits, LimitsFile

log = structlog.stdlib.get_logger("sluice.ratelimit")

NEAR_LIMIT_SHARE = 0.10


class Backend(Protocol):
    name: str

    async def acquire(self, checks: list[Check], interactive: bool, ttl_s: float, shadow: bool, tag: str = "") -> Decision: ...
    async def settle(self, lease_id: str, used_tokens: int | None) -> list[BudgetState]: ...
    async def renew(self, lease_id: str, ttl_s: float) -> float: ...
    async def peek(self, checks: list[Check], tag: str = "") -> list[BudgetState]: ...
    async def close(self) -> None: ...


class RateLimiter:
    def __init__(self, limits: LimitsFile | Callable[[], Limits], backend: Backend, max_lease_ttl_s: float = 600.0) -> None:
        self._limits_file = limits if isinstance(limits, LimitsFile) else None
        self._limits = (lambda: limits.current) if isinstance(limits, LimitsFile) else limits
        self.backend = backend
        self.max_lease_ttl_s = max_lease_ttl_s
        self._seen: set[tuple[str, str]] = set()
        self._reloader: asyncio.Task[None] | None = None
        # The children every decision touches, resolved once. The redis backend times its own
        # round trips (sluice_ratelimit_backend_seconds{backend="redis"}); the memory one is timed here.
        self._allowed = metrics.child(metrics.DECISIONS, "allowed", "")
        self._timed = backend.name == "memory"
        ops = ("acquire", "commit", "release") if self._timed else ()
        self._backend_seconds = {op: metrics.child(metrics.BACKEND_SECONDS, "memory", op) for op in ops}
        self._settled = {how: metrics.child(metrics.LEASES_SETTLED, how) for how in ("commit", "release")}

    @property
    def limits(self) -> Limits:
        return self._limits()

    async def acquire(self, tenant: str, model: str, interactive: bool, requests: int, tokens: int, lease_ttl_s: float | None = None) -> Decision:
        if not tenant:
            raise InvalidArgument("tenant", "must not be empty")
        if not model:
            raise InvalidArgument("model", "must not be empty")
        if requests < 0:
            raise InvalidArgument("requests", f"must be >= 0, got {requests}")
        if tokens < 0:
            raise InvalidArgument("reserved_tokens", f"must be >= 0, got {tokens}")
        requests = requests or 1
        ttl = self._ttl(lease_ttl_s)
        checks, shadow = self.limits.checks(tenant, model, interactive, requests, tokens)
        self._seen.add((tenant, model))
        if not checks:
            self._allowed.inc()
            return Decision(allowed=True)
        started = time.perf_counter()
        decision = _larger_than_a_limit(checks, interactive) or await self.backend.acquire(checks, interactive, ttl, shadow, model)
        if self._timed:
            self._backend_seconds["acquire"].observe(time.perf_counter() - started)
        if decision.allowed:
            decision.lease_ttl_s = ttl if decision.lease_id else 0.0
            self._allowed.inc()
            for state in decision.states:
                if state.remaining < state.limit * NEAR_LIMIT_SHARE:
                    metrics.child(metrics.NEAR_LIMIT, state.name).inc()
            return decision
        if decision.degraded:
            metrics.child(metrics.DECISIONS, "unavailable", decision.denied_name).inc()
            if not shadow:
                return decision
        if shadow:
            metrics.child(metrics.DECISIONS, "shadow_denied", decision.denied_name).inc()
            metrics.child(metrics.SHADOW_DENIALS, decision.denied_name).inc()
            log.info("shadow_denied", tenant=tenant, model=model, budget=decision.denied_name, retry_after_s=decision.retry_after_s)
            # Admitted without charging anything: the counters follow what enforcement would admit.
            decision.allowed = True
            decision.shadow = True
            return decision
        metrics.child(metrics.DECISIONS, "denied", decision.denied_name).inc()
        metrics.child(metrics.TENANT_DENIALS, tenant, decision.denied_name).inc()
        # Allowed decisions are only counted (the server logs OK Acquire calls at debug): a
        # denial is what an operator looks for, so it gets its own line.
        log.info(
            "denied",
            tenant=tenant,
            model=model,
            budget=decision.denied_name,
            retry_after_s=round(decision.retry_after_s, 3),
            exceeds_limit=decision.exceeds_limit,
        )
        return decision

    def _ttl(self, asked_s: float | None) -> float:
        if asked_s is not None and asked_s < 0:
            raise InvalidArgument("lease_ttl", f"must be >= 0 (unset or 0: the server's maximum), got {asked_s} s")
        return self.max_lease_ttl_s if not asked_s else min(asked_s, self.max_lease_ttl_s)

    async def renew(self, lease_id: str, lease_ttl_s: float | None = None) -> tuple[float, float]:
        """(new expiry, Unix seconds; the TTL granted) for a live lease, whose call runs on."""
        if not lease_id:
            raise InvalidArgument("lease_id", "must not be empty")
        ttl = self._ttl(lease_ttl_s)
        with _lease_errors(lease_id, "renew", metrics.child(metrics.LEASES_RENEWED, "unknown")):
            expires_at = await self.backend.renew(lease_id, ttl)
        metrics.child(metrics.LEASES_RENEWED, "renewed").inc()
        return expires_at, ttl

    async def commit(self, lease_id: str, used_tokens: int) -> list[BudgetState]:
        if used_tokens < 0:
            raise InvalidArgument("used_tokens", f"must be >= 0, got {used_tokens}")
        if used_tokens > MAX_AMOUNT:
            raise InvalidArgument("used_tokens", f"must be at most 2**53 ({MAX_AMOUNT}), got {used_tokens}")
        return await self._settle(lease_id, used_tokens, "commit")

    async def release(self, lease_id: str) -> None:
        await self._settle(lease_id, None, "release")

    async def abandon(self, lease_id: str) -> None:
        """Releases a lease granted to a caller that gave up before hearing of it (its deadline
        passed while it was decided): nobody else would settle it before its expiry."""
        try:
            await self.backend.settle(lease_id, None)
        except (LeaseNotFound, BackendUnavailable) as exc:
            log.warning("abandoned_lease_not_released", lease_id=lease_id, error=repr(exc))
            return
        metrics.child(metrics.LEASES_SETTLED, "abandoned").inc()

    async def _settle(self, lease_id: str, used_tokens: int | None, how: str) -> list[BudgetState]:
        if not lease_id:
            raise InvalidArgument("lease_id", "must not be empty")
        started = time.perf_counter()
        with _lease_errors(lease_id, "settle", metrics.child(metrics.LEASES_SETTLED, "unknown"), "; it frees its capacity at expiry"):
            states = await self.backend.settle(lease_id, used_tokens)
        if self._timed:
            self._backend_seconds[how].observe(time.perf_counter() - started)
        self._settled[how].inc()
        return states

    async def usage(self, tenant: str = "") -> list[tuple[str, str, list[BudgetState]]]:
        limits = self.limits
        pairs = sorted({*self._seen, *limits.known_pairs()})
        rows = []
        for name, model in pairs:
            if tenant and name != tenant:
                continue
            checks, _shadow = limits.checks(name, model, True, 0, 0)
            if not checks:
                continue
            try:
                states = await self.backend.peek(checks, model)
            except BackendUnavailable as exc:
                raise Unavailable(f"usage unknown: {exc}") from None
            rows.append((name, model, states))
        return rows

    @property
    def limits_error(self) -> str:
        return self._limits_file.error if self._limits_file is not None else ""

    def start_reloading(self, every_s: float, supervisor: Supervisor | None = None) -> None:
        if self._limits_file is not None:
            self._reloader = (supervisor or Supervisor()).start("limits-reload", lambda: self._reload_forever(every_s))

    async def _reload_forever(self, every_s: float) -> None:
        assert self._limits_file is not None
        while True:
            await asyncio.sleep(every_s)
            result = self._limits_file.maybe_reload()
            if result is not None:
                metrics.child(metrics.RELOADS, "applied" if result else "rejected").inc()

    async def stop(self) -> None:
        if self._reloader is not None:
            self._reloader.cancel()
            await asyncio.gather(self._reloader, return_exceptions=True)
        await self.backend.close()


@contextlib.contextmanager
def _lease_errors(lease_id: str, verb: str, unknown: Any, consequence: str = "") -> Iterator[None]:
    """A backend's lease errors as the service's: NotFound (counted in `unknown`) or Unavailable."""
    try:
        yield
    except LeaseNotFound:
        unknown.inc()
        raise NotFound(f"lease {lease_id} is unknown: already settled, or expired") from None
    except BackendUnavailable as exc:
        raise Unavailable(f"cannot {verb} lease {lease_id}: {exc}{consequence}") from None


def _larger_than_a_limit(checks: list[Check], interactive: bool) -> Decision | None:
    """A denial for a request that costs more than a budget can ever give it: waiting cannot help,
    so it is refused as such (no retry_after) instead of being told to come back later. For bulk
    work that is the limit less the floor kept for interactive traffic (sliding_window.admits)."""
    for check in checks:
        room = check.limit if interactive else check.limit - check.floor
        if check.limit > 0 and check.cost > room:
            reason = f"this request costs {check.cost} against {check.name}, whose whole limit is {check.limit}"
            if not interactive and check.floor:
                reason += f", {check.floor} of it kept for interactive traffic: bulk work gets at most {max(room, 0)}"
            state = BudgetState(check.budget, check.limit, check.limit, 0.0, check.name)
            return Decision(allowed=False, states=[state], denied_by=check.budget, denied_name=check.name, exceeds_limit=True, reason=reason)
    return None


def on_expired(count: int) -> None:
    metrics.LEASES_EXPIRED.inc(count)
