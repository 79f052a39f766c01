"""A client's cancellation or deadline stops the generation at Triton, not just at the client."""

from __future__ import annotations

import time

import grpc
import pytest
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2

from conftest import MODEL, auth, scrape

TOKENS = "sluice_triton_local_tokens_generated_total"
SLOTS = "sluice_triton_local_active_slots"


def long_request() -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content="Write a very long essay about the history of Europe.")],
        sampling=types_pb2.SamplingParams(max_tokens=400),
    )


def wait_for_idle_model(metrics_url: str, timeout_s: float = 5.0) -> float:
    """Waits until no slot is held and the token counter stands still; returns the counter."""
    deadline = time.monotonic() + timeout_s
    while True:
        before = scrape(metrics_url, TOKENS)
        time.sleep(0.5)
        if scrape(metrics_url, SLOTS) == 0 and scrape(metrics_url, TOKENS) == before:
            return before
        assert time.monotonic() < deadline, "Triton kept generating after the client went away"


def test_cancel_mid_stream_stops_generation_at_triton(gateway, stack) -> None:
    metrics = stack.metrics_url("triton-local")
    start_count = wait_for_idle_model(metrics)
    call = gateway.Generate(long_request(), metadata=auth(), timeout=120)
    received = 0
    for response in call:
        received += bool(response.text)
        if received == 5:
            break
    assert scrape(metrics, SLOTS) == 1, "the sequence should hold a slot while it streams"
    call.cancel()
    end_count = wait_for_idle_model(metrics)
    generated = end_count - start_count
    # Some tokens are in flight when the cancel lands; far fewer than the 400 asked for.
    assert 5 <= generated < 60, generated
    cancelled = scrape(stack.metrics_url("inference-adapter"), "sluice_adapter_cancellations_total", '{reason="cancelled"}')
    assert cancelled >= 1


def test_expired_deadline_is_deadline_exceeded_and_frees_the_slot(gateway, stack) -> None:
    metrics = stack.metrics_url("triton-local")
    start_count = wait_for_idle_model(metrics)
    with pytest.raises(grpc.RpcError) as caught:
        list(gateway.Generate(long_request(), metadata=auth(), timeout=1.0))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    generated = wait_for_idle_model(metrics) - start_count
    assert generated < 100, generated
