"""Issue 25 item 4 on the real stack: tool calls through the official openai SDK (a two-turn
conversation, streamed and not), LangChain's bind_tools, the gRPC API's typed ToolUse and a job row.
SmolLM2-135M is far too small to choose tools well: tool_choice required or a named function is what
makes its answer a valid call, which is what these check; auto leaves it free to answer in text."""

from __future__ import annotations

import json
import uuid
from typing import Any

import jsonschema
import openai
import pytest
from google.protobuf import json_format
from langchain_openai import ChatOpenAI
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.jobs.v1 import jobs_pb2

from conftest import DEMO_KEY, MODEL, auth
from sluice_stack import Stack
from test_jobs import all_results, wait_job

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}},
]  # fmt: skip
QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.openai_base_url, api_key=DEMO_KEY, max_retries=0, timeout=120)


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_two_turn_tool_conversation(client: openai.OpenAI, stream: bool) -> None:
    """Call, tool result, answer: the SDK's own types round-trip through Sluice."""
    if stream:
        with client.chat.completions.stream(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=_named("get_weather"), max_tokens=40) as events:  # type: ignore[arg-type]
            first = events.get_final_completion()
    else:
        first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=_named("get_weather"), max_tokens=40)  # type: ignore[arg-type]
    choice = first.choices[0]
    # A function named in tool_choice ends "stop", its call in tool_calls: OpenAI's and vLLM's answer
    # ("tool_calls" is for the auto and required choices).
    assert choice.finish_reason == "stop", choice
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)  # type: ignore[union-attr]
    history = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "-3 degrees and snowing"},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=24)  # type: ignore[arg-type]
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
    assert not answer.choices[0].message.tool_calls
    # The call and its result were shown to the model (tool_choice none hides the tool list only).
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert answer.usage is not None and plain.usage is not None and answer.usage.prompt_tokens > plain.usage.prompt_tokens + 20


def test_tool_choice_required_calls_given_tools_with_valid_arguments(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=1.0, seed=4,  # type: ignore[arg-type]
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls or []  # parallel_tool_calls false: one call
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])  # type: ignore[union-attr,index]


def test_an_unknown_tool_in_tool_choice_is_a_400_naming_tool_choice(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=_named("get_wether"), max_tokens=8)  # type: ignore[arg-type]
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "tool_choice" and "get_wether" in error["message"], error


def test_langchains_bind_tools(stack: Stack) -> None:
    llm = ChatOpenAI(model=MODEL, base_url=stack.openai_base_url, api_key=DEMO_KEY, max_retries=0, timeout=120, max_tokens=40)
    message = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("What is the weather in Oslo?")
    [call] = message.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER_PARAMETERS)


def _tool_use(mode: int, function: str = "") -> types_pb2.ToolUse:
    return types_pb2.ToolUse(
        tools=[types_pb2.Tool(name=t["function"]["name"], description=t["function"]["description"], parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS],  # type: ignore[index]
        choice=types_pb2.ToolChoice(mode=mode, function=function),
    )  # fmt: skip


def test_grpc_tool_use_is_typed_end_to_end(gateway: Any) -> None:
    request = gateway_pb2.GenerateRequest(
        model=MODEL, messages=[types_pb2.ChatMessage(role="user", content="What is the weather in Oslo?")],
        sampling=types_pb2.SamplingParams(max_tokens=40), tool_use=_tool_use(types_pb2.TOOL_CHOICE_MODE_FUNCTION, "get_weather"),
    )  # fmt: skip
    responses = list(gateway.Generate(request, metadata=auth(), timeout=120))
    assert "".join(r.text for r in responses) == ""  # the call is not text
    last = responses[-1]
    assert last.finish_reason == types_pb2.FINISH_REASON_TOOL_CALLS
    [call] = last.tool_calls
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    # The second turn, typed: the assistant's call and the tool's result.
    request.messages.append(types_pb2.ChatMessage(role="assistant", tool_calls=[call]))
    request.messages.append(types_pb2.ChatMessage(role="tool", tool_call_id=call.id, content="-3 degrees"))
    request.tool_use.choice.mode = types_pb2.TOOL_CHOICE_MODE_NONE
    responses = list(gateway.Generate(request, metadata=auth(), timeout=120))
    assert "".join(r.text for r in responses) and responses[-1].finish_reason in (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH)


def test_a_job_row_returns_its_tool_calls(gateway: Any) -> None:
    job_id = f"tools-{uuid.uuid4().hex[:6]}"
    job = jobs_pb2.JobRequest(job_id=job_id)
    row = job.rows.add(custom_id="weather")
    row.generate.CopyFrom(jobs_pb2.GenerateRow(
        model=MODEL, messages=[types_pb2.ChatMessage(role="user", content="What is the weather in Rome?")],
        sampling=types_pb2.SamplingParams(max_tokens=40), tool_use=_tool_use(types_pb2.TOOL_CHOICE_MODE_REQUIRED),
    ))  # fmt: skip
    gateway.SubmitJob(gateway_pb2.SubmitJobRequest(job=job), metadata=auth(), timeout=10)
    assert wait_job(gateway, job_id).state == jobs_pb2.JOB_STATE_COMPLETED
    [result] = all_results(gateway, job_id)
    assert result.finish_reason == types_pb2.FINISH_REASON_TOOL_CALLS, json_format.MessageToDict(result)
    assert result.tool_calls and all(c.name in ("get_weather", "get_time") for c in result.tool_calls)
