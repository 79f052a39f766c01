"""Keeps the table of request fields in docs/developers/openai-http.md true: every field it lists
behaves as it says (honoured: read, so a nonsense value is a 400 naming it, and a good one is
served; refused: null served, anything else a 400 naming it; recorded: served and on the
completion's event), and every field of OpenAI's request schemas (and every field the parser
knows) is listed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from sluice.evallog.v1 import events_pb2

from sluice_gateway.openai_front import requests as openai_requests
from sluice_gateway.jobs.job import generate_request
from sluice_gateway.openai_front.batches import job_row, parse_batch_file
from test_openai_http import AUTH, CHAT, setup  # noqa: F401 - the fixture, shared

ROOT = Path(__file__).resolve().parents[3]
DOC = (ROOT / "docs" / "developers" / "openai-http.md").read_text()
SCHEMAS = json.loads((ROOT / "tests" / "fixtures" / "upstream" / "openai_openapi_subset.json").read_text())["components"]["schemas"]

ENDPOINTS = {
    "/v1/chat/completions": ("CreateChatCompletionRequest", CHAT, openai_requests._CHAT_FIELDS),
    "/v1/completions": ("CreateCompletionRequest", {"model": "g", "prompt": "Once"}, openai_requests._COMPLETION_FIELDS),
    "/v1/embeddings": ("CreateEmbeddingRequest", {"model": "e", "input": "rivers"}, openai_requests._EMBEDDING_FIELDS),
}
KINDS = ("honoured", "refused", "recorded")

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# A good value of each honoured field (with the fields it needs), as body additions.
GOOD: dict[str, dict[str, Any]] = {
    "model": {}, "messages": {}, "prompt": {}, "input": {"input": ["rivers", "mountains"]},
    "max_completion_tokens": {"max_completion_tokens": 5}, "max_tokens": {"max_tokens": 5},
    "temperature": {"temperature": 0.5}, "top_p": {"top_p": 0.5}, "stop": {"stop": ["x"]}, "seed": {"seed": 3},
    "presence_penalty": {"presence_penalty": 0.5}, "frequency_penalty": {"frequency_penalty": 0.5},
    "logit_bias": {"logit_bias": {"5": 1}}, "n": {"n": 1}, "logprobs": {"logprobs": True},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2}, "echo": {"echo": True},
    "stream": {"stream": True}, "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "response_format": {"response_format": {"type": "json_object"}}, "tools": {"tools": TOOLS},
    "tool_choice": {"tools": TOOLS, "tool_choice": "auto"}, "parallel_tool_calls": {"tools": TOOLS, "parallel_tool_calls": False},
    "top_k": {"top_k": 5}, "min_p": {"min_p": 0.1}, "repetition_penalty": {"repetition_penalty": 1.1},
    "structured_outputs": {"structured_outputs": {"choice": ["yes", "no"]}},
    "encoding_format": {"encoding_format": "base64"}, "dimensions": {"dimensions": 3},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": -1},
}  # fmt: skip
GOOD_COMPLETIONS = {"logprobs": {"logprobs": 2}}
RECORDED = {"user": "end-user-7", "metadata": {"run": "eval-3", "team": "search"}}
NONSENSE = [[["sluice-test"]]]  # a value no field takes


def _schema_fields(schema: dict[str, Any]) -> set[str]:
    if "$ref" in schema:
        return _schema_fields(SCHEMAS[schema["$ref"].rsplit("/", 1)[-1]])
    fields = set(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        fields |= _schema_fields(part)
    return fields


def documented(endpoint: str) -> dict[str, str]:
    """The table under the heading "### `POST <endpoint>`": field -> kind."""
    section = DOC.split(f"### `POST {endpoint}`\n", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| ([a-z]+) \|", section, re.MULTILINE)
    assert rows, f"no table for {endpoint}"
    assert len(rows) == len({name for name, _ in rows}), f"a field listed twice for {endpoint}"
    for name, kind in rows:
        assert kind in KINDS, (endpoint, name, kind)
    return dict(rows)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_field_of_openais_schema_and_of_the_parser_is_in_the_table(endpoint: str) -> None:
    schema, _, known = ENDPOINTS[endpoint]
    listed = set(documented(endpoint))
    assert _schema_fields(SCHEMAS[schema]) - listed == set()
    assert set(known) - listed == set()


def _cases() -> list[tuple[str, str, str]]:
    return [(endpoint, name, kind) for endpoint in ENDPOINTS for name, kind in documented(endpoint).items()]


@pytest.mark.parametrize(("endpoint", "field", "kind"), _cases())
async def test_every_field_behaves_as_the_table_says(setup, endpoint: str, field: str, kind: str) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    client, adapter, _, publisher = setup
    _, base, _ = ENDPOINTS[endpoint]

    async def post(changes: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
        reply = await client.post(endpoint, json={**base, **changes}, headers=AUTH)
        body = await reply.json() if reply.content_type == "application/json" else None
        return reply.status, (body or {}).get("error")

    status, error = await post({field: NONSENSE})
    assert status == 400 and error is not None, (field, status)
    assert error["param"] == field or re.match(rf"{field}[.\[]", error["param"]), (field, error)
    if kind == "honoured":
        good = (GOOD_COMPLETIONS if endpoint == "/v1/completions" else {}).get(field) or GOOD[field]
        status, error = await post(good)
        assert status == 200, (field, error)
    elif kind == "refused":
        assert error["code"] == "unsupported_parameter", (field, error)
        status, error = await post({field: None})
        assert status == 200, (field, error)
    else:
        status, error = await post({field: RECORDED[field]})
        assert status == 200, (field, error)
        event = events_pb2.CompletionEvent.FromString(publisher.bodies[-1])
        recorded = event.user if field == "user" else dict(event.metadata)
        assert recorded == RECORDED[field]


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"user": "u" * 257}, "user"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 65),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"metadata": {"k": 1}}, "metadata.k"),
    ],
)
async def test_user_and_metadata_beyond_openais_limits_are_a_400_naming_them(setup, changes: dict[str, Any], param: str) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    client, adapter, _, _ = setup
    reply = await client.post("/v1/chat/completions", json={**CHAT, **changes}, headers=AUTH)
    assert (reply.status, (await reply.json())["error"]["param"]) == (400, param)
    assert not adapter.requests
    # (The test server's body limit is 4 KiB: one value at its longest.)
    at_limits = {"user": "u" * 256, "metadata": {f"{i:064d}": "v" * (512 if i == 0 else 1) for i in range(16)}}
    assert (await client.post("/v1/chat/completions", json={**CHAT, **at_limits}, headers=AUTH)).status == 200


def test_a_batch_lines_user_and_metadata_ride_on_its_job_row() -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {**CHAT, **RECORDED}}
    (parsed,) = parse_batch_file(json.dumps(line).encode(), 10)
    row = job_row(parsed).generate
    assert (row.user, dict(row.metadata)) == (RECORDED["user"], RECORDED["metadata"])
    # ... and on the request the worker runs for it (whose CompletionEvent the path publishes).
    request = generate_request(row)
    assert (request.user, dict(request.metadata)) == (RECORDED["user"], RECORDED["metadata"])


async def test_a_prompt_lists_event_records_user_and_metadata(setup) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """Several prompts are one request and one event (its first prompt standing for it): it carries them."""
    client, adapter, _, publisher = setup
    body = {"model": "g", "prompt": ["Once", "Twice"], **RECORDED}
    assert (await client.post("/v1/completions", json=body, headers=AUTH)).status == 200
    assert len(adapter.requests) == 2 and len(publisher.bodies) == 1
    event = events_pb2.CompletionEvent.FromString(publisher.bodies[0])
    assert (event.user, dict(event.metadata)) == (RECORDED["user"], RECORDED["metadata"])
