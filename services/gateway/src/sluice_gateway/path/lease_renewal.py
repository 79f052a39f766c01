"""Keeps a rate-limit lease alive while its call runs, so a gateway that dies frees it soon.

A lease asks to live as long as its call may (its deadline plus a margin, admission.py), but at
most SLUICE_GATEWAY_RATELIMIT_LEASE_TTL_S (60 s); rate-limit caps that again at its own maximum
(SLUICE_RATELIMIT_MAX_LEASE_TTL_S) and says what it granted (AcquireResponse.lease_ttl). A call
that may outlive the grant renews its lease halfway to each expiry until it is settled: it counts
in flight for as long as it runs, while the leases of a gateway or job worker that dies (SIGKILL,
OOM) free their capacity within one grant instead of at the end of the call's deadline. A renewal
that fails is tried again halfway to the expiry left, until the lease has expired; one the server
no longer knows (expired, settled) ends the renewals.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog
from prometheus_client import Counter
from sluice.ratelimit.v1 import ratelimit_pb2, ratelimit_pb2_grpc

from sluice_common.request_context import outgoing_metadata

log = structlog.stdlib.get_logger("sluice.gateway.admission")

RENEWALS = Counter(
    "sluice_gateway_ratelimit_renewals_total",
    "Renew calls for the leases of calls running past the TTL rate-limit granted, by outcome (ok, or the gRPC code).",
    ["result"],
)
RENEW_TIMEOUT_S = 5.0
# No renewal sooner than this after the last: a lease granted a very short TTL is not hammered.
MIN_RENEW_INTERVAL_S = 0.05
# The codes after which no renewal can succeed: the lease is gone, or rate-limit predates Renew.
_FINAL = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED)


def first_ttl(wanted_s: float | None, grant_s: float) -> float:
    """The TTL to ask for a call that may need `wanted_s` (None: no deadline), in grants of `grant_s`."""
    return grant_s if wanted_s is None else min(wanted_s, grant_s)


def needs_renewal(granted_s: float, wanted_s: float | None) -> bool:
    """Whether a lease granted `granted_s` can expire before its call ends (`wanted_s`: the call's
    deadline plus margin; None: no deadline). 0 granted: a server that does not say (older than
    Renew), or no lease."""
    return granted_s > 0 and (wanted_s is None or granted_s < wanted_s)


async def keep_alive(
    stub: ratelimit_pb2_grpc.RateLimitServiceStub, lease_id: str, granted_s: float, wanted_until: float | None, grant_s: float
) -> None:
    """Renews `lease_id`, `grant_s` at a time, until cancelled (its ticket settled) or it lives to
    `wanted_until` (time.monotonic(); None: for ever). `granted_s`: the TTL the lease has now."""
    expires = time.monotonic() + granted_s
    while True:
        now = time.monotonic()
        if now >= expires:
            log.warning("ratelimit_lease_expired_before_renewal", lease_id=lease_id)
            return
        await asyncio.sleep(max((expires - now) / 2, MIN_RENEW_INTERVAL_S))
        sent = time.monotonic()
        wanted_s = None if wanted_until is None else max(wanted_until - sent, MIN_RENEW_INTERVAL_S)
        request = ratelimit_pb2.RenewRequest(lease_id=lease_id)
        request.lease_ttl.FromNanoseconds(int(first_ttl(wanted_s, grant_s) * 1e9))
        try:
            reply = await stub.Renew(request, timeout=RENEW_TIMEOUT_S, metadata=outgoing_metadata())
        except grpc.aio.AioRpcError as exc:
            RENEWALS.labels(exc.code().name).inc()
            log.warning("ratelimit_renew_failed", lease_id=lease_id, code=exc.code().name, details=exc.details())
            if exc.code() in _FINAL:
                return
            continue
        RENEWALS.labels("ok").inc()
        expires = sent + reply.lease_ttl.ToNanoseconds() / 1e9
        if wanted_until is not None and expires >= wanted_until:
            return
