"""Issue 25 item 2 on the real stack: logprobs with top_logprobs, n and echo through the official
openai SDK (chat and completions, streamed and not) and the gRPC API, the engine's real numbers."""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2

from conftest import DEMO_KEY, MODEL, auth
from sluice_stack import Stack

QUESTION = "Name three fruits."


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.openai_base_url, api_key=DEMO_KEY, max_retries=0, timeout=120)


def _sorted_desc(values: list[float]) -> bool:
    return values == sorted(values, reverse=True)


def _check_chat_entries(entries: list[Any], k: int) -> None:
    assert entries
    for entry in entries:
        assert entry.logprob <= 0 and math.isfinite(entry.logprob)
        assert bytes(entry.bytes or []).decode("utf-8", errors="replace") == entry.token
        assert len(entry.top_logprobs) == k and _sorted_desc([t.logprob for t in entry.top_logprobs])


def test_chat_n3_with_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=1.0, seed=7,
        n=3, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1, texts  # seed + index: distinct streams
    for choice in reply.choices:
        _check_chat_entries(choice.logprobs.content, 3)  # type: ignore[union-attr]
    assert reply.usage is not None
    tokens = sum(len(c.logprobs.content) for c in reply.choices)  # type: ignore[union-attr]
    assert 0 <= reply.usage.completion_tokens - tokens <= 3  # an end-of-sequence token has no entry
    # The prompt is counted once (not three times): the same as a single choice's.
    single = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=1)
    assert single.usage is not None and reply.usage.prompt_tokens == single.usage.prompt_tokens
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=1.0, seed=7, n=3,
    )  # fmt: skip
    assert [c.message.content for c in again.choices] == texts  # reproducible


def test_chat_greedy_logprobs_top_holds_the_token(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0, logprobs=True, top_logprobs=5
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    _check_chat_entries(content, 5)
    for entry in content:
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    assert "".join(e.token for e in content) == reply.choices[0].message.content


def test_chat_streamed_n2_with_logprobs(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=10, temperature=1.0, seed=3,
        n=2, logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    text: dict[int, str] = {0: "", 1: ""}
    entries: dict[int, list[Any]] = {0: [], 1: []}
    finished: set[int] = set()
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                entries[choice.index] += choice.logprobs.content or []
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and all(text.values())
    for index in (0, 1):
        _check_chat_entries(entries[index], 2)
    # Every generated token has an entry but an end-of-sequence token (one per choice at most).
    assert usage is not None and 0 <= usage.completion_tokens - len(entries[0]) - len(entries[1]) <= 2


def test_completions_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    assert all(lp <= 0 for lp in logprobs.token_logprobs)  # type: ignore[operator]
    for top in logprobs.top_logprobs:
        assert len(top) <= 3 and _sorted_desc(list(top.values()))
    offsets = logprobs.text_offset or []
    assert offsets[0] == 0 and offsets == sorted(offsets)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, stream=True)
    tokens: list[str] = []
    text = ""
    for chunk in streamed:
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens or []
    assert tokens == logprobs.tokens and text == reply.choices[0].text


def test_completions_echo_and_n(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.8, seed=11, n=2, echo=True)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.text.startswith(prompt) and len(c.text) > len(prompt) for c in reply.choices)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, echo=True, logprobs=1)
    assert caught.value.body["param"] == "echo"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=9)
    assert caught.value.body["param"] == "n"  # type: ignore[index]


def test_grpc_n_and_logprobs(gateway: Any) -> None:
    request = gateway_pb2.GenerateRequest(
        model=MODEL, messages=[types_pb2.ChatMessage(role="user", content=QUESTION)],
        sampling=types_pb2.SamplingParams(max_tokens=8, temperature=1.0, seed=21, n=2, logprobs=2),
    )  # fmt: skip
    responses = list(gateway.Generate(request, metadata=auth(), timeout=120))
    by_index: dict[int, list[gateway_pb2.GenerateResponse]] = {0: [], 1: []}
    for r in responses:
        by_index[r.index].append(r)
    for index, rs in by_index.items():
        assert rs and rs[-1].finish_reason, index
        entries = [lp for r in rs for lp in r.logprobs]
        assert entries and all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in entries)
        assert all(_sorted_desc([t.logprob for t in lp.top_logprobs]) for lp in entries)
    with_usage = [r for r in responses if r.HasField("usage")]
    assert len(with_usage) == 1 and with_usage[0] is responses[-1]
    entries_total = sum(len(r.logprobs) for r in responses)
    assert 0 <= with_usage[0].usage.completion_tokens - entries_total <= 2
