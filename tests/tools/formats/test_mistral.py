"""Mistral's two layouts after `[TOOL_CALLS]`: the JSON list (v2-v7) and `NAME[ARGS]{...}`
(v11+): round trips, what each refuses, hostile JSON, and both through a tool env."""

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
    MistralToolCallFormat,
    MistralV11ToolCallFormat,
    ParsedToolCall,
    ToolCallParseError,
    parse_tool_calls,
)

LIST, V11 = MistralToolCallFormat(), MistralV11ToolCallFormat()
FORMATS = {"mistral": LIST, "mistral_v11": V11}


def wrap(name: str, arguments_json: str, tool: str = "add") -> str:
    """A call with `arguments_json` written as is, in the layout of format `name`."""
    if name == "mistral":
        return '[TOOL_CALLS][{"name": "' + tool + '", "arguments": ' + arguments_json + "}]"
    return f"[TOOL_CALLS]{tool}[ARGS]{arguments_json}"


def names_and_arguments(fmt: Any, text: str) -> list[tuple[str | None, Any]]:
    return [(c.name, getattr(c, "arguments", None)) for c in fmt.parse(text)]


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
    assert names_and_arguments(LIST, text) == [("add", {"a": 1}), ("search", {"query": "]"})]


def test_v11_calls_follow_each_other_and_may_carry_a_call_id() -> None:
    text = '[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}[TOOL_CALLS]search[ARGS]{"query": "x"}'
    assert names_and_arguments(V11, text) == [("add", {"a": 1}), ("search", {"query": "x"})]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_text_without_the_token_is_an_answer(name: str) -> None:
    assert FORMATS[name].parse('The answer is 42. [{"name": "add"}]') == []


@pytest.mark.parametrize("name", sorted(FORMATS))
@settings(max_examples=100, deadline=None)
@given(calls=st.lists(st.tuples(tool_names, arguments), min_size=1, max_size=4))
def test_any_calls_round_trip(name: str, calls: list[tuple[str, dict[str, Any]]]) -> None:
    fmt = FORMATS[name]
    text = "".join(fmt.render_call(tool, args) for tool, args in calls)
    assert names_and_arguments(fmt, text) == calls


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("case", sorted(HOSTILE_VALUES))
def test_hostile_json_is_a_parse_error(name: str, case: str) -> None:
    raw = wrap(name, hostile_arguments(case))
    [result] = parse_tool_calls(raw, TOOLS, FORMATS[name])
    assert isinstance(result, ToolCallParseError)
    assert result.kind == "parse" and result.raw == raw and len(result.message) < 300


BROKEN = {
    ("mistral", "list never closed"): ('[TOOL_CALLS][{"name": "add", "arguments": {}}', "closed"),
    ("mistral", "unclosed call"): (wrap("mistral", '{"a": 1'), "not valid JSON"),
    ("mistral", "unclosed and deep"): (wrap("mistral", UNCLOSED_AND_DEEP), "nested deeper"),
    ("mistral", "no list"): ('[TOOL_CALLS]{"name": "add"}', "JSON list"),
    ("mistral", "empty list"): ("[TOOL_CALLS][]", "lists no call"),
    ("mistral", "v11 layout"): ('[TOOL_CALLS]add[ARGS]{"a": 1}', "JSON list"),
    ("mistral", "text after the list"): (wrap("mistral", '{"a": 1}') + " ok", "unexpected text"),
    ("mistral", "token inside an argument"): (wrap("mistral", '{"q": "[TOOL_CALLS]"}'), ""),
    ("mistral_v11", "no [ARGS]"): ("[TOOL_CALLS]add", "[ARGS]"),
    ("mistral_v11", "unclosed"): (wrap("mistral_v11", '{"a": 1'), "not valid JSON"),
    ("mistral_v11", "unclosed and deep"): (wrap("mistral_v11", UNCLOSED_AND_DEEP), "nested"),
    ("mistral_v11", "list layout"): (wrap("mistral", '{"a": 1}'), "[ARGS]"),
    ("mistral_v11", "token inside an argument"): (wrap("mistral_v11", '{"q": "[TOOL_CALLS]"}'),
                                                  ""),
}  # fmt: skip


@pytest.mark.parametrize("key", sorted(BROKEN))
def test_what_the_parser_refuses(key: tuple[str, str]) -> None:
    text, needle = BROKEN[key]
    results = FORMATS[key[0]].parse(text)
    errors = [r for r in results if isinstance(r, ToolCallParseError)]
    assert errors and errors[0].kind == "parse" and needle in errors[0].message, results


def test_v11_without_a_name_is_missing_name() -> None:
    [result] = V11.parse('[TOOL_CALLS][ARGS]{"a": 1}')
    assert isinstance(result, ToolCallParseError) and result.kind == "missing_name"


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_lone_surrogates_never_raise_and_can_be_stored(name: str) -> None:
    fmt = FORMATS[name]
    [unknown] = parse_tool_calls(wrap(name, '{"a": 1}', tool="add\ud800"), TOOLS, fmt)
    assert isinstance(unknown, ToolCallParseError) and unknown.kind == "unknown_tool"
    [parsed] = parse_tool_calls(wrap(name, '{"query": "x\\udc00"}', tool="search"), TOOLS, fmt)
    assert isinstance(parsed, ParsedToolCall) and storable(parsed) and storable(unknown)


PIECES = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "</s>", "[", "]", "{", "}", '"', ":", ",",
          '"name"', '"arguments"', '"add"', "add", "1", "NaN", "\\ud800", "7" * 4400, "[" * 2000,
          "\ud800", " "]  # fmt: skip
fragments = st.lists(st.one_of(st.sampled_from(PIECES), any_text), max_size=30).map("".join)


@pytest.mark.parametrize("name", sorted(FORMATS))
@settings(max_examples=200, deadline=None)
@given(text=fragments)
def test_parser_never_raises_and_every_result_can_be_stored(name: str, text: str) -> None:
    for result in parse_tool_calls(text, TOOLS, FORMATS[name]):
        assert storable(result)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_expert_solves_tasks_in_this_format(name: str) -> None:
    env = CalculatorEnv(tool_call_format=name)
    episode = run_expert(env, seed=3)
    assert episode.success and episode.messages[2].content.startswith("[TOOL_CALLS]")
    assert env.stop_strings == []


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_malformed_call_is_an_error_observation_and_counted(name: str) -> None:
    env = CalculatorEnv(tool_call_format=name)
    env.reset(seed=1)
    obs, _, terminated, _, info = env.step("Calling.[TOOL_CALLS]calculator")
    step = read_step_info(info)
    assert obs[0]["content"].startswith("Error:") and not terminated
    assert (step.malformed_tool_calls, env.malformed_tool_calls) == (1, 1)


def test_render_tools_is_the_available_tools_block() -> None:
    schema = {"name": "add", "description": "Add.", "parameters": {"type": "object"}}
    for fmt in (LIST, V11):
        block = fmt.render_tools([schema])
        assert block.startswith("[AVAILABLE_TOOLS][") and block.endswith("][/AVAILABLE_TOOLS]")
        listed = block.removeprefix("[AVAILABLE_TOOLS]").removesuffix("[/AVAILABLE_TOOLS]")
        assert json.loads(listed) == [{"type": "function", "function": schema}]
