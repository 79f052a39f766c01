"""The gateway's admission helpers, and its failure policy against an unreachable rate-limit."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest
from google.protobuf import duration_pb2
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.ratelimit.v1 import ratelimit_pb2, ratelimit_pb2_grpc

from sluice_common.errors import DeadlineExceeded, Unavailable
from sluice_common.errors import ResourceExhausted
from sluice_gateway.path.admission import (
    Admission,
    Reservation,
    embedding_reservation,
    estimate_embedding_tokens,
    format_reset,
    generation_reservation,
    prompt_estimate,
    ratelimit_headers,
)


def request(content: str = "Hello there", max_tokens: int = 16) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model="m",
        messages=[types_pb2.ChatMessage(role="user", content=content)],
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens),
    )


def test_prompt_estimate_over_reserves_plain_english() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 20  # ~200 real tokens
    assert prompt_estimate(request(text)) >= 300
    assert prompt_estimate(gateway_pb2.GenerateRequest(prompt="abcdef")) == 3


def test_embedding_estimate_counts_every_input_and_over_reserves_plain_english() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 20  # ~200 real tokens (~45 bytes per 10)
    assert estimate_embedding_tokens(gateway_pb2.EmbedRequest(inputs=[text])) >= 300
    # ceil(bytes / 3) + 2 per input ([CLS], [SEP]); multi-byte text counts its UTF-8 bytes
    assert estimate_embedding_tokens(gateway_pb2.EmbedRequest(inputs=["abcdef", "a", "é"])) == (2 + 2) + (1 + 2) + (1 + 2)


def test_reservations_carry_model_priority_and_tokens() -> None:
    generate = generation_reservation(request("Hello there", max_tokens=16))
    prompt = prompt_estimate(request("Hello there"))
    assert generate == Reservation("m", types_pb2.PRIORITY_CLASS_INTERACTIVE, prompt, prompt + 16)
    embed = embedding_reservation(gateway_pb2.EmbedRequest(model="e", inputs=["abcdef"], priority_class=types_pb2.PRIORITY_CLASS_BULK))
    # Embeddings generate nothing: the reservation is the input estimate alone.
    assert embed == Reservation("e", types_pb2.PRIORITY_CLASS_BULK, 4, 4)


def test_reset_uses_openai_format() -> None:
    assert format_reset(0.02) == "20ms"
    assert format_reset(1.0) == "1s"
    assert format_reset(360.0) == "6m0s"
    assert format_reset(61.5) == "1m1.5s"


def test_headers_come_from_the_per_minute_budgets() -> None:
    status = ratelimit_pb2.BudgetStatus
    budgets = [
        status(budget=ratelimit_pb2.BUDGET_REQUESTS_PER_MINUTE, limit=60, remaining=59, reset_after=duration_pb2.Duration(seconds=1)),
        status(budget=ratelimit_pb2.BUDGET_TOKENS_PER_MINUTE, limit=1000, remaining=900, reset_after=duration_pb2.Duration(seconds=6)),
    ]
    assert dict(ratelimit_headers(budgets)) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "900",
        "x-ratelimit-reset-tokens": "6s",
    }


def _dead_stub() -> tuple[grpc.aio.Channel, ratelimit_pb2_grpc.RateLimitServiceStub]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return channel, ratelimit_pb2_grpc.RateLimitServiceStub(channel)


async def test_unreachable_rate_limit_fails_closed_within_the_timeout() -> None:
    channel, stub = _dead_stub()
    started = time.perf_counter()
    with pytest.raises(Unavailable):
        await Admission(stub, "closed", timeout_s=0.3).admit("t", generation_reservation(request()), time_remaining=10.0)
    assert time.perf_counter() - started < 1.0
    await channel.close()


async def test_unreachable_rate_limit_fails_open_when_configured_and_respects_a_short_deadline() -> None:
    channel, stub = _dead_stub()
    started = time.perf_counter()
    ticket = await Admission(stub, "open", timeout_s=5.0).admit("t", generation_reservation(request()), time_remaining=0.2)
    assert time.perf_counter() - started < 1.0
    assert ticket.lease_id == "" and ticket.metadata == ()
    ticket.settle()  # nothing to commit
    await channel.close()


class _FakeStub:
    def __init__(self, budgets: list[ratelimit_pb2.BudgetStatus], allowed: bool = True) -> None:
        self.budgets = budgets
        self.allowed = allowed
        self.acquired: list[ratelimit_pb2.AcquireRequest] = []
        self.committed: list[ratelimit_pb2.CommitRequest] = []

    async def Acquire(self, request, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        self.acquired.append(request)
        if not self.allowed:
            return ratelimit_pb2.AcquireResponse(
                allowed=False, denied_by=ratelimit_pb2.BUDGET_REQUESTS_PER_MINUTE, retry_after=duration_pb2.Duration(seconds=7)
            )
        return ratelimit_pb2.AcquireResponse(allowed=True, lease_id="l1", budgets=self.budgets)

    async def Commit(self, request, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        self.committed.append(request)
        return ratelimit_pb2.CommitResponse()


async def test_the_workers_rate_comes_from_the_per_minute_budget_never_the_in_flight_limit() -> None:
    status = ratelimit_pb2.BudgetStatus
    in_flight = status(budget=ratelimit_pb2.BUDGET_REQUESTS_IN_FLIGHT, limit=32, remaining=31)
    # No per-minute budget: x-ratelimit-limit-requests holds the in-flight limit, which is no rate.
    ticket = await Admission(_FakeStub([in_flight]), "closed").admit("t", generation_reservation(request()), time_remaining=10.0)  # type: ignore[arg-type]
    assert dict(ticket.metadata)["x-ratelimit-limit-requests"] == "32"
    assert ticket.requests_per_minute is None
    per_minute = status(budget=ratelimit_pb2.BUDGET_REQUESTS_PER_MINUTE, limit=600, remaining=599)
    ticket = await Admission(_FakeStub([in_flight, per_minute]), "closed").admit("t", generation_reservation(request()), time_remaining=10.0)  # type: ignore[arg-type]
    assert ticket.requests_per_minute == 600


async def test_an_embedding_lease_reserves_its_estimate_and_commits_the_real_usage() -> None:
    stub = _FakeStub([])
    admission = Admission(stub, "closed")  # type: ignore[arg-type]
    embed = gateway_pb2.EmbedRequest(model="e", inputs=["abcdef"] * 3, priority_class=types_pb2.PRIORITY_CLASS_BULK)
    ticket = await admission.admit("t", embedding_reservation(embed), time_remaining=10.0)
    acquired = stub.acquired[-1]
    assert (acquired.model, acquired.priority_class, acquired.requests, acquired.reserved_tokens) == ("e", types_pb2.PRIORITY_CLASS_BULK, 1, 12)
    assert acquired.lease_ttl.ToNanoseconds() > 0  # the caller's deadline bounds the lease
    ticket.record(types_pb2.Usage(prompt_tokens=9, total_tokens=9))
    ticket.settle()
    ticket.settle()  # once only
    await admission.drain()
    assert [(c.lease_id, c.used_tokens) for c in stub.committed] == [("l1", 9)]


async def test_a_call_without_usage_commits_its_input_estimate() -> None:
    stub = _FakeStub([])
    admission = Admission(stub, "closed")  # type: ignore[arg-type]
    ticket = await admission.admit("t", embedding_reservation(gateway_pb2.EmbedRequest(model="e", inputs=["abcdef"])), None)
    ticket.record(types_pb2.Usage())  # an adapter that does not count: no refund of work that was done
    ticket.settle()
    await admission.drain()
    assert [c.used_tokens for c in stub.committed] == [4]


async def test_a_denial_names_the_reservations_model_and_tells_when_to_retry() -> None:
    admission = Admission(_FakeStub([], allowed=False), "closed")  # type: ignore[arg-type]
    with pytest.raises(ResourceExhausted) as caught:
        await admission.admit("t", embedding_reservation(gateway_pb2.EmbedRequest(model="e", inputs=["x"])), 10.0)
    assert caught.value.retry_after_s == 7.0
    assert "tenant t on e" in str(caught.value)
    assert caught.value.quota_subject == "tenant:t/model:e/requests_per_minute"


class _TooLargeStub(_FakeStub):
    async def Acquire(self, request, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        self.acquired.append(request)
        tokens = ratelimit_pb2.BudgetStatus(budget=ratelimit_pb2.BUDGET_TOKENS_PER_MINUTE, limit=200000, remaining=200000)
        return ratelimit_pb2.AcquireResponse(allowed=False, denied_by=ratelimit_pb2.BUDGET_TOKENS_PER_MINUTE, exceeds_limit=True, budgets=[tokens])


async def test_a_request_larger_than_the_whole_allowance_is_refused_without_a_retry_time() -> None:
    admission = Admission(_TooLargeStub([]), "closed")  # type: ignore[arg-type]
    with pytest.raises(ResourceExhausted) as caught:
        await admission.admit("t", generation_reservation(request("x" * 900_000, max_tokens=16)), 10.0)
    assert caught.value.retry_after_s is None
    message = str(caught.value)
    assert "request too large" in message and "tokens_per_minute allowance of 200000" in message
    assert "no retry can admit it" in message and "retry after" not in message


class _RenewingStub(_FakeStub):
    """Grants `granted_s` per lease and renewal, as a rate-limit whose maximum TTL is that short."""

    def __init__(self, granted_s: float, renew_code: grpc.StatusCode | None = None) -> None:
        super().__init__([])
        self.granted = duration_pb2.Duration()
        self.granted.FromNanoseconds(int(granted_s * 1e9))
        self.renew_code = renew_code
        self.renewed: list[ratelimit_pb2.RenewRequest] = []

    async def Acquire(self, request, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        self.acquired.append(request)
        return ratelimit_pb2.AcquireResponse(allowed=True, lease_id="l1", lease_ttl=self.granted)

    async def Renew(self, request, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        self.renewed.append(request)
        if self.renew_code is not None:
            raise grpc.aio.AioRpcError(self.renew_code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="lease l1 is unknown")
        return ratelimit_pb2.RenewResponse(lease_ttl=self.granted)


async def test_a_call_running_past_its_granted_lease_renews_it_until_settled() -> None:
    stub = _RenewingStub(granted_s=0.2)  # the server capped the deadline's 10 s + margin at 0.2 s
    ticket = await Admission(stub, "closed").admit("t", generation_reservation(request()), time_remaining=10.0)  # type: ignore[arg-type]
    await _until(lambda: len(stub.renewed) >= 3)  # halfway to each expiry: about every 0.1 s
    assert {r.lease_id for r in stub.renewed} == {"l1"}
    # each asks for what the call may still need: its deadline's remainder plus the margin
    assert 10.0 < stub.renewed[-1].lease_ttl.ToNanoseconds() / 1e9 < 40.0
    ticket.settle()
    renewals = len(stub.renewed)
    await asyncio.sleep(0.3)
    assert len(stub.renewed) == renewals  # settled: no renewal after it


async def test_a_lease_granted_the_whole_deadline_is_never_renewed() -> None:
    stub = _RenewingStub(granted_s=40.0)  # 10 s deadline + 30 s margin fits
    ticket = await Admission(stub, "closed").admit("t", generation_reservation(request()), time_remaining=10.0)  # type: ignore[arg-type]
    assert stub.acquired[0].lease_ttl.ToNanoseconds() / 1e9 == pytest.approx(40.0)
    assert ticket.renewal is None
    ticket.settle()


async def test_a_long_call_asks_for_one_grant_at_a_time_and_renews() -> None:
    """A gateway that dies leaves its leases for one grant (60 s), not the call's hour."""
    stub = _RenewingStub(granted_s=60.0)
    ticket = await Admission(stub, "closed", lease_ttl_s=60.0).admit("t", generation_reservation(request()), time_remaining=3600.0)  # type: ignore[arg-type]
    assert stub.acquired[0].lease_ttl.seconds == 60
    assert ticket.renewal is not None and not ticket.renewal.done()
    ticket.settle()
    await asyncio.sleep(0)
    assert ticket.renewal.cancelled()


async def test_renewals_stop_once_the_server_no_longer_knows_the_lease() -> None:
    stub = _RenewingStub(granted_s=0.2, renew_code=grpc.StatusCode.NOT_FOUND)
    ticket = await Admission(stub, "closed").admit("t", generation_reservation(request()), time_remaining=None)  # type: ignore[arg-type]
    assert ticket.renewal is not None
    await asyncio.wait_for(ticket.renewal, 5)  # NOT_FOUND ends the renewals
    assert len(stub.renewed) == 1
    assert stub.acquired[0].lease_ttl.seconds == stub.renewed[0].lease_ttl.seconds == 60  # no deadline: a grant at a time
    assert ticket.renewal is not None and ticket.renewal.done()
    ticket.settle()


async def test_a_failed_renewal_is_tried_again_before_the_lease_expires() -> None:
    stub = _RenewingStub(granted_s=0.4, renew_code=grpc.StatusCode.UNAVAILABLE)
    ticket = await Admission(stub, "closed").admit("t", generation_reservation(request()), time_remaining=10.0)  # type: ignore[arg-type]
    assert ticket.renewal is not None
    await asyncio.wait_for(ticket.renewal, 5)  # expired: nothing left to renew, the renewals end
    # at 0.2, 0.3, 0.35, ... halfway to the expiry each time, then given up once it passed
    assert len(stub.renewed) >= 3
    ticket.settle()


class _SlowGrant(_FakeStub):
    """Grants after `delay_s`, or fails with `code`; records what is given back."""

    def __init__(self, delay_s: float = 0.0, code: grpc.StatusCode | None = None) -> None:
        super().__init__([])
        self.delay_s = delay_s
        self.code = code
        self.released: list[str] = []

    async def Acquire(self, request, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        await asyncio.sleep(self.delay_s)
        if self.code is not None:
            raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="Deadline Exceeded")
        return await super().Acquire(request, timeout, metadata)

    async def Release(self, request, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        self.released.append(request.lease_id)
        return ratelimit_pb2.ReleaseResponse()


async def test_a_grant_reaching_a_call_cancelled_while_it_waited_is_given_back() -> None:
    stub = _SlowGrant(delay_s=0.2)
    admission = Admission(stub, "closed")  # type: ignore[arg-type]
    waiting = asyncio.ensure_future(admission.admit("t", generation_reservation(request()), time_remaining=10.0))
    await asyncio.sleep(0.05)
    waiting.cancel()  # the client went away while rate-limit decided
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.sleep(0.3)
    await admission.drain()
    assert stub.released == ["l1"]  # not held until the lease expired


@pytest.mark.parametrize("policy", ["closed", "open"])
async def test_a_request_whose_own_deadline_ends_during_admission_is_deadline_exceeded(policy: str) -> None:
    admission = Admission(_SlowGrant(code=grpc.StatusCode.DEADLINE_EXCEEDED), policy, timeout_s=0.5)  # type: ignore[arg-type]
    with pytest.raises(DeadlineExceeded, match="deadline"):
        await admission.admit("t", generation_reservation(request()), time_remaining=0.05)
    # the gateway's own timeout (not the request's deadline) cut it: rate-limit is slow, the policy applies
    late = Admission(_SlowGrant(code=grpc.StatusCode.DEADLINE_EXCEEDED), policy, timeout_s=0.5)  # type: ignore[arg-type]
    if policy == "closed":
        with pytest.raises(Unavailable):
            await late.admit("t", generation_reservation(request()), time_remaining=10.0)
    else:
        assert (await late.admit("t", generation_reservation(request()), time_remaining=10.0)).lease_id == ""


async def _until(condition, within_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + within_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


class _FailingStub:
    """A rate-limit that answers Acquire with an error status."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code

    async def Acquire(self, request, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), "lease_ttl must be positive")


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED],
)
async def test_an_error_rate_limit_answered_is_internal_and_admits_nothing_whatever_the_policy(code: grpc.StatusCode) -> None:
    """Every Acquire error read as "unreachable": under the open policy a rate-limit that answered,
    and refused (a bug, a version skew), let every request through without limits."""
    from sluice_common.errors import SluiceError

    for policy in ("open", "closed"):
        with pytest.raises(SluiceError) as caught:
            await Admission(_FailingStub(code), policy).admit("t", generation_reservation(request()), time_remaining=10.0)  # type: ignore[arg-type]
        assert type(caught.value) is SluiceError and caught.value.code == "INTERNAL"
        assert caught.value.message == f"the rate-limit service answered {code.name}: lease_ttl must be positive"


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED])
async def test_a_rate_limit_that_could_not_decide_leaves_it_to_the_policy(code: grpc.StatusCode) -> None:
    ticket = await Admission(_FailingStub(code), "open").admit("t", generation_reservation(request()), time_remaining=10.0)  # type: ignore[arg-type]
    assert ticket.lease_id == ""
    with pytest.raises(Unavailable):
        await Admission(_FailingStub(code), "closed").admit("t", generation_reservation(request()), time_remaining=10.0)  # type: ignore[arg-type]
