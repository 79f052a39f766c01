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
    allow null there, as OpenAPI means. An optional property may be null too: OpenAI's own
    examples send unset optional fields as null (a Batch's `failed_at`, a file's `expires_at`)."""
    if isinstance(node, list):
        return [honour_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    schema = {key: honour_nullable(value) for key, value in node.items()}
    if isinstance(schema.get("properties"), dict):
        required = set(schema.get("required", ()))
        for name, prop in schema["properties"].items():
            if name not in required and isinstance(prop, dict):
                schema["properties"][name] = {"anyOf": [prop, {"type": "null"}]}
    if schema.pop("nullable", False):
        if isinstance(schema.get("type"), str):
            schema["type"] = [schema["type"], "null"]
        if "enum" in schema:
            schema["enum"] = [*schema["enum"], None]
        if "$ref" in schema or "allOf" in schema or "anyOf" in schema or "oneOf" in schema:
            schema = {"anyOf": [schema, {"type": "null"}]}
    return schema


UPSTREAM = honour_nullable(json.loads((REPO_ROOT / "tests" / "fixtures" / "upstream" / "openai_openapi_subset.json").read_text()))
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
    assert json.loads(events[-2])["usage"]["completion_tokens"] > 0


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
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode() + content + f"\r\n--{boundary}--\r\n".encode()
    headers = {"Authorization": f"Bearer {DEMO_KEY}", "Content-Type": f"multipart/form-data; boundary={boundary}"}
    request = urllib.request.Request(f"{stack.openai_base_url}/files", data=parts, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=60) as reply:
        return reply.status, reply.read()


def test_files_and_batches_match_upstream(stack: Stack) -> None:
    line = {"custom_id": "one", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}
    status, body = upload(stack, "schema.jsonl", (json.dumps(line) + "\n").encode())
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
    check("ListBatchesResponse", json.loads(call(stack, "GET", "/batches?limit=5")[1]))
    check("ListFilesResponse", json.loads(call(stack, "GET", "/files?limit=5")[1]))
