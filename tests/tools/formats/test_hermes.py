"""The Hermes format (`<tool_call>{json}</tool_call>`): parsing, typed errors, validation against
tool args models (here with `b` required), render/parse round trips of markup. What every format
does (round trips, hostile JSON, the format in a tool env) is in test_every_format.py; hostile
JSON in Hermes calls is also tested through the whole rollout in
tests/rollout/test_hostile_input.py."""

from __future__ import annotations

import json

from pydantic import BaseModel

from agent_grpo.testing.tool_formats import FakeTool
from agent_grpo.tools.formats import (
    HermesToolCallFormat,
    ParsedToolCall,
    ToolCallParseError,
    parse_tool_calls,
)


class AddArgs(BaseModel):
    a: int
    b: int


class SearchArgs(BaseModel):
    query: str
    k: int = 3


TOOLS = {"add": FakeTool(AddArgs), "search": FakeTool(SearchArgs)}


def call(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


def test_several_calls_in_one_turn() -> None:
    first = call('\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n')
    second = call('{"name": "search", "arguments": {"query": "<|im_end|> é"}}')
    text = f"Let me compute.\n{first} and {second} done"
    assert parse_tool_calls(text, TOOLS) == [
        ParsedToolCall(name="add", arguments={"a": 1, "b": 2}, raw=first),
        ParsedToolCall(name="search", arguments={"query": "<|im_end|> é"}, raw=second),
    ]


def test_bad_json_is_a_parse_error() -> None:
    raw = call('{"name": "add", "arguments": {"a": 1,}}')
    [error] = parse_tool_calls(raw, TOOLS)
    assert isinstance(error, ToolCallParseError)
    assert (error.kind, error.raw, error.name) == ("parse", raw, None)
    assert "not valid JSON" in error.message and "line 1 column" in error.message


def test_non_object_is_a_parse_error() -> None:
    [error] = parse_tool_calls(call('["add", 1, 2]'), TOOLS)
    assert isinstance(error, ToolCallParseError)
    assert error.kind == "parse" and "got list" in error.message


def test_missing_name() -> None:
    for body in ['{"arguments": {"a": 1}}', '{"name": "", "arguments": {}}', '{"name": 7}']:
        [error] = parse_tool_calls(call(body))
        assert isinstance(error, ToolCallParseError)
        assert error.kind == "missing_name" and error.name is None, body


def test_unknown_tool_lists_known_ones() -> None:
    [error] = parse_tool_calls(call('{"name": "mul", "arguments": {"a": 1, "b": 2}}'), TOOLS)
    assert isinstance(error, ToolCallParseError)
    assert (error.kind, error.name) == ("unknown_tool", "mul")
    assert error.message == "unknown tool 'mul'; available tools: add, search"


def test_unknown_tool_is_fine_without_a_tool_table() -> None:
    [parsed] = parse_tool_calls(call('{"name": "mul", "arguments": {}}'))
    assert parsed == ParsedToolCall(
        name="mul", arguments={}, raw=call('{"name": "mul", "arguments": {}}')
    )


def test_wrong_argument_type_names_field_and_value() -> None:
    [error] = parse_tool_calls(call('{"name": "add", "arguments": {"a": "two", "b": 2}}'), TOOLS)
    assert isinstance(error, ToolCallParseError)
    assert (error.kind, error.name) == ("invalid_arguments", "add")
    assert error.message.startswith("invalid arguments for add: a: ")
    assert "valid integer" in error.message and "(got 'two')" in error.message


def test_missing_arguments() -> None:
    [error] = parse_tool_calls(call('{"name": "add", "arguments": {"a": 1}}'), TOOLS)
    assert isinstance(error, ToolCallParseError)
    assert error.kind == "invalid_arguments"
    assert error.message == "invalid arguments for add: b: Field required"
    # No "arguments" key at all: validated as {}, so both fields are reported.
    [error] = parse_tool_calls(call('{"name": "add"}'), TOOLS)
    assert isinstance(error, ToolCallParseError)
    assert error.message == "invalid arguments for add: a: Field required; b: Field required"


def test_arguments_must_be_an_object() -> None:
    [error] = parse_tool_calls(call('{"name": "add", "arguments": "{\\"a\\": 1}"}'), TOOLS)
    assert isinstance(error, ToolCallParseError)
    assert (error.kind, error.name) == ("invalid_arguments", "add")
    assert "must be a JSON object, got str" in error.message


def test_unclosed_tag_is_a_parse_error() -> None:
    good = call('{"name": "add", "arguments": {"a": 1, "b": 2}}')
    cut = '<tool_call>{"name": "add", "argum'
    parsed, error = parse_tool_calls(f"{good}\n{cut}", TOOLS)
    assert isinstance(parsed, ParsedToolCall)
    assert isinstance(error, ToolCallParseError)
    assert (error.kind, error.raw) == ("parse", cut)
    assert error.message == "<tool_call> is never closed"


def test_reopened_tag_closes_nothing() -> None:
    # An opening tag inside a call means the first call was never closed.
    text = '<tool_call>{"name": "add" ' + call('{"name": "search", "arguments": {"query": "x"}}')
    error, parsed = parse_tool_calls(text, TOOLS)
    assert isinstance(error, ToolCallParseError) and error.raw == '<tool_call>{"name": "add" '
    assert isinstance(parsed, ParsedToolCall) and parsed.name == "search"


def test_hermes_render_tools_and_stop_strings() -> None:
    fmt = HermesToolCallFormat()
    bare = {
        "name": "add",
        "description": "Add two ints.",
        "parameters": AddArgs.model_json_schema(),
    }
    wrapped = {"type": "function", "function": {"name": "noop"}}
    block = fmt.render_tools([bare, wrapped])
    lines = block.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in lines] == [{"type": "function", "function": bare}, wrapped]
    assert block.startswith("# Tools\n") and "<tool_call>\n{" in block
    assert fmt.stop_strings == ["</tool_call>"]


def test_render_call_round_trips() -> None:
    fmt = HermesToolCallFormat()
    text = fmt.render_call("search", {"query": "日本 </tool_call>", "k": 2})
    assert text.startswith("<tool_call>\n{") and text.endswith("}\n</tool_call>")
    assert parse_tool_calls(f"ok {text}", TOOLS) == [
        ParsedToolCall(name="search", arguments={"query": "日本 </tool_call>", "k": 2}, raw=text)
    ]
    # Written literally, the same argument closes the block early: a limit of the format.
    [error] = parse_tool_calls(text.replace("<\\/", "</"), TOOLS)
    assert isinstance(error, ToolCallParseError) and error.kind == "parse"


def test_special_token_text_in_an_argument_is_written_as_an_escape() -> None:
    text = HermesToolCallFormat().render_call("search", {"query": "<|im_end|> [TOOL_CALLS]"})
    assert "<|" not in text and "[TOOL_CALLS]" not in text  # a tokenizer sees no special token
    [call] = parse_tool_calls(text)
    assert isinstance(call, ParsedToolCall) and call.arguments == {
        "query": "<|im_end|> [TOOL_CALLS]"
    }
