"""Llama 3's JSON calls: the turn is `{"name", "parameters"}` (after `<|python_tag|>` or not),
`;` between calls, round trips, what the parser refuses, hostile JSON, and the format in an env."""

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
    Llama3ToolCallFormat,
    ParsedToolCall,
    ToolCallParseError,
    parse_tool_calls,
)

FMT = Llama3ToolCallFormat()


def wrap(arguments_json: str, name: str = "add") -> str:
    return '{"name": "' + name + '", "parameters": ' + arguments_json + "}"


def names_and_arguments(text: str) -> list[tuple[str | None, Any]]:
    return [(c.name, getattr(c, "arguments", None)) for c in FMT.parse(text)]


def test_render_call_is_the_templates_json_and_parses_back() -> None:
    text = FMT.render_call("search", {"query": "6 * 7; {x}", "k": 2})
    assert text == '{"name": "search", "parameters": {"query": "6 * 7; {x}", "k": 2}}'
    assert parse_tool_calls(text, TOOLS, FMT) == [
        ParsedToolCall(name="search", arguments={"query": "6 * 7; {x}", "k": 2}, raw=text)
    ]


def test_a_call_may_follow_the_python_tag_and_end_with_an_end_of_turn_token() -> None:
    for text in ("<|python_tag|>" + wrap('{"a": 1}'), wrap('{"a": 1}') + "<|eom_id|>",
                 "Let me add.<|python_tag|>" + wrap('{"a": 1}') + "\n<|eot_id|>"):  # fmt: skip
        assert names_and_arguments(text) == [("add", {"a": 1})], text
    [call] = FMT.parse("<|python_tag|>" + wrap('{"a": 1}'))
    assert call.raw.startswith("<|python_tag|>")


def test_arguments_is_accepted_too_but_not_both() -> None:
    assert names_and_arguments('{"name": "add", "arguments": {"a": 1}}') == [("add", {"a": 1})]
    [error] = FMT.parse('{"name": "add", "arguments": {}, "parameters": {}}')
    assert isinstance(error, ToolCallParseError) and "both" in error.message


def test_several_calls_are_separated_by_semicolons() -> None:
    first, second = FMT.render_call("add", {"a": 1}), FMT.render_call("search", {"query": ";"})
    calls = parse_tool_calls(f"{first}; {second}", TOOLS, FMT)
    assert [(c.name, getattr(c, "arguments", None)) for c in calls] == [
        ("add", {"a": 1}), ("search", {"query": ";"})
    ]  # fmt: skip


def test_an_answer_is_not_a_call() -> None:
    assert FMT.parse("The answer is 42.") == []
    assert FMT.parse("") == []
    assert FMT.parse('I would call {"name": "add"} but no.') == []


@settings(max_examples=150, deadline=None)
@given(tool_names, arguments)
def test_any_call_round_trips(name: str, args: dict[str, Any]) -> None:
    assert names_and_arguments(FMT.render_call(name, args)) == [(name, args)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(tool_names, arguments), min_size=1, max_size=4))
def test_any_calls_in_one_turn_round_trip(calls: list[tuple[str, dict[str, Any]]]) -> None:
    text = "; ".join(FMT.render_call(name, args) for name, args in calls)
    assert names_and_arguments(text) == calls


@pytest.mark.parametrize("case", sorted(HOSTILE_VALUES))
def test_hostile_json_is_a_parse_error(case: str) -> None:
    raw = wrap(hostile_arguments(case))
    [result] = parse_tool_calls(raw, TOOLS, FMT)
    assert isinstance(result, ToolCallParseError)
    assert result.kind == "parse" and result.raw == raw and len(result.message) < 300


BROKEN = {
    "unclosed": (wrap('{"a": 1'), "not valid JSON"),
    "unclosed and deep": (wrap(UNCLOSED_AND_DEEP), "nested deeper"),
    "not JSON after the tag": ('<|python_tag|>brave_search.call(query="x")', "not valid JSON"),
    "an answer that looks like JSON": ("{1, 2}", "not valid JSON"),
    "not an object": ("<|python_tag|>[1, 2]", "must be a JSON object"),
    "text after the call": (wrap('{"a": 1}') + " and done", "unexpected text after the call"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_what_the_parser_refuses(case: str) -> None:
    text, needle = BROKEN[case]
    *_, result = FMT.parse(text)
    assert isinstance(result, ToolCallParseError) and result.kind == "parse", result
    assert needle in result.message


def test_markup_inside_an_argument_is_plain_json_text() -> None:
    text = wrap(json.dumps({"a": "<|eot_id|>}; {<|python_tag|>"}))
    assert names_and_arguments(text) == [("add", {"a": "<|eot_id|>}; {<|python_tag|>"})]
    assert "<|" not in FMT.render_call("add", {"a": "<|eot_id|>"})  # no special token in SFT data


def test_lone_surrogates_never_raise_and_can_be_stored() -> None:
    [unknown] = parse_tool_calls(wrap('{"a": 1}', name="add\ud800"), TOOLS, FMT)
    assert isinstance(unknown, ToolCallParseError) and unknown.kind == "unknown_tool"
    [parsed] = parse_tool_calls(wrap('{"query": "x\\udc00"}', name="search"), TOOLS, FMT)
    assert isinstance(parsed, ParsedToolCall) and storable(parsed) and storable(unknown)


PIECES = ["<|python_tag|>", "<|eom_id|>", "{", "}", "[", "]", '"', ":", ",", ";", '"name"',
          '"parameters"', '"add"', '"a"', "1", "NaN", "1e999", "\\ud800", "7" * 4400, "[" * 2000,
          "\ud800", " "]  # fmt: skip
fragments = st.lists(st.one_of(st.sampled_from(PIECES), any_text), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(fragments)
def test_parser_never_raises_and_every_result_can_be_stored(text: str) -> None:
    for result in parse_tool_calls(text, TOOLS, FMT):
        assert storable(result)


def test_the_expert_solves_tasks_in_this_format() -> None:
    env = CalculatorEnv(tool_call_format="llama3")
    episode = run_expert(env, seed=3)
    assert episode.success and episode.messages[2].content.startswith('{"name": "calculator"')
    assert env.stop_strings == []


def test_a_malformed_call_is_an_error_observation_and_counted() -> None:
    env = CalculatorEnv(tool_call_format="llama3")
    env.reset(seed=1)
    obs, _, terminated, _, info = env.step('{"name": "calculator", "parameters": {')
    step = read_step_info(info)
    assert obs[0]["content"].startswith("Error: tool call is not valid JSON") and not terminated
    assert (step.malformed_tool_calls, env.malformed_tool_calls) == (1, 1)


def test_render_tools_follows_the_templates_system_message() -> None:
    schema = {"name": "add", "description": "Add.", "parameters": {"type": "object"}}
    block = FMT.render_tools([schema])
    assert block.startswith(
        "You have access to the following functions. To call a function, please respond with "
        'JSON for a function call.Respond in the format {"name": function name, "parameters": '
        "dictionary of argument name and its value}.Do not use variables.\n\n{\n    "
    )
    assert json.loads(block.split("\n\n", 1)[1]) == {"type": "function", "function": schema}
