"""Issue 14 on the real stack: the official openai SDK (sync, async, streaming, embeddings, errors)
and the docs' curl examples (docs/developers/openai-http.md) against the gateway's OpenAI-compatible HTTP API; the HTTP requests'
completion events stored by evaluation-logging; max_tokens omitted on gRPC."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import evallog_pb2, evallog_pb2_grpc
from sluice.gateway.v1 import gateway_pb2

from conftest import DEMO_KEY, EMBEDDING_MODEL, MODEL, auth
from ratelimit_support import start_ratelimit
from sluice_stack import REPO_ROOT, Stack
from sluice_stack.launcher import ANY_HTTP_PORT
from test_ratelimit_gateway import start_gateway

PRIVATE_KEY = "sk-sluice-private"
QUESTION = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.openai_base_url, api_key=DEMO_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def evallog(stack: Stack) -> Iterator[evallog_pb2_grpc.EvalLogServiceStub]:
    with grpc.insecure_channel(stack.evallog_address) as channel:
        yield evallog_pb2_grpc.EvalLogServiceStub(channel)


def record_of(evallog: evallog_pb2_grpc.EvalLogServiceStub, request_id: str, key: str = DEMO_KEY, timeout_s: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        page = evallog.QueryRecords(evallog_pb2.QueryRecordsRequest(page_size=1000), metadata=auth(key), timeout=10)
        for record in page.records:
            if record.event.request_id == request_id:
                return record
        time.sleep(0.25)
    raise AssertionError(f"no evaluation record for {request_id}")


def test_models_list(client: openai.OpenAI) -> None:
    ids = {model.id for model in client.models.list()}
    assert {MODEL, EMBEDDING_MODEL} <= ids
    assert client.models.retrieve(MODEL).id == MODEL


def test_sync_chat_completion_reports_sluices_usage_and_is_stored_by_evaluation_logging(client: openai.OpenAI, evallog) -> None:  # type: ignore[no-untyped-def]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    reply = raw.parse()
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert int(raw.headers["x-ratelimit-limit-requests"]) > 0 and "x-ratelimit-remaining-tokens" in raw.headers
    request_id = raw.headers["x-request-id"]
    record = record_of(evallog, request_id)
    event = record.event
    assert event.tenant == "demo" and event.model == MODEL and event.output == reply.choices[0].message.content
    assert event.usage.completion_tokens == reply.usage.completion_tokens and event.usage.prompt_tokens == reply.usage.prompt_tokens
    assert event.finish_reason in (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH)
    assert event.sampling.max_tokens == 8 and event.sampling.temperature == 0.0


def test_user_and_metadata_are_recorded_and_queryable(client: openai.OpenAI, evallog, stack: Stack) -> None:  # type: ignore[no-untyped-def]
    """Issue 25 item 6: OpenAI's `user` and `metadata` are neither sent to the model nor dropped: the
    completion's evaluation record carries them and QueryRecords (and `sluice logs`) filters on them."""
    user, run = f"end-user-{time.time_ns()}", f"run-{time.time_ns()}"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, user=user, metadata={"run": run, "team": "e2e"}
    )
    request_id = raw.headers["x-request-id"]
    record = record_of(evallog, request_id)
    assert (record.event.user, dict(record.event.metadata)) == (user, {"run": run, "team": "e2e"})

    def found(**where: object) -> list[str]:
        page = evallog.QueryRecords(evallog_pb2.QueryRecordsRequest(page_size=1000, **where), metadata=auth(DEMO_KEY), timeout=10)
        return [r.event.request_id for r in page.records]

    assert found(user=user) == [request_id]
    assert found(metadata={"run": run}) == [request_id]
    assert found(user=user, metadata={"run": run, "team": "e2e"}) == [request_id]
    assert found(metadata={"run": run, "team": "other"}) == []
    summary = evallog.Summarize(evallog_pb2.SummarizeRequest(user=user, metadata={"run": run}), metadata=auth(DEMO_KEY), timeout=30)
    assert [(s.model, s.count) for s in summary.summaries] == [(MODEL, 1)]
    # The CLI's filters: the same record, as JSON.
    env = {**os.environ, "SLUICE_EVALLOG_URL": stack.evallog_address, "SLUICE_API_KEY": DEMO_KEY}
    logs = subprocess.run(
        [str(REPO_ROOT / "bin" / "sluice"), "logs", "--json", "--user", user, "--metadata", f"run={run}", "--since", "1h"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert logs.returncode == 0, logs.stdout + logs.stderr
    lines = [json.loads(line) for line in logs.stdout.splitlines()]  # every line JSON, for jq
    listed = [line for line in lines if "event" in line]
    assert [r["event"]["request_id"] for r in listed] == [request_id]
    assert listed[0]["event"]["user"] == user and listed[0]["event"]["metadata"] == {"run": run, "team": "e2e"}
    summaries = [line["summary"] for line in lines if "summary" in line]  # the summary: that one too
    assert [(s["model"], s["tenant"], int(s["count"])) for s in summaries] == [(MODEL, "demo", 1)]
    # Beyond OpenAI's limits: a 400 naming the param, before anything runs.
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, metadata={str(i): "v" for i in range(17)})
    assert refused.value.body["param"] == "metadata"  # type: ignore[index]


def test_async_streaming_with_include_usage(stack: Stack) -> None:
    async def run() -> tuple[list, str]:  # type: ignore[type-arg]
        client = openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=DEMO_KEY, max_retries=0, timeout=120)
        stream = await client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        whole = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
        await client.close()
        return chunks, whole.choices[0].message.content or ""

    chunks, whole = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole  # greedy: the stream and the whole reply agree
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None and 0 < usage_chunk.usage.completion_tokens <= 12
    assert all(c.usage is None for c in chunks[:-1])


def test_sync_streaming_and_text_completions(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, stream=True)
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks)
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert completion.object == "text_completion" and completion.choices[0].text
    assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 6


def test_embeddings_float_and_base64_agree_with_grpc(client: openai.OpenAI, gateway) -> None:  # type: ignore[no-untyped-def]
    texts = ["rivers run to the sea", "mountains stand still"]
    as_float = client.embeddings.create(model=EMBEDDING_MODEL, input=texts, encoding_format="float")
    as_base64 = client.embeddings.create(model=EMBEDDING_MODEL, input=texts)  # the SDK asks base64 and decodes it
    via_grpc = gateway.Embed(gateway_pb2.EmbedRequest(model=EMBEDDING_MODEL, inputs=texts), metadata=auth(), timeout=60)
    assert len(as_float.data) == 2 and len(as_float.data[0].embedding) == 384
    for index in range(2):
        expected = np.array(via_grpc.embeddings[index].values, dtype=np.float32)
        np.testing.assert_allclose(np.array(as_float.data[index].embedding, dtype=np.float32), expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.array(as_base64.data[index].embedding, dtype=np.float32), expected, rtol=1e-5, atol=1e-6)
    assert as_float.usage.prompt_tokens == via_grpc.usage.prompt_tokens > 0


def test_errors_are_openais(client: openai.OpenAI, stack: Stack) -> None:
    bad_key = openai.OpenAI(base_url=stack.openai_base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as unauthenticated:
        bad_key.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    assert unauthenticated.value.status_code == 401 and unauthenticated.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=4)
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=5)
    assert bad.value.param == "temperature" and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10**6)
    assert too_long.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as unknown_field:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, extra_body={"frobnicate": True})
    assert unknown_field.value.param == "frobnicate"
    with pytest.raises(openai.BadRequestError) as bad_input:
        client.embeddings.create(model=EMBEDDING_MODEL, input=[[1, 2, 3]])
    assert bad_input.value.param == "input"
    # Malformed JSON and an oversized body, as raw HTTP.
    malformed = post_raw(f"{stack.openai_base_url}/chat/completions", b'{"model": ')
    assert malformed[0] == 400 and malformed[1]["error"]["code"] == "invalid_json"
    huge = post_raw(f"{stack.openai_base_url}/embeddings", b"x" * (4 * 1024 * 1024 + 1024))
    assert huge[0] == 413 and huge[1]["error"]["type"] == "invalid_request_error"


def test_an_embedding_input_over_the_models_maximum_is_openais_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as too_long:
        client.embeddings.create(model=EMBEDDING_MODEL, input=["A short text.", "word " * 300])
    assert too_long.value.param == "input[1]" and too_long.value.type == "invalid_request_error"
    assert "maximum context length is 256 tokens. However, you requested 302 tokens" in too_long.value.message


def post_raw(url: str, body: bytes) -> tuple[int, dict]:  # type: ignore[type-arg]
    headers = {"Authorization": f"Bearer {DEMO_KEY}", "Content-Type": "application/json"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_disconnected_stream_is_cancelled_and_logged_so(client: openai.OpenAI, evallog) -> None:  # type: ignore[no-untyped-def]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a long story about a river."}], max_tokens=400, stream=True
    )
    request_id = raw.headers["x-request-id"]
    stream = raw.parse()
    next(iter(stream))
    stream.close()  # the client goes away after its first chunk
    event = record_of(evallog, request_id).event
    assert event.finish_reason == types_pb2.FINISH_REASON_CANCELLED
    assert event.usage.completion_tokens < 400


LIMITS = """
[tenants.private]
requests_per_minute = 1
burst = 1.0
"""


# The gateway's HTTP front on a port it binds itself and names in its log.
ANY_PORT = str(ANY_HTTP_PORT)


def test_rate_limited_is_429_with_retry_after_and_ratelimit_headers(stack: Stack, tmp_path: Path) -> None:
    limits = tmp_path / "limits.toml"
    limits.write_text(LIMITS)
    limiter, limiter_address = start_ratelimit(tmp_path, "rate-limit-openai", limits)
    try:
        gateway, _ = start_gateway(stack, tmp_path, "gateway-openai-rl", limiter_address, http_port=ANY_PORT)
        try:
            limited = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.ports['http']}/v1", api_key=PRIVATE_KEY, max_retries=0, timeout=60)
            first = limited.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=2)
            assert first.headers["x-ratelimit-limit-requests"] == "1"
            with pytest.raises(openai.RateLimitError) as denied:
                limited.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
            headers = denied.value.response.headers
            assert denied.value.status_code == 429 and denied.value.code == "rate_limit_exceeded"
            assert int(headers["retry-after"]) >= 1 and headers["x-ratelimit-limit-requests"] == "1"
            assert headers["x-ratelimit-remaining-requests"] == "0"
        finally:
            gateway.stop()
    finally:
        limiter.stop()


def test_no_adapter_to_serve_is_503_with_retry_after(stack: Stack, tmp_path: Path) -> None:
    """A gateway whose only adapter has died: OpenAI's 503 (its SDK retries those), not a 500 or a hang."""
    adapter, adapter_address, _ = stack.add_adapter("adapter-openai-503")
    gateway, _ = start_gateway(stack, tmp_path, "gateway-openai-503", stack.ratelimit_address, http_port=ANY_PORT, adapter_url=adapter_address)
    try:
        served = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.ports['http']}/v1", api_key=DEMO_KEY, max_retries=0, timeout=60)
        assert served.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2).choices[0].finish_reason
        adapter.kill()
        with pytest.raises(openai.InternalServerError) as unavailable:
            served.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
        assert unavailable.value.status_code == 503 and unavailable.value.code == "unavailable"
        assert int(unavailable.value.response.headers["retry-after"]) >= 1
        body = unavailable.value.body
        assert isinstance(body, dict) and body["type"] == "service_unavailable" and body["message"]
    finally:
        gateway.stop()


def documented_curls() -> list[str]:
    """The curl lines of the HTTP API's page (the README's "OpenAI-compatible HTTP API" section before)."""
    page = (REPO_ROOT / "docs" / "developers" / "openai-http.md").read_text()
    return [line for line in page.splitlines() if line.startswith("curl ")]


def test_documented_curl_examples_work(stack: Stack) -> None:
    commands = documented_curls()
    assert len(commands) == 5
    port = stack.openai_base_url.split(":")[2].split("/")[0]
    for command in commands:
        command = command.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        done = subprocess.run(["bash", "-c", command + " -w '\\n%{http_code}'"], capture_output=True, text=True, timeout=120)
        body, _, status = done.stdout.rpartition("\n")
        assert done.returncode == 0 and status == "200", (command, done.stdout, done.stderr)
        if '"stream":true' in command:
            events = re.findall(r"^data: (.*)$", body, re.MULTILINE)
            assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["total_tokens"] > 0
        else:
            assert "error" not in json.loads(body)


def test_grpc_generate_without_max_tokens_gets_the_default(gateway) -> None:  # type: ignore[no-untyped-def]
    request = gateway_pb2.GenerateRequest(model=MODEL, messages=[types_pb2.ChatMessage(role="user", content="Say OK.")])
    responses = list(gateway.Generate(request, metadata=auth(), timeout=120))
    final = responses[-1]
    # Accepted (no longer INVALID_ARGUMENT "must be > 0"), and the answer ends on its own, not on
    # a tiny default: the default is the remaining context capped by DEFAULT_MAX_TOKENS.
    assert final.finish_reason == types_pb2.FINISH_REASON_STOP
    assert 0 < final.usage.completion_tokens < 1024
