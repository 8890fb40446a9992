"""Llama 3's JSON calls: the turn is `{"name", "parameters"}` (after `<|python_tag|>` or not),
`;` between calls, what the parser refuses. What every format does (round trips, hostile JSON,
the format in a tool env) is in test_every_format.py."""

from __future__ import annotations

import json

import pytest

from agent_grpo.testing.tool_formats import (
    TOOLS,
    UNCLOSED_AND_DEEP,
    assert_refused,
    llama3_call,
    names_and_arguments,
)
from agent_grpo.tools.formats import (
    Llama3ToolCallFormat,
    ParsedToolCall,
    ToolCallParseError,
    parse_tool_calls,
)

FMT = Llama3ToolCallFormat()
ADD = llama3_call('{"a": 1}')


def test_render_call_is_the_templates_json_and_parses_back() -> None:
    text = FMT.render_call("search", {"query": "6 * 7; {x}", "k": 2})
    assert text == '{"name": "search", "parameters": {"query": "6 * 7; {x}", "k": 2}}'
    assert parse_tool_calls(text, TOOLS, FMT) == [
        ParsedToolCall(name="search", arguments={"query": "6 * 7; {x}", "k": 2}, raw=text)
    ]


def test_a_call_may_follow_the_python_tag_and_end_with_an_end_of_turn_token() -> None:
    for text in (
        "<|python_tag|>" + ADD,
        ADD + "<|eom_id|>",
        f"Let me add.<|python_tag|>{ADD}\n<|eot_id|>",
    ):
        assert names_and_arguments(FMT.parse(text)) == [("add", {"a": 1})], text
    [parsed] = FMT.parse("<|python_tag|>" + ADD)
    assert parsed.raw.startswith("<|python_tag|>")


def test_arguments_is_accepted_too_but_not_both() -> None:
    assert names_and_arguments(FMT.parse('{"name": "add", "arguments": {"a": 1}}')) == [
        ("add", {"a": 1})
    ]
    [error] = FMT.parse('{"name": "add", "arguments": {}, "parameters": {}}')
    assert isinstance(error, ToolCallParseError) and "both" in error.message


def test_several_calls_are_separated_by_semicolons() -> None:
    first, second = FMT.render_call("add", {"a": 1}), FMT.render_call("search", {"query": ";"})
    calls = parse_tool_calls(f"{first}; {second}", TOOLS, FMT)
    assert names_and_arguments(calls) == [("add", {"a": 1}), ("search", {"query": ";"})]


BROKEN = {
    "unclosed": (llama3_call('{"a": 1'), "not valid JSON"),
    "unclosed and deep": (llama3_call(UNCLOSED_AND_DEEP), "nested deeper"),
    "not JSON after the tag": ('<|python_tag|>brave_search.call(query="x")', "not valid JSON"),
    "an answer that looks like JSON": ("{1, 2}", "not valid JSON"),
    "not an object": ("<|python_tag|>[1, 2]", "must be a JSON object"),
    "text after the call": (
        llama3_call('{"a": 1}') + " and done",
        "unexpected text after the call",
    ),
}


@pytest.mark.parametrize(("text", "needle"), BROKEN.values(), ids=list(BROKEN))
def test_what_the_parser_refuses(text: str, needle: str) -> None:
    assert_refused(FMT.parse(text), needle)


def test_markup_inside_an_argument_is_plain_json_text() -> None:
    text = llama3_call(json.dumps({"a": "<|eot_id|>}; {<|python_tag|>"}))
    assert names_and_arguments(FMT.parse(text)) == [("add", {"a": "<|eot_id|>}; {<|python_tag|>"})]
    assert "<|" not in FMT.render_call("add", {"a": "<|eot_id|>"})  # no special token in SFT data


def test_render_tools_follows_the_templates_system_message() -> None:
    schema = {"name": "add", "description": "Add.", "parameters": {"type": "object"}}
    block = FMT.render_tools([schema])
    assert block.startswith(
        "You have access to the following functions. To call a function, please respond with "
        'JSON for a function call.Respond in the format {"name": function name, "parameters": '
        "dictionary of argument name and its value}.Do not use variables.\n\n{\n    "
    )
    assert json.loads(block.split("\n\n", 1)[1]) == {"type": "function", "function": schema}
