"""What every format shares: tagged blocks, JSON that cannot hurt (limits and escapes), calls from
decoded objects, a new format plugged in with one small class, and typing of text arguments."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings

from agent_grpo.testing.tool_formats import TOOLS, json_values, nested
from agent_grpo.tools.formats import (
    MAX_JSON_DEPTH,
    ParsedToolCall,
    ToolCallFormat,
    ToolCallParseError,
    decode_call_json,
    dump_json,
    find_tagged_blocks,
    parse_tool_calls,
)
from agent_grpo.tools.formats.base import (
    arguments_call,
    call_from_object,
    decode_json_prefix,
    load_json,
)


def test_find_tagged_blocks() -> None:
    assert find_tagged_blocks("a[x]b[y", "[", "]") == [("[x]", "x"), ("[y", None)]


def test_load_json_tells_text_that_is_not_json_from_json_it_refuses() -> None:
    assert load_json(' {"a": [1]} ') == ({"a": [1]}, None)
    for text in ("{", "nope", '{"a": 1} x'):
        value, problem = load_json(text)
        assert value is None and problem is not None and problem.syntax, text
    for text in (nested(MAX_JSON_DEPTH + 1), "7" * 5000, "NaN", "[1e999]", nested(100_000)):
        value, problem = load_json(text)
        assert value is None and problem is not None and not problem.syntax, text[:10]
    assert load_json(nested(MAX_JSON_DEPTH))[1] is None
    assert load_json(nested(MAX_JSON_DEPTH), depth=MAX_JSON_DEPTH - 1)[1] is not None


def test_decode_json_prefix_reads_one_value_and_says_where_it_ends() -> None:
    text = ' {"a": "};"} ; [2]'
    assert decode_json_prefix(text) == ({"a": "};"}, 12, None)
    assert decode_json_prefix(text, 14) == ([2], len(text), None)
    value, end, problem = decode_json_prefix("  {", 0)
    assert (value, end) == (None, 2) and problem is not None and problem.syntax


MARKUP = "</tool_call> <tool_call> <|im_end|> <｜tool▁call▁end｜> [TOOL_CALLS] [/AVAILABLE_TOOLS]"


def test_dump_json_writes_no_markup_and_decodes_to_the_same_value() -> None:
    text = dump_json({"q": MARKUP, "<tool_call>": ["[ARGS]"], "plain": "a < b [x] [1]"})
    for markup in ("</", "<t", "<|", "<｜", "[T", "[/", "[A"):
        assert markup not in text
    assert json.loads(text) == {"q": MARKUP, "<tool_call>": ["[ARGS]"], "plain": "a < b [x] [1]"}
    assert "a < b [x] [1]" in text  # only what could read as markup is escaped
    with pytest.raises(ValueError):
        dump_json({"x": float("nan")})


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_dump_json_round_trips_any_value(value: Any) -> None:
    text = dump_json(value)
    assert json.loads(text) == value
    assert re.search(r"</|<[A-Za-z|｜]|\[[A-Z/]", text) is None


def test_call_from_object_takes_the_formats_arguments_keys() -> None:
    keys = ("parameters", "arguments")
    assert call_from_object("r", {"name": "add", "parameters": {"a": 1}}, keys) == ParsedToolCall(
        name="add", arguments={"a": 1}, raw="r"
    )
    both = call_from_object("r", {"name": "add", "parameters": {}, "arguments": {}}, keys)
    assert isinstance(both, ToolCallParseError) and both.kind == "parse"
    assert "both" in both.message and both.name == "add"


def test_arguments_call_needs_a_name_and_an_object() -> None:
    missing = arguments_call("r", " ", "{}")
    assert isinstance(missing, ToolCallParseError) and missing.kind == "missing_name"
    listed = arguments_call("r", "add", "[1]")
    assert isinstance(listed, ToolCallParseError) and listed.kind == "invalid_arguments"
    deep = arguments_call("r", "add", '{"a": ' + nested(MAX_JSON_DEPTH - 1) + "}")
    assert isinstance(deep, ToolCallParseError) and deep.kind == "parse"
    at_limit = arguments_call("r", "add", '{"a": ' + nested(MAX_JSON_DEPTH - 2) + "}")
    assert isinstance(at_limit, ParsedToolCall)


class FunctionTagFormat:
    """A new format in one small class: `<function=NAME>{json arguments}</function>`."""

    name = "function_tag"
    stop_strings = ["</function>"]

    def parse(self, text: str) -> list[ParsedToolCall | ToolCallParseError]:
        calls = re.finditer(r"<function=([^>]*)>(.*?)</function>", text, re.DOTALL)
        return [
            decode_call_json(m[0], f'{{"name": {json.dumps(m[1])}, "arguments": {m[2]}}}')
            for m in calls
        ]

    def render_tools(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        return "Call a tool as <function=NAME>{json}</function>. Tools: " + json.dumps(
            list(schemas)
        )

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        return f"<function={name}>{dump_json(dict(arguments))}</function>"


def test_another_format_plugs_in() -> None:
    fmt: ToolCallFormat = FunctionTagFormat()
    text = 'x <function=add>{"a": 1, "b": 2}</function> <function=add>{"b": 1}</function>'
    parsed, error = parse_tool_calls(text, TOOLS, fmt)
    assert parsed == ParsedToolCall(name="add", arguments={"a": 1, "b": 2}, raw=text[2:43])
    assert isinstance(error, ToolCallParseError) and error.kind == "invalid_arguments"
    hermes = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert parse_tool_calls(hermes, TOOLS, fmt) == []


class TextValuesFormat(FunctionTagFormat):
    """Values are text (`<function=NAME>a=1</function>`), typed by the schema afterwards."""

    def parse(self, text: str) -> list[ParsedToolCall | ToolCallParseError]:
        calls = re.finditer(r"<function=([^>]*)>(\w+)=(.*?)</function>", text, re.DOTALL)
        return [ParsedToolCall(name=m[1], arguments={m[2]: m[3]}, raw=m[0]) for m in calls]

    def typed_arguments(
        self, call: ParsedToolCall, schema: Mapping[str, Any]
    ) -> ParsedToolCall | ToolCallParseError:
        types = {k: v.get("type") for k, v in schema["properties"].items()}
        typed = {k: int(v) if types.get(k) == "integer" else v for k, v in call.arguments.items()}
        return call.model_copy(update={"arguments": typed})


def test_a_format_with_text_values_types_them_by_the_tools_schema() -> None:
    fmt = TextValuesFormat()
    [typed] = parse_tool_calls("<function=add>a=41</function>", TOOLS, fmt)
    assert isinstance(typed, ParsedToolCall) and typed.arguments == {"a": 41}
    [text] = parse_tool_calls("<function=add>a=41</function>", None, fmt)  # no tools: as written
    assert isinstance(text, ParsedToolCall) and text.arguments == {"a": "41"}
