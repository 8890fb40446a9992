"""Test doubles for the tool-call formats: a small tool table, the hostile JSON every parser must
survive, the check that a parse result can be stored, hypothesis strategies for tool names and
arguments (this module needs the dev extra's `hypothesis`), and calls of each format written by
hand (`hermes_call`, `llama3_call`, ...: the arguments as given, not through `render_call`).

tests/tools/formats/test_every_format.py writes `hostile_arguments(case)` into each format's call
syntax and expects a `parse` error value, never an exception, as the Hermes parser has always
done; each format's own tests write what only that format refuses with the same writers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from pydantic import BaseModel

from agent_grpo.tools.formats.base import ParsedToolCall, ToolCallParseError
from agent_grpo.trajectory.record import ToolCallRecord

__all__ = [
    "DEEPSEEK_V3_BEGIN",
    "DEEPSEEK_V3_END",
    "HARMONY_ANALYSIS",
    "HOSTILE_VALUES",
    "TOOLS",
    "UNCLOSED_AND_DEEP",
    "AddArgs",
    "FakeTool",
    "SearchArgs",
    "any_text",
    "arguments",
    "assert_refused",
    "deepseek_v3_block",
    "deepseek_v3_call",
    "harmony_call",
    "hermes_call",
    "hostile_arguments",
    "json_type",
    "json_values",
    "llama3_call",
    "mistral_call",
    "mistral_v11_call",
    "names_and_arguments",
    "nested",
    "qwen3_coder_call",
    "storable",
    "tool_names",
]


class AddArgs(BaseModel):
    """An integer and an optional float: typed values for the hostile numbers to land in."""

    a: int
    b: float = 0.0


class SearchArgs(BaseModel):
    """A string, an int, an object and a flag: one value of every shape a format writes."""

    query: str
    k: int = 3
    filters: dict[str, Any] = {}
    exact: bool = False


@dataclass(frozen=True)
class FakeTool:
    """A tool as `parse_tool_calls` sees it: only its args model."""

    args_model: type[BaseModel]


TOOLS = {"add": FakeTool(AddArgs), "search": FakeTool(SearchArgs)}
"""The tool table the format tests validate against."""


def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    """`depth` levels of `open_ ... close` around nothing (`[[[]]]`)."""
    return open_ * depth + close * depth


HOSTILE_VALUES = {
    "arrays_1000_deep": nested(1000),
    "arrays_100000_deep": nested(100_000),
    "objects_1000_deep": nested(1000, '{"a": ', "}").replace('{"a": }', '{"a": 1}'),
    # Below Python's recursion limit, above what a record can be serialized with (about 255).
    "arrays_300_deep": nested(300),
    "integer_5000_digits": "7" * 5000,
    "float_overflow": "1e999",
    "negative_float_overflow": "-1e999",
    "nan": "NaN",
    "infinity": "-Infinity",
}
"""JSON text for the value of the argument `a` that no parser may hold."""

UNCLOSED_AND_DEEP = '{"a": ' + "[" * 100_000
"""Arguments that never close and nest past any recursion limit."""


def hostile_arguments(case: str) -> str:
    """The arguments object `{"a": <HOSTILE_VALUES[case]>}` as JSON text."""
    return '{"a": ' + HOSTILE_VALUES[case] + "}"


def storable(result: ParsedToolCall | ToolCallParseError) -> bool:
    """Whether a parse result survives a round trip through a stored `ToolCallRecord`."""
    arguments = result.arguments if isinstance(result, ParsedToolCall) else None
    error = result.message if isinstance(result, ToolCallParseError) else None
    name, raw = result.name or "", result.raw
    record = ToolCallRecord(name=name, arguments=arguments, raw=raw, error=error)
    return ToolCallRecord.model_validate_json(record.model_dump_json()) == record


def names_and_arguments(
    results: Sequence[ParsedToolCall | ToolCallParseError],
) -> list[tuple[str | None, Any]]:
    """Each result's name and arguments (None for an error): what a round trip must give back."""
    return [(r.name, r.arguments if isinstance(r, ParsedToolCall) else None) for r in results]


def assert_refused(results: Sequence[ParsedToolCall | ToolCallParseError], needle: str) -> None:
    """That a parser refused a turn: its first error and its last result are `parse` errors whose
    message holds `needle` (a well-formed call before the refused one may stand first)."""
    errors = [r for r in results if isinstance(r, ToolCallParseError)]
    assert errors and isinstance(results[-1], ToolCallParseError), results
    for error in (errors[0], results[-1]):
        assert error.kind == "parse" and needle in error.message, results


def hermes_call(arguments_json: str, name: str = "add") -> str:
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the arguments as given."""
    return '<tool_call>{"name": "' + name + '", "arguments": ' + arguments_json + "}</tool_call>"


def llama3_call(arguments_json: str, name: str = "add") -> str:
    """Llama 3's `{"name": ..., "parameters": ...}`, the arguments as given."""
    return '{"name": "' + name + '", "parameters": ' + arguments_json + "}"


def mistral_call(arguments_json: str, name: str = "add") -> str:
    """Mistral's `[TOOL_CALLS]` list (v2-v7) of one call, the arguments as given."""
    return '[TOOL_CALLS][{"name": "' + name + '", "arguments": ' + arguments_json + "}]"


def mistral_v11_call(arguments_json: str, name: str = "add") -> str:
    """Mistral v11's `[TOOL_CALLS]NAME[ARGS]{...}`, the arguments as given."""
    return f"[TOOL_CALLS]{name}[ARGS]{arguments_json}"


HARMONY_ANALYSIS = "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant"
"""An analysis message before a call: in a Harmony turn each message after it starts anew."""


def harmony_call(arguments_json: str, name: str = "add", end: str = "<|call|>") -> str:
    """A Harmony commentary message to `functions.NAME`, the arguments as given, ended by `end`."""
    header = f"<|channel|>commentary to=functions.{name} <|constrain|>json"
    return f"{header}<|message|>{arguments_json}{end}"


DEEPSEEK_V3_BEGIN, DEEPSEEK_V3_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
"""The markers around DeepSeek V3's block of calls."""


def deepseek_v3_call(arguments_json: str, name: str = "add", kind: str = "function") -> str:
    """One DeepSeek V3 call (without the block around it), the arguments as given."""
    return (
        f"<｜tool▁call▁begin｜>{kind}<｜tool▁sep｜>{name}\n```json\n{arguments_json}\n```"
        "<｜tool▁call▁end｜>"
    )


def deepseek_v3_block(*calls: str) -> str:
    """DeepSeek V3's block around `calls`, one a line."""
    return DEEPSEEK_V3_BEGIN + "\n".join(calls) + DEEPSEEK_V3_END


def qwen3_coder_call(name: str, **values: str) -> str:
    """A Qwen3-Coder call, each value as the text between its tags."""
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def json_type(value: Any) -> str:
    """The JSON schema type of a Python value (`integer`, `string`, ...)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if value is None:
        return "null"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
"""Any text, lone surrogates, control characters and markup-looking runs included."""

tool_names = st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True)
"""Every name `agent_grpo.tools.tool.check_tool_name` accepts."""

_MARKUP = st.sampled_from(
    ["</tool_call>", "<tool_call>", "</parameter>", "<|im_end|>", "<|call|>", "<|message|>",
     "[TOOL_CALLS]", "[ARGS]", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "```", ";", "\n"]
)  # fmt: skip
_texts = st.lists(st.one_of(any_text, _MARKUP), max_size=4).map("".join)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | _texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_texts, inner, max_size=3),
    max_leaves=12,
)
"""JSON values a tool may be called with (finite numbers), strings full of markup."""

arguments = st.dictionaries(_texts, json_values, max_size=4)
"""Tool-call arguments: an object of JSON values."""
