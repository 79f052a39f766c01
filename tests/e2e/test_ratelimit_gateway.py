"""The gateway's admission through rate-limit, on the real stack.

The session's stack runs with config/limits.toml; these tests also start a rate-limit with tight
limits of their own and gateways in front of the stack's adapter that use it (or a dead address).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from sluice.ratelimit.v1 import ratelimit_pb2, ratelimit_pb2_grpc

from conftest import DEMO_KEY, EMBEDDING_MODEL, MODEL, auth, wait_for
from ratelimit_support import start_ratelimit
from sluice_stack import ServiceProcess, Stack
from sluice_stack.launcher import ANY_HTTP_PORT, GATEWAY_PORT_ENV

PRIVATE_KEY = "sk-sluice-private"
LIMITS = """
[tenants.demo]
requests_per_minute = 100
tokens_per_minute = 100000
requests_in_flight = 4
burst = 1.0

[tenants.private]
requests_per_minute = 1
burst = 1.0
"""


def start_gateway(stack: Stack, run_dir: Path, name: str, ratelimit_url: str, **env: str) -> tuple[ServiceProcess, str]:
    settings = {
        "PYTHONUNBUFFERED": "1",
        "SLUICE_GATEWAY_PORT": "0",
        "SLUICE_GATEWAY_METRICS_PORT": "0",
        "SLUICE_GATEWAY_ADAPTER_URL": stack.adapter_address,
        "SLUICE_GATEWAY_TENANTS_FILE": str(stack.tenants_file),
        "SLUICE_GATEWAY_AMQP_URL": stack.amqp_url,
        "SLUICE_GATEWAY_AMQP_PREFIX": stack.amqp_prefix,
        "SLUICE_GATEWAY_EVENTS_SPILL_FILE": str(run_dir / f"{name}-events.spill"),
        "SLUICE_GATEWAY_JOBS_SQLITE_PATH": str(run_dir / f"{name}-jobs.sqlite3"),
        "SLUICE_GATEWAY_RATELIMIT_URL": ratelimit_url,
        **{f"SLUICE_GATEWAY_{key.upper()}": value for key, value in env.items()},
    }
    process = ServiceProcess(name, "sluice_gateway", settings, run_dir / f"{name}.log", project="gateway", port_env=GATEWAY_PORT_ENV)
    process.start_ready(120)
    return process, process.address


@pytest.fixture(scope="module")
def limited_gateway(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServiceProcess, str]]:
    """(gateway, rate-limit address) with the tight LIMITS; the gateway serves gRPC and HTTP."""
    run_dir = tmp_path_factory.mktemp("ratelimit-gateway")
    limits = run_dir / "limits.toml"
    limits.write_text(LIMITS)
    limiter, limiter_address = start_ratelimit(run_dir, "rate-limit-gw", limits)
    try:
        gateway, _ = start_gateway(stack, run_dir, "gateway-rl", limiter_address, http_port=str(ANY_HTTP_PORT))
        try:
            yield gateway, limiter_address
        finally:
            gateway.stop()
    finally:
        limiter.stop()


@pytest.fixture(scope="module")
def limited(limited_gateway: tuple[ServiceProcess, str]) -> tuple[str, str]:
    """(gateway address, rate-limit address) with the tight LIMITS."""
    gateway, limiter_address = limited_gateway
    return gateway.address, limiter_address


def request(max_tokens: int = 4, content: str = "Say hello.") -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content=content)],
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def usage(limiter_address: str, tenant: str, model: str = MODEL) -> dict[int, ratelimit_pb2.BudgetStatus]:
    with grpc.insecure_channel(limiter_address) as channel:
        reply = ratelimit_pb2_grpc.RateLimitServiceStub(channel).GetUsage(ratelimit_pb2.GetUsageRequest(tenant=tenant), timeout=5)
    return {b.budget: b for row in reply.usage if row.model == model for b in row.budgets}


def test_the_stack_gateway_sends_openai_ratelimit_headers(gateway) -> None:
    call = gateway.Generate(request(), metadata=auth(), timeout=60)
    headers = dict(call.initial_metadata())
    list(call)
    for suffix in ("requests", "tokens"):
        assert int(headers[f"x-ratelimit-limit-{suffix}"]) > 0
        assert 0 <= int(headers[f"x-ratelimit-remaining-{suffix}"]) < int(headers[f"x-ratelimit-limit-{suffix}"])
        assert headers[f"x-ratelimit-reset-{suffix}"].endswith("s")


def test_real_usage_is_committed_after_the_stream(limited) -> None:
    gateway_address, limiter_address = limited
    with grpc.insecure_channel(gateway_address) as channel:
        call = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request(max_tokens=6), metadata=auth(), timeout=60)
        headers = dict(call.initial_metadata())
        final = [r for r in call if r.finish_reason][-1]
    assert headers["x-ratelimit-limit-tokens"] == "100000"
    reserved = 100000 - int(headers["x-ratelimit-remaining-tokens"])
    used = final.usage.prompt_tokens + final.usage.completion_tokens
    assert reserved > used  # the estimate over-reserves (prompt bytes / 3 + framing, + max_tokens) ...
    # ... and the commit frees the in-flight slot and leaves exactly the real usage charged
    wait_for(lambda: usage(limiter_address, "demo")[ratelimit_pb2.BUDGET_REQUESTS_IN_FLIGHT].remaining == 4)
    spent = 100000 - usage(limiter_address, "demo")[ratelimit_pb2.BUDGET_TOKENS_PER_MINUTE].remaining
    assert spent == used


def test_a_cancelled_stream_is_committed_at_once(limited) -> None:
    gateway_address, limiter_address = limited
    with grpc.insecure_channel(gateway_address) as channel:
        call = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request(max_tokens=200), metadata=auth(), timeout=60)
        next(iter(call))
        assert usage(limiter_address, "demo")[ratelimit_pb2.BUDGET_REQUESTS_IN_FLIGHT].remaining == 3
        call.cancel()
    # settled by the gateway, not by the lease's expiry (deadline + 30 s away)
    wait_for(lambda: usage(limiter_address, "demo")[ratelimit_pb2.BUDGET_REQUESTS_IN_FLIGHT].remaining == 4, timeout_s=5.0)


def _grpc_stream(gateway: ServiceProcess) -> None:
    with grpc.insecure_channel(gateway.address) as channel:
        list(gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request(max_tokens=2), metadata=auth(), timeout=60))


def _http_stream(gateway: ServiceProcess) -> None:
    """A streamed chat read up to its `data: [DONE]`, as an OpenAI client reads it (urllib raises
    HTTPError on a 429)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2, "stream": True}
    sent = urllib.request.Request(
        f"http://127.0.0.1:{gateway.ports['http']}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {DEMO_KEY}"},
    )
    with urllib.request.urlopen(sent, timeout=60) as response:
        for line in response:
            if line.strip() == b"data: [DONE]":
                return
    raise AssertionError("the stream ended without data: [DONE]")


@pytest.mark.parametrize("stream", [_grpc_stream, _http_stream], ids=["grpc", "http"])
def test_a_client_keeping_its_in_flight_limit_busy_is_never_refused(limited_gateway, stream: Callable[[ServiceProcess], None]) -> None:
    """A stream's in-flight slot is free by the time its client has read the stream's end, so a
    client that keeps exactly requests_in_flight streams going, sending the next as one ends (what
    every load generator and worker pool does), is never told to come back in a second."""
    gateway, limiter_address = limited_gateway
    idle = lambda: (b := usage(limiter_address, "demo").get(ratelimit_pb2.BUDGET_REQUESTS_IN_FLIGHT)) is None or b.remaining == 4  # noqa: E731
    wait_for(idle)
    refused: list[str] = []

    def client() -> None:
        for _ in range(4):
            try:
                stream(gateway)
            except (grpc.RpcError, urllib.error.HTTPError) as error:
                refused.append(repr(error))

    clients = [threading.Thread(target=client) for _ in range(4)]  # the tenant's requests_in_flight
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(timeout=120)
    assert refused == []


def test_a_denial_is_resource_exhausted_with_retry_info_and_quota_failure(limited) -> None:
    gateway_address, _ = limited
    with grpc.insecure_channel(gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        list(stub.Generate(request(), metadata=auth(PRIVATE_KEY), timeout=60))
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request(), metadata=auth(PRIVATE_KEY), timeout=60))
    assert "requests_per_minute" in caught.value.details()
    assert_denied_by_requests_per_minute(caught.value, MODEL)
    # The same x-ratelimit-* figures the HTTP front sends as headers with its 429.
    trailing = dict(caught.value.trailing_metadata())
    assert trailing["x-ratelimit-remaining-requests"] == "0"
    assert int(trailing["x-ratelimit-limit-requests"]) > 0 and trailing["x-ratelimit-reset-requests"].endswith("s")


def assert_denied_by_requests_per_minute(error: grpc.RpcError, model: str) -> None:
    """RESOURCE_EXHAUSTED with RetryInfo (a delay within the window) and QuotaFailure naming the budget."""
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = {d.TypeName(): d for d in rpc_status.from_call(error).details}
    retry = error_details_pb2.RetryInfo()
    details["google.rpc.RetryInfo"].Unpack(retry)
    assert 0 < retry.retry_delay.ToNanoseconds() / 1e9 <= 60
    quota = error_details_pb2.QuotaFailure()
    details["google.rpc.QuotaFailure"].Unpack(quota)
    assert quota.violations[0].subject == f"tenant:private/model:{model}/requests_per_minute"


def embed_request(*inputs: str) -> gateway_pb2.EmbedRequest:
    return gateway_pb2.EmbedRequest(model=EMBEDDING_MODEL, inputs=list(inputs))


def test_embed_is_admitted_and_commits_its_tokens(limited) -> None:
    gateway_address, limiter_address = limited
    with grpc.insecure_channel(gateway_address) as channel:
        reply, call = gateway_pb2_grpc.GatewayServiceStub(channel).Embed.with_call(
            embed_request("A man is eating food.", "The girl is carrying a baby."), metadata=auth(), timeout=60
        )
    headers = dict(call.initial_metadata())
    assert len(reply.embeddings) == 2
    assert headers["x-ratelimit-limit-tokens"] == "100000"
    reserved = 100000 - int(headers["x-ratelimit-remaining-tokens"])
    assert reserved > 0  # the inputs' estimate; max_tokens is 0 for embeddings
    # Committed after the call: the in-flight slot is free again and the tokens stay charged
    # (the reply's usage when the adapter counts, else the estimate).
    wait_for(lambda: usage(limiter_address, "demo", EMBEDDING_MODEL)[ratelimit_pb2.BUDGET_REQUESTS_IN_FLIGHT].remaining == 4)
    spent = 100000 - usage(limiter_address, "demo", EMBEDDING_MODEL)[ratelimit_pb2.BUDGET_TOKENS_PER_MINUTE].remaining
    assert spent == (reply.usage.total_tokens or reserved)


def test_embed_past_the_requests_per_minute_is_resource_exhausted_with_retry_info(limited) -> None:
    gateway_address, _ = limited
    with grpc.insecure_channel(gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        stub.Embed(embed_request("one"), metadata=auth(PRIVATE_KEY), timeout=60)  # the tenant's 1 per minute
        with pytest.raises(grpc.RpcError) as caught:
            stub.Embed(embed_request("two"), metadata=auth(PRIVATE_KEY), timeout=60)
    assert_denied_by_requests_per_minute(caught.value, EMBEDDING_MODEL)


def test_an_unreachable_rate_limit_fails_closed_within_the_deadline(
    stack: Stack, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    # A port this test holds bound but not listening: connections to it are refused, and no other
    # process can start serving on it meanwhile.
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{held.getsockname()[1]}"
    gateway, address = start_gateway(stack, tmp_path, "gateway-rl-dead", dead, ratelimit_timeout_s="0.3")
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)  # the timing below is the call's, not the connection's
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            for timeout in (30.0, 0.2):
                started = time.perf_counter()
                with pytest.raises(grpc.RpcError) as caught:
                    list(stub.Generate(request(), metadata=auth(), timeout=timeout))
                elapsed = time.perf_counter() - started
                record_property(f"failed_closed_s_timeout{timeout}", round(elapsed, 3))
                assert caught.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                assert elapsed < min(timeout, 0.3) + 0.7, elapsed
                if timeout > 1:
                    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert "rate-limit" in caught.value.details()
    finally:
        gateway.stop()
        held.close()
