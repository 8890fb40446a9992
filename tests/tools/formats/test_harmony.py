"""gpt-oss Harmony: calls are `commentary` messages to `functions.NAME`; other channels are not
calls; round trips, what the parser refuses, hostile JSON, the TypeScript tool declarations, and
the format through a tool env."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_grpo.envs.calculator import CalculatorEnv
from agent_grpo.envs.text_env import read_step_info, run_expert
from agent_grpo.testing.tool_formats import (
    HOSTILE_VALUES,
    TOOLS,
    UNCLOSED_AND_DEEP,
    any_text,
    arguments,
    hostile_arguments,
    storable,
    tool_names,
)
from agent_grpo.tools.formats import (
    HarmonyToolCallFormat,
    ParsedToolCall,
    ToolCallParseError,
    parse_tool_calls,
)
from agent_grpo.tools.formats.harmony import render_typescript

FMT = HarmonyToolCallFormat()
ANALYSIS = "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant"


def wrap(arguments_json: str, name: str = "add", end: str = "<|call|>") -> str:
    header = f"<|channel|>commentary to=functions.{name} <|constrain|>json"
    return f"{header}<|message|>{arguments_json}{end}"


def names_and_arguments(text: str) -> list[tuple[str | None, Any]]:
    return [(c.name, getattr(c, "arguments", None)) for c in FMT.parse(text)]


def test_render_call_is_a_commentary_message_to_the_function() -> None:
    text = FMT.render_call("search", {"query": "<|call|>", "k": 2})
    assert text == (
        "<|channel|>commentary to=functions.search <|constrain|>json<|message|>"
        '{"query": "\\u003c|call|>", "k": 2}<|call|>'
    )
    calls = parse_tool_calls(f"{ANALYSIS}{text}", TOOLS, FMT)
    assert calls == [
        ParsedToolCall(
            name="search", arguments={"query": "<|call|>", "k": 2}, raw=f"<|start|>assistant{text}"
        )
    ]
    assert FMT.stop_strings == ["<|call|>"]


def test_the_recipient_may_sit_in_the_role_part_of_the_header() -> None:
    text = f'{ANALYSIS} to=functions.add<|channel|>commentary json<|message|>{{"a": 1}}<|call|>'
    assert names_and_arguments(text) == [("add", {"a": 1})]
    assert names_and_arguments('<|channel|>commentary to=functions.add<|message|>{"a": 1}') == [
        ("add", {"a": 1})  # no content type, and the <|call|> taken off as the turn's end
    ]


def test_messages_without_a_recipient_are_not_calls() -> None:
    final = f"{ANALYSIS}<|channel|>final<|message|>The answer is 42.<|return|>"
    preamble = "<|channel|>commentary<|message|>I will add.<|end|><|start|>assistant"
    assert FMT.parse(final) == []
    assert names_and_arguments(preamble + wrap('{"a": 1}')) == [("add", {"a": 1})]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(tool_names, arguments), min_size=1, max_size=4))
def test_any_calls_round_trip(calls: list[tuple[str, dict[str, Any]]]) -> None:
    text = "<|start|>assistant".join(FMT.render_call(name, args) for name, args in calls)
    assert names_and_arguments(ANALYSIS + text) == calls


@pytest.mark.parametrize("case", sorted(HOSTILE_VALUES))
def test_hostile_json_is_a_parse_error(case: str) -> None:
    raw = wrap(hostile_arguments(case))
    [result] = parse_tool_calls(raw, TOOLS, FMT)
    assert isinstance(result, ToolCallParseError)
    assert result.kind == "parse" and result.raw == raw and len(result.message) < 300


BROKEN = {
    "unclosed": (wrap('{"a": 1', end=""), "not valid JSON"),
    "unclosed and deep": (wrap(UNCLOSED_AND_DEEP, end=""), "nested deeper"),
    "header never reaches the content": ("<|channel|>commentary to=functions.add <|constrain|>",
                                         "never reaches <|message|>"),
    "ended by end": (wrap('{"a": 1}', end="<|end|>"), "must end with <|call|>"),
    "ended by return": (wrap('{"a": 1}', end="<|return|>"), "must end with <|call|>"),
    "a builtin tool": ('<|channel|>analysis to=python<|message|>print(1)<|call|>', "functions."),
    "not json": ("<|channel|>commentary to=functions.add <|constrain|>text<|message|>1<|call|>",
                 "must be json"),
    "call token inside an argument": (wrap('{"q": "<|call|>"}'), "not valid JSON"),
    "unended message before the next": (wrap('{"a": 1', end="<|start|>assistant"),
                                        "not valid JSON"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_what_the_parser_refuses(case: str) -> None:
    text, needle = BROKEN[case]
    results = FMT.parse(text)
    errors = [r for r in results if isinstance(r, ToolCallParseError)]
    assert errors and errors[0].kind == "parse" and needle in errors[0].message, results


def test_arguments_that_are_not_an_object_or_a_missing_name() -> None:
    [listed] = FMT.parse(wrap("[1, 2]"))
    assert isinstance(listed, ToolCallParseError) and listed.kind == "invalid_arguments"
    [nameless] = FMT.parse(wrap('{"a": 1}', name=""))
    assert isinstance(nameless, ToolCallParseError) and nameless.kind == "missing_name"


def test_lone_surrogates_never_raise_and_can_be_stored() -> None:
    [unknown] = parse_tool_calls(wrap('{"a": 1}', name="add\ud800"), TOOLS, FMT)
    assert isinstance(unknown, ToolCallParseError) and unknown.kind == "unknown_tool"
    [parsed] = parse_tool_calls(wrap('{"query": "x\\udc00"}', name="search"), TOOLS, FMT)
    assert isinstance(parsed, ParsedToolCall) and storable(parsed) and storable(unknown)


PIECES = ["<|start|>", "assistant", "<|channel|>", "commentary", " to=functions.add", " to=",
          "<|constrain|>", "json", "<|message|>", "<|call|>", "<|end|>", "<|return|>", "{", "}",
          '"a"', ":", "1", "NaN", "7" * 4400, "[" * 2000, "\ud800"]  # fmt: skip
fragments = st.lists(st.one_of(st.sampled_from(PIECES), any_text), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(fragments)
def test_parser_never_raises_and_every_result_can_be_stored(text: str) -> None:
    for result in parse_tool_calls(text, TOOLS, FMT):
        assert storable(result)


def test_the_expert_solves_tasks_in_this_format() -> None:
    episode = run_expert(CalculatorEnv(tool_call_format="harmony"), seed=3)
    assert episode.success
    assert episode.messages[2].content.startswith("<|channel|>commentary to=functions.calculator")


def test_a_malformed_call_is_an_error_observation_and_counted() -> None:
    env = CalculatorEnv(tool_call_format="harmony")
    env.reset(seed=1)
    obs, _, terminated, _, info = env.step(wrap('{"expression": "1 +', name="calculator"))
    step = read_step_info(info)
    assert obs[0]["content"].startswith("Error: tool call is not valid JSON") and not terminated
    assert (step.malformed_tool_calls, env.malformed_tool_calls) == (1, 1)


def test_render_tools_is_harmonys_functions_namespace() -> None:
    weather = {
        "name": "get_current_weather",
        "description": "Gets the current weather in the provided location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. SF"},
                "format": {"type": "string", "enum": ["celsius", "fahrenheit"],
                           "default": "celsius"},
            },
            "required": ["location"],
        },
    }  # fmt: skip
    location = {"name": "get_location", "description": "Gets the location of the user."}
    assert FMT.render_tools([location, weather]) == (
        "# Tools\n\n## functions\n\nnamespace functions {\n\n"
        "// Gets the location of the user.\ntype get_location = () => any;\n\n"
        "// Gets the current weather in the provided location.\n"
        "type get_current_weather = (_: {\n// The city and state, e.g. SF\nlocation: string,\n"
        'format?: "celsius" | "fahrenheit", // default: celsius\n}) => any;\n\n'
        "} // namespace functions"
    )


def test_typescript_of_the_shapes_our_tools_produce() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "default": 3},
            "tags": {"type": "array", "items": {"type": "string"}},
            "maybe": {"anyOf": [{"type": "number"}, {"type": "null"}], "default": None},
            "point": {"$ref": "#/$defs/Point"},
            "anything": {},
        },
        "required": ["tags", "point", "anything"],
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}},
                            "required": ["x"]}},
    }  # fmt: skip
    assert render_typescript(schema) == (
        "{\nn?: number, // default: 3\ntags: string[],\nmaybe?: number | null, // default: null\n"
        "point: {\n    x: number,\n    },\nanything: any,\n}"
    )
