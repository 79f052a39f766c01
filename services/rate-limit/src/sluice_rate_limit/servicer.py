"""sluice.ratelimit.v1.RateLimitService: messages in and out of the RateLimiter."""

from __future__ import annotations

import grpc
from google.protobuf import duration_pb2, timestamp_pb2
from sluice.common.v1 import types_pb2
from sluice.ratelimit.v1 import ratelimit_pb2, ratelimit_pb2_grpc

from sluice_rate_limit.budgets import BudgetState, Decision
from sluice_rate_limit.limiter import RateLimiter


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(int(max(seconds, 0.0) * 1e9))
    return duration


def _statuses(states: list[BudgetState]) -> list[ratelimit_pb2.BudgetStatus]:
    # reset_after is left unset when it is 0 (in-flight budgets): an unset Duration reads as 0, and
    # building one costs as much as the rest of the status.
    return [
        ratelimit_pb2.BudgetStatus(budget=int(s.budget), limit=s.limit, remaining=s.remaining, reset_after=_duration(s.reset_after_s))
        if s.reset_after_s > 0
        else ratelimit_pb2.BudgetStatus(budget=int(s.budget), limit=s.limit, remaining=s.remaining)
        for s in states
    ]


def acquire_response(decision: Decision) -> ratelimit_pb2.AcquireResponse:
    response = ratelimit_pb2.AcquireResponse(
        allowed=decision.allowed,
        lease_id=decision.lease_id,
        budgets=_statuses(decision.states),
        shadow=decision.shadow,
        degraded=decision.degraded,
        exceeds_limit=decision.exceeds_limit,
    )
    if decision.lease_expires_at:
        expires = timestamp_pb2.Timestamp()
        expires.FromNanoseconds(int(decision.lease_expires_at * 1e9))
        response.lease_expires_at.CopyFrom(expires)
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
        decision = await self._limiter.acquire(
            request.tenant,
            request.model,
            request.priority_class != types_pb2.PRIORITY_CLASS_BULK,
            request.requests,
            request.reserved_tokens,
            ttl,
        )
        return acquire_response(decision)

    async def Commit(self, request: ratelimit_pb2.CommitRequest, context: grpc.aio.ServicerContext) -> ratelimit_pb2.CommitResponse:
        states = await self._limiter.commit(request.lease_id, request.used_tokens)
        return ratelimit_pb2.CommitResponse(budgets=_statuses(states))

    async def Release(self, request: ratelimit_pb2.ReleaseRequest, context: grpc.aio.ServicerContext) -> ratelimit_pb2.ReleaseResponse:
        await self._limiter.release(request.lease_id)
        return ratelimit_pb2.ReleaseResponse()

    async def GetUsage(self, request: ratelimit_pb2.GetUsageRequest, context: grpc.aio.ServicerContext) -> ratelimit_pb2.GetUsageResponse:
        rows = await self._limiter.usage(request.tenant)
        return ratelimit_pb2.GetUsageResponse(
            usage=[ratelimit_pb2.TenantUsage(tenant=t, model=m, budgets=_statuses(s)) for t, m, s in rows],
            limits_version=self._limiter.limits.version,
            limits_error=self._limiter.limits_error,
        )
