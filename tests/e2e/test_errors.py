"""Authentication and validation errors: the right status, the field and a reason a person can act on."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2

from conftest import MODEL, auth


def call_error(gateway, request: gateway_pb2.GenerateRequest, metadata=None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        list(gateway.Generate(request, metadata=auth() if metadata is None else metadata, timeout=30))
    return caught.value


def valid_request(**overrides: object) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content="Hello")],
        sampling=types_pb2.SamplingParams(max_tokens=4),
    )
    for name, value in overrides.items():
        if name == "sampling":
            request.sampling.CopyFrom(value)
        elif name == "messages":
            del request.messages[:]
            request.messages.extend(value)
        else:
            setattr(request, name, value)
    return request


def bad_request_field(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)
    assert status is not None, "no google.rpc.Status details on the error"
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            return bad_request.field_violations[0].field
    raise AssertionError("no BadRequest detail")


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ((), "missing `authorization: Bearer <api key>`"),
        ((("authorization", "Bearer sk-wrong"),), "invalid API key"),
        ((("authorization", "sk-sluice-demo"),), "must be `Bearer <api key>`"),
    ],
    ids=["missing", "wrong", "not-bearer"],
)
def test_api_key_problems_are_unauthenticated(gateway, metadata, message) -> None:
    error = call_error(gateway, valid_request(), metadata=metadata)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert message in error.details()


LONG_PROMPT = "Tell me about rivers. " * 600  # ~3600 tokens, above the 2048-token context

VALIDATION_CASES = [
    ("no-messages", dict(messages=[]), "messages", "no messages"),
    ("max-tokens-negative", dict(sampling=types_pb2.SamplingParams(max_tokens=-3)), "sampling.max_tokens", "must be > 0"),
    ("max-tokens-above-limit", dict(sampling=types_pb2.SamplingParams(max_tokens=5000)), "sampling.max_tokens", "above the limit"),
    ("unknown-model", dict(model="gpt-17"), "model", "unknown generation model 'gpt-17'"),
    ("embedding-model", dict(model="all-minilm-l6-v2"), "model", "unknown generation model 'all-minilm-l6-v2'"),
    (
        "prompt-too-long",
        dict(messages=[types_pb2.ChatMessage(role="user", content=LONG_PROMPT)]),
        "messages",
        "maximum context length is 2048 tokens",
    ),
    ("bad-role", dict(messages=[types_pb2.ChatMessage(role="robot", content="hi")]), "messages[0].role", "must be one of"),
    ("both-inputs", dict(prompt="raw"), "prompt", "give exactly one of messages, prompt or prompt_token_ids"),
    ("temperature", dict(sampling=types_pb2.SamplingParams(max_tokens=4, temperature=7)), "sampling.temperature", "[0, 2]"),
]


@pytest.mark.parametrize(("overrides", "field", "reason"), [c[1:] for c in VALIDATION_CASES], ids=[c[0] for c in VALIDATION_CASES])
def test_validation_errors_name_field_and_reason(gateway, overrides, field, reason) -> None:
    error = call_error(gateway, valid_request(**overrides))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in error.details()
    assert bad_request_field(error) == field
