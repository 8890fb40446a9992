"""gpt-oss Harmony: calls are `commentary` messages to `functions.NAME`; other channels are not
calls; what the parser refuses and the TypeScript tool declarations. What every format does
(round trips, hostile JSON, the format through a tool env) is in test_every_format.py."""

from __future__ import annotations

import pytest

from agent_grpo.testing.tool_formats import (
    HARMONY_ANALYSIS,
    TOOLS,
    UNCLOSED_AND_DEEP,
    assert_refused,
    harmony_call,
    names_and_arguments,
)
from agent_grpo.tools.formats import HarmonyToolCallFormat, ParsedToolCall, parse_tool_calls
from agent_grpo.tools.formats.harmony import render_typescript

FMT = HarmonyToolCallFormat()


def test_render_call_is_a_commentary_message_to_the_function() -> None:
    text = FMT.render_call("search", {"query": "<|call|>", "k": 2})
    assert text == (
        "<|channel|>commentary to=functions.search <|constrain|>json<|message|>"
        '{"query": "\\u003c|call|>", "k": 2}<|call|>'
    )
    calls = parse_tool_calls(f"{HARMONY_ANALYSIS}{text}", TOOLS, FMT)
    assert calls == [
        ParsedToolCall(
            name="search", arguments={"query": "<|call|>", "k": 2}, raw=f"<|start|>assistant{text}"
        )
    ]
    assert FMT.stop_strings == ["<|call|>"]


def test_the_recipient_may_sit_in_the_role_part_of_the_header() -> None:
    header = " to=functions.add<|channel|>commentary json"
    text = f'{HARMONY_ANALYSIS}{header}<|message|>{{"a": 1}}<|call|>'
    assert names_and_arguments(FMT.parse(text)) == [("add", {"a": 1})]
    # No content type, and the <|call|> taken off as the turn's end:
    bare = '<|channel|>commentary to=functions.add<|message|>{"a": 1}'
    assert names_and_arguments(FMT.parse(bare)) == [("add", {"a": 1})]


def test_messages_without_a_recipient_are_not_calls() -> None:
    final = f"{HARMONY_ANALYSIS}<|channel|>final<|message|>The answer is 42.<|return|>"
    preamble = "<|channel|>commentary<|message|>I will add.<|end|><|start|>assistant"
    assert FMT.parse(final) == []
    assert names_and_arguments(FMT.parse(preamble + harmony_call('{"a": 1}'))) == [
        ("add", {"a": 1})
    ]


BROKEN = {
    "unclosed": (harmony_call('{"a": 1', end=""), "not valid JSON"),
    "unclosed and deep": (harmony_call(UNCLOSED_AND_DEEP, end=""), "nested deeper"),
    "header never reaches the content": ("<|channel|>commentary to=functions.add <|constrain|>",
                                         "never reaches <|message|>"),
    "ended by end": (harmony_call('{"a": 1}', end="<|end|>"), "must end with <|call|>"),
    "ended by return": (harmony_call('{"a": 1}', end="<|return|>"), "must end with <|call|>"),
    "a builtin tool": ('<|channel|>analysis to=python<|message|>print(1)<|call|>', "functions."),
    "not json": ("<|channel|>commentary to=functions.add <|constrain|>text<|message|>1<|call|>",
                 "must be json"),
    "call token inside an argument": (harmony_call('{"q": "<|call|>"}'), "not valid JSON"),
    "unended message before the next": (harmony_call('{"a": 1', end="<|start|>assistant"),
                                        "not valid JSON"),
}  # fmt: skip


@pytest.mark.parametrize(("text", "needle"), BROKEN.values(), ids=list(BROKEN))
def test_what_the_parser_refuses(text: str, needle: str) -> None:
    assert_refused(FMT.parse(text), needle)


def test_render_tools_is_harmonys_functions_namespace() -> None:
    properties = {
        "location": {"type": "string", "description": "The city and state, e.g. SF"},
        "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
    }
    weather = {
        "name": "get_current_weather",
        "description": "Gets the current weather in the provided location.",
        "parameters": {"type": "object", "properties": properties, "required": ["location"]},
    }
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


# ---- the turn as gpt-oss templates take it -------------------------------------------------------

FINAL = "<|channel|>final<|message|>The answer is 42."


def test_structure_reads_the_analysis_the_final_answer_and_the_calls() -> None:
    call = FMT.render_call("add", {"a": 1})
    with_analysis = FMT.structure(f"{HARMONY_ANALYSIS}{call}")
    assert with_analysis is not None and with_analysis.reasoning == "Need the tool."
    assert [(c.name, c.arguments) for c in with_analysis.calls] == [("add", {"a": 1})]
    assert with_analysis.content == ""
    two = FMT.structure(f"{call}<|start|>assistant{FMT.render_call('search', {})}")
    assert two is not None and [c.name for c in two.calls] == ["add", "search"]
    final = FMT.structure(f"{HARMONY_ANALYSIS}{FINAL}")  # its <|return|> taken off as the turn end
    assert final is not None and (final.content, final.reasoning, final.calls) == (
        "The answer is 42.",
        "Need the tool.",
        (),
    )
    assert FMT.structure(f"{FINAL}<|return|>") == final.model_copy(update={"reasoning": None})
    # the call's <|call|> taken off, or never sampled: still a call
    cut = FMT.structure(call.removesuffix("<|call|>"))
    assert cut is not None and [(c.name, c.arguments) for c in cut.calls] == [("add", {"a": 1})]


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 42.",  # no Harmony message at all
        "<|channel|>commentary<|message|>I will add.<|end|><|start|>assistant"
        + harmony_call('{"a": 1}'),  # a preamble has no field of its own
        HARMONY_ANALYSIS + HARMONY_ANALYSIS.removeprefix("<|channel|>") + FINAL,  # two analyses
        harmony_call('{"a": 1'),  # malformed
        harmony_call('{"a": 1}', name="add|x"),  # a name that is not a tool name
        harmony_call('{"a": 1}', end="<|end|>"),  # a call ended otherwise
        "<|channel|>final<|message|>a<|channel|>final<|message|>b",  # markup in the text
        f"{FINAL}<|end|><|start|>assistant{harmony_call('{}')}",  # an answer and a call
    ],
)
def test_structure_refuses_other_shapes(text: str) -> None:
    assert FMT.structure(text) is None
