"""Tool calls: the tools shown to the model, the constraint on its calls, and the calls parsed back.

A chat template with tool support would render tools its own way; SmolLM2's (and any template Sluice
renders itself) has none, so every model gets one documented rendering, Hermes' (the one Qwen2.5, and
vLLM's `hermes` tool parser, use):

- the tools, unless tool_choice is none, are appended to the first system message (one is added when
  the chat has none) as `<tools>` holding one `{"type": "function", "function": {...}}` per line, with
  the instruction to answer each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- an assistant turn that made calls is its content followed by those `<tool_call>` blocks;
- tool results (role "tool") become a user turn of `<tool_response>` blocks, consecutive ones merged.

What the model may write follows tool_choice, as vLLM does it: `auto` leaves decoding free and parses
the `<tool_call>` blocks out of the text; `required` constrains decoding to a JSON array of
`{"name", "parameters"}` objects of the given tools (nothing else in them) (one element without parallel_tool_calls); a named
function constrains it to that function's parameters, which are the call's arguments. `none` hides the
tools and leaves the text as text, streamed as it is made and never parsed into calls. Plain domain
code (no grpc): the InferencePath plans and parses, the fronts shape the calls.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.common.v1 import types_pb2

from sluice_common.errors import InvalidArgument
from sluice_common.sampling import StructuredOutputs, StructuredOutputsError
from sluice_common.errors import clip
from sluice_common.structured_outputs import check
from sluice_common.validation import MAX_CONSTRAINT_CHARS, MAX_TOOLS, ROLES

# A chat with tools may also hold the results of calls (role "tool").
ROLES_WITH_TOOLS = (*ROLES, "tool")

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)

Mode = types_pb2.ToolChoiceMode


@dataclass(frozen=True)
class ToolPlan:
    """How a request's tools are used: shown to the model or not, and the constraint on its calls."""

    mode: int
    tools: dict[str, dict[str, Any]]  # name -> the parameters' schema
    descriptions: dict[str, str]
    function: str = ""
    parallel: bool = True

    @property
    def shown(self) -> bool:
        return self.mode != Mode.TOOL_CHOICE_MODE_NONE and bool(self.tools)

    def constraint(self) -> StructuredOutputs | None:
        if self.mode == Mode.TOOL_CHOICE_MODE_FUNCTION:
            return StructuredOutputs.json_schema(self.tools[self.function])
        if self.mode != Mode.TOOL_CHOICE_MODE_REQUIRED:
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,  # a call ends after its two fields
            }
            for name, schema in self.tools.items()
        ]  # fmt: skip
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputs.json_schema(array)

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self)


def plan(tool_use: types_pb2.ToolUse, sampling: types_pb2.SamplingParams) -> ToolPlan | None:
    """The request's plan, None when it has no tools. Raises InvalidArgument naming the field."""
    if tool_use.choice.mode not in Mode.values():  # proto3 keeps an enum value it does not know
        raise InvalidArgument("tool_use.choice.mode", f"must be one of {', '.join(Mode.keys())}, got {tool_use.choice.mode}")
    mode = tool_use.choice.mode or Mode.TOOL_CHOICE_MODE_AUTO
    if not tool_use.tools:
        if mode in (Mode.TOOL_CHOICE_MODE_REQUIRED, Mode.TOOL_CHOICE_MODE_FUNCTION):
            raise InvalidArgument("tool_use.choice", "a tool must be called but no tools were given")
        return None
    _check_sizes(tool_use.tools)  # before any schema is compiled
    tools: dict[str, dict[str, Any]] = {}
    descriptions: dict[str, str] = {}
    for index, tool in enumerate(tool_use.tools):
        where = f"tool_use.tools[{index}]"
        if not _NAME.fullmatch(tool.name):
            raise InvalidArgument(f"{where}.name", f"must be 1 to 64 letters, digits, underscores or dashes, got {clip(tool.name)!r}")
        if tool.name in tools:
            raise InvalidArgument(f"{where}.name", f"{tool.name!r} is given twice")  # 1 to 64 characters, as checked
        tools[tool.name] = _parameters(tool.parameters, f"{where}.parameters")
        descriptions[tool.name] = tool.description
    if mode == Mode.TOOL_CHOICE_MODE_FUNCTION and tool_use.choice.function not in tools:
        named = clip(", ".join(tools), 256)  # up to 128 names of 64 characters: the first few
        raise InvalidArgument("tool_use.choice.function", f"no tool is named {clip(tool_use.choice.function)!r}; the tools are {named}")
    parallel = tool_use.parallel_tool_calls if tool_use.HasField("parallel_tool_calls") else True
    found = ToolPlan(mode, tools, descriptions, tool_use.choice.function, parallel)
    constraint = found.constraint()
    if constraint is not None and sampling.HasField("structured_outputs"):
        raise InvalidArgument(
            "sampling.structured_outputs",
            "a tool call's arguments are constrained already (tool_choice required or a named function): drop this constraint or use tool_choice auto",
        )
    if constraint is not None and len(constraint.value) > MAX_CONSTRAINT_CHARS:  # the calls' wrapping, \u escapes
        raise InvalidArgument(
            "tool_use.tools",
            f"the constraint tool_choice sets (required: every tool's call; a named function: its parameters) is"
            f" {len(constraint.value)} characters, at most {MAX_CONSTRAINT_CHARS}",
        )
    return found


def _check_sizes(tools: Sequence[types_pb2.Tool]) -> None:
    """The bounds on what tools ask to be compiled (sluice_common.validation), at the cost of a length each."""
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument("tool_use.tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    for index, tool in enumerate(tools):
        if len(tool.parameters) > MAX_CONSTRAINT_CHARS:
            raise InvalidArgument(f"tool_use.tools[{index}].parameters", f"at most {MAX_CONSTRAINT_CHARS} characters, got {len(tool.parameters)}")
    total = sum(len(tool.parameters) for tool in tools)
    if total > MAX_CONSTRAINT_CHARS:
        raise InvalidArgument("tool_use.tools", f"the tools' parameters total {total} characters, at most {MAX_CONSTRAINT_CHARS}")


def _parameters(text: str, field_name: str) -> dict[str, Any]:
    if not text:
        return dict(_NO_ARGUMENTS)
    try:
        constraint = StructuredOutputs.json_schema(text)
        check(constraint)
    except StructuredOutputsError as exc:
        raise InvalidArgument(field_name, str(exc)) from None
    return constraint.schema()


# -- what the model is shown ------------------------------------------------------


def check_chat(messages: Sequence[types_pb2.ChatMessage]) -> None:
    """The client's chat, checked before `render` rewrites it (a system turn inserted, tool results
    merged): an error then names the message the client sent, at its own index."""
    for index, message in enumerate(messages):
        if message.role not in ROLES_WITH_TOOLS:
            raise InvalidArgument(f"messages[{index}].role", f"must be one of {', '.join(ROLES_WITH_TOOLS)}, got {clip(message.role)!r}")
        if not message.content and not message.tool_calls and message.role != "tool":
            raise InvalidArgument(f"messages[{index}].content", "must not be empty")


def render(messages: Sequence[types_pb2.ChatMessage], tool_plan: ToolPlan | None) -> list[types_pb2.ChatMessage]:
    """The chat as system/user/assistant turns the engine's template takes (see the module's docstring)."""
    rendered: list[types_pb2.ChatMessage] = []
    for index, message in enumerate(messages):
        if message.role == "tool":
            block = f"<tool_response>\n{message.content}\n</tool_response>"
            previous = rendered[-1] if rendered else None
            if previous is not None and previous.content.startswith("<tool_response>") and messages[index - 1].role == "tool":
                previous.content += "\n" + block
            else:
                rendered.append(types_pb2.ChatMessage(role="user", content=block))
        elif message.tool_calls:
            calls = "\n".join(_call_text(call) for call in message.tool_calls)
            content = f"{message.content}\n{calls}" if message.content else calls
            rendered.append(types_pb2.ChatMessage(role=message.role, content=content))
        else:
            rendered.append(types_pb2.ChatMessage(role=message.role, content=message.content))
    if tool_plan is not None and tool_plan.shown:
        instructions = _instructions(tool_plan)
        if rendered and rendered[0].role == "system":
            rendered[0].content += "\n\n" + instructions
        else:
            rendered.insert(0, types_pb2.ChatMessage(role="system", content=instructions))
    return rendered


def _call_text(call: types_pb2.ToolCall) -> str:
    try:
        arguments: Any = json.loads(call.arguments or "{}")
        # Written back inside the call: arguments nested near the recursion limit parse, then fail here.
        text = json.dumps({"name": call.name, "arguments": arguments})
    except (ValueError, RecursionError):  # ValueError: JSONDecodeError, or an integer over 4,300 digits
        text = json.dumps({"name": call.name, "arguments": call.arguments})  # as the client sent it back: shown, not judged
    return f"{OPEN}\n{text}\n{CLOSE}"


def _instructions(tool_plan: ToolPlan) -> str:
    lines = [
        json.dumps({"type": "function", "function": {"name": name, "description": tool_plan.descriptions[name], "parameters": schema}})
        for name, schema in tool_plan.tools.items()
    ]  # fmt: skip
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(lines)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within"
        ' <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


# -- what the model wrote ---------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallParser:
    """One choice's text as it streams: what may be shown as text now, and at the end the calls.

    Constrained modes hold all text (it is the call). `auto` passes text through until a `<tool_call>`
    may be starting (a suffix that is a prefix of it is held back) and holds everything from there.
    `none` passes all text through as it comes and parses nothing: the model is to call no tool."""

    tool_plan: ToolPlan
    held: str = ""
    calls: list[types_pb2.ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> str:
        if self.tool_plan.mode == Mode.TOOL_CHOICE_MODE_NONE:
            return text  # no calls asked for: text as it is made
        if self.tool_plan.mode != Mode.TOOL_CHOICE_MODE_AUTO:
            self.held += text
            return ""
        if OPEN in self.held:
            self.held += text
            return ""
        pending = self.held + text
        start = pending.find(OPEN)
        if start < 0:
            start = _partial_open(pending)
        self.held = pending[start:]
        return pending[:start]

    def finish(self, finish_reason: int) -> tuple[str, int]:
        """(text not shown yet, the finish reason): calls parsed into `calls` end as TOOL_CALLS."""
        text, self.held = self.held, ""
        mode = self.tool_plan.mode
        if finish_reason != types_pb2.FINISH_REASON_STOP or mode == Mode.TOOL_CHOICE_MODE_NONE:
            return text, finish_reason  # cut short, failed or no calls asked for: the text as it is
        if mode == Mode.TOOL_CHOICE_MODE_FUNCTION:
            self.calls = [types_pb2.ToolCall(id=new_call_id(), name=self.tool_plan.function, arguments=text)]
            return "", types_pb2.FINISH_REASON_TOOL_CALLS
        if mode == Mode.TOOL_CHOICE_MODE_REQUIRED:
            calls = _required_calls(text)
            if calls is None:  # the constrained list cut short (a stop string inside it): text as it is
                return text, finish_reason
            self.calls = calls
            return "", types_pb2.FINISH_REASON_TOOL_CALLS
        return self._parse_auto(text, finish_reason)

    def _parse_auto(self, text: str, finish_reason: int) -> tuple[str, int]:
        calls = []
        for match in _CALL.finditer(text):
            call = _parse_call(match.group(1), self.tool_plan.tools)
            if call is None:
                return text, finish_reason  # not a call of these tools after all: it was text
            calls.append(call)
        if not calls:
            return text, finish_reason
        # parallel_tool_calls false: the model was asked for one call at most; the first is it.
        self.calls = calls if self.tool_plan.parallel else calls[:1]
        return _CALL.sub("", text).strip(), types_pb2.FINISH_REASON_TOOL_CALLS


def _required_calls(text: str) -> list[types_pb2.ToolCall] | None:
    """tool_choice "required"'s output, the JSON list of {"name", "parameters"} its grammar makes;
    None when the text is not one (the engine stopped it early)."""
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):  # ValueError: JSONDecodeError, or an integer over 4,300 digits
        return None
    if not isinstance(items, list) or not all(
        isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item for item in items
    ):
        return None
    return [types_pb2.ToolCall(id=new_call_id(), name=item["name"], arguments=json.dumps(item["parameters"])) for item in items]


def _parse_call(body: str, tools: dict[str, dict[str, Any]]) -> types_pb2.ToolCall | None:
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):  # ValueError: JSONDecodeError, or an integer over 4,300 digits
        return None
    # A name the model wrote as a list or an object is no call either (and no dict key).
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str) or parsed["name"] not in tools:
        return None
    arguments = parsed.get("arguments", {})
    if isinstance(arguments, str):  # the arguments written as a JSON string of the object
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):  # a call's arguments are a JSON object: anything else is text
        return None
    return types_pb2.ToolCall(id=new_call_id(), name=parsed["name"], arguments=json.dumps(arguments))


def _partial_open(text: str) -> int:
    """Where a suffix of `text` that could begin `<tool_call>` starts; len(text) when none does."""
    for start in range(max(0, len(text) - len(OPEN) + 1), len(text)):
        if OPEN.startswith(text[start:]):
            return start
    return len(text)
