"""Mistral's two layouts after `[TOOL_CALLS]`: the JSON list (v2-v7) and `NAME[ARGS]{...}`
(v11+): each layout, ids, and what each refuses. What every format does (round trips, hostile
JSON, both through a tool env) is in test_every_format.py."""

from __future__ import annotations

import json

import pytest

from agent_grpo.testing.tool_formats import (
    TOOLS,
    UNCLOSED_AND_DEEP,
    assert_refused,
    mistral_call,
    mistral_v11_call,
    names_and_arguments,
)
from agent_grpo.tools.formats import (
    MistralToolCallFormat,
    MistralV11ToolCallFormat,
    ParsedToolCall,
    get_tool_format,
    parse_tool_calls,
)

LIST, V11 = MistralToolCallFormat(), MistralV11ToolCallFormat()


def test_render_call_writes_each_layout() -> None:
    arguments = {"query": "[TOOL_CALLS] x", "k": 2}
    assert LIST.render_call("search", arguments) == (
        '[TOOL_CALLS][{"name": "search", "arguments": {"query": "\\u005bTOOL_CALLS] x", "k": 2}}]'
    )
    assert V11.render_call("search", arguments) == (
        '[TOOL_CALLS]search[ARGS]{"query": "\\u005bTOOL_CALLS] x", "k": 2}'
    )
    for fmt in (LIST, V11):
        text = fmt.render_call("search", arguments)
        assert parse_tool_calls(f"Let me look.{text}</s>", TOOLS, fmt) == [
            ParsedToolCall(
                name="search",
                arguments=arguments,
                raw=text[len("[TOOL_CALLS][") : -1] if fmt is LIST else text,
            )
        ]


def test_a_list_holds_several_calls_and_ids_are_allowed() -> None:
    text = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}, "id": "abc123xyz"},\n {"name": "search", "arguments": {"query": "]"}}]'  # noqa: E501
    assert names_and_arguments(LIST.parse(text)) == [("add", {"a": 1}), ("search", {"query": "]"})]


def test_v11_calls_follow_each_other_and_may_carry_a_call_id() -> None:
    text = '[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}[TOOL_CALLS]search[ARGS]{"query": "x"}'
    assert names_and_arguments(V11.parse(text)) == [("add", {"a": 1}), ("search", {"query": "x"})]


BROKEN = {
    ("mistral", "list never closed"): ('[TOOL_CALLS][{"name": "add", "arguments": {}}', "closed"),
    ("mistral", "unclosed call"): (mistral_call('{"a": 1'), "not valid JSON"),
    ("mistral", "unclosed and deep"): (mistral_call(UNCLOSED_AND_DEEP), "nested deeper"),
    ("mistral", "no list"): ('[TOOL_CALLS]{"name": "add"}', "JSON list"),
    ("mistral", "empty list"): ("[TOOL_CALLS][]", "lists no call"),
    ("mistral", "v11 layout"): ('[TOOL_CALLS]add[ARGS]{"a": 1}', "JSON list"),
    ("mistral", "text after the list"): (mistral_call('{"a": 1}') + " ok", "unexpected text"),
    ("mistral", "token inside an argument"): (mistral_call('{"q": "[TOOL_CALLS]"}'), ""),
    ("mistral_v11", "no [ARGS]"): ("[TOOL_CALLS]add", "[ARGS]"),
    ("mistral_v11", "unclosed"): (mistral_v11_call('{"a": 1'), "not valid JSON"),
    ("mistral_v11", "unclosed and deep"): (mistral_v11_call(UNCLOSED_AND_DEEP), "nested"),
    ("mistral_v11", "list layout"): (mistral_call('{"a": 1}'), "[ARGS]"),
    ("mistral_v11", "token inside an argument"): (mistral_v11_call('{"q": "[TOOL_CALLS]"}'), ""),
}


@pytest.mark.parametrize("key", sorted(BROKEN), ids="/".join)
def test_what_the_parser_refuses(key: tuple[str, str]) -> None:
    text, needle = BROKEN[key]
    assert_refused(get_tool_format(key[0]).parse(text), needle)


def test_render_tools_is_the_available_tools_block() -> None:
    schema = {"name": "add", "description": "Add.", "parameters": {"type": "object"}}
    for fmt in (LIST, V11):
        block = fmt.render_tools([schema])
        assert block.startswith("[AVAILABLE_TOOLS][") and block.endswith("][/AVAILABLE_TOOLS]")
        listed = block.removeprefix("[AVAILABLE_TOOLS]").removesuffix("[/AVAILABLE_TOOLS]")
        assert json.loads(listed) == [{"type": "function", "function": schema}]
