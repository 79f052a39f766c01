"""A prompt no wait can admit is told so at once, interactive or as a job row (issue 12).

A million-token prompt (a million digits: SmolLM2 tokenizes digits one by one) used to be
answered RESOURCE_EXHAUSTED "retry after 60.00s" by the rate limit, and a job row holding it
was retried until its job's window ended. The gateway now counts a prompt whose estimate does
not fit the model's context and refuses it before taking any lease.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import grpc
import pytest
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2

from conftest import DEMO_KEY, MODEL, auth, scrape
from sluice_stack import Stack
from test_jobs import gen_row, publish_and_collect

MILLION_DIGITS = "7" * 1_000_000


def million_token_chat() -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content=MILLION_DIGITS)],
        sampling=types_pb2.SamplingParams(max_tokens=16),
    )


def test_a_million_token_prompt_is_invalid_and_takes_no_lease(stack: Stack, gateway: Any) -> None:
    decisions = stack.metrics_url("gateway")
    leases_before = scrape(decisions, "sluice_gateway_ratelimit_decisions_total", '{result="allowed"}')
    denied_before = scrape(decisions, "sluice_gateway_ratelimit_decisions_total", '{result="denied"}')
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        list(gateway.Generate(million_token_chat(), metadata=auth(), timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details()
    assert details.startswith("messages: This model's maximum context length is 2048 tokens. However, you requested ")
    prompt_tokens = int(details.split("(")[1].split(" in the messages, 16 in the completion)")[0])
    assert prompt_tokens > 1_000_000  # every digit, plus the chat template's tokens
    assert time.monotonic() - started < 30
    assert scrape(decisions, "sluice_gateway_ratelimit_decisions_total", '{result="allowed"}') == leases_before
    assert scrape(decisions, "sluice_gateway_ratelimit_decisions_total", '{result="denied"}') == denied_before


def test_a_million_token_job_row_fails_at_once_and_the_others_run(stack: Stack, gateway: Any) -> None:
    job_id = f"ctx-{uuid.uuid4().hex[:6]}"
    huge = {"custom_id": "huge", "generate": {"model": MODEL, "prompt": MILLION_DIGITS, "sampling": {"max_tokens": 4}}}
    job = {"job_id": job_id, "api_key": DEMO_KEY, "rows": [huge, gen_row("ok")]}
    started = time.monotonic()
    replies = asyncio.run(publish_and_collect(stack, job, expect=2, timeout_s=90))
    by_id = {r["custom_id"]: r for r in replies}
    assert by_id["huge"]["error"]["code"] == "INVALID_ARGUMENT"
    assert "This model's maximum context length is 2048 tokens. However, you requested" in by_id["huge"]["error"]["message"]
    assert "error" not in by_id["ok"] and by_id["ok"]["usage"]["completion_tokens"] >= 1
    assert time.monotonic() - started < 60  # not retried until the job's window (24 h) ends
