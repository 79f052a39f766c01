"""Any JSON value in any field of an OpenAI body is answered 400 naming the field or served, never
a 500: a list or an object tested with `in` against a dict raised TypeError (unhashable), which
the HTTP front answered 500 internal_error (a batch line's url failed the whole upload so)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sluice_gateway.openai_front.batches import parse_batch_file, parse_create
from sluice_gateway.openai_front.errors import OpenAIError
from sluice_gateway.openai_front.requests import parse_chat, parse_completion, parse_embeddings

TOOL = {"type": "function", "function": {"name": "get", "description": "d", "parameters": {"type": "object", "properties": {}}, "strict": True}}
CHAT = {
    "model": "g",
    "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}], "name": "n"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
    ],
    "max_tokens": 4, "temperature": 0.5, "stop": ["x"], "seed": 1, "logit_bias": {"1": 1}, "top_k": 2, "n": 1,
    "logprobs": True, "top_logprobs": 1, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get"}},
    "parallel_tool_calls": True, "user": "u", "metadata": {"a": "b"}, "stream": True, "stream_options": {"include_usage": True},
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}},
    "service_tier": "auto", "store": False, "function_call": "auto",
}  # fmt: skip
COMPLETION = {"model": "g", "prompt": "x", "echo": False, "logprobs": 1, "best_of": 1, "suffix": "", "structured_outputs": {"regex": "a+"}}
EMBEDDINGS = {"model": "e", "input": ["x"], "encoding_format": "float", "dimensions": 3, "truncate_prompt_tokens": 2}
CREATE = {"input_file_id": "f", "endpoint": "/v1/chat/completions", "completion_window": "24h", "metadata": {"a": "b"}}
LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "g", "messages": [{"role": "user", "content": "x"}]}}


def _line(document: dict[str, Any]) -> Any:
    return parse_batch_file(json.dumps(document).encode(), 10)


PARSERS: dict[str, tuple[Callable[[dict[str, Any]], Any], dict[str, Any]]] = {
    "chat": (parse_chat, CHAT),
    "completion": (parse_completion, COMPLETION),
    "embeddings": (parse_embeddings, EMBEDDINGS),
    "batch create": (parse_create, CREATE),
    "batch line": (_line, LINE),
}


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if path:
        yield path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _paths(child, (*path, key))


def _with(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(body)
    parent: Any = changed
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return changed


@pytest.mark.parametrize("name", PARSERS)
def test_a_list_or_an_object_anywhere_is_a_400_or_served_never_a_type_error(name: str) -> None:
    parse, body = PARSERS[name]
    for path in _paths(body):
        values: tuple[Any, ...] = (["x"], {"a": {}}, [], {})
        for value in values:
            try:
                parse(_with(body, path, value))
            except OpenAIError as exc:
                assert exc.status == 400 and exc.param, (path, value)


@pytest.mark.parametrize(
    ("name", "path", "param"),
    [
        ("chat", ("messages", 1, "role"), "messages[1].role"),
        ("batch create", ("endpoint",), "endpoint"),
        ("batch create", ("completion_window",), "completion_window"),
        ("batch line", ("url",), "url"),
        ("batch line", ("body", "messages", 0, "role"), "body.messages[0].role"),
    ],
)
def test_a_name_given_as_a_list_or_object_is_refused_naming_it(name: str, path: tuple[Any, ...], param: str) -> None:
    parse, body = PARSERS[name]
    for value in (["user"], {"a": 1}):
        with pytest.raises(OpenAIError) as caught:
            parse(_with(body, path, value))
        assert (caught.value.status, caught.value.param, caught.value.type) == (400, param, "invalid_request_error")
