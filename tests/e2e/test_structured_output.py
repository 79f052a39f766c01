"""Issue 25 item 3 on the real stack: structured output by constrained decoding, from every front.

The official openai SDK's `parse` with a Pydantic model gets a parsed object; LangChain's ChatOpenAI
`with_structured_output` too; response_format json_object is enforced (decoded under it, not only
scored); gRPC clients get a regex, a choice list and a grammar; a job row carries a constraint; a
schema the library cannot compile is a 400 / INVALID_ARGUMENT naming the keyword, before anything is
generated. SmolLM2-135M is far too small to answer these well: the constraint is what makes every
output valid, which is the point."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import grpc
import openai
import pytest
from google.protobuf import json_format
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.jobs.v1 import jobs_pb2

from conftest import DEMO_KEY, MODEL, auth
from sluice_stack import Stack
from test_jobs import all_results, wait_job


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0, le=50_000_000)


QUESTION = "Describe Paris as JSON with its name, its country and its population."


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.openai_base_url, api_key=DEMO_KEY, max_retries=0, timeout=120)


def test_the_openai_sdks_parse_returns_a_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], response_format=City, max_tokens=80, temperature=0.7, seed=3,
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    city = choice.message.parsed
    assert isinstance(city, City) and 0 <= city.population <= 50_000_000, choice.message.content
    assert City.model_validate_json(choice.message.content or "") == city


def test_a_streamed_json_schema_answer_validates_whole(client: openai.OpenAI) -> None:
    schema = City.model_json_schema()
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=80, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
    )  # fmt: skip
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    City.model_validate_json(text)


def test_langchains_chat_openai_with_structured_output(stack: Stack) -> None:
    llm = ChatOpenAI(model=MODEL, base_url=stack.openai_base_url, api_key=DEMO_KEY, max_retries=0, timeout=120, max_tokens=80, temperature=0)
    city = llm.with_structured_output(City, method="json_schema").invoke(QUESTION)
    assert isinstance(city, City)


def test_json_object_is_enforced_for_every_choice(client: openai.OpenAI) -> None:
    """Before, {"type": "json_object"} was accepted and only scored afterwards: now every sampled
    choice decodes under it (at temperature 1.0 a 135M model left alone writes prose)."""
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about rivers."}], max_tokens=60, temperature=1.0, seed=11, n=3,
        response_format={"type": "json_object"},
    )  # fmt: skip
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content or ""), dict), choice.message.content
        else:  # cut by max_tokens: still the beginning of an object
            assert (choice.message.content or "").startswith("{"), choice.message.content


def test_vllms_structured_outputs_extension_on_the_http_front(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky green?"}], max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert reply.choices[0].message.content in ("yes", "no")


def test_a_schema_the_library_cannot_compile_is_a_400_naming_the_keyword(client: openai.OpenAI) -> None:
    bad = {"type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]}, "then": {"required": ["b"]}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=stream,
                response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}},
            )  # fmt: skip
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == "response_format" and "if" in error["message"], error


def _grpc_generate(gateway: Any, constraint: types_pb2.StructuredOutputs, question: str, max_tokens: int = 24) -> list[Any]:
    request = gateway_pb2.GenerateRequest(
        model=MODEL, messages=[types_pb2.ChatMessage(role="user", content=question)],
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=5, structured_outputs=constraint),
    )  # fmt: skip
    return list(gateway.Generate(request, metadata=auth(), timeout=120))


def test_grpc_regex_choice_and_grammar(gateway: Any) -> None:
    responses = _grpc_generate(gateway, types_pb2.StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}"), "Make up a phone number.")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", "".join(r.text for r in responses))
    assert responses[-1].finish_reason == types_pb2.FINISH_REASON_STOP
    options = ["north", "south", "east", "west"]
    responses = _grpc_generate(gateway, types_pb2.StructuredOutputs(choice=types_pb2.ChoiceList(options=options)), "Which way?")
    assert "".join(r.text for r in responses) in options
    grammar = 'start: "(" pair ")"\npair: NUMBER "," NUMBER\nNUMBER: /[0-9]{1,3}/'
    responses = _grpc_generate(gateway, types_pb2.StructuredOutputs(grammar=grammar), "Give me a point.")
    assert re.fullmatch(r"\([0-9]{1,3},[0-9]{1,3}\)", "".join(r.text for r in responses))


def test_grpc_refuses_an_uncompilable_constraint_naming_the_field(gateway: Any) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        _grpc_generate(gateway, types_pb2.StructuredOutputs(grammar='start: "a" | missing_rule'), "hi")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs" in caught.value.details() and "missing_rule" in caught.value.details()
    # A token the model's vocabulary lacks: only the engine can tell, and it is still the client's error
    # (it came back UNAVAILABLE, which clients and job rows retry).
    with pytest.raises(grpc.RpcError) as caught:
        _grpc_generate(gateway, types_pb2.StructuredOutputs(grammar="start: <|no_such_token|>"), "hi")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs" in caught.value.details() and "no_such_token" in caught.value.details()


def test_a_job_row_is_decoded_under_its_constraint(gateway: Any) -> None:
    job_id = f"structured-{uuid.uuid4().hex[:6]}"
    schema = json.dumps(City.model_json_schema())
    job = json_format.ParseDict(
        {
            "job_id": job_id,
            "rows": [
                {"custom_id": "city", "generate": {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
                                                   "sampling": {"max_tokens": 80, "structured_outputs": {"json": schema}}}},
                {"custom_id": "object", "generate": {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}],
                                                     "sampling": {"max_tokens": 40}, "response_format": "RESPONSE_FORMAT_JSON_OBJECT"}},
            ],
        },
        jobs_pb2.JobRequest(),
    )  # fmt: skip
    gateway.SubmitJob(gateway_pb2.SubmitJobRequest(job=job), metadata=auth(), timeout=10)
    assert wait_job(gateway, job_id).state == jobs_pb2.JOB_STATE_COMPLETED
    results = {r.custom_id: r for r in all_results(gateway, job_id)}
    City.model_validate_json(results["city"].output)
    assert results["object"].output.startswith("{"), results["object"].output
