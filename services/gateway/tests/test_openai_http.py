"""The OpenAI-compatible HTTP front over a fake adapter: shapes checked against the openai
package's own types (OpenAI's definitions), errors in OpenAI's shape with its codes."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from typing import Any

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai.types import CreateEmbeddingResponse, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion import Completion
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from conftest import adapter_stub
from sluice.ratelimit.v1 import ratelimit_pb2

from sluice_common.amqp import EventTopology
from sluice_common.errors import InvalidArgument
from sluice_common.interceptor import status_for
from sluice_common.sampling import Sampling, StructuredOutputs
from sluice_common.sampling_proto import from_proto
from sluice_gateway.path.admission import Admission
from sluice_gateway.path.completion_events import CompletionEvents
from sluice_gateway.path.inference_path import InferencePath
from sluice_gateway.path.model_catalog import ModelCatalog
from sluice_gateway.openai_front.http import OpenAIFront, build_app
from sluice_gateway.openai_front.replies import OBFUSCATION_BLOCK
from sluice_common.tenants import TenantDirectory, hash_api_key

KEY = "sk-test"
GENERATION = types_pb2.ModelInfo(
    name="g",
    kind=types_pb2.MODEL_KIND_GENERATION,
    context_length=2048,
    max_output_tokens=1024,
    logprobs=True,
    structured_outputs=True,
    logit_bias=True,
)
EMBEDDING = types_pb2.ModelInfo(name="e", kind=types_pb2.MODEL_KIND_EMBEDDING, embedding_dimensions=3)
USAGE = types_pb2.Usage(prompt_tokens=7, completion_tokens=2, total_tokens=9, cached_tokens=4)


class _Call:
    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = chunks
        self.cancelled = False

    def __aiter__(self):  # type: ignore[no-untyped-def]
        async def run():  # type: ignore[no-untyped-def]
            for chunk in self.chunks:
                if isinstance(chunk, BaseException):
                    raise chunk
                yield chunk

        return run()

    def cancel(self) -> None:
        self.cancelled = True


class _Adapter:
    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.prompt_tokens = 10  # what CountTokens answers
        self.chunks: list[Any] = [
            inference_pb2.GenerateResponse(text="Hello", token_count=1),
            inference_pb2.GenerateResponse(text=" there", token_count=1, finish_reason=types_pb2.FINISH_REASON_STOP, usage=USAGE),
        ]

    async def ListModels(self, request, timeout=None):  # noqa: N802
        return inference_pb2.ListModelsResponse(models=[GENERATION, EMBEDDING])

    async def CountTokens(self, request, timeout=None, metadata=None):  # noqa: N802
        return inference_pb2.CountTokensResponse(prompt_tokens=self.prompt_tokens, context_length=GENERATION.context_length)

    def Generate(self, request, timeout=None, metadata=None):  # noqa: N802
        self.requests.append(request)
        return _Call(self.chunks)

    async def Embed(self, request, timeout=None, metadata=None):  # noqa: N802
        self.requests.append(request)
        return inference_pb2.EmbedResponse(
            embeddings=[types_pb2.Embedding(values=[0.5, -1.0, 2.0]) for _ in request.inputs], usage=types_pb2.Usage(prompt_tokens=4, total_tokens=4)
        )


class _RateLimit:
    def __init__(self) -> None:
        self.allowed = True
        self.degraded = False  # a denial because the limiter cannot decide (its store down, fail-closed)
        self.denied_by = ratelimit_pb2.BUDGET_REQUESTS_PER_MINUTE

    async def Acquire(self, request, timeout=None, metadata=None):  # noqa: N802
        budgets = [ratelimit_pb2.BudgetStatus(budget=ratelimit_pb2.BUDGET_REQUESTS_PER_MINUTE, limit=60, remaining=0 if not self.allowed else 59)]
        if not self.allowed:
            reply = ratelimit_pb2.AcquireResponse(allowed=False, denied_by=self.denied_by, budgets=budgets, degraded=self.degraded)
            reply.retry_after.FromMilliseconds(2500)
            return reply
        return ratelimit_pb2.AcquireResponse(allowed=True, lease_id="l1", budgets=budgets)

    async def Commit(self, request, timeout=None, metadata=None):  # noqa: N802
        return ratelimit_pb2.CommitResponse()


class _Publisher:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def submit(self, message) -> None:  # type: ignore[no-untyped-def]
        self.bodies.append(message.body)


@pytest.fixture
async def setup(tmp_path):  # type: ignore[no-untyped-def]
    adapter, ratelimit, publisher = _Adapter(), _RateLimit(), _Publisher()
    catalog = ModelCatalog(adapter)  # type: ignore[arg-type]
    await catalog.refresh()
    events = CompletionEvents(publisher, EventTopology("t"))  # type: ignore[arg-type]
    path = InferencePath(adapter, catalog, Admission(ratelimit), events, default_max_tokens=50)  # type: ignore[arg-type]
    tenants = TenantDirectory.from_file(_tenants_file(tmp_path))
    client = TestClient(TestServer(build_app(OpenAIFront(tenants, path), 4096)))
    await client.start_server()
    try:
        yield client, adapter, ratelimit, publisher
    finally:
        await client.close()


def _tenants_file(tmp_path):  # type: ignore[no-untyped-def]
    path = tmp_path / "tenants.toml"
    path.write_text(f'[[tenants]]\nname = "acme"\napi_key_sha256 = "{hash_api_key(KEY)}"\n')
    return path


AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "g", "messages": [{"role": "user", "content": "Hi"}]}


async def test_chat_completion_whole_with_openai_defaults(setup) -> None:  # type: ignore[no-untyped-def]
    client, adapter, _, publisher = setup
    reply = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert reply.status == 200, await reply.text()
    completion = ChatCompletion.model_validate(await reply.json())
    assert completion.choices[0].message.content == "Hello there" and completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.total_tokens == 9
    assert completion.usage.prompt_tokens_details is not None and completion.usage.prompt_tokens_details.cached_tokens == 4
    assert reply.headers["x-ratelimit-remaining-requests"] == "59" and reply.headers["x-request-id"] in completion.id
    sent = adapter.requests[0].sampling
    assert (sent.max_tokens, sent.temperature, sent.top_p) == (50, 1.0, 1.0)  # defaults: configured cap, OpenAI's 1.0 / 1.0
    assert len(publisher.bodies) == 1  # the CompletionEvent, through the same path as gRPC


async def test_chat_completion_streams_sse_with_usage_and_done(setup) -> None:  # type: ignore[no-untyped-def]
    client, *_ = setup
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 5, "temperature": 0}
    reply = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in (await reply.text()).split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(e)) for e in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
    assert json.loads(events[-2])["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert all(c.usage is None for c in chunks[:-1])


async def test_chat_stream_chunks_carry_obfuscation_padding_unless_turned_off(setup) -> None:  # type: ignore[no-untyped-def]
    """OpenAI's stream obfuscation, on by default: each chat chunk's `obfuscation` pads its text to a
    multiple of OBFUSCATION_BLOCK characters; `include_obfuscation: false` leaves the field out; a
    text completion's chunk (upstream has no such field there) never has it."""
    client, *_ = setup

    async def chunks(path: str, body: dict) -> list[dict]:
        reply = await client.post(path, json={**body, "stream": True, "max_tokens": 5, "temperature": 0}, headers=AUTH)
        assert reply.status == 200
        events = [line[len("data: ") :] for line in (await reply.text()).split("\n\n") if line]
        return [json.loads(e) for e in events[:-1]]

    padded = await chunks("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}})
    assert all("obfuscation" in c for c in padded)
    for chunk in padded:
        text = chunk["choices"][0]["delta"].get("content") or "" if chunk["choices"] else ""
        assert (len(text) + len(chunk["obfuscation"])) % OBFUSCATION_BLOCK == 0 and len(chunk["obfuscation"]) < OBFUSCATION_BLOCK
    assert any(chunk["obfuscation"] for chunk in padded)
    plain = await chunks("/v1/chat/completions", {**CHAT, "stream_options": {"include_obfuscation": False}})
    assert plain and not any("obfuscation" in c for c in plain)
    completion = await chunks("/v1/completions", {"model": CHAT["model"], "prompt": "Hi", "stream_options": {"include_obfuscation": True}})
    assert completion and not any("obfuscation" in c for c in completion)
    reply = await client.post("/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"include_obfuscation": "yes"}}, headers=AUTH)
    assert reply.status == 400 and (await reply.json())["error"]["param"] == "stream_options.include_obfuscation"


async def test_a_stream_failing_after_its_first_chunk_ends_with_an_error_event(setup) -> None:  # type: ignore[no-untyped-def]
    import grpc

    client, adapter, _, publisher = setup
    failure = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "replica died")
    adapter.chunks = [inference_pb2.GenerateResponse(text="Hel", token_count=1), failure]
    reply = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH)
    text = await reply.text()
    assert reply.status == 200 and "[DONE]" not in text
    error = json.loads(text.strip().split("\n")[-1][len("data: ") :])["error"]
    assert error["type"] == "service_unavailable" and "replica died" in error["message"]
    from sluice.evallog.v1 import events_pb2

    assert events_pb2.CompletionEvent.FromString(publisher.bodies[-1]).error_code == "UNAVAILABLE"


async def test_an_engine_failure_mid_stream_is_the_adapters_503_not_a_generic_500(setup) -> None:  # type: ignore[no-untyped-def]
    """The adapter ends a failed stream with an ERROR chunk, then its status (UNAVAILABLE): the
    front stopped at the chunk, answered 500 and recorded the stream as completed."""
    import grpc

    client, adapter, _, publisher = setup
    failure = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "the model backend failed mid-stream")
    adapter.chunks = [
        inference_pb2.GenerateResponse(text="Hel", token_count=1),
        inference_pb2.GenerateResponse(finish_reason=types_pb2.FINISH_REASON_ERROR),
        failure,
    ]
    reply = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH)
    text = await reply.text()
    error = json.loads(text.strip().split("\n")[-1][len("data: ") :])["error"]
    assert error["type"] == "service_unavailable" and "failed mid-stream" in error["message"]
    from sluice.evallog.v1 import events_pb2

    event = events_pb2.CompletionEvent.FromString(publisher.bodies[-1])
    assert (event.finish_reason, event.error_code) == (types_pb2.FINISH_REASON_ERROR, "UNAVAILABLE")


class _FailingAdapter(inference_pb2_grpc.InferenceServiceServicer):
    """A real gRPC adapter (so that its calls iterate as grpc.aio's do) whose choice 0 (seed 100) fails
    as the adapter reports an engine failure mid-stream: a token, the ERROR chunk, then UNAVAILABLE;
    its other choices finish."""

    async def ListModels(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        return inference_pb2.ListModelsResponse(models=[GENERATION])

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        yield inference_pb2.GenerateResponse(text="Hel", token_count=1)
        if request.sampling.seed != 100:
            yield inference_pb2.GenerateResponse(text="lo", token_count=1, finish_reason=types_pb2.FINISH_REASON_STOP, usage=USAGE)
            return
        yield inference_pb2.GenerateResponse(finish_reason=types_pb2.FINISH_REASON_ERROR)
        await asyncio.sleep(0.1)  # the status follows the chunk (over a network, a moment later)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the model backend failed mid-stream")


@pytest.fixture
async def failing_client(tmp_path):  # type: ignore[no-untyped-def]
    async with adapter_stub(_FailingAdapter()) as stub:
        catalog = ModelCatalog(stub)
        await catalog.refresh()
        path = InferencePath(stub, catalog, Admission(None), default_max_tokens=50)
        client = TestClient(TestServer(build_app(OpenAIFront(TenantDirectory.from_file(_tenants_file(tmp_path)), path), 4096)))
        await client.start_server()
        try:
            yield client
        finally:
            await client.close()


@pytest.mark.parametrize("n", [1, 2])
async def test_an_engine_failure_of_any_choice_is_the_adapters_503_streamed_or_not(failing_client, n: int) -> None:  # type: ignore[no-untyped-def]
    """n > 1 streamed read the stream a second time to reach the status: a second merge over the
    same gRPC calls, "anext(): asynchronous generator is already running", a 500. Whole, the front
    stopped at the ERROR chunk and answered 500 generation_failed, never reading the adapter's
    UNAVAILABLE."""
    body = {**CHAT, "n": n, "seed": 100}
    reply = await failing_client.post("/v1/chat/completions", json=body, headers=AUTH)
    status, error = await _error(reply)
    assert (status, error["type"], error["code"]) == (503, "service_unavailable", "unavailable"), error
    assert "failed mid-stream" in error["message"] and reply.headers["retry-after"] == "1"
    reply = await failing_client.post("/v1/chat/completions", json={**body, "stream": True}, headers=AUTH)
    text = await reply.text()
    assert reply.status == 200 and "event: error" in text and "[DONE]" not in text
    error = json.loads(text.strip().split("\n")[-1][len("data: ") :])["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "unavailable") and "failed mid-stream" in error["message"], error


async def test_a_stream_broken_by_any_error_after_its_first_chunk_ends_with_an_error_event(setup) -> None:  # type: ignore[no-untyped-def]
    """Not only Sluice's own errors and the adapter's statuses: a bug of ours mid-stream is still an
    error event the SDK raises on, never a 200 cut short with neither an error nor [DONE]."""
    client, adapter, _, publisher = setup
    adapter.chunks = [inference_pb2.GenerateResponse(text="Hel", token_count=1), RuntimeError("a bug")]
    reply = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH)
    text = await reply.text()
    assert reply.status == 200 and "[DONE]" not in text and "event: error" in text
    error = json.loads(text.strip().split("\n")[-1][len("data: ") :])["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error") and "a bug" not in error["message"]
    from sluice.evallog.v1 import events_pb2

    assert events_pb2.CompletionEvent.FromString(publisher.bodies[-1]).error_code == "UNKNOWN"  # as gRPC names an unhandled error


async def test_a_prompt_that_does_not_fit_the_context_is_openais_context_length_exceeded(setup) -> None:  # type: ignore[no-untyped-def]
    client, adapter, _, _ = setup
    adapter.prompt_tokens = 1900  # counted by the adapter: 1,900 + 1,024 do not fit 2,048
    body = {**CHAT, "messages": [{"role": "user", "content": "7" * 1500}], "max_tokens": 1024}
    for stream in (False, True):
        status, error = await _error(await client.post("/v1/chat/completions", json={**body, "stream": stream}, headers=AUTH))
        assert (status, error["code"], error["param"], error["type"]) == (400, "context_length_exceeded", "messages", "invalid_request_error")
        assert error["message"] == (
            "This model's maximum context length is 2048 tokens. However, you requested 2924 tokens"
            " (1900 in the messages, 1024 in the completion). Please reduce the length of the messages or completion."
        )
    assert adapter.requests == []


async def test_a_fail_closed_rate_limit_is_a_503_that_says_when_to_retry(setup) -> None:  # type: ignore[no-untyped-def]
    client, _, ratelimit, _ = setup
    ratelimit.allowed, ratelimit.degraded = False, True
    reply = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    status, error = await _error(reply)
    assert (status, error["type"]) == (503, "service_unavailable") and "fail-closed" in error["message"]
    assert reply.headers["retry-after"] == "3"  # the limiter's 2.5 s, in whole seconds up


async def test_completions_and_embeddings_and_models(setup) -> None:  # type: ignore[no-untyped-def]
    client, *_ = setup
    reply = await client.post("/v1/completions", json={"model": "g", "prompt": "Once", "max_tokens": 3}, headers=AUTH)
    completion = Completion.model_validate(await reply.json())
    assert completion.choices[0].text == "Hello there" and completion.object == "text_completion"
    for encoding in ("float", "base64"):
        reply = await client.post("/v1/embeddings", json={"model": "e", "input": ["a", "b"], "encoding_format": encoding}, headers=AUTH)
        embeddings = CreateEmbeddingResponse.model_validate(await reply.json()) if encoding == "float" else await reply.json()
        if encoding == "float":
            assert [d.embedding for d in embeddings.data] == [[0.5, -1.0, 2.0]] * 2 and embeddings.usage.total_tokens == 4
        else:
            raw = base64.b64decode(embeddings["data"][1]["embedding"])
            assert list(struct.unpack("<3f", raw)) == [0.5, -1.0, 2.0]
    reply = await client.get("/v1/models", headers=AUTH)
    assert {Model.model_validate(m).id for m in (await reply.json())["data"]} == {"g", "e"}
    assert (await client.get("/v1/models/nope", headers=AUTH)).status == 404


async def _error(reply) -> tuple[int, dict[str, Any]]:  # type: ignore[no-untyped-def]
    return reply.status, (await reply.json())["error"]


async def test_errors_in_openais_shape(setup) -> None:  # type: ignore[no-untyped-def]
    client, _, ratelimit, _ = setup
    status, error = await _error(await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"}))
    assert status == 401 and error["code"] == "invalid_api_key"
    status, error = await _error(await client.post("/v1/chat/completions", json=CHAT))
    assert status == 401
    status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=AUTH))
    assert status == 404 and error["code"] == "model_not_found" and error["param"] == "model"
    status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, "temperature": 3}, headers=AUTH))
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == "temperature"
    status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, "temperature": "hot"}, headers=AUTH))
    assert status == 400 and error["param"] == "temperature"
    status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5000}, headers=AUTH))
    assert status == 400 and error["param"] == "max_tokens"
    status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, "frobnicate": 1}, headers=AUTH))
    assert status == 400 and error["param"] == "frobnicate" and "Unrecognized request argument" in error["message"]
    status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, "n": 9}, headers=AUTH))
    assert status == 400 and error["param"] == "n"
    assert (await client.post("/v1/chat/completions", json={**CHAT, "n": 1, "user": "u", "logprobs": False}, headers=AUTH)).status == 200
    status, error = await _error(await client.post("/v1/chat/completions", data=b"{not json", headers=AUTH))
    assert status == 400 and error["code"] == "invalid_json"
    status, error = await _error(await client.post("/v1/chat/completions", data=b"x" * 10_000, headers=AUTH))
    assert status == 413
    messages = [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "x"}]
    status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, "messages": messages}, headers=AUTH))
    assert status == 400 and error["param"] == "messages[1].role"
    status, error = await _error(await client.post("/v1/embeddings", json={"model": "e", "input": 3}, headers=AUTH))
    assert status == 400 and error["param"] == "input"
    status, error = await _error(await client.post("/v1/embeddings", json={"model": "e", "input": "a", "dimensions": 8}, headers=AUTH))
    assert status == 400 and error["param"] == "dimensions"
    assert (await client.get("/v1/chat/completions", headers=AUTH)).status == 405
    ratelimit.allowed = False
    reply = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    status, error = await _error(reply)
    assert (status, error["code"], error["type"]) == (429, "rate_limit_exceeded", "requests")
    assert reply.headers["retry-after"] == "3" and reply.headers["x-ratelimit-remaining-requests"] == "0"
    ratelimit.denied_by = ratelimit_pb2.BUDGET_TOKENS_PER_MINUTE
    status, error = await _error(await client.post("/v1/chat/completions", json=CHAT, headers=AUTH))
    assert (status, error["type"]) == (429, "tokens")  # OpenAI's type names the limit hit


# JSON's escape of a lone UTF-16 surrogate: valid JSON (RFC 8259), not valid Unicode text.
LONE_SURROGATE = "\\ud800"


async def test_text_that_is_not_unicode_is_refused_naming_the_param(setup) -> None:  # type: ignore[no-untyped-def]
    client, adapter, _, publisher = setup
    cases = [
        ("/v1/chat/completions", '{"model": "g", "messages": [{"role": "user", "content": "%s"}]}', "messages[0].content"),
        ("/v1/chat/completions", '{"model": "g", "messages": [{"role": "user", "content": "Hi"}], "stop": ["a", "%s"]}', "stop[1]"),
        ("/v1/chat/completions", '{"model": "g", "messages": [{"role": "user", "content": "Hi"}], "user": "%s"}', "user"),
        ("/v1/chat/completions", '{"model": "g%s", "messages": [{"role": "user", "content": "Hi"}]}', "model"),
        ("/v1/completions", '{"model": "g", "prompt": "Once %s"}', "prompt"),
        ("/v1/embeddings", '{"model": "e", "input": ["a", "%s"]}', "input[1]"),
    ]
    for route, template, param in cases:
        reply = await client.post(route, data=(template % LONE_SURROGATE).encode(), headers={**AUTH, "Content-Type": "application/json"})
        status, error = await _error(reply)
        assert (status, error["param"], error["type"]) == (400, param, "invalid_request_error"), (route, param, error)
        assert "not valid Unicode" in error["message"]
    # A key holding one: named with the surrogate escaped.
    reply = await client.post("/v1/chat/completions", data=('{"x%s": 1}' % LONE_SURROGATE).encode(), headers=AUTH)
    status, error = await _error(reply)
    assert status == 400 and error["param"] == "x\\ud800"
    assert adapter.requests == [] and publisher.bodies == []
    # The front still serves.
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status == 200


@pytest.mark.parametrize(
    ("changes", "param", "named"),
    [
        ({"max_tokens": 5000}, "max_tokens", "max_tokens: 5000 is above the limit"),
        ({"max_completion_tokens": 5000}, "max_completion_tokens", "max_completion_tokens: 5000 is above the limit"),
        ({"max_tokens": 5, "max_completion_tokens": 5000}, "max_completion_tokens", "5000"),
        ({"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
         "response_format", "response_format: a tool call's arguments are constrained already"),
        ({"structured_outputs": {"choice": ["a"]}, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
         "structured_outputs", "constrained already"),
    ],
)  # fmt: skip
async def test_a_refusal_of_the_path_names_the_field_as_the_client_sent_it(setup, changes: dict[str, Any], param: str, named: str) -> None:  # type: ignore[no-untyped-def]
    """Checked by the InferencePath (the model's limits, the tools' constraint) under Sluice's field
    names: an over-limit max_completion_tokens was reported as max_tokens, and response_format with
    a constrained tool_choice as structured_outputs, neither of them sent."""
    client, adapter, _, _ = setup
    for stream in (False, True):
        status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, **changes, "stream": stream}, headers=AUTH))
        assert (status, error["param"]) == (400, param) and named in error["message"], error
    assert not adapter.requests


async def test_seed_takes_openais_int64_range(setup) -> None:  # type: ignore[no-untyped-def]
    client, adapter, _, _ = setup
    for seed in (-(2**63), 2**63 - 1):
        assert (await client.post("/v1/chat/completions", json={**CHAT, "seed": seed}, headers=AUTH)).status == 200
        assert adapter.requests[-1].sampling.seed == seed % 2**64  # the uint64 of the same bits


async def test_a_completions_max_tokens_defaults_to_openais_16_and_a_chats_to_the_gateways(setup) -> None:  # type: ignore[no-untyped-def]
    """OpenAI's CreateCompletionRequest.max_tokens has `"default": 16` (vLLM's too); its chat
    request has no default, where the gateway's (the remaining context, capped) applies."""
    client, adapter, _, _ = setup
    for extra in ({}, {"max_tokens": None}):
        assert (await client.post("/v1/completions", json={"model": "g", "prompt": "Once", **extra}, headers=AUTH)).status == 200
        assert adapter.requests[-1].sampling.max_tokens == 16
    assert (await client.post("/v1/completions", json={"model": "g", "prompt": "Once", "max_tokens": 40}, headers=AUTH)).status == 200
    assert adapter.requests[-1].sampling.max_tokens == 40
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status == 200
    assert adapter.requests[-1].sampling.max_tokens == 50  # the configured cap (SLUICE_GATEWAY_DEFAULT_MAX_TOKENS)


async def test_text_content_parts_are_joined_with_newlines_as_vllm_joins_them(setup) -> None:  # type: ignore[no-untyped-def]
    client, adapter, _, _ = setup
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    reply = await client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": parts}]}, headers=AUTH)
    assert reply.status == 200 and adapter.requests[-1].messages[0].content == "Hello\nworld"


async def test_an_assistants_refusal_parts_are_its_text_as_vllm_takes_them(setup) -> None:  # type: ignore[no-untyped-def]
    """OpenAI's assistant content parts are text or refusal (ChatCompletionRequestAssistantMessageContentPart);
    vLLM's chat_utils takes a refusal part's text as it takes a text part's. Other roles have no refusal parts."""
    client, adapter, _, _ = setup
    parts = [{"type": "text", "text": "Let me see."}, {"type": "refusal", "refusal": "I can't help with that."}]
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": parts}, {"role": "user", "content": "b"}]
    reply = await client.post("/v1/chat/completions", json={**CHAT, "messages": messages}, headers=AUTH)
    assert reply.status == 200, await reply.text()
    assert adapter.requests[-1].messages[1].content == "Let me see.\nI can't help with that."
    for bad in ([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}], [{"role": "assistant", "content": [{"type": "refusal"}]}]):
        status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, "messages": bad}, headers=AUTH))
        assert (status, error["param"]) == (400, "messages[0].content[0]"), error


async def test_a_stop_string_refused_is_named_as_the_client_sent_it(setup) -> None:  # type: ignore[no-untyped-def]
    """One stop string is carried as a list of one: refused, it was named "stop[0]" and worded with
    Sluice's field ("sampling.stop[0]: ...") though the client sent a string."""
    client, adapter, _, _ = setup
    for stop, param in (("", "stop"), (["ok", ""], "stop[1]")):
        status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, "stop": stop}, headers=AUTH))
        assert (status, error["param"]) == (400, param) and error["message"].startswith(f"{param}: "), error
    assert not adapter.requests


async def test_bodies_nested_too_deeply_or_numbers_too_large_are_refused(setup) -> None:  # type: ignore[no-untyped-def]
    client, adapter, *_ = setup
    status, error = await _error(await client.post("/v1/chat/completions", data=b"[" * 4000, headers=AUTH))
    assert status == 400 and error["code"] == "invalid_json"
    status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1 << 40}, headers=AUTH))
    assert status == 400 and error["param"] == "max_tokens"
    assert adapter.requests == []


async def _raw_status(client, head: bytes) -> int:  # type: ignore[no-untyped-def]
    """The status of a request written byte for byte (aiohttp's client encodes its headers)."""
    import asyncio

    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    body = json.dumps(CHAT).encode()
    writer.write(head + b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    await writer.drain()
    status_line = await reader.readline()
    writer.close()
    return int(status_line.split()[1])


async def test_header_bytes_that_are_not_utf8_are_refused(setup) -> None:  # type: ignore[no-untyped-def]
    client, adapter, *_ = setup
    start = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    auth = b"Authorization: Bearer " + KEY.encode() + b"\r\n"
    assert await _raw_status(client, start + auth + b"X-Client-Request-Id: a\xed\xa0\x80\xff\r\n") == 400
    assert await _raw_status(client, start + auth + b"X-Request-Id: a\xff\r\n") == 400
    assert await _raw_status(client, start + b"Authorization: Bearer sk-\xff\r\n") == 401
    assert adapter.requests == []
    assert await _raw_status(client, start + auth + b"X-Client-Request-Id: caf\xc3\xa9\r\n") == 200


async def _raw_reply(client, head: bytes) -> tuple[int, dict[str, str], bytes]:  # type: ignore[no-untyped-def]
    """Status, headers (lower-cased names) and body of a request written byte for byte."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    body = json.dumps(CHAT).encode()
    writer.write(head + b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    await writer.drain()
    reply = await reader.read()
    writer.close()
    head_bytes, _, content = reply.partition(b"\r\n\r\n")
    status_line, *lines = head_bytes.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, content


@pytest.mark.parametrize("value", [b"\xc3\xa9-id", b"x\ty", b"caf\xc3\xa9 \xe2\x9c\x93"])
async def test_a_request_id_grpc_metadata_cannot_carry_is_a_400_naming_the_header(failing_client, value: bytes) -> None:  # type: ignore[no-untyped-def]
    """The request id goes into every downstream call's gRPC metadata, which takes printable ASCII
    only: UTF-8 text outside it went through and grpc refused to send the call (here the adapter's
    stream: INTERNAL "Invalid metadata"; rate-limit's unary Acquire: ExecuteBatchError, no status at
    all), a 500 counted in the error ratio for a client's bad header."""
    start = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
    status, headers, content = await _raw_reply(failing_client, start + b"X-Request-Id: " + value + b"\r\n")
    error = json.loads(content)["error"]
    assert (status, error["param"], error["code"]) == (400, "x-request-id", "invalid_value"), (status, error)
    assert "printable ASCII" in error["message"]
    # Answered under an id of the gateway's own (32 hex digits), which the log lines carry too.
    assert len(headers["x-request-id"]) == 32 and int(headers["x-request-id"], 16) >= 0


async def test_a_printable_ascii_request_id_follows_the_call_and_a_client_request_id_needs_no_ascii(failing_client) -> None:  # type: ignore[no-untyped-def]
    """Space to ~ is what gRPC metadata carries: kept as sent (the first MAX_REQUEST_ID characters).
    X-Client-Request-Id is no metadata (a field of the request, any UTF-8, as gRPC's callers send it)."""
    start = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
    status, headers, _ = await _raw_reply(failing_client, start + b"X-Request-Id: my id ~1\r\nX-Client-Request-Id: caf\xc3\xa9\r\n")
    assert (status, headers["x-request-id"]) == (200, "my id ~1")
    status, headers, _ = await _raw_reply(failing_client, start + b"X-Request-Id: " + b"a" * 100 + b"\r\n")
    assert (status, headers["x-request-id"]) == (200, "a" * 64)


# ---- sampling options (issue 25): honoured, range-checked, or refused naming the param

OPTIONS = {
    "presence_penalty": 0.5, "frequency_penalty": -0.25, "logit_bias": {"5": 100, "9": -100}, "seed": 7,
    "top_k": 40, "min_p": 0.125, "repetition_penalty": 1.25, "temperature": 0.5, "top_p": 0.75, "stop": ["\n"],
}  # fmt: skip


async def test_every_sampling_option_reaches_the_adapter(setup) -> None:  # type: ignore[no-untyped-def]
    client, adapter, _, _ = setup
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": "g", "prompt": "Once"})):
        assert (await client.post(path, json={**body, **OPTIONS}, headers=AUTH)).status == 200
        sent = from_proto(adapter.requests[-1].sampling)
        assert sent == Sampling(
            max_tokens=sent.max_tokens, temperature=0.5, top_p=0.75, top_k=40, min_p=0.125, presence_penalty=0.5,
            frequency_penalty=-0.25, repetition_penalty=1.25, logit_bias=((5, 100.0), (9, -100.0)), seed=7, stop=("\n",),
        ), path  # fmt: skip
    # null or vLLM's "no limit" (-1) are the neutral values.
    neutral = {"presence_penalty": None, "frequency_penalty": None, "logit_bias": None, "top_k": -1, "min_p": None, "repetition_penalty": None}
    assert (await client.post("/v1/chat/completions", json={**CHAT, **neutral}, headers=AUTH)).status == 200
    sent = from_proto(adapter.requests[-1].sampling)
    assert (sent.top_k, sent.min_p, sent.presence_penalty, sent.repetition_penalty, sent.logit_bias) == (0, 0.0, 0.0, 1.0, ())


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": "high"}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"5": -101}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {" 5": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"5": True}}, "logit_bias"),
        ({"logit_bias": [5, 1]}, "logit_bias"),
        ({"logit_bias": {"99999999999": 1}}, "logit_bias"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        # Integers too large for a float: float() raised OverflowError, a 500.
        *(({name: 10**400}, name) for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty")),
        ({"logit_bias": {"5": -(10**400)}}, "logit_bias"),
        # Beyond OpenAI's int64: 2^64 + 5 was seed 5.
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**64 + 5}, "seed"),
        ({"seed": 10**400}, "seed"),
        # Both limits are checked, whichever wins.
        ({"max_completion_tokens": 5, "max_tokens": "many"}, "max_tokens"),
        ({"max_completion_tokens": 5, "max_tokens": 0}, "max_tokens"),
    ],
)
async def test_an_option_out_of_range_is_a_400_naming_it(setup, changes: dict[str, Any], param: str) -> None:  # type: ignore[no-untyped-def]
    client, adapter, _, _ = setup
    status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, **changes}, headers=AUTH))
    assert (status, error["param"], error["type"]) == (400, param, "invalid_request_error"), error
    assert not adapter.requests  # refused before any adapter call


@pytest.mark.parametrize(
    ("path", "changes", "param"),
    [
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"suffix": "x"}, "suffix"),
        ("/v1/chat/completions", {"audio": {"voice": "alloy"}}, "audio"),
    ],
)
async def test_options_still_unsupported_are_refused_naming_them(setup, path: str, changes: dict[str, Any], param: str) -> None:  # type: ignore[no-untyped-def]
    client, _, _, _ = setup
    body = CHAT if path == "/v1/chat/completions" else {"model": "g", "prompt": "Once"}
    status, error = await _error(await client.post(path, json={**body, **changes}, headers=AUTH))
    assert (status, error["param"], error["code"]) == (400, param, "unsupported_parameter"), error


ENDPOINT_BODIES = {"/v1/chat/completions": CHAT, "/v1/completions": {"model": "g", "prompt": "Once"}, "/v1/embeddings": {"model": "e", "input": "a"}}


@pytest.mark.parametrize(
    ("path", "changes"),
    [
        ("/v1/chat/completions", {"best_of": 1}),
        ("/v1/chat/completions", {"suffix": ""}),
        ("/v1/chat/completions", {"echo": False}),
        ("/v1/completions", {"top_logprobs": 0}),
        ("/v1/completions", {"store": False}),
        ("/v1/completions", {"functions": None}),
        ("/v1/embeddings", {"n": 1}),
        ("/v1/embeddings", {"logprobs": False}),
        ("/v1/embeddings", {"store": False}),
    ],
)
async def test_a_field_of_another_endpoint_is_unrecognized_even_at_its_neutral_value(setup, path: str, changes: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    """Each endpoint allows the neutral values of its own upstream fields only (OpenAI answers any
    other field "Unrecognized request argument"); every endpoint let every endpoint's through."""
    client, adapter, _, _ = setup
    [(param, _)] = changes.items()
    status, error = await _error(await client.post(path, json={**ENDPOINT_BODIES[path], **changes}, headers=AUTH))
    assert (status, error["param"], error["code"]) == (400, param, "unknown_parameter"), error
    assert not adapter.requests


async def test_a_token_the_engine_does_not_know_is_a_400_naming_logit_bias(setup) -> None:  # type: ignore[no-untyped-def]
    """Only the engine knows the vocabulary: the adapter's INVALID_ARGUMENT (its BadRequest names
    sampling.logit_bias) becomes OpenAI's 400 with param logit_bias, not a 500."""
    client, adapter, _, _ = setup
    refused = InvalidArgument("sampling.logit_bias", "token id 49152 is not a token: ids must be in 0..49151")
    status = status_for(refused)
    adapter.chunks = [grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(), grpc.aio.Metadata(*status.trailing_metadata), details=status.details)]
    for stream in (False, True):
        reply = await client.post("/v1/chat/completions", json={**CHAT, "logit_bias": {"49152": 5}, "stream": stream}, headers=AUTH)
        code, error = await _error(reply)
        assert (code, error["param"], error["type"]) == (400, "logit_bias", "invalid_request_error"), (stream, error)
        assert "49152" in error["message"]


async def test_an_embedding_input_over_the_models_maximum_is_a_400_naming_it(setup) -> None:  # type: ignore[no-untyped-def]
    """The adapter refuses a text longer than the embedding model's maximum input (its BadRequest
    names inputs[i]), as OpenAI and vLLM do, instead of embedding it truncated: a 400 naming it."""
    client, adapter, _, _ = setup
    refused = InvalidArgument(
        "inputs[1]",
        "This model's maximum context length is 256 tokens. However, you requested 302 tokens in the input for"
        " embedding generation. Please reduce the length of the input.",
    )
    status = status_for(refused)
    error = grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(), grpc.aio.Metadata(*status.trailing_metadata), details=status.details)

    async def embed(request, timeout=None, metadata=None):  # type: ignore[no-untyped-def]
        raise error

    adapter.Embed = embed
    code, body = await _error(await client.post("/v1/embeddings", json={"model": "e", "input": ["a", "word " * 300]}, headers=AUTH))
    assert (code, body["param"], body["type"]) == (400, "input[1]", "invalid_request_error"), body
    assert "maximum context length is 256 tokens. However, you requested 302 tokens" in body["message"]


async def test_truncate_prompt_tokens_reaches_the_adapter_as_sent_and_its_refusal_names_it(setup) -> None:  # type: ignore[no-untyped-def]
    """vLLM's opt-in to truncation on /v1/embeddings: carried to the adapter's EmbedRequest as the
    client set it (absent or null: unset, so the adapter refuses an input over the model's maximum);
    the adapter, which knows that maximum, refuses a count it cannot honour, and the 400 names it."""
    client, adapter, _, _ = setup
    for extra, carried in (
        ({"truncate_prompt_tokens": -1}, -1),
        ({"truncate_prompt_tokens": 256}, 256),
        ({"truncate_prompt_tokens": None}, None),
        ({}, None),
    ):
        reply = await client.post("/v1/embeddings", json={"model": "e", "input": ["a", "word " * 300], **extra}, headers=AUTH)
        assert reply.status == 200, await reply.text()
        downstream = adapter.requests[-1]
        assert downstream.HasField("truncate_prompt_tokens") == (carried is not None)
        assert carried is None or downstream.truncate_prompt_tokens == carried
    for bad in (-2, 1.5, "-1", True, [[1]]):
        code, body = await _error(await client.post("/v1/embeddings", json={"model": "e", "input": "a", "truncate_prompt_tokens": bad}, headers=AUTH))
        assert (code, body["param"]) == (400, "truncate_prompt_tokens"), (bad, body)
    refused = InvalidArgument(
        "truncate_prompt_tokens", "truncate_prompt_tokens value (300) is greater than max_model_len (256). Please, select a smaller truncation size."
    )
    status = status_for(refused)
    error = grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(), grpc.aio.Metadata(*status.trailing_metadata), details=status.details)

    async def embed(request, timeout=None, metadata=None):  # type: ignore[no-untyped-def]
        assert request.truncate_prompt_tokens == 300
        raise error

    adapter.Embed = embed
    code, body = await _error(await client.post("/v1/embeddings", json={"model": "e", "input": "a", "truncate_prompt_tokens": 300}, headers=AUTH))
    assert (code, body["param"], body["type"]) == (400, "truncate_prompt_tokens", "invalid_request_error"), body
    assert "is greater than max_model_len (256)" in body["message"]


def test_a_batch_line_asking_for_truncation_is_refused_naming_it() -> None:
    """A job's embedding row carries no truncation: such a line is refused when the file is checked,
    not run as if the option had not been sent."""
    from sluice_gateway.openai_front.batches import parse_batch_file
    from sluice_gateway.openai_front.errors import OpenAIError

    line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "e", "input": "a", "truncate_prompt_tokens": -1}}
    with pytest.raises(OpenAIError) as refused:
        parse_batch_file(json.dumps(line).encode(), 10)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, "body.truncate_prompt_tokens", "unsupported_parameter")
    assert refused.value.message.startswith("Line 1 of the batch file: truncate_prompt_tokens is not supported in a batch")
    null = {**line, "body": {"model": "e", "input": "a", "truncate_prompt_tokens": None}}
    (parsed,) = parse_batch_file(json.dumps(null).encode(), 10)
    assert not parsed.call.request.HasField("truncate_prompt_tokens")


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("changes", "expected", "response_format"),
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutputs.json_object(), types_pb2.RESPONSE_FORMAT_JSON_OBJECT),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
            StructuredOutputs.json_schema(PERSON),
            types_pb2.RESPONSE_FORMAT_JSON_OBJECT,
        ),
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, StructuredOutputs.regex("[0-9]{3}"), types_pb2.RESPONSE_FORMAT_UNSPECIFIED),
        ({"structured_outputs": {"choice": ["red", "blue"]}}, StructuredOutputs.choice(["red", "blue"]), types_pb2.RESPONSE_FORMAT_UNSPECIFIED),
        ({"structured_outputs": {"grammar": 'start: "a"+'}}, StructuredOutputs.grammar('start: "a"+'), types_pb2.RESPONSE_FORMAT_UNSPECIFIED),
    ],
)
async def test_structured_output_reaches_the_adapter_as_a_constraint(
    setup, changes: dict[str, Any], expected: StructuredOutputs, response_format: int
) -> None:  # type: ignore[no-untyped-def]
    """json_object is enforced while decoding, not only scored afterwards (and the completion event
    still says a JSON object was asked for, for the evaluators)."""
    from sluice.evallog.v1 import events_pb2

    client, adapter, _, publisher = setup
    reply = await client.post("/v1/chat/completions", json={**CHAT, **changes}, headers=AUTH)
    assert reply.status == 200, await reply.text()
    assert from_proto(adapter.requests[-1].sampling).structured_outputs == expected
    assert events_pb2.CompletionEvent.FromString(publisher.bodies[-1]).response_format == response_format


@pytest.mark.parametrize(
    ("changes", "param", "named"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object", "if": {}, "then": {}}}}},
            "response_format",
            "if",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}}}, "response_format", "strin"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "response_format.json_schema.name", "name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "response_format.json_schema.schema", "schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "extra": 1}}},
            "response_format.json_schema.extra",
            "extra",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "unclosed"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format", "not both"),
    ],
)
async def test_a_constraint_that_cannot_be_compiled_is_a_400_naming_it(setup, changes: dict[str, Any], param: str, named: str) -> None:  # type: ignore[no-untyped-def]
    client, adapter, _, _ = setup
    for stream in (False, True):
        status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, **changes, "stream": stream}, headers=AUTH))
        assert (status, error["param"], error["type"]) == (400, param, "invalid_request_error"), error
        assert named in error["message"], error
    assert not adapter.requests  # refused before any lease or adapter call


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


async def test_a_named_tool_choice_is_constrained_and_answered_as_tool_calls(setup) -> None:  # type: ignore[no-untyped-def]
    """tool_choice naming a function: decoding constrained to its parameters; the answer's text is the
    call's arguments, returned as OpenAI's tool_calls (whole and streamed), finish_reason stop: OpenAI
    and vLLM (chat_completion/serving.py) answer tool_calls only for the auto and required choices."""
    client, adapter, _, publisher = setup
    adapter.chunks = [
        inference_pb2.GenerateResponse(text='{"city": ', token_count=3),
        inference_pb2.GenerateResponse(text='"Oslo"}', token_count=3, finish_reason=types_pb2.FINISH_REASON_STOP, usage=USAGE),
    ]
    body = {**CHAT, "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    reply = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert reply.status == 200, await reply.text()
    completion = ChatCompletion.model_validate(await reply.json())
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments), call.type) == ("get_weather", {"city": "Oslo"}, "function")  # type: ignore[union-attr]
    sent = adapter.requests[-1]
    assert from_proto(sent.sampling).structured_outputs == StructuredOutputs.json_schema(WEATHER_TOOL["function"]["parameters"])  # type: ignore[index]
    assert sent.messages[0].role == "system" and '"name": "get_weather"' in sent.messages[0].content
    # The evaluation record keeps what the model wrote.
    from sluice.evallog.v1 import events_pb2

    assert events_pb2.CompletionEvent.FromString(publisher.bodies[-1]).output == '{"city": "Oslo"}'

    reply = await client.post("/v1/chat/completions", json={**body, "stream": True}, headers=AUTH)
    chunks = [ChatCompletionChunk.model_validate(json.loads(line[6:])) for line in (await reply.text()).splitlines() if line.startswith("data: {")]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""  # the call is never streamed as text
    [streamed] = [t for d in deltas for t in (d.tool_calls or [])]
    assert (streamed.index, streamed.function.name, streamed.function.arguments) == (0, "get_weather", '{"city": "Oslo"}')  # type: ignore[union-attr]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


@pytest.mark.parametrize(
    ("tool_choice", "text", "finish_reason"),
    [
        ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Oslo"}', "stop"),
        ("required", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', "tool_calls"),
        ("auto", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', "tool_calls"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_only_auto_and_required_tool_calls_end_tool_calls(setup, tool_choice: Any, text: str, finish_reason: str, stream: bool) -> None:  # type: ignore[no-untyped-def]
    """As vLLM (chat_completion/serving.py: "tool_calls" for auto or required tool calls, "stop" for
    named tool calls, as OpenAI answers): each answer carries the call all the same."""
    client, adapter, _, _ = setup
    adapter.chunks = [inference_pb2.GenerateResponse(text=text, token_count=5, finish_reason=types_pb2.FINISH_REASON_STOP, usage=USAGE)]
    body = {**CHAT, "tools": [WEATHER_TOOL], "tool_choice": tool_choice, "stream": stream}
    reply = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    if stream:
        chunks = [ChatCompletionChunk.model_validate(json.loads(x[6:])) for x in (await reply.text()).splitlines() if x.startswith("data: {")]
        calls = [t.function.name for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]  # type: ignore[union-attr]
        finished = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = ChatCompletion.model_validate(await reply.json()).choices[0]
        calls = [t.function.name for t in choice.message.tool_calls or []]  # type: ignore[union-attr]
        finished = choice.finish_reason
    assert (calls, finished) == (["get_weather"], finish_reason)


async def test_tool_choice_none_answers_text_streamed_as_it_is_made(setup) -> None:  # type: ignore[no-untyped-def]
    """tool_choice none with tools: the model calls no tool and generates a message (OpenAI's words).
    The text was held to the stream's last chunk, and a <tool_call> block in it answered as a call."""
    client, adapter, _, _ = setup
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    adapter.chunks = [
        inference_pb2.GenerateResponse(text="Sure: ", token_count=2),
        inference_pb2.GenerateResponse(text=block, token_count=9),
        inference_pb2.GenerateResponse(text=" done", token_count=1, finish_reason=types_pb2.FINISH_REASON_STOP, usage=USAGE),
    ]
    body = {**CHAT, "tools": [WEATHER_TOOL], "tool_choice": "none"}
    reply = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert reply.status == 200, await reply.text()
    choice = ChatCompletion.model_validate(await reply.json()).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (f"Sure: {block} done", None, "stop")
    assert "<tools>" not in adapter.requests[-1].messages[0].content  # none hides the tools

    reply = await client.post("/v1/chat/completions", json={**body, "stream": True}, headers=AUTH)
    chunks = [ChatCompletionChunk.model_validate(json.loads(line[6:])) for line in (await reply.text()).splitlines() if line.startswith("data: {")]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert [d.content for d in deltas if d.content] == ["Sure: ", block, " done"]  # each piece as it came
    assert not any(d.tool_calls for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


async def test_a_tool_conversation_is_rendered_for_the_model(setup) -> None:  # type: ignore[no-untyped-def]
    client, adapter, _, _ = setup
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C and snow"},
    ]
    reply = await client.post("/v1/chat/completions", json={"model": "g", "messages": messages, "tools": [WEATHER_TOOL]}, headers=AUTH)
    assert reply.status == 200, await reply.text()
    completion = ChatCompletion.model_validate(await reply.json())
    assert completion.choices[0].message.content == "Hello there" and completion.choices[0].finish_reason == "stop"
    sent = adapter.requests[-1]
    assert [m.role for m in sent.messages] == ["system", "user", "assistant", "user"]
    assert sent.messages[2].content == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert sent.messages[3].content == "<tool_response>\n-3 C and snow\n</tool_response>"
    assert not sent.sampling.HasField("structured_outputs")  # auto: the model may answer in text


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_wether"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}]}, "tools[0].function.parameters"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [WEATHER_TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
async def test_a_bad_tool_or_tool_choice_is_a_400_naming_it(setup, changes: dict[str, Any], param: str) -> None:  # type: ignore[no-untyped-def]
    client, adapter, _, _ = setup
    status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, **changes}, headers=AUTH))
    assert (status, error["param"]) == (400, param), error
    assert not adapter.requests


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"model": "x" * 20_000}, "model"),
        ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"description": "d" * 70_000}}}]}, "tools[0].function.parameters"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ({"structured_outputs": {"choice": [f"o{i}" for i in range(1025)]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a" * 70_000}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"description": "d" * 70_000}}}}, "response_format"),
    ],
    ids=["model", "tools", "tool_parameters", "logit_bias", "choice", "regex", "json_schema"],
)
async def test_the_grpc_bounds_on_what_is_compiled_are_a_400_naming_the_param(tmp_path, changes: dict[str, Any], param: str) -> None:  # type: ignore[no-untyped-def]
    """The same bounds (sluice_common.validation) as gRPC's, before anything is compiled."""
    adapter = _Adapter()
    catalog = ModelCatalog(adapter)  # type: ignore[arg-type]
    await catalog.refresh()
    path = InferencePath(adapter, catalog, Admission(_RateLimit()), None, default_max_tokens=50)  # type: ignore[arg-type]
    client = TestClient(TestServer(build_app(OpenAIFront(TenantDirectory.from_file(_tenants_file(tmp_path)), path), 1 << 20)))
    await client.start_server()
    try:
        status, error = await _error(await client.post("/v1/chat/completions", json={**CHAT, **changes}, headers=AUTH))
    finally:
        await client.close()
    assert (status, error["param"]) == (400, param), error
    assert len(error["message"]) < 300 and not adapter.requests


# ---- prompt lists and token-id prompts (vLLM's OpenAI server is the reference)


class _PromptAdapter(_Adapter):
    """Answers each call with its own prompt and seed, so that a choice shows where it came from;
    a prompt's usage counts its characters (or ids), 1 of them cached."""

    def __init__(self, token_prompts: bool = True) -> None:
        super().__init__()
        self.token_prompts = token_prompts

    async def ListModels(self, request, timeout=None):  # noqa: N802
        model = types_pb2.ModelInfo()
        model.CopyFrom(GENERATION)
        model.token_prompts = self.token_prompts
        return inference_pb2.ListModelsResponse(models=[model, EMBEDDING])

    def Generate(self, request, timeout=None, metadata=None):  # noqa: N802
        self.requests.append(request)
        prompt = request.prompt or ",".join(map(str, request.prompt_token_ids))
        tokens = len(request.prompt) or len(request.prompt_token_ids)
        usage = types_pb2.Usage(prompt_tokens=tokens, completion_tokens=2, total_tokens=tokens + 2, cached_tokens=1)
        return _Call([
            inference_pb2.GenerateResponse(text=f"[{prompt}]", token_count=1),
            inference_pb2.GenerateResponse(text=f"#{request.sampling.seed}", token_count=1, finish_reason=types_pb2.FINISH_REASON_STOP, usage=usage),
        ])  # fmt: skip


class _RecordingRateLimit(_RateLimit):
    def __init__(self) -> None:
        super().__init__()
        self.acquired: list[Any] = []

    async def Acquire(self, request, timeout=None, metadata=None):  # noqa: N802
        self.acquired.append(request)
        return await super().Acquire(request, timeout, metadata)


async def _prompt_client(tmp_path, token_prompts: bool = True):  # type: ignore[no-untyped-def]
    adapter, ratelimit = _PromptAdapter(token_prompts), _RecordingRateLimit()
    catalog = ModelCatalog(adapter)  # type: ignore[arg-type]
    await catalog.refresh()
    path = InferencePath(adapter, catalog, Admission(ratelimit), None, default_max_tokens=50)  # type: ignore[arg-type]
    client = TestClient(TestServer(build_app(OpenAIFront(TenantDirectory.from_file(_tenants_file(tmp_path)), path), 4096)))
    await client.start_server()
    return client, adapter, ratelimit


@pytest.fixture
async def prompts(tmp_path):  # type: ignore[no-untyped-def]
    client, adapter, ratelimit = await _prompt_client(tmp_path)
    try:
        yield client, adapter, ratelimit
    finally:
        await client.close()


async def test_a_prompt_list_answers_every_prompts_n_choices_in_vllms_order(prompts) -> None:  # type: ignore[no-untyped-def]
    """Choice i x n + j is prompt i's choice j (seeded seed + j); the usage counts each prompt once
    and every choice's tokens; one lease reserves every prompt and P x n x max_tokens."""
    client, adapter, ratelimit = prompts
    body = {"model": "g", "prompt": ["ab", "cdef"], "n": 2, "seed": 10, "max_tokens": 7}
    reply = await client.post("/v1/completions", json=body, headers=AUTH)
    assert reply.status == 200, await reply.text()
    completion = Completion.model_validate(await reply.json())
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert [c.text for c in completion.choices] == ["[ab]#10", "[ab]#11", "[cdef]#10", "[cdef]#11"]
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (6, 8, 14)
    assert completion.usage.prompt_tokens_details is not None and completion.usage.prompt_tokens_details.cached_tokens == 2
    assert [r.prompt for r in adapter.requests] == ["ab", "ab", "cdef", "cdef"]
    assert all(r.sampling.max_tokens == 7 and not r.sampling.HasField("n") for r in adapter.requests)
    [acquired] = ratelimit.acquired
    # Each prompt's estimate (ceil(bytes / 3) + 1: 2 and 3) plus 2 prompts x 2 choices x 7.
    assert acquired.requests == 1 and acquired.reserved_tokens == 2 + 3 + 4 * 7


async def test_a_streamed_prompt_list_echoes_each_choices_own_prompt(prompts) -> None:  # type: ignore[no-untyped-def]
    client, *_ = prompts
    body = {"model": "g", "prompt": ["ab", "cd"], "n": 2, "seed": 0, "echo": True, "stream": True, "stream_options": {"include_usage": True}}
    reply = await client.post("/v1/completions", json=body, headers=AUTH)
    assert reply.status == 200, await reply.text()
    events = [line[len("data: ") :] for line in (await reply.text()).split("\n\n") if line]
    assert events[-1] == "[DONE]"
    # The openai package's Completion has finish_reason non-null: its streamed chunks before the
    # end (null there, as OpenAI and vLLM send) are read as JSON, the rest validated.
    chunks = [json.loads(e) for e in events[:-1]]
    texts: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            assert chunk["object"] == "text_completion" and len(chunk["choices"]) == 1
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                Completion.model_validate(chunk)
                finished[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "ab[ab]#0", 1: "ab[ab]#1", 2: "cd[cd]#0", 3: "cd[cd]#1"}
    assert finished == {0: "stop", 1: "stop", 2: "stop", 3: "stop"}
    usage = Completion.model_validate(chunks[-1])
    assert usage.choices == [] and usage.usage is not None and usage.usage.prompt_tokens == 4


async def test_token_id_prompts_reach_the_adapter_as_ids(prompts) -> None:  # type: ignore[no-untyped-def]
    client, adapter, _ = prompts
    reply = await client.post("/v1/completions", json={"model": "g", "prompt": [5, 6, 7], "seed": 1}, headers=AUTH)
    assert reply.status == 200, await reply.text()
    completion = Completion.model_validate(await reply.json())
    assert [c.text for c in completion.choices] == ["[5,6,7]#1"] and completion.usage is not None and completion.usage.prompt_tokens == 3
    [sent] = adapter.requests
    assert list(sent.prompt_token_ids) == [5, 6, 7] and sent.prompt == ""
    reply = await client.post("/v1/completions", json={"model": "g", "prompt": [[1], [2, 3]], "seed": 1}, headers=AUTH)
    completion = Completion.model_validate(await reply.json())
    assert [c.text for c in completion.choices] == ["[1]#1", "[2,3]#1"]
    assert completion.usage is not None and completion.usage.prompt_tokens == 3


@pytest.mark.parametrize(
    ("prompt", "extra", "param"),
    [
        ([], {}, "prompt"),
        (["a", [1]], {}, "prompt"),
        ([1, "a"], {}, "prompt"),
        ([[1, -2]], {}, "prompt"),
        ([[1, 1 << 31]], {}, "prompt"),
        ([True, 2], {}, "prompt"),
        ([[]], {}, "prompt"),
        (["a", ""], {}, "prompt"),
        (["p"] * 17, {}, "prompt"),
        ([1, 2], {"echo": True}, "echo"),
        ({"text": "a"}, {}, "prompt"),
    ],
)
async def test_malformed_prompts_are_400_naming_their_param(prompts, prompt, extra, param) -> None:  # type: ignore[no-untyped-def]
    client, adapter, _ = prompts
    status, error = await _error(await client.post("/v1/completions", json={"model": "g", "prompt": prompt, **extra}, headers=AUTH))
    assert (status, error["param"]) == (400, param), error
    assert adapter.requests == []


async def test_sixteen_prompts_are_accepted(prompts) -> None:  # type: ignore[no-untyped-def]
    client, adapter, _ = prompts
    reply = await client.post("/v1/completions", json={"model": "g", "prompt": ["p"] * 16}, headers=AUTH)
    assert reply.status == 200 and len((await reply.json())["choices"]) == 16 == len(adapter.requests)


async def test_a_token_prompt_to_a_text_only_model_is_400_naming_prompt(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Triton's vLLM backend takes text_input only: the model says so (ModelInfo.token_prompts),
    and the gateway refuses before any lease or adapter call."""
    client, adapter, ratelimit = await _prompt_client(tmp_path, token_prompts=False)
    try:
        status, error = await _error(await client.post("/v1/completions", json={"model": "g", "prompt": [1, 2]}, headers=AUTH))
        assert (status, error["param"]) == (400, "prompt") and "token ids" in error["message"], error
        assert adapter.requests == [] and ratelimit.acquired == []
        assert (await client.post("/v1/completions", json={"model": "g", "prompt": ["a", "b"]}, headers=AUTH)).status == 200
    finally:
        await client.close()


async def test_every_request_is_counted_by_method_route_template_and_status(setup) -> None:  # type: ignore[no-untyped-def]
    """The HTTP front had no metrics: its traffic and 5xx were in neither the gateway's error ratio
    nor its dashboard. Routes are the templates, never the paths (unbounded label values)."""
    from prometheus_client import REGISTRY

    def count(method: str, route: str, status: str) -> float:
        labels = {"http_request_method": method, "http_route": route, "http_response_status_code": status, "error_type": ""}
        return REGISTRY.get_sample_value("http_server_request_duration_seconds_count", labels) or 0.0

    client, _adapter, _ratelimit, _publisher = setup
    before = count("POST", "/v1/chat/completions", "200"), count("GET", "unmatched", "404"), count("POST", "/v1/chat/completions", "401")
    body = {"model": "g", "messages": [{"role": "user", "content": "Hi"}]}
    assert (await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})).status == 200
    assert (await client.get("/no/such/path/1234")).status == 404
    assert (await client.post("/v1/chat/completions", json=body)).status == 401
    after = count("POST", "/v1/chat/completions", "200"), count("GET", "unmatched", "404"), count("POST", "/v1/chat/completions", "401")
    assert [a - b for a, b in zip(after, before)] == [1, 1, 1]


def _http_count(status: str, error_type: str) -> float:
    from prometheus_client import REGISTRY

    labels = {"http_request_method": "POST", "http_route": "/v1/chat/completions", "http_response_status_code": status, "error_type": error_type}
    return REGISTRY.get_sample_value("http_server_request_duration_seconds_count", labels) or 0.0


@pytest.mark.parametrize(
    ("tail", "error_type"),
    [
        ([grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "replica died")], "503"),
        ([RuntimeError("a bug")], "500"),
        # An ERROR finish and no status after it: answered by the front itself (generation_failed).
        ([inference_pb2.GenerateResponse(finish_reason=types_pb2.FINISH_REASON_ERROR)], "500"),
    ],
)
async def test_a_stream_failing_after_its_first_chunk_counts_as_an_error(setup, tail: list[Any], error_type: str) -> None:  # type: ignore[no-untyped-def]
    """Its 200 was sent (OpenTelemetry's http.response.status_code is the status sent): recorded as
    200 with error.type the failure's status, which the error ratio counts. It was a plain 200,
    which no rule could tell from a success."""
    client, adapter, _, _ = setup
    adapter.chunks = [inference_pb2.GenerateResponse(text="Hel", token_count=1), *tail]
    before = _http_count("200", error_type), _http_count("200", "")
    reply = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH)
    assert reply.status == 200 and "event: error" in await reply.text()
    assert (_http_count("200", error_type) - before[0], _http_count("200", "") - before[1]) == (1, 0)


async def test_a_server_error_answered_has_its_status_as_error_type_and_a_client_error_none(setup) -> None:  # type: ignore[no-untyped-def]
    """OpenTelemetry's error.type of an HTTP server request: its status when a 5xx, none for a 4xx (the client's)."""
    client, adapter, ratelimit, _ = setup
    adapter.chunks = [grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "no replica")]
    before = _http_count("503", "503"), _http_count("429", "")
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status == 503
    ratelimit.allowed = False
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status == 429
    assert (_http_count("503", "503") - before[0], _http_count("429", "") - before[1]) == (1, 1)


async def test_the_generation_span_is_named_after_the_catalogs_model_never_the_clients_unknown_one(setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Through the path: a model the catalog lacks leaves the placeholder ("chat _OTHER"); a known
    one names the span even when the call then fails (refused by rate-limit after the checks)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sluice_common import tracing

    client, _adapter, ratelimit, _ = setup
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_enabled", True)  # after the app is built: no aiohttp instrumentation
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer("sluice"))
    assert (await client.post("/v1/chat/completions", json={**CHAT, "model": "no-such-model-7f3a"}, headers=AUTH)).status == 404
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status == 200
    ratelimit.allowed = False
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status == 429
    names = [span.name for span in exporter.get_finished_spans() if span.name.startswith("chat")]
    assert names == ["chat _OTHER", "chat g", "chat g"]


async def test_an_unexpected_error_is_a_500_logged_with_its_traceback(setup) -> None:  # type: ignore[no-untyped-def]
    """A bug of ours: answered 500 without its details, and logged with its traceback (only its
    repr was logged: no line to find it by)."""
    from structlog.testing import capture_logs

    client, adapter, _, _ = setup
    adapter.chunks = [RuntimeError("a bug")]
    with capture_logs() as logs:
        status, error = await _error(await client.post("/v1/chat/completions", json=CHAT, headers=AUTH))
    assert (status, error["code"]) == (500, "internal_error") and "a bug" not in error["message"]
    (line,) = [e for e in logs if e["event"] == "http_internal_error"]
    assert line["log_level"] == "error" and isinstance(line["exc_info"], RuntimeError) and str(line["exc_info"]) == "a bug"
