"""Issue 22, item 12 on the real stack: no input gets a 500 / INTERNAL / UNKNOWN, and the services
keep serving. Property-based (hypothesis):

- every route of the gateway's OpenAI HTTP front, read from the aiohttp app's own router (so a new
  route is covered without touching this file): arbitrary JSON bodies (lone surrogates, huge numbers,
  nested junk, wrong types, unknown fields), raw bytes, path parameters, query strings, headers;
- every method of the public gRPC services (GatewayService with its jobs API, evaluation-logging's
  EvalLogService), read from their descriptors: arbitrary field values, including string fields
  whose bytes are not UTF-8 (what a lone surrogate becomes on the wire; the protobuf library refuses
  to write one, so the bytes are sent through a generic call).

Each answer must be a 4xx or a valid answer (HTTP) / any status but INTERNAL and UNKNOWN (gRPC).
Bounded for CI: fixed example counts, derandomized, no example database; every generation asks for
at most a few tokens.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import evallog_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.jobs.v1 import jobs_pb2

from conftest import DEMO_KEY, EMBEDDING_MODEL, MODEL
from sluice_stack import Stack

# Examples per gRPC method (12 methods) and per HTTP route (about 15 routes, HEAD included).
GRPC_PROPERTY = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
HTTP_PROPERTY = settings(GRPC_PROPERTY, max_examples=12)
# Most generations are refused before they run; those that run ask for at most this many tokens.
MAX_TOKENS = 2
CALL_TIMEOUT_S = 60.0

SURROGATES = ("\ud800", "\udfff", "\udc80")
# A string field holding this is sent with these bytes in its place (same length: the length
# prefixes stay right): a lone surrogate as a non-conforming encoder writes it, which is not UTF-8.
WIRE_MARK, WIRE_BAD = b"\x01\x02\x03", b"\xed\xa0\x80"
KNOWN_STRINGS = (MODEL, EMBEDDING_MODEL, "user", "system", "assistant", "developer", "text", "json_object", "24h", "batch", DEMO_KEY)


# ---- values


def _with_surrogate(text: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.builds(lambda a, s, b: a + s + b, text, st.sampled_from(SURROGATES), text)


# Listed twice: drawn more often than the surrogates, so that a request can be valid otherwise.
TEXT = st.one_of(*[st.text(max_size=12), st.sampled_from(KNOWN_STRINGS)] * 2, _with_surrogate(st.text(max_size=4)))
NUMBERS = st.one_of(
    st.integers(-5, 5),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([2**31, 2**32, 2**63, 2**64, -(2**63) - 1, 1e308]),
)
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=12,
)
# Bodies close enough to a valid request to reach past the first check, with fields mutated or added.
TEMPLATES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": MAX_TOKENS},
    "/v1/completions": {"model": MODEL, "prompt": "Once", "max_tokens": MAX_TOKENS},
    "/v1/embeddings": {"model": EMBEDDING_MODEL, "input": "a"},
    "/v1/batches": {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
}
FIELD_NAMES = st.one_of(
    st.sampled_from(
        [
            "model", "messages", "prompt", "input", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
            "seed", "stream", "stream_options", "response_format", "n", "logprobs", "user", "encoding_format",
            "dimensions", "input_file_id", "endpoint", "completion_window", "metadata", "tools", "tool_choice", "parallel_tool_calls",
            "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "min_p", "repetition_penalty", "echo",
        ]
    ),
    TEXT,
)  # fmt: skip


def _cap_tokens(body: Any) -> Any:
    """A body that would generate asks for at most MAX_TOKENS (or for a count no model serves)."""
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and MAX_TOKENS < value < 10**6:
                body[name] = MAX_TOKENS
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = MAX_TOKENS
    return body


@st.composite
def json_body(draw: st.DrawFn, path: str) -> bytes:
    kind = draw(st.sampled_from(["mutated", "mutated", "arbitrary", "raw"]))
    if kind == "raw":
        return draw(st.one_of(st.binary(max_size=40), st.sampled_from([b"", b"{", b"[" * 5000, b'{"model": "\xff"}', b"null", b"1e999"])))
    if kind == "arbitrary":
        body = draw(JSON)
    else:
        body = {**TEMPLATES.get(path, {}), **draw(st.dictionaries(FIELD_NAMES, JSON, max_size=2))}
    # ensure_ascii (the default) writes a lone surrogate as its escape "\ud800": valid JSON.
    return json.dumps(_cap_tokens(body)).encode()


@st.composite
def batch_file(draw: st.DrawFn) -> bytes:
    lines = []
    for index in range(draw(st.integers(0, 3))):
        body = _cap_tokens({**TEMPLATES["/v1/chat/completions"], **draw(st.dictionaries(FIELD_NAMES, JSON, max_size=2))})
        line: Any = {"custom_id": f"r{index}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        line.update(draw(st.dictionaries(st.sampled_from(["custom_id", "method", "url", "body", "extra"]), JSON, max_size=1)))
        lines.append(json.dumps(line).encode())
    junk = draw(st.sampled_from([b"", b"not json", b"\xff\xfe", b"[" * 3000]))
    return b"\n".join(lines + [junk])


def _multipart(purpose: str | None, filename: bytes, content: bytes) -> tuple[bytes, str]:
    boundary = "sluice-fuzz-boundary"
    parts = []
    if purpose is not None:
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'.encode() + purpose.encode("utf-8", "surrogatepass") + b"\r\n"
        )
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="'.encode()
        + filename
        + b'"\r\nContent-Type: application/jsonl\r\n\r\n'
        + content
        + b"\r\n"
    )
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


# ---- the HTTP front


def http_routes(stack: Stack) -> list[tuple[str, str]]:
    """(method, path) of every route of the gateway's aiohttp app, from its router (built in the
    gateway's own environment, with placeholder handlers)."""
    script = (
        "import json\n"
        "from sluice_gateway.openai_front.http import build_app\n"
        "class Handlers:\n"
        "    def __getattr__(self, name):\n"
        "        async def handler(request): ...\n"
        "        return handler\n"
        "app = build_app(Handlers(), 1024, Handlers())\n"
        "print(json.dumps(sorted({(r.method, r.resource.canonical) for r in app.router.routes()})))\n"
    )
    python = stack.service("gateway").python
    out = subprocess.run([str(python), "-c", script], capture_output=True, text=True, check=True, timeout=60).stdout
    return [tuple(route) for route in json.loads(out)]  # type: ignore[misc]


PATH_VALUES = st.one_of(st.text(min_size=1, max_size=12), st.sampled_from([MODEL, "file-x", "batch_x", "..", "%ff", "\x00"]))
HEADER_BYTES = st.binary(max_size=12).filter(lambda b: not set(b) & {0, 10, 13})


@st.composite
def http_request(draw: st.DrawFn, method: str, template: str) -> tuple[str, bytes, dict[str, bytes]]:
    path = template
    while "{" in path:
        start, end = path.index("{"), path.index("}")
        path = path[:start] + urllib.parse.quote(draw(PATH_VALUES).encode("utf-8", "surrogatepass"), safe="") + path[end + 1 :]
    query = draw(st.dictionaries(st.sampled_from(["limit", "after", "purpose", "x"]), st.one_of(TEXT, st.integers().map(str)), max_size=2))
    if query:
        path += "?" + urllib.parse.urlencode({k: v.encode("utf-8", "surrogatepass") for k, v in query.items()})
    headers = {"Authorization": draw(st.sampled_from([f"Bearer {DEMO_KEY}".encode()] * 4 + [b"", b"Bearer nope", b"Bearer \xff\xfe"]))}
    if draw(st.booleans()):
        headers[draw(st.sampled_from(["X-Client-Request-Id", "X-Request-Id"]))] = draw(HEADER_BYTES)
    body = b""
    if method == "POST" and template == "/v1/files":
        purpose = draw(st.one_of(st.none(), st.just("batch"), TEXT))
        body, content_type = _multipart(purpose, draw(st.one_of(st.just(b"in.jsonl"), HEADER_BYTES)), draw(batch_file()))
        if draw(st.integers(0, 4)) == 0:
            body = draw(st.one_of(st.binary(max_size=60), st.just(body[: len(body) // 2])))  # no multipart, or cut short
        headers["Content-Type"] = draw(st.sampled_from([content_type.encode()] * 4 + [b"application/json", b"multipart/form-data"]))
    elif method == "POST":
        body = draw(json_body(template))
        headers["Content-Type"] = b"application/json"
    return path, body, headers


def send(port: int, method: str, path: str, body: bytes, headers: dict[str, bytes]) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=CALL_TIMEOUT_S)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers.items():
            if value:
                connection.putheader(name, value)
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()


def test_every_http_route_answers_arbitrary_input_without_a_5xx(stack: Stack) -> None:
    routes = http_routes(stack)
    paths = {path for _, path in routes}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/v1/files", "/v1/batches"} <= paths, paths
    port = stack.service("gateway").ports["http"]  # bound by the gateway itself (port 0)
    for method, template in routes:  # each route its own examples: none left out by chance

        @HTTP_PROPERTY
        @given(request=http_request(method, template))
        def answers_without_a_5xx(request: tuple[str, bytes, dict[str, bytes]]) -> None:
            path, body, headers = request
            status, reply = send(port, method, path, body, headers)
            assert status < 500, (method, path, body[:300], headers, status, reply[:500])
            if status >= 400 and reply.startswith(b"{"):
                # The front's errors are OpenAI's shape; aiohttp's parser refuses what never reaches
                # it (a control character in a header) with a plain-text 400.
                error = json.loads(reply)["error"]
                assert isinstance(error["message"], str) and error["message"], reply

        answers_without_a_5xx()
    # The surrogate case of the issue, whatever the examples held.
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 1}).encode()
    status, reply = send(
        port, "POST", "/v1/chat/completions", body, {"Authorization": f"Bearer {DEMO_KEY}".encode(), "Content-Type": b"application/json"}
    )
    assert status == 400 and json.loads(reply)["error"]["param"] == "messages[0].content", reply
    _assert_still_serving(stack)


# ---- the gRPC services


def _classes() -> Callable[[Descriptor], type]:
    cache: dict[str, type] = {}

    def class_of(descriptor: Descriptor) -> type:
        if descriptor.full_name not in cache:
            cache[descriptor.full_name] = message_factory.GetMessageClass(descriptor)
        return cache[descriptor.full_name]

    return class_of


message_class = _classes()
_INTS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
WIRE_TEXT = st.one_of(*[st.text(max_size=12), st.sampled_from(KNOWN_STRINGS)] * 2, st.just(WIRE_MARK.decode()))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_STRING:
        return WIRE_TEXT
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=12)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.integers(-3, 8)  # proto3 enums are open: unknown values arrive as they are
    low, high = _INTS[field.type]
    return st.one_of(st.integers(-3, 8).filter(lambda v: low <= v <= high), st.integers(low, high), st.sampled_from([low, high]))


@st.composite
def message(draw: st.DrawFn, descriptor: Descriptor, depth: int = 0, sparse: bool = False) -> Any:
    """A message with arbitrary values in some of its fields (a few of them when `sparse`)."""
    value = message_class(descriptor)()
    for field in descriptor.fields:
        if draw(st.integers(0, 3)) != 0 if sparse else not draw(st.booleans()):
            continue
        target = getattr(value, field.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth >= 3:
                continue
            if field.message_type.GetOptions().map_entry:
                key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
                for key, item in draw(st.dictionaries(_scalar(key_field), _field_value(value_field, depth), max_size=2)).items():
                    if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                        target[key].CopyFrom(item)
                    else:
                        target[key] = item
            elif field.is_repeated:
                for item in draw(st.lists(message(field.message_type, depth + 1), max_size=3)):
                    target.add().CopyFrom(item)
            else:
                target.CopyFrom(draw(message(field.message_type, depth + 1)))
        elif field.is_repeated:
            target.extend(draw(st.lists(_scalar(field), max_size=3)))
        else:
            setattr(value, field.name, draw(_scalar(field)))
    return value


def _field_value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    return message(field.message_type, depth + 1) if field.type == FieldDescriptor.TYPE_MESSAGE else _scalar(field)


def cap_generation(value: Any) -> None:
    """Every generation in `value` (a request, a job's rows) asks for at most MAX_TOKENS, or for a
    count the gateway refuses; 0 would take the model's default, hundreds of tokens."""
    for field in value.DESCRIPTOR.fields:
        if field.message_type is types_pb2.SamplingParams.DESCRIPTOR and not field.is_repeated:
            sampling = getattr(value, field.name)
            if 0 <= sampling.max_tokens and not 1 <= sampling.max_tokens <= MAX_TOKENS and sampling.max_tokens < 10**6:
                sampling.max_tokens = MAX_TOKENS
    for field, inner in value.ListFields():
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        if field.message_type.GetOptions().map_entry:
            items = inner.values() if field.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE else []
        else:
            items = inner if field.is_repeated else [inner]
        for item in items:
            cap_generation(item)


SERVICES = [
    ("gateway", gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"]),
    ("evaluation-logging", evallog_pb2.DESCRIPTOR.services_by_name["EvalLogService"]),
]
METHODS: list[tuple[str, MethodDescriptor]] = [(service, method) for service, descriptor in SERVICES for method in descriptor.methods]
AUTHORIZATION = st.sampled_from([f"Bearer {DEMO_KEY}"] * 4 + [None, "Bearer nope", "nope"])


def _grpc_templates() -> dict[str, Any]:
    """Valid requests, mutated by a few drawn fields to reach past the first check."""
    sampling = types_pb2.SamplingParams(max_tokens=MAX_TOKENS)
    chat = [types_pb2.ChatMessage(role="user", content="Hi")]
    row = jobs_pb2.JobRow(custom_id="r", generate=jobs_pb2.GenerateRow(model=MODEL, messages=chat, sampling=sampling))
    return {
        "sluice.gateway.v1.GatewayService.Generate": gateway_pb2.GenerateRequest(model=MODEL, messages=chat, sampling=sampling),
        "sluice.gateway.v1.GatewayService.Embed": gateway_pb2.EmbedRequest(model=EMBEDDING_MODEL, inputs=["a"]),
        # One job id: a valid submission is the same small job again (one row of MAX_TOKENS).
        "sluice.gateway.v1.GatewayService.SubmitJob": gateway_pb2.SubmitJobRequest(
            job=jobs_pb2.JobRequest(job_id="fuzz-job", api_key=DEMO_KEY, rows=[row])
        ),
        "sluice.gateway.v1.GatewayService.GetJob": gateway_pb2.GetJobRequest(job_id="fuzz-job"),
        "sluice.gateway.v1.GatewayService.ListJobResults": gateway_pb2.ListJobResultsRequest(job_id="fuzz-job"),
    }


GRPC_TEMPLATES = _grpc_templates()


@st.composite
def grpc_payload(draw: st.DrawFn, method: MethodDescriptor) -> tuple[bytes, str | None]:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        payload = draw(st.binary(max_size=40))  # not a message at all
    else:
        template = GRPC_TEMPLATES.get(method.full_name)
        if kind >= 5 and template is not None:
            request = type(template)()
            request.CopyFrom(template)
            request.MergeFrom(draw(message(method.input_type, sparse=True)))
        else:
            request = draw(message(method.input_type))
        cap_generation(request)
        payload = request.SerializeToString().replace(WIRE_MARK, WIRE_BAD)
    return payload, draw(AUTHORIZATION)


@pytest.fixture(scope="module")
def channels(stack: Stack) -> Iterator[dict[str, grpc.Channel]]:
    opened = {"gateway": grpc.insecure_channel(stack.gateway_address), "evaluation-logging": grpc.insecure_channel(stack.evallog_address)}
    yield opened
    for channel in opened.values():
        channel.close()


def call(channel: grpc.Channel, method: MethodDescriptor, payload: bytes, authorization: str | None) -> grpc.StatusCode:
    """The call's status, the request and the answers as raw bytes (no client-side parsing)."""
    name = f"/{method.containing_service.full_name}/{method.name}"
    metadata = (("authorization", authorization),) if authorization is not None else ()
    try:
        if method.server_streaming:
            for _ in channel.unary_stream(name)(payload, metadata=metadata, timeout=CALL_TIMEOUT_S):
                pass
        else:
            channel.unary_unary(name)(payload, metadata=metadata, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return, attr-defined]
    return grpc.StatusCode.OK


def test_every_public_grpc_method_answers_arbitrary_input_without_internal(stack: Stack, channels: dict[str, grpc.Channel]) -> None:
    for service, method in METHODS:  # each method its own examples: none left out by chance

        @GRPC_PROPERTY
        @given(request=grpc_payload(method))
        def answers_without_internal(request: tuple[bytes, str | None]) -> None:
            payload, authorization = request
            code = call(channels[service], method, payload, authorization)
            assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (method.full_name, payload, authorization, code)

        answers_without_internal()
    # The surrogate case, on each front that takes text.
    chat = gateway_pb2.GenerateRequest(model=MODEL, messages=[types_pb2.ChatMessage(role="user", content=WIRE_MARK.decode())])
    chat.sampling.max_tokens = 1
    code = call(channels["gateway"], gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].methods_by_name["Generate"],
                chat.SerializeToString().replace(WIRE_MARK, WIRE_BAD), f"Bearer {DEMO_KEY}")  # fmt: skip
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    _assert_still_serving(stack)


def _assert_still_serving(stack: Stack) -> None:
    for name, address in (("gateway", stack.gateway_address), ("evaluation-logging", stack.evallog_address)):
        assert stack.service(name).process is not None and stack.service(name).process.poll() is None, f"{name} exited"
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
    status, reply = send(stack.service("gateway").ports["http"], "GET", "/v1/models", b"", {"Authorization": f"Bearer {DEMO_KEY}".encode()})
    assert status == 200 and MODEL in reply.decode(), reply
