"""n, logprobs and echo through the OpenAI front and the InferencePath, over a fake adapter: the
shapes checked against the openai package's own types, the fan-out (n calls, seed + i, n cleared),
the merged usage, the reservation, and the refusals naming their param."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion import Completion
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.inference.v1 import inference_pb2

from sluice_gateway.path.admission import generation_reservation
from test_openai_http import AUTH, CHAT, GENERATION, _Call, _error, setup  # noqa: F401  # the fixture

PROMPT = "Once"


def _lp(token: str, logprob: float, *top: tuple[str, float]) -> types_pb2.TokenLogprob:
    return types_pb2.TokenLogprob(
        token=token, logprob=logprob, bytes=token.encode(),
        top_logprobs=[types_pb2.TopLogprob(token=t, logprob=v, bytes=t.encode()) for t, v in top],
    )  # fmt: skip


def _choice_chunks(i: int) -> list[Any]:
    """Choice i: two tokens "A{i}" " b", with logprobs; its usage counts its own tokens."""
    usage = types_pb2.Usage(prompt_tokens=7, completion_tokens=2, total_tokens=9, cached_tokens=0 if i == 0 else 7)
    return [
        inference_pb2.GenerateResponse(text=f"A{i}", token_count=1, logprobs=[_lp(f"A{i}", -0.5, (f"A{i}", -0.5), ("Z", -1.5))]),
        inference_pb2.GenerateResponse(
            text=" b", token_count=1, logprobs=[_lp(" b", -0.25, (" b", -0.25), (" c", -2.0))],
            finish_reason=types_pb2.FINISH_REASON_STOP if i != 1 else types_pb2.FINISH_REASON_LENGTH, usage=usage,
        ),
    ]  # fmt: skip


@pytest.fixture
def per_choice(setup):  # type: ignore[no-untyped-def]  # noqa: F811
    """The fake adapter answers each call by the seed it was sent (seed 10 + i is choice i)."""
    client, adapter, ratelimit, publisher = setup

    def generate(request, timeout=None, metadata=None):  # type: ignore[no-untyped-def]
        adapter.requests.append(request)
        return _Call(_choice_chunks(request.sampling.seed - 10))

    adapter.Generate = generate
    return client, adapter


async def test_chat_n_with_logprobs_whole(per_choice) -> None:  # type: ignore[no-untyped-def]
    client, adapter = per_choice
    body = {**CHAT, "n": 3, "seed": 10, "logprobs": True, "top_logprobs": 2}
    reply = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert reply.status == 200, await reply.text()
    completion = ChatCompletion.model_validate(await reply.json())
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert [c.message.content for c in completion.choices] == ["A0 b", "A1 b", "A2 b"]
    assert [c.finish_reason for c in completion.choices] == ["stop", "length", "stop"]
    # The prompt once, every choice's completion tokens; cached: the fewest of any choice.
    assert completion.usage is not None and (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (7, 6)
    assert completion.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    content = completion.choices[1].logprobs.content  # type: ignore[union-attr]
    assert [(t.token, t.logprob, t.bytes) for t in content] == [("A1", -0.5, list(b"A1")), (" b", -0.25, list(b" b"))]
    assert [t.token for t in content[0].top_logprobs] == ["A1", "Z"]
    # n calls of n = 1, choice i seeded 10 + i, each asking for 2 alternatives.
    assert [(r.sampling.HasField("n"), r.sampling.seed, r.sampling.logprobs) for r in adapter.requests] == [
        (False, 10, 2),
        (False, 11, 2),
        (False, 12, 2),
    ]


async def test_chat_n_streamed_interleaves_choices_with_their_index(per_choice) -> None:  # type: ignore[no-untyped-def]
    client, _ = per_choice
    body = {**CHAT, "n": 2, "seed": 10, "logprobs": True, "stream": True, "stream_options": {"include_usage": True}}
    reply = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    events = [line[6:] for line in (await reply.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(e)) for e in events[:-1]]
    text = {0: "", 1: ""}
    tokens: dict[int, list[str]] = {0: [], 1: []}
    finishes = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        text[choice.index] += choice.delta.content or ""
        if choice.logprobs is not None:
            tokens[choice.index] += [t.token for t in choice.logprobs.content or []]
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert text == {0: "A0 b", 1: "A1 b"} and tokens == {0: ["A0", " b"], 1: ["A1", " b"]}
    assert finishes == {0: "stop", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


async def test_completion_logprobs_whole_and_streamed(per_choice) -> None:  # type: ignore[no-untyped-def]
    client, adapter = per_choice
    body = {"model": "g", "prompt": PROMPT, "seed": 10, "logprobs": 1}
    completion = Completion.model_validate(await (await client.post("/v1/completions", json=body, headers=AUTH)).json())
    (choice,) = completion.choices
    assert choice.text == "A0 b" and choice.logprobs is not None
    assert choice.logprobs.tokens == ["A0", " b"] and choice.logprobs.token_logprobs == [-0.5, -0.25]
    assert choice.logprobs.top_logprobs == [{"A0": -0.5, "Z": -1.5}, {" b": -0.25, " c": -2.0}]
    assert choice.logprobs.text_offset == [0, 2]
    assert adapter.requests[-1].sampling.logprobs == 1
    streamed = await client.post("/v1/completions", json={**body, "stream": True}, headers=AUTH)
    events = [json.loads(line[6:]) for line in (await streamed.text()).splitlines() if line.startswith("data: {")]
    parts = [e["choices"][0] for e in events]  # (a stream chunk's null finish_reason is not in Completion's type)
    offsets = [o for p in parts if p["logprobs"] is not None for o in p["logprobs"]["text_offset"]]
    assert "".join(p["text"] for p in parts) == "A0 b" and offsets == [0, 2]
    assert [t for p in parts if p["logprobs"] for t in p["logprobs"]["tokens"]] == ["A0", " b"]


async def test_completion_echo_prepends_the_prompt(per_choice) -> None:  # type: ignore[no-untyped-def]
    client, _ = per_choice
    body = {"model": "g", "prompt": PROMPT, "seed": 10, "echo": True, "n": 2}
    completion = Completion.model_validate(await (await client.post("/v1/completions", json=body, headers=AUTH)).json())
    assert [c.text for c in completion.choices] == [PROMPT + "A0 b", PROMPT + "A1 b"]
    streamed = await client.post("/v1/completions", json={**body, "stream": True}, headers=AUTH)
    events = [json.loads(line[6:]) for line in (await streamed.text()).splitlines() if line.startswith("data: {")]
    by_index: dict[int, str] = {}
    for event in events:
        for c in event["choices"]:
            by_index[c["index"]] = by_index.get(c["index"], "") + c["text"]
    assert by_index == {0: PROMPT + "A0 b", 1: PROMPT + "A1 b"}


@pytest.mark.parametrize(
    ("path", "changes", "param"),
    [
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/chat/completions", {"n": 9}, "n"),
        ("/v1/chat/completions", {"n": 0}, "n"),
        ("/v1/chat/completions", {"n": "2"}, "n"),
        ("/v1/completions", {"n": 10**40}, "n"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"echo": True, "logprobs": 0}, "echo"),
        ("/v1/completions", {"echo": "yes"}, "echo"),
    ],
)
async def test_bad_choice_options_are_400s_naming_them(setup, path: str, changes: dict[str, Any], param: str) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    client, adapter, _, _ = setup
    body = CHAT if path == "/v1/chat/completions" else {"model": "g", "prompt": PROMPT}
    status, error = await _error(await client.post(path, json={**body, **changes}, headers=AUTH))
    assert (status, error["param"]) == (400, param), error
    assert not adapter.requests


@pytest.fixture
def silent_model():  # type: ignore[no-untyped-def]
    """The model lists no logprobs (Triton's vLLM backend through the passthrough), before the catalog loads."""
    GENERATION.logprobs = False
    yield
    GENERATION.logprobs = True


async def test_logprobs_from_a_model_that_reports_none_is_a_400(silent_model, setup) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    client, adapter, _, _ = setup
    status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, "logprobs": True}, headers=AUTH))
    assert (status, error["param"]) == (400, "logprobs") and "log-probabilities" in error["message"]
    assert not adapter.requests


def test_the_reservation_counts_the_prompt_once_and_n_times_max_tokens() -> None:
    request = gateway_pb2.GenerateRequest(model="g", prompt="x" * 30, sampling=types_pb2.SamplingParams(max_tokens=100, n=4))
    one = gateway_pb2.GenerateRequest(model="g", prompt="x" * 30, sampling=types_pb2.SamplingParams(max_tokens=100))
    assert generation_reservation(request, 10).reserved_tokens - generation_reservation(one, 10).reserved_tokens == 300
