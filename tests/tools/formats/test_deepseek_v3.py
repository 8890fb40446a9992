"""DeepSeek V3's calls block (`<｜tool▁calls▁begin｜>`, one ```json block per call): its layout and
what the parser refuses. What every format does (round trips, hostile JSON, the format through a
tool env) is in test_every_format.py."""

from __future__ import annotations

import json

import pytest

from agent_grpo.testing.tool_formats import DEEPSEEK_V3_BEGIN as BEGIN
from agent_grpo.testing.tool_formats import DEEPSEEK_V3_END as END
from agent_grpo.testing.tool_formats import TOOLS, UNCLOSED_AND_DEEP, assert_refused
from agent_grpo.testing.tool_formats import deepseek_v3_block as block
from agent_grpo.testing.tool_formats import deepseek_v3_call as one
from agent_grpo.tools.formats import DeepSeekV3ToolCallFormat, ParsedToolCall, parse_tool_calls
from agent_grpo.tools.formats.deepseek_v3 import CALLS_BEGIN, CALLS_END

FMT = DeepSeekV3ToolCallFormat()


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
    add, search = one('{"a": 1}'), one('{"query": "x"}', name="search")
    assert FMT.parse(block(add, search) + "<｜end▁of▁sentence｜>") == [
        ParsedToolCall(name="add", arguments={"a": 1}, raw=add),
        ParsedToolCall(name="search", arguments={"query": "x"}, raw=search),
    ]


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


@pytest.mark.parametrize(("text", "needle"), BROKEN.values(), ids=list(BROKEN))
def test_what_the_parser_refuses(text: str, needle: str) -> None:
    assert_refused(FMT.parse(text), needle)


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


# ---- the turn as DeepSeek V3 templates take it ---------------------------------------------------


def test_structure_reads_the_text_before_the_calls_and_the_calls() -> None:
    call = FMT.render_call("add", {"a": 1})
    turn = FMT.structure(f"Let me add.\n{call}")
    assert turn is not None and turn.content == "Let me add.\n" and turn.reasoning is None
    assert [(c.name, c.arguments) for c in turn.calls] == [("add", {"a": 1})]
    two = call.removesuffix(CALLS_END) + "\n" + FMT.render_call("sub", {}).removeprefix(CALLS_BEGIN)
    structured = FMT.structure(two)
    assert structured is not None and [c.name for c in structured.calls] == ["add", "sub"]


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 42.",  # no calls block
        FMT.render_call("add", {"a": 1}) + " done",  # text after the block
        FMT.render_call("add", {}) + FMT.render_call("add", {}),  # two blocks
        FMT.render_call("add", {"a": 1}).replace("```json", "```"),  # malformed
        FMT.render_call("add", {}).replace("add", "bad name"),  # not a tool name
        FMT.render_call("add", {}).removesuffix(CALLS_END),  # never closed
    ],
)
def test_structure_refuses_other_shapes(text: str) -> None:
    assert FMT.structure(text) is None
