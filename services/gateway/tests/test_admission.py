"""The gateway's admission helpers, and its failure policy against an unreachable rate-limit."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
from google.protobuf import duration_pb2
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.ratelimit.v1 import ratelimit_pb2, ratelimit_pb2_grpc

from sluice_common.errors import Unavailable
from sluice_gateway.admission import Admission, estimate_prompt_tokens, format_reset, ratelimit_headers


def request(content: str = "Hello there", max_tokens: int = 16) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model="m",
        messages=[types_pb2.ChatMessage(role="user", content=content)],
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens),
    )


def test_prompt_estimate_over_reserves_plain_english() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 20  # ~200 real tokens
    assert estimate_prompt_tokens(request(text)) >= 300
    assert estimate_prompt_tokens(gateway_pb2.GenerateRequest(prompt="abcdef")) == 3


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
        await Admission(stub, "closed", timeout_s=0.3).admit("t", request(), time_remaining=10.0)
    assert time.perf_counter() - started < 1.0
    await channel.close()


async def test_unreachable_rate_limit_fails_open_when_configured_and_respects_a_short_deadline() -> None:
    channel, stub = _dead_stub()
    started = time.perf_counter()
    ticket = await Admission(stub, "open", timeout_s=5.0).admit("t", request(), time_remaining=0.2)
    assert time.perf_counter() - started < 1.0
    assert ticket.lease_id == "" and ticket.metadata == ()
    ticket.settle()  # nothing to commit
    await channel.close()


class _FakeStub:
    def __init__(self, budgets: list[ratelimit_pb2.BudgetStatus]) -> None:
        self.budgets = budgets

    async def Acquire(self, request, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        return ratelimit_pb2.AcquireResponse(allowed=True, lease_id="l1", budgets=self.budgets)


async def test_the_workers_rate_comes_from_the_per_minute_budget_never_the_in_flight_limit() -> None:
    status = ratelimit_pb2.BudgetStatus
    in_flight = status(budget=ratelimit_pb2.BUDGET_REQUESTS_IN_FLIGHT, limit=32, remaining=31)
    # No per-minute budget: x-ratelimit-limit-requests holds the in-flight limit, which is no rate.
    ticket = await Admission(_FakeStub([in_flight]), "closed").admit("t", request(), time_remaining=10.0)  # type: ignore[arg-type]
    assert dict(ticket.metadata)["x-ratelimit-limit-requests"] == "32"
    assert ticket.requests_per_minute is None
    per_minute = status(budget=ratelimit_pb2.BUDGET_REQUESTS_PER_MINUTE, limit=600, remaining=599)
    ticket = await Admission(_FakeStub([in_flight, per_minute]), "closed").admit("t", request(), time_remaining=10.0)  # type: ignore[arg-type]
    assert ticket.requests_per_minute == 600
