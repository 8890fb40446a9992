"""What every tool-call format in the registry must do, each test run once per format: rendered
calls parse back in order (any name, any arguments), answers are not calls, hostile JSON and lone
surrogates are error values that can be stored, the parser never raises on any text, and in a
tool env the expert solves tasks while a malformed call is an error observation, counted.

`CASES` says, per format, how its calls are written by hand (the writers in
`agent_grpo.testing.tool_formats`), where they stand in a turn, and what the env shows. What only
one format does (its exact layout, golden strings, what its parser refuses) is tested in that
format's own module beside this one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_grpo.envs.calculator import CalculatorEnv
from agent_grpo.envs.text_env import read_step_info, run_expert
from agent_grpo.testing.tool_formats import (
    DEEPSEEK_V3_BEGIN,
    DEEPSEEK_V3_END,
    HARMONY_ANALYSIS,
    HOSTILE_VALUES,
    TOOLS,
    any_text,
    arguments,
    deepseek_v3_block,
    deepseek_v3_call,
    harmony_call,
    hermes_call,
    llama3_call,
    mistral_call,
    mistral_v11_call,
    names_and_arguments,
    qwen3_coder_call,
    storable,
    tool_names,
)
from agent_grpo.tools.formats import (
    TOOL_FORMATS,
    ParsedToolCall,
    ToolCallParseError,
    get_tool_format,
    parse_tool_calls,
)


def _words(text: str) -> list[str]:
    """The pieces of `text` between its spaces (markup pieces written on one line)."""
    return text.split()


def _same(text: str) -> str:
    return text


def _deepseek_v3_unblocked(text: str) -> str:
    return text.removeprefix(DEEPSEEK_V3_BEGIN).removesuffix(DEEPSEEK_V3_END)


@dataclass(frozen=True)
class Case:
    """How these tests write one format's calls and where its calls stand in a turn."""

    write_json: Callable[[str, str], str] | None
    """(the arguments' JSON as given, tool name) -> a turn of that one call; None for a format
    whose arguments are not one JSON object (qwen3_coder)."""
    joiner: str = ""
    """What stands between two rendered calls in one turn."""
    prefix: str = ""
    """What stands before the first rendered call."""
    raw: Callable[[str], str] = _same
    """A rendered call's `raw` in a turn so written."""
    lead: str = ""
    """What the `raw` of a call after the first keeps of the joiner before it."""
    unreadable_raw: Callable[[str], str] = _same
    """The `raw` of the error for a turn of one written call whose JSON cannot be read."""
    name_apart: bool = False
    """Whether the name is read apart from the JSON, so that such an error still names the tool."""


def _deepseek_v3_turn(arguments_json: str, name: str) -> str:
    return deepseek_v3_block(deepseek_v3_call(arguments_json, name))


CASES = {
    "hermes": Case(hermes_call, joiner="thinking\n"),
    "qwen3_coder": Case(None, joiner="\n", name_apart=True),
    "llama3": Case(llama3_call, joiner="; ", lead=" "),
    "mistral": Case(mistral_call, raw=lambda text: text[len("[TOOL_CALLS][") : -len("]")]),
    "mistral_v11": Case(mistral_v11_call, name_apart=True),
    "harmony": Case(
        harmony_call,
        joiner="<|start|>assistant",
        prefix=HARMONY_ANALYSIS,
        raw=lambda text: "<|start|>assistant" + text,
        name_apart=True,
    ),
    "deepseek_v3": Case(
        _deepseek_v3_turn,
        raw=_deepseek_v3_unblocked,
        unreadable_raw=_deepseek_v3_unblocked,
        name_apart=True,
    ),
}
"""Every format in `TOOL_FORMATS`, by name."""

STOP_STRINGS = {
    "hermes": ["</tool_call>"],
    "qwen3_coder": ["</tool_call>"],
    "llama3": [],
    "mistral": [],
    "mistral_v11": [],
    "harmony": ["<|call|>"],
    "deepseek_v3": [DEEPSEEK_V3_END],
}

EXPERT_CALLS = {
    "hermes": '<tool_call>\n{"name": "calculator"',
    "qwen3_coder": "<tool_call>\n<function=calculator>\n<parameter=expression>\n",
    "llama3": '{"name": "calculator", "parameters": {"expression": ',
    "mistral": '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": ',
    "mistral_v11": '[TOOL_CALLS]calculator[ARGS]{"expression": ',
    "harmony": "<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>",
    "deepseek_v3": DEEPSEEK_V3_BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n",
}
"""How the expert's first call in the calculator env starts."""

NOT_JSON = "Error: tool call is not valid JSON: "
MALFORMED = {
    "hermes": ('<tool_call>{"name": "calculator"', "Error: <tool_call> is never closed"),
    "qwen3_coder": ("<tool_call>\n<function=calculator>\n", "Error: <tool_call> is never closed"),
    "llama3": (
        '{"name": "calculator", "parameters": {',
        NOT_JSON + "Expecting property name enclosed in double quotes: line 1 column 39 (char 38)",
    ),
    "mistral": (
        "Calling.[TOOL_CALLS]calculator",
        "Error: [TOOL_CALLS] must be followed by a JSON list of calls",
    ),
    "mistral_v11": (
        "Calling.[TOOL_CALLS]calculator",
        "Error: [TOOL_CALLS]NAME must be followed by [ARGS] and the arguments",
    ),
    "harmony": (
        harmony_call('{"expression": "1 +', name="calculator"),
        NOT_JSON + "Unterminated string starting at: line 1 column 16 (char 15)",
    ),
    "deepseek_v3": (
        DEEPSEEK_V3_BEGIN + deepseek_v3_call('{"expression": "1"}', name="calculator"),
        f"Error: {DEEPSEEK_V3_BEGIN} is never closed",
    ),
}
"""A turn whose call the format cannot read, as a policy might sample it, and what the env
answers it with."""

JSON_PIECES = [*_words('{ } [ ] " : , 1 NaN 1e999 \\ud800'), "7" * 4400, "[" * 2000, "\ud800", " "]
MISTRAL_PIECES = [*_words('[TOOL_CALLS] [ARGS] [CALL_ID] </s> "name" "arguments" "add" add')]
PIECES = {
    "hermes": [
        *_words('<tool_call> </tool_call> "name" "arguments" "add" "a"'),
        "\n",
        *JSON_PIECES,
    ],
    "qwen3_coder": [
        *_words("<tool_call> </tool_call> <function= </function> <parameter= </parameter>"),
        *_words("add a > 1 [ { NaN"),
        *("\n", "7" * 4400, "[" * 2000, "\ud800"),
    ],
    "llama3": [*_words('<|python_tag|> <|eom_id|> ; "name" "parameters" "add" "a"'), *JSON_PIECES],
    "mistral": [*MISTRAL_PIECES, *JSON_PIECES],
    "mistral_v11": [*MISTRAL_PIECES, *JSON_PIECES],
    "harmony": [
        *_words("<|start|> assistant <|channel|> commentary <|constrain|> json <|message|>"),
        *("<|call|>", "<|end|>", "<|return|>", " to=functions.add", " to="),
        *_words('{ } "a" : 1 NaN'),
        *("7" * 4400, "[" * 2000, "\ud800"),
    ],
    "deepseek_v3": [
        *(DEEPSEEK_V3_BEGIN, DEEPSEEK_V3_END, "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"),
        *_words('<｜tool▁sep｜> function add ```json ``` { } "a" : 1 NaN'),
        *("\n", "7" * 4400, "[" * 2000, "\ud800"),
    ],
}
"""Each format's markup and hostile bits, which the fuzzer strings together with any text."""

NAMES = sorted(CASES)
JSON_NAMES = [name for name in NAMES if CASES[name].write_json is not None]
"""The formats whose arguments are one JSON object, so that any JSON value can be written."""


def written(name: str, tool: str, **values: str) -> str:
    """A turn of one call of `tool` in format `name`, written by hand: each argument's value is
    the JSON text given; qwen3_coder writes a string's text, and any other value's JSON, between
    its tags, as its template does."""
    write_json = CASES[name].write_json
    if write_json is None:
        texts = {k: json.loads(v) if v.startswith('"') else v for k, v in values.items()}
        return qwen3_coder_call(tool, **texts)
    members = ", ".join(f"{json.dumps(k)}: {v}" for k, v in values.items())
    return write_json("{" + members + "}", tool)


def rendered_turn(name: str, calls: list[tuple[str, dict[str, Any]]]) -> tuple[str, list[str]]:
    """A turn of `calls` as format `name` renders them, and the `raw` each must parse back with."""
    case, fmt = CASES[name], get_tool_format(name)
    texts = [fmt.render_call(tool, args) for tool, args in calls]
    raws = [case.raw(text if i == 0 else case.lead + text) for i, text in enumerate(texts)]
    return case.prefix + case.joiner.join(texts), raws


def test_every_registered_format_has_its_case() -> None:
    for table in (CASES, STOP_STRINGS, EXPERT_CALLS, MALFORMED, PIECES):
        assert sorted(table) == sorted(TOOL_FORMATS)


@pytest.mark.parametrize("name", NAMES)
def test_rendered_calls_parse_back_in_order(name: str) -> None:
    calls: list[tuple[str, dict[str, Any]]] = [
        ("add", {"a": 1, "b": 2}),
        ("search", {"query": "x"}),
    ]
    text, raws = rendered_turn(name, calls)
    assert parse_tool_calls(text, TOOLS, get_tool_format(name)) == [
        ParsedToolCall(name=tool, arguments=args, raw=raw)
        for (tool, args), raw in zip(calls, raws, strict=True)
    ]


@pytest.mark.parametrize("name", JSON_NAMES)
@settings(max_examples=150, deadline=None)
@given(tool=tool_names, args=arguments)
def test_any_call_round_trips(name: str, tool: str, args: dict[str, Any]) -> None:
    text, raws = rendered_turn(name, [(tool, args)])
    results = get_tool_format(name).parse(text)
    assert names_and_arguments(results) == [(tool, args)]
    assert [r.raw for r in results] == raws


@pytest.mark.parametrize("name", JSON_NAMES)
@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.tuples(tool_names, arguments), min_size=1, max_size=4))
def test_any_calls_in_one_turn_round_trip(
    name: str, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    text, raws = rendered_turn(name, calls)
    results = get_tool_format(name).parse(text)
    assert names_and_arguments(results) == calls
    assert [r.raw for r in results] == raws


ANSWERS = [
    "",
    "The answer is 42.",
    "The answer is 9. </tool_call> is just text here",
    'I would call {"name": "add"} but no.',
    'The answer is 42. [{"name": "add"}]',
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("answer", ANSWERS)
def test_an_answer_is_not_a_call(name: str, answer: str) -> None:
    assert get_tool_format(name).parse(answer) == []
    assert parse_tool_calls(answer, TOOLS, get_tool_format(name)) == []


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", sorted(HOSTILE_VALUES))
def test_hostile_json_is_a_parse_error(name: str, case: str) -> None:
    text = written(name, "add", a=HOSTILE_VALUES[case])
    [result] = parse_tool_calls(text, TOOLS, get_tool_format(name))
    assert isinstance(result, ToolCallParseError)
    assert (result.kind, result.raw) == ("parse", CASES[name].unreadable_raw(text))
    assert result.name == ("add" if CASES[name].name_apart else None)
    assert len(result.message) < 300


@pytest.mark.parametrize("name", NAMES)
def test_lone_surrogates_never_raise_and_can_be_stored(name: str) -> None:
    fmt = get_tool_format(name)
    [unknown] = parse_tool_calls(written(name, "add\ud800", a="1"), TOOLS, fmt)
    assert isinstance(unknown, ToolCallParseError) and unknown.kind == "unknown_tool"
    [parsed] = parse_tool_calls(written(name, "search", query=json.dumps("x\udc00")), TOOLS, fmt)
    assert isinstance(parsed, ParsedToolCall) and parsed.arguments == {"query": "x\udc00"}
    assert storable(parsed) and storable(unknown)


@pytest.mark.parametrize("name", NAMES)
def test_a_call_without_a_name_is_missing_name(name: str) -> None:
    for nameless in (written(name, "", a="1"), written(name, " ")):
        [result] = get_tool_format(name).parse(nameless)
        assert isinstance(result, ToolCallParseError) and result.kind == "missing_name", nameless


@pytest.mark.parametrize("name", JSON_NAMES)
def test_arguments_that_are_not_an_object_are_invalid_arguments(name: str) -> None:
    write_json = CASES[name].write_json
    assert write_json is not None
    for listed in ("[1]", "[1, 2]"):
        [result] = get_tool_format(name).parse(write_json(listed, "add"))
        assert isinstance(result, ToolCallParseError) and result.kind == "invalid_arguments"
        assert result.name == "add" and "must be a JSON object, got list" in result.message


FRAGMENTS = {
    name: st.lists(st.one_of(st.sampled_from(pieces), any_text), max_size=30).map("".join)
    for name, pieces in PIECES.items()
}
"""Any text, strung together from each format's markup."""


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_parser_never_raises_and_every_result_can_be_stored(name: str, data: st.DataObject) -> None:
    text = data.draw(FRAGMENTS[name], label="text")
    for result in parse_tool_calls(text, TOOLS, get_tool_format(name)):
        assert storable(result)


@pytest.mark.parametrize("name", NAMES)
def test_the_expert_solves_tasks_in_this_format(name: str) -> None:
    env = CalculatorEnv(tool_call_format=name)
    episode = run_expert(env, seed=3)
    assert episode.success and episode.messages[2].content.startswith(EXPERT_CALLS[name])
    assert env.stop_strings == get_tool_format(name).stop_strings == STOP_STRINGS[name]


@pytest.mark.parametrize("name", NAMES)
def test_a_malformed_call_is_an_error_observation_and_counted(name: str) -> None:
    env = CalculatorEnv(tool_call_format=name)
    env.reset(seed=1)
    turn, observation = MALFORMED[name]
    obs, _, terminated, _, info = env.step(turn)
    step = read_step_info(info)
    assert obs[0]["content"] == observation and not terminated
    assert (step.malformed_tool_calls, env.malformed_tool_calls) == (1, 1)
    assert step.tool_calls[0].error_kind == "parse"
