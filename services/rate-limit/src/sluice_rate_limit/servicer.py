"""sluice.ratelimit.v1.RateLimitService: messages in and out of the RateLimiter."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import duration_pb2
from sluice.common.v1 import types_pb2
from sluice.ratelimit.v1 import ratelimit_pb2, ratelimit_pb2_grpc

from sluice_common.errors import InvalidArgument
from sluice_rate_limit.budgets import BudgetState, Decision
from sluice_rate_limit.limiter import RateLimiter


# priority_class -> interactive? (UNSPECIFIED is treated as INTERACTIVE, types.proto)
_INTERACTIVE = {
    types_pb2.PRIORITY_CLASS_UNSPECIFIED: True,
    types_pb2.PRIORITY_CLASS_INTERACTIVE: True,
    types_pb2.PRIORITY_CLASS_BULK: False,
}


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(int(max(seconds, 0.0) * 1e9))
    return duration


def _add_statuses(budgets: Any, states: list[BudgetState]) -> None:
    """Appends one BudgetStatus per state to a response's repeated `budgets` field.

    Built in place (`add`, the Duration's fields set on the child): a list of messages handed to
    the response's constructor is built and then copied, twice the work, and this runs for six
    budgets on every Acquire and every Commit. reset_after stays unset when it is 0 (in-flight
    budgets): an unset Duration reads as 0.
    """
    add = budgets.add
    for state in states:
        status = add(budget=state.budget, limit=state.limit, remaining=state.remaining)
        if state.reset_after_s > 0:
            nanos = int(state.reset_after_s * 1e9)
            reset = status.reset_after
            reset.seconds, reset.nanos = divmod(nanos, 1_000_000_000)


def _set_time(timestamp: Any, unix_s: float) -> None:
    timestamp.seconds, timestamp.nanos = divmod(int(unix_s * 1e9), 1_000_000_000)


def acquire_response(decision: Decision) -> ratelimit_pb2.AcquireResponse:
    response = ratelimit_pb2.AcquireResponse(
        allowed=decision.allowed,
        lease_id=decision.lease_id,
        shadow=decision.shadow,
        degraded=decision.degraded,
        exceeds_limit=decision.exceeds_limit,
    )
    _add_statuses(response.budgets, decision.states)
    if decision.lease_expires_at:
        _set_time(response.lease_expires_at, decision.lease_expires_at)
        ttl = response.lease_ttl  # set in place: a Duration built and copied costs twice (every Acquire)
        ttl.seconds, ttl.nanos = divmod(int(decision.lease_ttl_s * 1e9), 1_000_000_000)
    if decision.denied_by is not None:
        response.denied_by = int(decision.denied_by)
        if not decision.exceeds_limit:
            response.retry_after.CopyFrom(_duration(decision.retry_after_s))
    return response


class RateLimitServicer(ratelimit_pb2_grpc.RateLimitServiceServicer):
    def __init__(self, limiter: RateLimiter) -> None:
        self._limiter = limiter

    async def Acquire(self, request: ratelimit_pb2.AcquireRequest, context: grpc.aio.ServicerContext) -> ratelimit_pb2.AcquireResponse:
        ttl = request.lease_ttl.ToNanoseconds() / 1e9 if request.HasField("lease_ttl") else None
        interactive = _INTERACTIVE.get(request.priority_class)
        if interactive is None:  # refused, not guessed: taken as interactive it would skip the bulk floor
            raise InvalidArgument("priority_class", f"unknown value {request.priority_class} (known: UNSPECIFIED, INTERACTIVE, BULK)")
        decision = await self._limiter.acquire(
            request.tenant,
            request.model,
            interactive,
            request.requests,
            request.reserved_tokens,
            ttl,
        )
        remaining = context.time_remaining()
        if decision.lease_id and remaining is not None and remaining <= 0:
            # The caller's deadline passed while this was decided: the answer goes nowhere, and
            # nobody would settle its lease before the lease's expiry.
            await self._limiter.abandon(decision.lease_id)
        return acquire_response(decision)

    async def Commit(self, request: ratelimit_pb2.CommitRequest, context: grpc.aio.ServicerContext) -> ratelimit_pb2.CommitResponse:
        response = ratelimit_pb2.CommitResponse()
        _add_statuses(response.budgets, await self._limiter.commit(request.lease_id, request.used_tokens))
        return response

    async def Release(self, request: ratelimit_pb2.ReleaseRequest, context: grpc.aio.ServicerContext) -> ratelimit_pb2.ReleaseResponse:
        await self._limiter.release(request.lease_id)
        return ratelimit_pb2.ReleaseResponse()

    async def Renew(self, request: ratelimit_pb2.RenewRequest, context: grpc.aio.ServicerContext) -> ratelimit_pb2.RenewResponse:
        asked = request.lease_ttl.ToNanoseconds() / 1e9 if request.HasField("lease_ttl") else None
        expires_at, ttl = await self._limiter.renew(request.lease_id, asked)
        response = ratelimit_pb2.RenewResponse(lease_ttl=_duration(ttl))
        _set_time(response.lease_expires_at, expires_at)
        return response

    async def GetUsage(self, request: ratelimit_pb2.GetUsageRequest, context: grpc.aio.ServicerContext) -> ratelimit_pb2.GetUsageResponse:
        rows = await self._limiter.usage(request.tenant)
        response = ratelimit_pb2.GetUsageResponse(limits_version=self._limiter.limits.version, limits_error=self._limiter.limits_error)
        for tenant, model, states in rows:
            _add_statuses(response.usage.add(tenant=tenant, model=model).budgets, states)
        return response
