"""What the OpenAI-compatible HTTP front sends, validated against OpenAI's own OpenAPI schemas
(tests/fixtures/upstream/openai_openapi_subset.json, cut from github.com/openai/openai-openapi by
tools/openai_openapi_subset.py). The SDK parses leniently; these schemas do not."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import jsonschema
import pytest

from conftest import DEMO_KEY, EMBEDDING_MODEL, MODEL
from sluice_stack import REPO_ROOT, Stack


def honour_nullable(node: Any) -> Any:
    """OpenAI's document says `nullable: true` (OpenAPI 3.0's keyword, which JSON Schema ignores):
    allow null there, as OpenAPI means, and nowhere else. An optional property that is not nullable
    is absent or of its type, never null: the front omits what it does not set."""
    if isinstance(node, list):
        return [honour_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    schema = {key: honour_nullable(value) for key, value in node.items()}
    if schema.pop("nullable", False):
        if isinstance(schema.get("type"), str):
            schema["type"] = [schema["type"], "null"]
        if "enum" in schema:
            schema["enum"] = [*schema["enum"], None]
        if "$ref" in schema or "allOf" in schema or "anyOf" in schema or "oneOf" in schema:
            schema = {"anyOf": [schema, {"type": "null"}]}
    return schema


FIXTURES = REPO_ROOT / "tests" / "fixtures" / "upstream"
UPSTREAM = honour_nullable(json.loads((FIXTURES / "openai_openapi_subset.json").read_text()))
# The per-line object of a batch's output and error files, from an older release of the same
# document (the subset's generated openapi.json no longer publishes it).
UPSTREAM["components"]["schemas"].update(
    honour_nullable(json.loads((FIXTURES / "openai_batch_request_output_schema.json").read_text()))["components"]["schemas"]
)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6, "temperature": 0}


def check(schema_name: str, document: Any) -> None:
    """Raises when `document` breaks upstream's schema `schema_name` (its $refs resolve in the subset)."""
    schema = {"$ref": f"#/components/schemas/{schema_name}", "components": UPSTREAM["components"]}
    jsonschema.Draft202012Validator(schema).validate(document)


def call(stack: Stack, method: str, path: str, body: dict[str, Any] | None = None, key: str = DEMO_KEY) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    request = urllib.request.Request(f"{stack.openai_base_url}{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_the_requests_these_tests_send_are_upstream_requests() -> None:
    check("CreateChatCompletionRequest", CHAT)
    check("CreateCompletionRequest", {"model": MODEL, "prompt": "Paris is", "max_tokens": 4})
    check("CreateEmbeddingRequest", {"model": EMBEDDING_MODEL, "input": ["a", "b"]})
    with pytest.raises(jsonschema.ValidationError):
        check("CreateChatCompletionRequest", {"model": MODEL, "messages": "not a list"})


def test_an_optional_property_that_is_not_nullable_may_not_be_null() -> None:
    """The schemas as OpenAI wrote them: `usage` is optional on a completion and not nullable, so a
    completion without counts omits it; on a stream chunk it is nullable (every chunk but the last)."""
    whole = {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Blue.", "refusal": None}, "logprobs": None, "finish_reason": "stop"}],
    }  # fmt: skip
    check("CreateChatCompletionResponse", whole)
    for name, value in (("usage", None), ("system_fingerprint", None)):
        with pytest.raises(jsonschema.ValidationError):
            check("CreateChatCompletionResponse", {**whole, name: value})
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": [], "usage": None}
    check("CreateChatCompletionStreamResponse", chunk)
    with pytest.raises(jsonschema.ValidationError):
        check("ListBatchesResponse", {"object": "list", "data": [], "has_more": False, "first_id": None})


def sse_events(body: bytes) -> list[tuple[str, str]]:
    """(event name, data) of each server-sent event; the name is "message" unless it says otherwise."""
    events = []
    for block in body.decode().split("\n\n"):
        lines = block.splitlines()
        data = "\n".join(line.removeprefix("data: ") for line in lines if line.startswith("data: "))
        name = next((line.removeprefix("event: ") for line in lines if line.startswith("event: ")), "message")
        if data:
            events.append((name, data))
    return events


def test_chat_completion_and_its_stream_match_upstream(stack: Stack) -> None:
    status, body = call(stack, "POST", "/chat/completions", CHAT)
    assert status == 200
    check("CreateChatCompletionResponse", json.loads(body))
    status, body = call(stack, "POST", "/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    events = [line.removeprefix("data: ") for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3
    for event in events[:-1]:
        check("CreateChatCompletionStreamResponse", json.loads(event))
    # The usage chunk (stream_options.include_usage): no choices, the counts; every other chunk null.
    usage_chunk = json.loads(events[-2])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    assert all(json.loads(event)["usage"] is None for event in events[:-2])


def test_completion_streams_finish_and_usage_chunks_match_upstream(stack: Stack) -> None:
    """Upstream has no chunk schema for /v1/completions: its stream sends CreateCompletionResponse
    objects whose finish_reason is null until the last (as OpenAI and vLLM send them), which that
    schema does not allow. The finishing chunk and the usage chunk are held to it exactly."""
    body = {"model": MODEL, "prompt": "Paris is", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    status, reply = call(stack, "POST", "/completions", body)
    assert status == 200
    events = [data for _, data in sse_events(reply)]
    assert events[-1] == "[DONE]" and len(events) >= 3
    finishing, usage_chunk = json.loads(events[-3]), json.loads(events[-2])
    assert finishing["choices"][0]["finish_reason"] == "length"
    check("CreateCompletionResponse", finishing)
    check("CreateCompletionResponse", usage_chunk)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] > 0


def test_a_stream_cut_after_its_first_chunk_ends_with_an_upstream_error_event(stack: Stack) -> None:
    """An adapter that dies mid-stream: the stream's chunks so far, then an `error` event whose data
    is OpenAI's ErrorResponse (what its SDK raises from), not a silent cut."""
    adapter, adapter_address, _ = stack.add_adapter("adapter-schema-error-event")
    try:
        gateway, _, _ = stack.add_gateway("gateway-schema-error-event", env={"SLUICE_GATEWAY_ADAPTER_URL": adapter_address})
        try:
            body = json.dumps({**CHAT, "max_tokens": 512, "stream": True, "stream_options": {"include_usage": True}}).encode()
            headers = {"Authorization": f"Bearer {DEMO_KEY}", "Content-Type": "application/json"}
            url = f"http://127.0.0.1:{gateway.env['SLUICE_GATEWAY_HTTP_PORT']}/v1/chat/completions"
            request = urllib.request.Request(url, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=120) as reply:
                first = reply.readline()
                assert first.startswith(b"data: "), first
                adapter.kill()
                rest = reply.read()
        finally:
            gateway.stop()
    finally:
        adapter.stop()
    events = sse_events(first + rest)
    name, data = events[-1]
    assert name == "error", events[-3:]
    check("ErrorResponse", json.loads(data))
    for name, data in events[:-1]:
        assert name == "message"
        check("CreateChatCompletionStreamResponse", json.loads(data))


def test_completion_embeddings_and_models_match_upstream(stack: Stack) -> None:
    status, body = call(stack, "POST", "/completions", {"model": MODEL, "prompt": "Paris is", "max_tokens": 4})
    assert status == 200
    check("CreateCompletionResponse", json.loads(body))
    status, body = call(stack, "POST", "/embeddings", {"model": EMBEDDING_MODEL, "input": ["a", "b"]})
    assert status == 200
    check("CreateEmbeddingResponse", json.loads(body))
    status, body = call(stack, "GET", "/models")
    assert status == 200
    check("ListModelsResponse", json.loads(body))
    status, body = call(stack, "GET", f"/models/{MODEL}")
    assert status == 200
    check("Model", json.loads(body))


def test_errors_match_upstream(stack: Stack) -> None:
    cases = [
        (call(stack, "POST", "/chat/completions", CHAT, key="sk-wrong"), 401),
        (call(stack, "POST", "/chat/completions", {**CHAT, "temperature": 5}), 400),
        (call(stack, "POST", "/chat/completions", {**CHAT, "model": "no-such-model"}), 404),
        (call(stack, "GET", "/models/no-such-model"), 404),
    ]
    for (status, body), expected in cases:
        assert status == expected, body
        check("ErrorResponse", json.loads(body))


def upload(stack: Stack, name: str, content: bytes) -> tuple[int, bytes]:
    """POST /v1/files as multipart/form-data, the way OpenAI's clients send it."""
    boundary = "sluice-schema-test"
    parts = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + content
        + f"\r\n--{boundary}--\r\n".encode()
    )
    headers = {"Authorization": f"Bearer {DEMO_KEY}", "Content-Type": f"multipart/form-data; boundary={boundary}"}
    request = urllib.request.Request(f"{stack.openai_base_url}/files", data=parts, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=60) as reply:
        return reply.status, reply.read()


def check_batch_lines(stack: Stack, file_id: str, response_schema: str) -> list[dict[str, Any]]:
    """Every line of a batch's output or error file, against BatchRequestOutput and, where it has a
    response, its body against the endpoint's own response schema (200) or ErrorResponse (an HTTP
    error, which OpenAI's error files carry as the response)."""
    status, content = call(stack, "GET", f"/files/{file_id}/content")
    assert status == 200
    lines = [json.loads(line) for line in content.decode().splitlines()]
    for line in lines:
        check("BatchRequestOutput", line)
        if line["response"] is not None:
            check(response_schema if line["response"]["status_code"] == 200 else "ErrorResponse", line["response"]["body"])
    return lines


def test_files_and_batches_match_upstream(stack: Stack) -> None:
    check("ListBatchesResponse", json.loads(call(stack, "GET", "/batches?after=batch_none&limit=1")[1]))
    line = {"custom_id": "one", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}
    unknown = {**line, "custom_id": "two", "body": {**CHAT, "model": "no-such-model"}}
    status, body = upload(stack, "schema.jsonl", (json.dumps(line) + "\n" + json.dumps(unknown) + "\n").encode())
    assert status == 200
    uploaded = json.loads(body)
    check("OpenAIFile", uploaded)
    status, body = call(stack, "POST", "/batches", {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert status == 200
    batch = json.loads(body)
    check("Batch", batch)
    deadline = time.monotonic() + 120
    while batch["status"] not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = json.loads(call(stack, "GET", f"/batches/{batch['id']}")[1])
    assert batch["status"] == "completed", batch
    check("Batch", batch)
    check("OpenAIFile", json.loads(call(stack, "GET", f"/files/{batch['output_file_id']}")[1]))
    (output,) = check_batch_lines(stack, batch["output_file_id"], "CreateChatCompletionResponse")
    (error,) = check_batch_lines(stack, batch["error_file_id"], "CreateChatCompletionResponse")
    assert (output["custom_id"], output["error"], error["custom_id"], error["error"]) == ("one", None, "two", None)
    assert error["response"]["status_code"] == 400
    check("ListBatchesResponse", json.loads(call(stack, "GET", "/batches?limit=5")[1]))
    check("ListFilesResponse", json.loads(call(stack, "GET", "/files?limit=5")[1]))
