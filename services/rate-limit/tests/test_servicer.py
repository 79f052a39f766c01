"""The servicer's own rule: a lease decided after its caller's deadline is given back at once."""

from __future__ import annotations

import pytest
from google.protobuf.duration_pb2 import Duration
from sluice.common.v1 import types_pb2
from sluice.ratelimit.v1 import ratelimit_pb2

from sluice_common.errors import InvalidArgument
from sluice_rate_limit.limiter import RateLimiter
from sluice_rate_limit.limits import parse_limits
from sluice_rate_limit.memory_backend import MemoryBackend
from sluice_rate_limit.servicer import RateLimitServicer


class _Context:
    """What the servicer reads of grpc.aio's ServicerContext: the caller's time left (None: no deadline)."""

    def __init__(self, remaining_s: float | None) -> None:
        self.remaining_s = remaining_s

    def time_remaining(self) -> float | None:
        return self.remaining_s


async def test_a_lease_decided_after_the_callers_deadline_is_released_at_once() -> None:
    limits = parse_limits("[defaults]\nrequests_in_flight = 1\n")
    servicer = RateLimitServicer(RateLimiter(lambda: limits, MemoryBackend(10.0)))
    request = ratelimit_pb2.AcquireRequest(tenant="a", model="m", requests=1, reserved_tokens=5)
    late = await servicer.Acquire(request, _Context(0.0))  # type: ignore[arg-type]
    assert late.allowed and late.lease_id  # the answer nobody hears ...
    on_time = await servicer.Acquire(request, _Context(1.0))  # type: ignore[arg-type]
    assert on_time.allowed  # ... held no in-flight slot: it was given back
    assert not (await servicer.Acquire(request, _Context(None))).allowed  # one in flight: the limit holds


async def test_an_unknown_priority_class_and_a_negative_lease_ttl_are_invalid() -> None:
    """Class 7 was taken as interactive (past the bulk floor); a negative TTL as the maximum."""
    limits = parse_limits("[defaults]\nrequests_in_flight = 10\n")
    servicer = RateLimitServicer(RateLimiter(lambda: limits, MemoryBackend(10.0)))
    context = _Context(None)
    for known in (types_pb2.PRIORITY_CLASS_UNSPECIFIED, types_pb2.PRIORITY_CLASS_INTERACTIVE, types_pb2.PRIORITY_CLASS_BULK):
        request = ratelimit_pb2.AcquireRequest(tenant="a", model="m", requests=1, priority_class=known)
        assert (await servicer.Acquire(request, context)).allowed  # type: ignore[arg-type]
    unknown = ratelimit_pb2.AcquireRequest(tenant="a", model="m", requests=1, priority_class=7)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as caught:
        await servicer.Acquire(unknown, context)  # type: ignore[arg-type]
    assert caught.value.field_name == "priority_class" and "7" in caught.value.reason
    negative = ratelimit_pb2.AcquireRequest(tenant="a", model="m", requests=1, lease_ttl=Duration(seconds=-5))
    with pytest.raises(InvalidArgument) as caught:
        await servicer.Acquire(negative, context)  # type: ignore[arg-type]
    assert caught.value.field_name == "lease_ttl"
    lease = await servicer.Acquire(ratelimit_pb2.AcquireRequest(tenant="a", model="m", requests=1), context)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as caught:
        await servicer.Renew(ratelimit_pb2.RenewRequest(lease_id=lease.lease_id, lease_ttl=Duration(seconds=-1)), context)  # type: ignore[arg-type]
    assert caught.value.field_name == "lease_ttl"
