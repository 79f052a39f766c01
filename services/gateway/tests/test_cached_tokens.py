"""Prompt tokens the engine served from its prefix cache (Usage.cached_tokens, issue 24) reach every
front: OpenAI's usage.prompt_tokens_details.cached_tokens on chat and text completions, whole and
streamed, the gRPC usage, the CompletionEvent and a bulk job row's result. The adapter is
test_openai_http's stand-in, whose final chunk says 4 of its 7 prompt tokens were cached."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import events_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from sluice.jobs.v1 import jobs_pb2

from sluice_common.amqp import EventTopology
from sluice_gateway.path.admission import Admission
from sluice_gateway.path.completion_events import CompletionEvents
from sluice_gateway.path.inference_path import InferencePath
from sluice_gateway.jobs.job import JSON, encode_reply, run_row
from sluice_gateway.path.model_catalog import ModelCatalog
from sluice_gateway.openai_front.replies import usage_object
from test_grpc_bad_input import AUTH as GRPC_AUTH
from test_grpc_bad_input import gateway  # noqa: F401 - the fixture
from test_openai_http import AUTH, CHAT, USAGE, _Adapter, _Publisher, setup  # noqa: F401 - the fixture

UPSTREAM = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "upstream"
COMPLETION_USAGE = json.loads((UPSTREAM / "openai_openapi_subset.json").read_text())["components"]["schemas"]["CompletionUsage"]


def conforms(value: Any, schema: dict[str, Any]) -> None:
    """`value` has only properties `schema` names, nested as it nests them, integers where it says so."""
    if schema.get("type") == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
        return
    assert schema.get("type") == "object" and isinstance(value, dict), (schema, value)
    assert set(schema.get("required", ())) <= set(value), value
    for name, item in value.items():
        assert name in schema["properties"], f"{name} is not a property of OpenAI's {schema.get('description')!r}"
        conforms(item, schema["properties"][name])


def test_the_usage_object_is_upstreams_completion_usage() -> None:
    counted = usage_object(USAGE)
    assert counted == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}
    conforms(counted, COMPLETION_USAGE)
    # None cached is said too, as OpenAI's API says it (a client reads a number, not a missing key).
    none_cached = usage_object(types_pb2.Usage(prompt_tokens=7, completion_tokens=2, total_tokens=9))
    assert none_cached is not None and none_cached["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage_object(types_pb2.Usage()) is None  # still nothing when nothing was counted


def sse_events(text: str) -> list[dict[str, Any]]:
    events = [line[len("data: ") :] for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_completions_whole_and_streamed_say_what_was_cached(setup, path: str) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    client, _, _, publisher = setup
    body: dict[str, Any] = dict(CHAT) if path.endswith("chat/completions") else {"model": "g", "prompt": "Hi"}
    reply = await client.post(path, json=body, headers=AUTH)
    assert reply.status == 200, await reply.text()
    usage = (await reply.json())["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4} and usage["prompt_tokens"] == 7
    conforms(usage, COMPLETION_USAGE)

    reply = await client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}}, headers=AUTH)
    chunks = sse_events(await reply.text())
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    conforms(chunks[-1]["usage"], COMPLETION_USAGE)

    # Each completion's CompletionEvent (evaluation-logging stores it) carries the count too.
    events = [events_pb2.CompletionEvent.FromString(body) for body in publisher.bodies]
    assert [(e.usage.prompt_tokens, e.usage.cached_tokens) for e in events] == [(7, 4), (7, 4)]


async def test_the_grpc_usage_carries_cached_tokens(gateway) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    channel, _ = gateway
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    request = gateway_pb2.GenerateRequest(model="g", prompt="Hi", sampling=types_pb2.SamplingParams(max_tokens=5))
    responses = [response async for response in stub.Generate(request, metadata=GRPC_AUTH)]
    assert responses[-1].finish_reason == types_pb2.FINISH_REASON_STOP
    assert (responses[-1].usage.prompt_tokens, responses[-1].usage.cached_tokens) == (7, 4)


async def test_a_bulk_rows_result_carries_cached_tokens() -> None:
    adapter, publisher = _Adapter(), _Publisher()
    catalog = ModelCatalog(adapter)  # type: ignore[arg-type]
    await catalog.refresh()
    path = InferencePath(adapter, catalog, Admission(None), CompletionEvents(publisher, EventTopology("t")), default_max_tokens=50)  # type: ignore[arg-type]
    row = jobs_pb2.JobRow(custom_id="r", generate=jobs_pb2.GenerateRow(model="g", prompt="Hi", sampling=types_pb2.SamplingParams(max_tokens=5)))
    run = await run_row(path, jobs_pb2.RowTask(job_id="j", tenant="acme", row=row), "rid", 10.0)
    assert (run.result.usage.prompt_tokens, run.result.usage.cached_tokens) == (7, 4)
    # A producer that sent its job as JSON reads its results as JSON, proto field names kept.
    assert json.loads(encode_reply(run.result, JSON))["usage"]["cached_tokens"] == 4
    assert jobs_pb2.RowResult.FromString(encode_reply(run.result, "application/x-protobuf")).usage.cached_tokens == 4
    [event] = [events_pb2.CompletionEvent.FromString(body) for body in publisher.bodies]
    assert (event.job_id, event.usage.cached_tokens) == ("j", 4)
