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


DEADLINE_S = 1.0


def tokens_per_second(gateway) -> float:  # type: ignore[no-untyped-def]
    """The stack's pace on this prompt, one stream, from the request sent (its first token included)."""
    request = long_request()
    request.sampling.max_tokens = 100
    started = time.perf_counter()
    responses = list(gateway.Generate(request, metadata=auth(), timeout=60))
    return responses[-1].usage.completion_tokens / (time.perf_counter() - started)


def test_expired_deadline_is_deadline_exceeded_and_frees_the_slot(gateway, stack) -> None:
    metrics = stack.metrics_url("triton-local")
    rate = tokens_per_second(gateway)
    # What the deadline leaves time for at this stack's pace, plus the steps in flight when it passed
    # (a round's shared response, ~50 ms): a generation that outlived the deadline makes all 400.
    limit = rate * DEADLINE_S * 1.3 + 16
    assert limit < long_request().sampling.max_tokens * 0.75, f"at {rate:.0f} tok/s the deadline's tokens cannot be told from all of them"
    start_count = wait_for_idle_model(metrics)
    with pytest.raises(grpc.RpcError) as caught:
        list(gateway.Generate(long_request(), metadata=auth(), timeout=DEADLINE_S))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    generated = wait_for_idle_model(metrics) - start_count
    assert generated < limit, (generated, limit, rate)
