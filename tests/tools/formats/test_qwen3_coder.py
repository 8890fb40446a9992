"""Qwen3-Coder's XML calls: the template's layout, values typed by the tool's schema, round trips
through the schema, what the parser refuses and what it cannot write. What every format does
(hostile values, lone surrogates, the parser never raising, the format in a tool env) is in
test_every_format.py."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_grpo.envs.calculator import CalculatorEnv
from agent_grpo.testing.tool_formats import (
    TOOLS,
    assert_refused,
    json_type,
    json_values,
    tool_names,
)
from agent_grpo.testing.tool_formats import qwen3_coder_call as call
from agent_grpo.tools.formats import (
    ParsedToolCall,
    Qwen3CoderToolCallFormat,
    ToolCallParseError,
    parse_tool_calls,
)

FMT = Qwen3CoderToolCallFormat()

SEARCH = """<tool_call>
<function=search>
<parameter=query>
6 * 7
</parameter>
<parameter=k>
2
</parameter>
<parameter=filters>
{"lang": "en"}
</parameter>
<parameter=exact>
True
</parameter>
</function>
</tool_call>"""


def test_render_call_writes_the_templates_layout_and_parses_back_typed() -> None:
    arguments = {"query": "6 * 7", "k": 2, "filters": {"lang": "en"}, "exact": True}
    assert FMT.render_call("search", arguments) == SEARCH
    assert parse_tool_calls(f"Let me search.\n{SEARCH}", TOOLS, FMT) == [
        ParsedToolCall(name="search", arguments=arguments, raw=SEARCH)
    ]


def test_without_tools_values_are_the_text_between_the_tags() -> None:
    [parsed] = FMT.parse(SEARCH)
    assert isinstance(parsed, ParsedToolCall)
    assert parsed.arguments == {"query": "6 * 7", "k": "2", "filters": '{"lang": "en"}',
                                "exact": "True"}  # fmt: skip


def test_a_string_parameter_keeps_text_that_looks_like_json() -> None:
    [parsed] = parse_tool_calls(call("search", query="42", k="5"), TOOLS, FMT)
    assert isinstance(parsed, ParsedToolCall) and parsed.arguments == {"query": "42", "k": 5}
    [parsed] = parse_tool_calls(call("search", query='{"a": 1}'), TOOLS, FMT)
    assert isinstance(parsed, ParsedToolCall) and parsed.arguments == {"query": '{"a": 1}'}


def test_a_value_that_does_not_decode_is_reported_by_the_args_model() -> None:
    [error] = parse_tool_calls(call("add", a="two"), TOOLS, FMT)
    assert isinstance(error, ToolCallParseError) and error.kind == "invalid_arguments"
    assert "a: Input should be a valid integer" in error.message


def test_newlines_around_a_value_survive_a_round_trip() -> None:
    for value in ("", "\n", "\nx\n", "a\n\nb", " x "):
        [parsed] = FMT.parse(FMT.render_call("search", {"query": value}))
        assert isinstance(parsed, ParsedToolCall) and parsed.arguments == {"query": value}


def test_markup_a_value_cannot_hold_is_refused_when_rendering() -> None:
    for value in ("x </parameter> y", "<tool_call>", "</tool_call>", "<|im_end|>", "<｜x｜>"):
        with pytest.raises(ValueError, match="qwen3_coder cannot write parameter 'query'"):
            FMT.render_call("search", {"query": value})
    with pytest.raises(ValueError, match="parameter named"):
        FMT.render_call("search", {"a>b": 1})
    # Markup a value ends at never appears unescaped in JSON values.
    [parsed] = parse_tool_calls(FMT.render_call("search", {"query": "q", "filters": {
        "x": "</parameter></tool_call><|im_end|>"}}), TOOLS, FMT)  # fmt: skip
    assert isinstance(parsed, ParsedToolCall)
    assert parsed.arguments["filters"] == {"x": "</parameter></tool_call><|im_end|>"}


text_values = st.text(max_size=20).filter(
    lambda s: not any(m in s for m in ("</parameter>", "<tool_call>", "</tool_call>", "<|", "<｜"))
)
parameter_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
typed_values = st.one_of(text_values, json_values.filter(lambda v: not isinstance(v, str)))


@settings(max_examples=150, deadline=None)
@given(tool_names, st.dictionaries(parameter_names, typed_values, max_size=5))
def test_any_call_round_trips_through_the_schema(name: str, args: dict[str, Any]) -> None:
    schema = {"properties": {k: {"type": json_type(v)} for k, v in args.items()}}
    [parsed] = FMT.parse(FMT.render_call(name, args))
    assert isinstance(parsed, ParsedToolCall) and parsed.name == name
    typed = FMT.typed_arguments(parsed, schema)
    assert isinstance(typed, ParsedToolCall) and typed.arguments == args


def test_an_unclosed_deep_value_is_a_parse_error() -> None:
    [result] = parse_tool_calls(call("add", a="[" * 100_000), TOOLS, FMT)
    assert isinstance(result, ToolCallParseError) and result.kind == "parse"


BROKEN = {
    "tool_call never closed": ("<tool_call>\n<function=add>\n<parameter=a>\n1", "never closed"),
    "function never closed": ("<tool_call><function=add><parameter=a>1</parameter></tool_call>",
                              "never closed"),
    "function name never closed": ("<tool_call><function=add</tool_call>", "never closed"),
    "parameter never closed": ("<tool_call><function=add><parameter=a>1</function></tool_call>",
                               "never closed"),
    "hermes json inside": ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
                           "must hold <function=NAME>"),
    "text between parameters": (call("add", a="1").replace("</parameter>\n", "</parameter> hi"),
                                "unexpected text"),
    "parameter twice": (call("add", a="1").replace("</function>",
                        "<parameter=a>\n2\n</parameter>\n</function>"), "given twice"),
    "closing tag inside a value": (call("search", query="a </parameter> b"), "unexpected text"),
}  # fmt: skip


@pytest.mark.parametrize(("text", "needle"), BROKEN.values(), ids=list(BROKEN))
def test_what_the_parser_refuses(text: str, needle: str) -> None:
    [result] = FMT.parse(text)
    assert_refused([result], needle)


def test_a_call_without_a_name_is_missing_name() -> None:
    [result] = FMT.parse("<tool_call><function=>\n</function></tool_call>")
    assert isinstance(result, ToolCallParseError) and result.kind == "missing_name"


def test_render_tools_writes_each_schema_as_the_templates_xml() -> None:
    schema = {
        "name": "add",
        "description": " Add two numbers. ",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "description": "first"},
                           "b": {"type": "number", "default": 0.0}},
            "required": ["a"],
        },
    }  # fmt: skip
    block = FMT.render_tools([{"type": "function", "function": schema}])
    assert block.startswith(
        "# Tools\n\nYou have access to the following functions:\n\n<tools>\n<function>\n"
        "<name>add</name>\n<description>Add two numbers.</description>\n<parameters>\n"
        "<parameter>\n<name>a</name>\n<type>integer</type>\n<description>first</description>\n"
        "</parameter>\n<parameter>\n<name>b</name>\n<type>number</type>\n<default>0.0</default>\n"
        '</parameter>\n<required>["a"]</required>\n</parameters>\n</function>\n</tools>\n\n'
        "If you choose to call a function ONLY reply in the following format with NO suffix:"
    )
    assert block.endswith("</IMPORTANT>")


def test_the_system_prompt_lists_the_tools_in_the_templates_xml() -> None:
    messages, _ = CalculatorEnv(tool_call_format="qwen3_coder").reset(seed=3)
    assert "<function>\n<name>calculator</name>" in messages[0]["content"]
