"""DeepSeek V3: calls in a `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>` block.

Each call inside the block (newlines between calls allowed) is

    <｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator
    ```json
    {"expression": "6 * 7"}
    ```<｜tool▁call▁end｜>

The markers hold U+FF5C (fullwidth bar) and U+2581 (lower one-eighth block), as the tokenizer's
special tokens spell them. `<｜tool▁calls▁end｜>` is the stop string. Tools are announced as in
vLLM's DeepSeek-V3 tool template (the official template writes no tool list): JSON schemas in
`<tools></tools>`, then how to write a call with these markers. V3.1 and later write calls
differently (`NAME<｜tool▁sep｜>{...}`, no code block) and are not this format.

What the parser refuses (`parse` errors): a calls block or a call never closed, a call marker
outside a calls block, text between calls, a call type other than `function`, arguments that are
not a ```` ```json ```` code block holding one JSON object.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent_grpo.tools.formats.base import (
    TOOL_NAME,
    ParsedToolCall,
    StructuredTurn,
    ToolCallParseError,
    arguments_call,
    as_function,
    dump_json,
    find_tagged_blocks,
    parse_error,
    short_repr,
)

__all__ = ["DeepSeekV3ToolCallFormat"]

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
SEP, EOS = "<｜tool▁sep｜>", "<｜end▁of▁sentence｜>"
FENCE, FENCE_END = "```json", "```"

Parsed = list[ParsedToolCall | ToolCallParseError]

_INSTRUCTIONS = (
    "\n</tools>\n\n"
    f"For function call returns, you should first print {CALLS_BEGIN}"
    "For each function call, you should return object like:\n"
    f"{CALL_BEGIN}function{SEP}<function_name>\n```json\n<function_arguments_in_json_format>\n"
    f"```{CALL_END}"
    f"At the end of function call returns, you should print {CALLS_END}{EOS}"
)


class DeepSeekV3ToolCallFormat:
    """DeepSeek V3: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and a ```json block."""

    name = "deepseek_v3"

    @property
    def stop_strings(self) -> list[str]:
        """End the turn after the calls block."""
        return [CALLS_END]

    def parse(self, text: str) -> Parsed:
        """Every call of every calls block in the turn, in order."""
        blocks = find_tagged_blocks(text, CALLS_BEGIN, CALLS_END)
        if not blocks and CALL_BEGIN in text:
            return [parse_error(text, f"{CALL_BEGIN} outside a {CALLS_BEGIN} block")]
        calls: Parsed = []
        for raw, inner in blocks:
            if inner is None:
                calls.append(parse_error(raw, f"{CALLS_BEGIN} is never closed"))
            else:
                calls += _block_calls(raw, inner)
        return calls

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call in its own calls block."""
        call = f"{CALL_BEGIN}function{SEP}{name}\n{FENCE}\n{dump_json(dict(arguments))}\n"
        return f"{CALLS_BEGIN}{call}{FENCE_END}{CALL_END}{CALLS_END}"

    def render_tools(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        """The JSON schemas in `<tools>`, then the template's instructions."""
        lines = "".join("\n" + dump_json(as_function(schema)) for schema in schemas)
        head = (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        )
        return head + lines + _INSTRUCTIONS

    def structure(self, text: str) -> StructuredTurn | None:
        """The turn as DeepSeek V3 templates take it: the text before its one calls block as
        `content`, and the block's calls. None for any other shape (no block, two, a malformed
        call, text after the block): the template then renders the turn as its text."""
        blocks = find_tagged_blocks(text, CALLS_BEGIN, CALLS_END)
        if len(blocks) != 1 or blocks[0][1] is None or not text.endswith(blocks[0][0]):
            return None
        calls = _block_calls(blocks[0][0], blocks[0][1])
        named = [c for c in calls if isinstance(c, ParsedToolCall) and TOOL_NAME.fullmatch(c.name)]
        if len(named) != len(calls):
            return None
        return StructuredTurn(content=text[: text.find(CALLS_BEGIN)], calls=tuple(named))


def _block_calls(raw: str, inner: str) -> Parsed:
    """The calls of one closed block; text between them is an error."""
    calls: Parsed = []
    pos = 0
    while (begin := inner.find(CALL_BEGIN, pos)) != -1:
        if inner[pos:begin].strip():
            return [*calls, parse_error(raw, f"unexpected text between calls in {CALLS_BEGIN}")]
        close = inner.find(CALL_END, begin)
        reopen = inner.find(CALL_BEGIN, begin + len(CALL_BEGIN))
        if close == -1 or (reopen != -1 and reopen < close):
            return [*calls, parse_error(inner[begin:], f"{CALL_BEGIN} is never closed")]
        end = close + len(CALL_END)
        calls.append(_call(inner[begin:end], inner[begin + len(CALL_BEGIN) : close]))
        pos = end
    if inner[pos:].strip():
        return [*calls, parse_error(raw, f"unexpected text in {CALLS_BEGIN} (expected calls)")]
    return calls or [parse_error(raw, f"{CALLS_BEGIN} holds no {CALL_BEGIN}")]


def _call(raw: str, inner: str) -> ParsedToolCall | ToolCallParseError:
    """`function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```` of one call."""
    kind, sep, rest = inner.partition(SEP)
    if not sep:
        return parse_error(raw, f"a call must be written function{SEP}NAME")
    if kind.strip() != "function":
        return parse_error(raw, f"call type must be function, got {short_repr(kind.strip())}")
    name, newline, body = rest.partition("\n")
    body = body.strip()
    if not newline or not body.startswith(FENCE) or not body.endswith(FENCE_END):
        return parse_error(raw, "the arguments must follow the name as a ```json code block")
    return arguments_call(raw, name.strip(), body[len(FENCE) : -len(FENCE_END)])
