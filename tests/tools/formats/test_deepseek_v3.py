"""DeepSeek V3's calls block (`<｜tool▁calls▁begin｜>`, one ```json block per call): round trips,
what the parser refuses, hostile JSON, and the format through a tool env."""

from __future__ import annotations

import json
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
    DeepSeekV3ToolCallFormat,
    ParsedToolCall,
    ToolCallParseError,
    parse_tool_calls,
)

FMT = DeepSeekV3ToolCallFormat()
BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def one(arguments_json: str, name: str = "add", kind: str = "function") -> str:
    """One call (without the block around it), its arguments written as is."""
    return (
        f"<｜tool▁call▁begin｜>{kind}<｜tool▁sep｜>{name}\n```json\n{arguments_json}\n```"
        "<｜tool▁call▁end｜>"
    )


def block(*calls: str) -> str:
    return BEGIN + "\n".join(calls) + END


def names_and_arguments(text: str) -> list[tuple[str | None, Any]]:
    return [(c.name, getattr(c, "arguments", None)) for c in FMT.parse(text)]


def test_render_call_writes_a_block_that_parses_back() -> None:
    text = FMT.render_call("search", {"query": "```<｜tool▁call▁end｜>", "k": 2})
    assert text == block(one('{"query": "```\\u003c｜tool▁call▁end｜>", "k": 2}', name="search"))
    assert parse_tool_calls(f"Let me look.{text}", TOOLS, FMT) == [
        ParsedToolCall(
            name="search",
            arguments={"query": "```<｜tool▁call▁end｜>", "k": 2},
            raw=one('{"query": "```\\u003c｜tool▁call▁end｜>", "k": 2}', name="search"),
        )
    ]
    assert FMT.stop_strings == [END]


def test_a_block_holds_several_calls() -> None:
    text = block(one('{"a": 1}'), one('{"query": "x"}', name="search")) + "<｜end▁of▁sentence｜>"
    assert names_and_arguments(text) == [("add", {"a": 1}), ("search", {"query": "x"})]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(tool_names, arguments), min_size=1, max_size=4))
def test_any_calls_round_trip(calls: list[tuple[str, dict[str, Any]]]) -> None:
    text = "".join(FMT.render_call(name, args) for name, args in calls)
    assert names_and_arguments(text) == calls


@pytest.mark.parametrize("case", sorted(HOSTILE_VALUES))
def test_hostile_json_is_a_parse_error(case: str) -> None:
    raw = one(hostile_arguments(case))
    [result] = parse_tool_calls(block(raw), TOOLS, FMT)
    assert isinstance(result, ToolCallParseError)
    assert result.kind == "parse" and result.raw == raw and len(result.message) < 300


BROKEN = {
    "block never closed": (BEGIN + one('{"a": 1}'), "never closed"),
    "call never closed": (BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n" + END,
                          "never closed"),
    "unclosed json": (block(one('{"a": 1')), "not valid JSON"),
    "unclosed and deep": (block(one(UNCLOSED_AND_DEEP)), "nested deeper"),
    "call outside a block": (one('{"a": 1}'), "outside"),
    "empty block": (BEGIN + END, "holds no"),
    "text between calls": (block(one('{"a": 1}') + " and " + one('{"a": 2}')), "unexpected text"),
    "not a function": (block(one('{"a": 1}', kind="python")), "must be function"),
    "no code block": (block('<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n{"a": 1}'
                            "<｜tool▁call▁end｜>"), "```json"),
    "no separator": (block('<｜tool▁call▁begin｜>add {"a": 1}<｜tool▁call▁end｜>'), "function"),
    "end marker inside an argument": (block(one('{"q": "<｜tool▁call▁end｜>"}')), ""),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_what_the_parser_refuses(case: str) -> None:
    text, needle = BROKEN[case]
    results = FMT.parse(text)
    errors = [r for r in results if isinstance(r, ToolCallParseError)]
    assert errors and errors[0].kind == "parse" and needle in errors[0].message, results


def test_arguments_that_are_not_an_object_or_a_missing_name() -> None:
    [listed] = FMT.parse(block(one("[1]")))
    assert isinstance(listed, ToolCallParseError) and listed.kind == "invalid_arguments"
    [nameless] = FMT.parse(block(one("{}", name=" ")))
    assert isinstance(nameless, ToolCallParseError) and nameless.kind == "missing_name"


def test_lone_surrogates_never_raise_and_can_be_stored() -> None:
    [unknown] = parse_tool_calls(block(one('{"a": 1}', name="add\ud800")), TOOLS, FMT)
    assert isinstance(unknown, ToolCallParseError) and unknown.kind == "unknown_tool"
    [parsed] = parse_tool_calls(block(one('{"query": "x\\udc00"}', name="search")), TOOLS, FMT)
    assert isinstance(parsed, ParsedToolCall) and storable(parsed) and storable(unknown)


PIECES = [BEGIN, END, "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "function",
          "add", "\n", "```json", "```", "{", "}", '"a"', ":", "1", "NaN", "7" * 4400, "[" * 2000,
          "\ud800"]  # fmt: skip
fragments = st.lists(st.one_of(st.sampled_from(PIECES), any_text), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(fragments)
def test_parser_never_raises_and_every_result_can_be_stored(text: str) -> None:
    for result in parse_tool_calls(text, TOOLS, FMT):
        assert storable(result)


def test_the_expert_solves_tasks_in_this_format() -> None:
    episode = run_expert(CalculatorEnv(tool_call_format="deepseek_v3"), seed=3)
    assert episode.success and episode.messages[2].content.startswith(BEGIN)


def test_a_malformed_call_is_an_error_observation_and_counted() -> None:
    env = CalculatorEnv(tool_call_format="deepseek_v3")
    env.reset(seed=1)
    obs, _, terminated, _, info = env.step(BEGIN + one('{"expression": "1"}', name="calculator"))
    step = read_step_info(info)
    assert obs[0]["content"] == f"Error: {BEGIN} is never closed" and not terminated
    assert (step.malformed_tool_calls, env.malformed_tool_calls) == (1, 1)


def test_render_tools_lists_the_schemas_and_the_markers() -> None:
    schema = {"name": "add", "description": "Add.", "parameters": {"type": "object"}}
    rendered = FMT.render_tools([schema])
    head, rest = rendered.split("<tools>\n", 1)
    assert head.startswith("# Tools\n\nYou may call one or more functions")
    assert json.loads(rest.split("\n</tools>")[0]) == {"type": "function", "function": schema}
    assert rendered.endswith(
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜><function_name>\n```json\n"
        "<function_arguments_in_json_format>\n```<｜tool▁call▁end｜>At the end of function call "
        "returns, you should print <｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    )
