"""Tool calls as domain code: the plan and its checks, the rendering the model is shown, the
constraint per tool_choice, and the parser that turns what the model wrote into calls."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sluice.common.v1 import types_pb2

from sluice_common.errors import InvalidArgument
from sluice_common.sampling import StructuredOutputs
from sluice_common.structured_outputs import check
from sluice_gateway.path.tool_calls import CLOSE, OPEN, plan, render

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
Mode = types_pb2.ToolChoiceMode


def tool_use(mode: int = Mode.TOOL_CHOICE_MODE_AUTO, function: str = "", parallel: bool | None = None) -> types_pb2.ToolUse:
    use = types_pb2.ToolUse(
        tools=[types_pb2.Tool(name="get_weather", description="Weather now", parameters=json.dumps(WEATHER)), types_pb2.Tool(name="get_time")],
        choice=types_pb2.ToolChoice(mode=mode, function=function),
    )  # fmt: skip
    if parallel is not None:
        use.parallel_tool_calls = parallel
    return use


def test_a_named_function_constrains_to_its_parameters_and_required_to_an_array_of_calls() -> None:
    named = plan(tool_use(Mode.TOOL_CHOICE_MODE_FUNCTION, "get_weather"), types_pb2.SamplingParams())
    assert named is not None and named.constraint() == StructuredOutputs.json_schema(WEATHER)
    required = plan(tool_use(Mode.TOOL_CHOICE_MODE_REQUIRED, parallel=False), types_pb2.SamplingParams())
    assert required is not None
    constraint = required.constraint()
    assert constraint is not None
    check(constraint)
    schema = constraint.schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    auto = plan(tool_use(), types_pb2.SamplingParams())
    assert auto is not None and auto.constraint() is None and auto.shown
    hidden = plan(tool_use(Mode.TOOL_CHOICE_MODE_NONE), types_pb2.SamplingParams())
    assert hidden is not None and not hidden.shown


@pytest.mark.parametrize(
    ("use", "field", "named"),
    [
        (tool_use(Mode.TOOL_CHOICE_MODE_FUNCTION, "get_wether"), "tool_use.choice.function", "get_wether"),
        (types_pb2.ToolUse(choice=types_pb2.ToolChoice(mode=Mode.TOOL_CHOICE_MODE_REQUIRED)), "tool_use.choice", "no tools"),
        (types_pb2.ToolUse(tools=[types_pb2.Tool(name="bad name")]), "tool_use.tools[0].name", "bad name"),
        (types_pb2.ToolUse(tools=[types_pb2.Tool(name="a"), types_pb2.Tool(name="a")]), "tool_use.tools[1].name", "twice"),
        (types_pb2.ToolUse(tools=[types_pb2.Tool(name="a", parameters='{"type": "object", "if": {}}')]), "tool_use.tools[0].parameters", "if"),
        (types_pb2.ToolUse(tools=[types_pb2.Tool(name="a", parameters="[1]")]), "tool_use.tools[0].parameters", "JSON object"),
        (types_pb2.ToolUse(tools=[types_pb2.Tool(name="a", parameters="[" * 5000)]), "tool_use.tools[0].parameters", "nested too deeply"),
    ],
)
def test_a_bad_tool_or_choice_is_invalid_naming_the_field(use: types_pb2.ToolUse, field: str, named: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        plan(use, types_pb2.SamplingParams())
    assert caught.value.field_name == field and named in caught.value.reason


def test_a_constrained_tool_choice_and_structured_outputs_are_refused_together() -> None:
    sampling = types_pb2.SamplingParams(structured_outputs=types_pb2.StructuredOutputs(json_object=True))
    with pytest.raises(InvalidArgument) as caught:
        plan(tool_use(Mode.TOOL_CHOICE_MODE_REQUIRED), sampling)
    assert caught.value.field_name == "sampling.structured_outputs"
    assert plan(tool_use(), sampling) is not None  # auto: the text may still be constrained


def test_the_rendering_shows_the_tools_the_calls_and_the_results_in_hermes_form() -> None:
    history = [
        types_pb2.ChatMessage(role="user", content="Weather in Oslo and Rome?"),
        types_pb2.ChatMessage(
            role="assistant",
            tool_calls=[
                types_pb2.ToolCall(id="c1", name="get_weather", arguments='{"city": "Oslo"}'),
                types_pb2.ToolCall(id="c2", name="get_weather", arguments='{"city": "Rome"}'),
            ],
        ),  # fmt: skip
        types_pb2.ChatMessage(role="tool", tool_call_id="c1", content="-3 C"),
        types_pb2.ChatMessage(role="tool", tool_call_id="c2", content="18 C"),
    ]
    rendered = render(history, plan(tool_use(), types_pb2.SamplingParams()))
    assert [m.role for m in rendered] == ["system", "user", "assistant", "user"]
    assert "<tools>" in rendered[0].content and '"name": "get_weather"' in rendered[0].content and "<tool_call>" in rendered[0].content
    assert (
        rendered[2].content
        == f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}\n{CLOSE}\n{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Rome"}}}}\n{CLOSE}'
    )
    assert rendered[3].content == "<tool_response>\n-3 C\n</tool_response>\n<tool_response>\n18 C\n</tool_response>"
    # A system prompt of the client's own comes first, the tools after it; tool_choice none hides them.
    with_system = render([types_pb2.ChatMessage(role="system", content="Be brief."), history[0]], plan(tool_use(), types_pb2.SamplingParams()))
    assert with_system[0].content.startswith("Be brief.\n\n# Tools")
    hidden = render(history[:1], plan(tool_use(Mode.TOOL_CHOICE_MODE_NONE), types_pb2.SamplingParams()))
    assert [m.role for m in hidden] == ["user"]


def _run(
    mode: int, pieces: list[str], finish: int = types_pb2.FINISH_REASON_STOP, function: str = ""
) -> tuple[str, str, int, list[types_pb2.ToolCall]]:
    tool_plan = plan(tool_use(mode, function), types_pb2.SamplingParams())
    assert tool_plan is not None
    parser = tool_plan.parser()
    shown = "".join(parser.feed(piece) for piece in pieces)
    rest, reason = parser.finish(finish)
    return shown, rest, reason, parser.calls


def test_auto_streams_text_and_holds_a_call_from_its_first_character() -> None:
    pieces = ["Let me check. ", "<tool", '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}\n</tool_call>']
    shown, rest, reason, calls = _run(Mode.TOOL_CHOICE_MODE_AUTO, pieces)
    assert shown == "Let me check. " and rest == "" and reason == types_pb2.FINISH_REASON_TOOL_CALLS
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert calls[0].id.startswith("call_")


def test_auto_text_that_only_looks_like_a_call_is_text() -> None:
    shown, rest, reason, calls = _run(Mode.TOOL_CHOICE_MODE_AUTO, ["a <tool", "box> b"])
    assert shown + rest == "a <toolbox> b" and reason == types_pb2.FINISH_REASON_STOP and not calls
    shown, rest, reason, calls = _run(Mode.TOOL_CHOICE_MODE_AUTO, ['<tool_call>{"name": "unknown_tool"}</tool_call>'])
    assert rest == '<tool_call>{"name": "unknown_tool"}</tool_call>' and reason == types_pb2.FINISH_REASON_STOP and not calls


@pytest.mark.parametrize("body", ['{"name": ["get_weather"]}', '{"name": {"a": 1}}', '{"name": 7}', "[" * 5000, "1" * 5000])
def test_a_call_naming_no_tool_by_a_string_or_too_deep_to_read_is_text(body: str) -> None:
    """These raised inside the stream after its lease was settled: the client got INTERNAL and no
    final chunk while the event said the stream had stopped normally."""
    text = f"<tool_call>{body}</tool_call>"
    shown, rest, reason, calls = _run(Mode.TOOL_CHOICE_MODE_AUTO, [text])
    assert shown + rest == text and reason == types_pb2.FINISH_REASON_STOP and not calls
    shown, rest, reason, calls = _run(Mode.TOOL_CHOICE_MODE_REQUIRED, [f'[{{"name": {body}, "parameters": {{}}}}]'])
    assert reason != types_pb2.FINISH_REASON_TOOL_CALLS and not calls


def test_constrained_modes_hold_everything_and_parse_the_calls() -> None:
    shown, rest, reason, calls = _run(Mode.TOOL_CHOICE_MODE_FUNCTION, ['{"city": ', '"Rome"}'], function="get_weather")
    assert (shown, rest, reason) == ("", "", types_pb2.FINISH_REASON_TOOL_CALLS)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Rome"}')]
    required = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    shown, rest, reason, calls = _run(Mode.TOOL_CHOICE_MODE_REQUIRED, [required[:10], required[10:]])
    assert (shown, rest, reason) == ("", "", types_pb2.FINISH_REASON_TOOL_CALLS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    assert len({c.id for c in calls}) == 2


def test_a_call_cut_by_max_tokens_is_returned_as_text_with_length() -> None:
    shown, rest, reason, calls = _run(Mode.TOOL_CHOICE_MODE_FUNCTION, ['{"city": "Ro'], types_pb2.FINISH_REASON_LENGTH, function="get_weather")
    assert (shown, rest, reason, calls) == ("", '{"city": "Ro', types_pb2.FINISH_REASON_LENGTH, [])


def test_a_required_call_list_a_stop_string_cut_short_is_returned_as_text() -> None:
    # The engine applies stop strings whatever the grammar: the list then ends early, as the
    # engine's own STOP. It was parsed as JSON all the same, and the stream broke off mid-way.
    cut = '[{"name": "get_weather", "parameters": {"city": "Os'
    shown, rest, reason, calls = _run(Mode.TOOL_CHOICE_MODE_REQUIRED, [cut])
    assert (shown, rest, reason, calls) == ("", cut, types_pb2.FINISH_REASON_STOP, [])
    shown, rest, reason, calls = _run(Mode.TOOL_CHOICE_MODE_REQUIRED, ['[{"name": "get_weather"}]'])
    assert (rest, reason, calls) == ('[{"name": "get_weather"}]', types_pb2.FINISH_REASON_STOP, [])


def test_an_unknown_tool_choice_mode_is_refused_naming_it() -> None:
    use = tool_use()
    use.choice.mode = 9  # type: ignore[assignment]
    with pytest.raises(InvalidArgument) as caught:
        plan(use, types_pb2.SamplingParams())
    assert caught.value.field_name == "tool_use.choice.mode" and "9" in caught.value.reason


def test_auto_without_parallel_calls_keeps_the_first_call_only() -> None:
    two = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    for parallel, names in ((True, ["get_time", "get_weather"]), (False, ["get_time"])):
        tool_plan = plan(tool_use(parallel=parallel), types_pb2.SamplingParams())
        assert tool_plan is not None
        parser = tool_plan.parser()
        parser.feed(two)
        assert parser.finish(types_pb2.FINISH_REASON_STOP) == ("", types_pb2.FINISH_REASON_TOOL_CALLS)
        assert [c.name for c in parser.calls] == names


def test_none_streams_the_text_as_it_comes_and_parses_no_calls() -> None:
    """tool_choice none: the model is to call no tool. Its text was held to the end (a stream came
    in one last chunk) and a <tool_call> block in it was answered as a call."""
    pieces = ["Sure: ", '<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}\n</tool_call>']
    tool_plan = plan(tool_use(Mode.TOOL_CHOICE_MODE_NONE), types_pb2.SamplingParams())
    assert tool_plan is not None
    parser = tool_plan.parser()
    assert [parser.feed(piece) for piece in pieces] == pieces
    assert parser.finish(types_pb2.FINISH_REASON_STOP) == ("", types_pb2.FINISH_REASON_STOP) and parser.calls == []


@pytest.mark.parametrize(
    ("arguments", "parsed"),
    [
        ('{"city": "Oslo"}', {"city": "Oslo"}),  # an object: as it is
        ('"{\\"city\\": \\"Oslo\\"}"', {"city": "Oslo"}),  # a JSON string of an object: the object, not encoded twice
        ('["Oslo"]', None),
        ("null", None),
        ('"Oslo"', None),
        ('"[1]"', None),
        ("7", None),
    ],
)
def test_auto_takes_a_calls_arguments_only_as_a_json_object(arguments: str, parsed: dict[str, Any] | None) -> None:
    text = f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>'
    shown, rest, reason, calls = _run(Mode.TOOL_CHOICE_MODE_AUTO, [text])
    if parsed is None:  # not a call after all: the block is text
        assert (shown + rest, reason, calls) == (text, types_pb2.FINISH_REASON_STOP, [])
    else:
        assert reason == types_pb2.FINISH_REASON_TOOL_CALLS and [json.loads(c.arguments) for c in calls] == [parsed]


def _tools(count: int, parameters: str = "") -> types_pb2.ToolUse:
    return types_pb2.ToolUse(tools=[types_pb2.Tool(name=f"f{i}", parameters=parameters) for i in range(count)])


def _schema(chars: int) -> str:
    """A valid JSON Schema of about `chars` characters (its length in a description)."""
    return json.dumps({"type": "object", "description": "d" * chars})


@pytest.mark.parametrize(
    ("use", "field", "named"),
    [
        (_tools(129), "tool_use.tools", "at most 128 tools, got 129"),
        (_tools(1, _schema(70_000)), "tool_use.tools[0].parameters", "at most 65536 characters"),
        (_tools(4, _schema(20_000)), "tool_use.tools", "total 80"),
    ],
    ids=["count", "one_tool", "all_tools"],
)
def test_tools_too_many_or_too_large_to_compile_are_refused_before_any_is_compiled(monkeypatch, use, field, named) -> None:  # type: ignore[no-untyped-def]
    """10,000 tools took 1.8 s to compile on the event loop (each tool's schema compiled), before any
    bound: OpenAI takes at most 128, and their schemas are bounded as a constraint is."""

    def compile_(constraint: object) -> None:
        raise AssertionError("compiled before the tools' sizes were checked")

    monkeypatch.setattr("sluice_gateway.path.tool_calls.check", compile_)
    with pytest.raises(InvalidArgument) as caught:
        plan(use, types_pb2.SamplingParams())
    assert caught.value.field_name == field and named in caught.value.reason, caught.value.reason


def test_tools_at_their_bounds_are_planned() -> None:
    assert plan(_tools(128), types_pb2.SamplingParams()) is not None
    assert plan(_tools(1, _schema(60_000)), types_pb2.SamplingParams()) is not None


def test_required_tools_whose_one_constraint_outgrows_the_bound_are_refused_naming_the_tools() -> None:
    """Within the bound each and together, their calls wrapped into one constraint (tool_choice
    required) are larger: refused naming the tools, not a structured_outputs the client never set."""
    use = _tools(4, _schema(16_300))
    use.choice.mode = Mode.TOOL_CHOICE_MODE_REQUIRED
    with pytest.raises(InvalidArgument) as caught:
        plan(use, types_pb2.SamplingParams())
    assert caught.value.field_name == "tool_use.tools" and "tool_choice" in caught.value.reason


def test_a_tool_schema_with_an_integer_too_long_to_read_is_invalid_not_internal() -> None:
    """json.loads raises a plain ValueError (not JSONDecodeError) for an integer of more than 4,300
    digits: it escaped as an INTERNAL."""
    schema = '{"type": "object", "properties": {"a": {"type": "integer", "maximum": ' + "9" * 5000 + "}}}"
    with pytest.raises(InvalidArgument) as caught:
        plan(_tools(1, schema), types_pb2.SamplingParams())
    assert caught.value.field_name == "tool_use.tools[0].parameters" and "not valid JSON" in caught.value.reason


def test_a_long_name_is_quoted_in_part() -> None:
    for use, field in (
        (types_pb2.ToolUse(tools=[types_pb2.Tool(name="n" * 20_000)]), "tool_use.tools[0].name"),
        (types_pb2.ToolUse(tools=[types_pb2.Tool(name=f"f{i:03d}_" + "x" * 59) for i in range(128)],
                           choice=types_pb2.ToolChoice(mode=Mode.TOOL_CHOICE_MODE_FUNCTION, function="g" * 20_000)), "tool_use.choice.function"),
    ):  # fmt: skip
        with pytest.raises(InvalidArgument) as caught:
            plan(use, types_pb2.SamplingParams())
        assert caught.value.field_name == field and len(caught.value.message) < 500, len(caught.value.message)


def test_call_arguments_nested_to_the_recursion_limit_are_shown_as_sent() -> None:
    """Arguments that json.loads still reads were written back by json.dumps outside any guard, a
    few frames deeper: RecursionError out of render (an INTERNAL)."""
    import sys

    limit = sys.getrecursionlimit()
    for depth in range(limit - 80, limit + 5):
        arguments = "[" * depth + "]" * depth
        call = types_pb2.ToolCall(id="c", name="f", arguments=arguments)
        (rendered,) = render([types_pb2.ChatMessage(role="assistant", tool_calls=[call])], None)
        assert rendered.content.startswith(OPEN) and rendered.content.endswith(CLOSE)
