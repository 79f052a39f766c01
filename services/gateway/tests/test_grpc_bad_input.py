"""Request bytes that protobuf refuses reach the gateway's gRPC front as INVALID_ARGUMENT naming the
field, never grpc's UNKNOWN ("Unexpected DecodeError"). A protobuf client cannot serialize a lone
surrogate, so the bytes are sent as they are (a generic call), as any other client could send them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import events_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from sluice_common.amqp import EventTopology
from sluice_common.server import RunningServer, create_server
from sluice_common.tenants import TenantDirectory
from sluice_gateway.path.admission import Admission
from sluice_gateway.path.completion_events import CompletionEvents
from sluice_gateway.path.inference_path import InferencePath
from sluice_gateway.path.model_catalog import ModelCatalog
from sluice_gateway.grpc_front.servicer import GatewayServicer
from test_openai_http import KEY, _Adapter, _Publisher, _RateLimit, _tenants_file

SERVICE = "/sluice.gateway.v1.GatewayService"
AUTH = (("authorization", f"Bearer {KEY}"),)
# What a lone surrogate (U+D800) becomes when a non-conforming encoder writes it (WTF-8): not UTF-8.
SURROGATE_BYTES = b"\xed\xa0\x80"
MARK = "\x01\x02\x03"  # three bytes, swapped for SURROGATE_BYTES: the length prefixes stay right


@contextlib.asynccontextmanager
async def served_gateway(adapter: _Adapter, publisher: _Publisher, tmp_path: Any) -> AsyncIterator[grpc.aio.Channel]:
    """The gateway's gRPC front on a port of its own, over `adapter` (a stand-in), its events to
    `publisher`: a channel to it, the server stopped after."""
    catalog = ModelCatalog(adapter)  # type: ignore[arg-type]
    await catalog.refresh()
    events = CompletionEvents(publisher, EventTopology("t"))  # type: ignore[arg-type]
    path = InferencePath(adapter, catalog, Admission(_RateLimit()), events, default_max_tokens=50)  # type: ignore[arg-type]
    servicer = GatewayServicer(TenantDirectory.from_file(_tenants_file(tmp_path)), path)

    def register(server: grpc.aio.Server) -> list[str]:
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
        return ["sluice.gateway.v1.GatewayService"]

    running: RunningServer = await create_server("127.0.0.1", 0, 0, register)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            yield channel
    finally:
        await running.server.stop(None)


@pytest.fixture
async def gateway(tmp_path) -> AsyncIterator[tuple[grpc.aio.Channel, _Adapter]]:  # type: ignore[no-untyped-def]
    adapter = _Adapter()
    async with served_gateway(adapter, _Publisher(), tmp_path) as channel:
        yield channel, adapter


def _with_surrogate(message: object) -> bytes:
    raw = message.SerializeToString()  # type: ignore[attr-defined]
    assert raw.count(MARK.encode()) == 1
    return raw.replace(MARK.encode(), SURROGATE_BYTES)


def _violation(error: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(error)
    assert status is not None, error
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            return bad.field_violations[0].field
    raise AssertionError(f"no BadRequest in {status}")


async def test_a_string_field_that_is_not_utf8_is_invalid_argument_naming_it(gateway) -> None:  # type: ignore[no-untyped-def]
    channel, adapter = gateway
    chat = gateway_pb2.GenerateRequest(
        model="g",
        messages=[types_pb2.ChatMessage(role="user", content="Hi"), types_pb2.ChatMessage(role="user", content=f"a{MARK}")],
        sampling=types_pb2.SamplingParams(max_tokens=2),
    )
    generate = channel.unary_stream(f"{SERVICE}/Generate")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in generate(_with_surrogate(chat), metadata=AUTH):
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert _violation(caught.value) == "messages[1].content"

    embed = channel.unary_unary(f"{SERVICE}/Embed")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await embed(_with_surrogate(gateway_pb2.EmbedRequest(model="e", inputs=["a", MARK])), metadata=AUTH)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _violation(caught.value) == "inputs[1]"

    # Bytes that are no message at all: refused as a whole.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await embed(b"\xff\xff\xff", metadata=AUTH)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _violation(caught.value) == "request"
    assert adapter.requests == []

    # The same server answers the next good request.
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    models = await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=AUTH)
    assert {m.name for m in models.models} == {"g", "e"}


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (types_pb2.SamplingParams(max_tokens=2, presence_penalty=2.5), "sampling.presence_penalty"),
        (types_pb2.SamplingParams(max_tokens=2, frequency_penalty=-2.5), "sampling.frequency_penalty"),
        (types_pb2.SamplingParams(max_tokens=2, repetition_penalty=0.0), "sampling.repetition_penalty"),
        (types_pb2.SamplingParams(max_tokens=2, top_k=-3), "sampling.top_k"),
        (types_pb2.SamplingParams(max_tokens=2, min_p=-0.5), "sampling.min_p"),
        (types_pb2.SamplingParams(max_tokens=2, logit_bias={7: 150.0}), "sampling.logit_bias"),
        (types_pb2.SamplingParams(max_tokens=2, logit_bias={-7: 1.0}), "sampling.logit_bias"),
    ],
)
async def test_a_sampling_option_out_of_range_is_invalid_argument_naming_it(gateway, sampling, field) -> None:  # type: ignore[no-untyped-def]
    channel, adapter = gateway
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    request = gateway_pb2.GenerateRequest(model="g", messages=[types_pb2.ChatMessage(role="user", content="Hi")], sampling=sampling)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Generate(request, metadata=AUTH):
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _violation(caught.value) == field
    assert adapter.requests == []
    # In range, the same options reach the adapter as sent.
    fine = types_pb2.SamplingParams(max_tokens=2, presence_penalty=1.0, top_k=5, min_p=0.5, repetition_penalty=1.5, logit_bias={7: 100.0})
    async for _ in stub.Generate(gateway_pb2.GenerateRequest(model="g", prompt="x", sampling=fine), metadata=AUTH):
        pass
    assert adapter.requests[-1].sampling == fine


def _constrained(**constraint: object) -> types_pb2.SamplingParams:
    return types_pb2.SamplingParams(max_tokens=2, structured_outputs=types_pb2.StructuredOutputs(**constraint))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sampling", "named"),
    [
        (_constrained(json='{"type": "object", "if": {}, "then": {}}'), "if"),
        (_constrained(json="{not json"), "not valid JSON"),
        (_constrained(json="[" * 5000), "nested too deeply"),
        (_constrained(regex="(unclosed"), "unclosed"),
        (_constrained(grammar='start: "a" | missing_rule'), "missing_rule"),
        (_constrained(choice=types_pb2.ChoiceList()), "non-empty list"),
        (_constrained(), "must set one of"),
    ],
)
async def test_a_constraint_the_library_cannot_compile_is_invalid_argument_naming_it(gateway, sampling, named) -> None:  # type: ignore[no-untyped-def]
    channel, adapter = gateway
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    request = gateway_pb2.GenerateRequest(model="g", prompt="x", sampling=sampling)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Generate(request, metadata=AUTH):
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _violation(caught.value) == "sampling.structured_outputs"
    assert named in (caught.value.details() or ""), caught.value.details()
    assert adapter.requests == []


async def test_a_regex_choice_or_grammar_reaches_the_adapter_as_sent(gateway) -> None:  # type: ignore[no-untyped-def]
    channel, adapter = gateway
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    for sampling in (
        _constrained(regex="[0-9]+"),
        _constrained(choice=types_pb2.ChoiceList(options=["yes", "no"])),
        _constrained(grammar='start: "a"+'),
    ):
        async for _ in stub.Generate(gateway_pb2.GenerateRequest(model="g", prompt="x", sampling=sampling), metadata=AUTH):
            pass
        assert adapter.requests[-1].sampling == sampling


async def test_response_format_json_object_is_enforced_not_only_scored(gateway) -> None:  # type: ignore[no-untyped-def]
    """A gRPC (or job) request asking for a JSON object is decoded under one, as OpenAI's is."""
    channel, adapter = gateway
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    request = gateway_pb2.GenerateRequest(
        model="g", prompt="x", sampling=types_pb2.SamplingParams(max_tokens=2), response_format=types_pb2.RESPONSE_FORMAT_JSON_OBJECT
    )
    async for _ in stub.Generate(request, metadata=AUTH):
        pass
    assert adapter.requests[-1].sampling.structured_outputs == types_pb2.StructuredOutputs(json_object=True)
    # A constraint of the client's own is kept.
    request.sampling.CopyFrom(_constrained(json='{"type": "object"}'))
    async for _ in stub.Generate(request, metadata=AUTH):
        pass
    assert adapter.requests[-1].sampling.structured_outputs.json == '{"type": "object"}'


@pytest.mark.parametrize(
    ("recorded", "field"),
    [
        ({"user": "u" * 257}, "user"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),  # a key too long to be a field's name: the map's
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"metadata": {"": "v"}}, "metadata."),
        ({"client_request_id": "c" * 129}, "client_request_id"),  # the HTTP front keeps the first 128
    ],
)
async def test_user_and_metadata_beyond_openais_bounds_are_invalid_argument_naming_them(gateway, recorded, field) -> None:  # type: ignore[no-untyped-def]
    """gRPC's GenerateRequest.user and metadata have the OpenAI front's bounds (they ride on every
    evaluation record)."""
    channel, adapter = gateway
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    request = gateway_pb2.GenerateRequest(model="g", prompt="x", sampling=types_pb2.SamplingParams(max_tokens=2), **recorded)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Generate(request, metadata=AUTH):
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _violation(caught.value) == field
    assert adapter.requests == []


async def test_a_priority_class_outside_the_enum_is_invalid_argument_not_internal(gateway) -> None:  # type: ignore[no-untyped-def]
    """Found by e2e test_bad_input's fuzzing: priority_class -1 (an unknown enum value, which proto3
    keeps) made the tracing span's enum name raise, an INTERNAL."""
    channel, adapter = gateway
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    request = gateway_pb2.GenerateRequest(model="g", prompt="x", sampling=types_pb2.SamplingParams(max_tokens=2), priority_class=-1)  # type: ignore[arg-type]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Generate(request, metadata=AUTH):
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _violation(caught.value) == "priority_class"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Embed(gateway_pb2.EmbedRequest(model="e", inputs=["a"], priority_class=7), metadata=AUTH)  # type: ignore[arg-type]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _violation(caught.value) == "priority_class"
    assert adapter.requests == []


@pytest.mark.parametrize("method", ["GetJob", "WatchJob", "CancelJob", "ListJobResults"])
async def test_a_job_call_without_a_key_is_unauthenticated_even_where_jobs_are_off(gateway, method: str) -> None:  # type: ignore[no-untyped-def]
    """This gateway runs no jobs: a caller with a key hears UNIMPLEMENTED, one without hears
    UNAUTHENTICATED first, as on every other call (it learned what is configured before)."""
    channel, _adapter = gateway
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    request = {"GetJob": gateway_pb2.GetJobRequest, "WatchJob": gateway_pb2.WatchJobRequest, "CancelJob": gateway_pb2.CancelJobRequest,
               "ListJobResults": gateway_pb2.ListJobResultsRequest}[method](job_id="j")  # fmt: skip
    for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED), (AUTH, grpc.StatusCode.UNIMPLEMENTED)):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            call = getattr(stub, method)(request, metadata=metadata)
            if method == "WatchJob":
                async for _ in call:
                    pass
            else:
                await call
        assert caught.value.code() == code, method


async def test_a_bad_message_in_a_chat_with_tools_is_named_at_the_clients_own_index(gateway) -> None:  # type: ignore[no-untyped-def]
    """Tools insert a system turn before validation ran: the client's messages[1] was reported as
    messages[2]."""
    channel, adapter = gateway
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    tools = types_pb2.ToolUse(tools=[types_pb2.Tool(name="get_time")])
    for messages, field in (
        ([types_pb2.ChatMessage(role="user", content="hi"), types_pb2.ChatMessage(role="assistant", content="")], "messages[1].content"),
        ([types_pb2.ChatMessage(role="user", content="hi"), types_pb2.ChatMessage(role="robot", content="x")], "messages[1].role"),
    ):
        request = gateway_pb2.GenerateRequest(model="g", messages=messages, sampling=types_pb2.SamplingParams(max_tokens=2), tool_use=tools)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Generate(request, metadata=AUTH):
                pass
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _violation(caught.value) == field
    assert adapter.requests == []


async def _refused(stub: gateway_pb2_grpc.GatewayServiceStub, request: gateway_pb2.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Generate(request, metadata=AUTH):
            pass
    return caught.value


async def test_a_20000_character_model_role_key_or_name_is_invalid_argument_not_resource_exhausted(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Quoted whole into the message, the BadRequest and the log context, a client's 20,000 characters
    outgrew gRPC's metadata: the client heard RESOURCE_EXHAUSTED ("received metadata size exceeds hard
    limit") instead of INVALID_ARGUMENT, and a 20 KB log line and CompletionEvent were written."""
    adapter, publisher = _Adapter(), _Publisher()
    long = "x" * 20_000
    hi = [types_pb2.ChatMessage(role="user", content="hi")]
    sampling = types_pb2.SamplingParams(max_tokens=2)
    cases = [
        (gateway_pb2.GenerateRequest(model=long, prompt="hi", sampling=sampling), "model"),
        (gateway_pb2.GenerateRequest(model="g", messages=[types_pb2.ChatMessage(role=long, content="hi")], sampling=sampling), "messages[0].role"),
        (gateway_pb2.GenerateRequest(model="g", messages=[types_pb2.ChatMessage(role=long, content="hi")], sampling=sampling,
                                     tool_use=types_pb2.ToolUse(tools=[types_pb2.Tool(name="f")])), "messages[0].role"),
        (gateway_pb2.GenerateRequest(model="g", messages=hi, sampling=sampling, metadata={long: "v"}), "metadata"),
        (gateway_pb2.GenerateRequest(model="g", messages=hi, sampling=sampling, tool_use=types_pb2.ToolUse(
            tools=[types_pb2.Tool(name="f")], choice=types_pb2.ToolChoice(mode=types_pb2.TOOL_CHOICE_MODE_FUNCTION, function=long))),
         "tool_use.choice.function"),
    ]  # fmt: skip
    async with served_gateway(adapter, publisher, tmp_path) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for request, field in cases:
            error = await _refused(stub, request)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and _violation(error) == field, (field, error.code())
            assert len(error.details() or "") < 300, field
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Embed(gateway_pb2.EmbedRequest(model=long, inputs=["a"]), metadata=AUTH)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _violation(caught.value) == "model"
    assert adapter.requests == []
    events = [events_pb2.CompletionEvent.FromString(body) for body in publisher.bodies]
    assert len(events[0].model) <= 257 and len(publisher.bodies[0]) < 2000  # the refused request's event


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"tool_use": types_pb2.ToolUse(tools=[types_pb2.Tool(name=f"f{i}") for i in range(129)])}, "tool_use.tools"),
        (
            {"tool_use": types_pb2.ToolUse(tools=[types_pb2.Tool(name="f", parameters='{"description": "' + "d" * 70_000 + '"}')])},
            "tool_use.tools[0].parameters",
        ),
        ({"sampling": types_pb2.SamplingParams(max_tokens=2, logit_bias={i: 1.0 for i in range(1025)})}, "sampling.logit_bias"),
        ({"sampling": _constrained(choice=types_pb2.ChoiceList(options=[f"o{i}" for i in range(1025)]))}, "sampling.structured_outputs"),
        ({"sampling": _constrained(regex="a" * 70_000)}, "sampling.structured_outputs"),
    ],
    ids=["tools", "tool_parameters", "logit_bias", "choice", "regex"],
)
async def test_what_is_too_large_to_compile_on_the_event_loop_is_invalid_argument_naming_it(gateway, changes, field) -> None:  # type: ignore[no-untyped-def]
    channel, adapter = gateway
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    request = gateway_pb2.GenerateRequest(model="g", messages=[types_pb2.ChatMessage(role="user", content="hi")], **changes)
    if not request.HasField("sampling"):
        request.sampling.max_tokens = 2
    error = await _refused(stub, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and _violation(error) == field, error.details()
    assert adapter.requests == []


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (
            {"tool_use": types_pb2.ToolUse(tools=[types_pb2.Tool(name="f", parameters='{"type": "integer", "maximum": ' + "9" * 5000 + "}")])},
            "tool_use.tools[0].parameters",
        ),
        ({"sampling": _constrained(json='{"type": "integer", "maximum": ' + "9" * 5000 + "}")}, "sampling.structured_outputs"),
    ],
    ids=["tool", "structured_outputs"],
)
async def test_a_schema_with_an_integer_too_long_to_read_is_invalid_argument_not_internal(gateway, changes, field) -> None:  # type: ignore[no-untyped-def]
    channel, _adapter = gateway
    request = gateway_pb2.GenerateRequest(model="g", messages=[types_pb2.ChatMessage(role="user", content="hi")], **changes)
    if not request.HasField("sampling"):
        request.sampling.max_tokens = 2
    error = await _refused(gateway_pb2_grpc.GatewayServiceStub(channel), request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and _violation(error) == field, error.details()
