"""Issue 24 item 2 on the real stack: the engine's prefix cache says what it reused. The same long
system prompt twice through the gateway's OpenAI-compatible HTTP front: the second answer's usage
says in prompt_tokens_details.cached_tokens (OpenAI's CompletionUsage) how many of its prompt
tokens the engine took from its cache instead of prefilling, the first says none, greedy decoding
gives the same text either way, and evaluation-logging stores the count."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from sluice.evallog.v1 import evallog_pb2, evallog_pb2_grpc

from conftest import DEMO_KEY, MODEL, auth
from sluice_stack import Stack

# About 200 tokens of SmolLM2's tokenizer (196; the nonce line below adds about 35, the chat template and
# the question about 30 more).
SYSTEM_PROMPT = (
    "You are the support assistant of Riverside Outfitters, a shop that sells kayaks, canoes, paddles,"
    " life jackets, dry bags and camping gear. Answer in one short sentence, politely and plainly."
    " Never invent prices, stock levels or delivery dates: when a customer asks for them, say that a"
    " colleague will check and reply by email. Orders ship from the warehouse in Lyon on weekdays;"
    " returns are accepted within thirty days when the item is unused and in its original packaging."
    " Repairs of paddles and seats are free during the first year, and a kayak bought in the shop may"
    " be exchanged once for another model of the same price. The shop is open from nine to six, Monday"
    " to Saturday, and closed on public holidays. Guided river trips leave every Sunday morning in"
    " summer; beginners are welcome and every guest gets a life jacket and a helmet. Do not discuss"
    " competitors, politics or the weather forecast, and never ask a customer for a card number."
)
QUESTION = "Can I return a paddle I bought two weeks ago?"


@pytest.fixture(scope="module")
def evallog(stack: Stack) -> Iterator[evallog_pb2_grpc.EvalLogServiceStub]:
    with grpc.insecure_channel(stack.evallog_address) as channel:
        yield evallog_pb2_grpc.EvalLogServiceStub(channel)


def chat(stack: Stack, system: str) -> tuple[dict[str, Any], str]:
    """A chat completion's JSON body as the front sent it (not the SDK's parse of it), and its request id."""
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
        "max_tokens": 24,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{stack.openai_base_url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {DEMO_KEY}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200
        return json.loads(reply.read()), reply.headers["x-request-id"]


def stored_usage(evallog: evallog_pb2_grpc.EvalLogServiceStub, request_id: str, timeout_s: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        page = evallog.QueryRecords(evallog_pb2.QueryRecordsRequest(model=MODEL, page_size=1000), metadata=auth(), timeout=10)
        for record in page.records:
            if record.event.request_id == request_id:
                return record.event.usage
        time.sleep(0.25)
    raise AssertionError(f"no evaluation record for {request_id}")


def test_the_same_system_prompt_twice_reports_the_cached_prompt_tokens(stack: Stack, evallog) -> None:  # type: ignore[no-untyped-def]
    # A nonce first: no earlier request of this session (or of an engine that outlived one) shares
    # more than the chat template's opening with this prompt, so the first answer has nothing cached.
    system = f"Conversation {uuid.uuid4().hex}.\n{SYSTEM_PROMPT}"
    first, first_id = chat(stack, system)
    second, second_id = chat(stack, system)

    for reply in (first, second):
        usage = reply["usage"]
        assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}, usage
        assert set(usage["prompt_tokens_details"]) == {"cached_tokens"}, usage
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] > 200
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached <= second["usage"]["prompt_tokens"], second["usage"]
    # Reusing the cached prefix changes nothing in what greedy decoding makes of it.
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert second["choices"][0]["finish_reason"] == first["choices"][0]["finish_reason"]

    # The completion events say it too, and evaluation-logging stores and returns it.
    assert stored_usage(evallog, first_id).cached_tokens == 0
    assert stored_usage(evallog, second_id).cached_tokens == cached
