"""Llama 3.1 / 3.2 / 3.3: the whole turn is `{"name": ..., "parameters": {...}}`.

Llama 3's chat template tells the model to answer with a JSON object and nothing else, so a turn
is a call when it begins (after whitespace) with `{`, or holds `<|python_tag|>` (the
code-interpreter marker, which the model may put before a call). Several calls are JSON objects
separated by `;`, as vLLM's `llama3_json` parser reads them. The template's own key is
`parameters`; `arguments` is accepted too (the 3.2 template shows both), one of them per call.
The turn ends with the model's end-of-turn token (`<|eot_id|>`, or `<|eom_id|>` after a call),
so there is no stop string; a trailing one of them in the text is dropped.

Tools are announced as in the template's system-message variant: its instructions, then each
schema as `{"type": "function", "function": ...}` JSON indented by 4.

What the parser refuses (`parse` errors): a turn that begins with `{` but is not JSON (an
answer that looks like JSON is read as a call: a limit of the format), a JSON value that is not
an object, text after a call other than `;` and another call, a call with both `parameters` and
`arguments`. Builtin-tool calls after `<|python_tag|>` (`brave_search.call(query=...)`) are not
JSON and are refused the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent_grpo.tools.formats.base import (
    ParsedToolCall,
    ToolCallParseError,
    as_function,
    call_from_object,
    decode_json_prefix,
    dump_json,
    parse_error,
)

__all__ = ["Llama3ToolCallFormat"]

PYTHON_TAG = "<|python_tag|>"
TURN_ENDS = ("<|eom_id|>", "<|eot_id|>")
ARGUMENT_KEYS = ("parameters", "arguments")
_SPACE = re.compile(r"\s*")

_INSTRUCTIONS = (
    "You have access to the following functions. To call a function, please respond with JSON "
    "for a function call."
    'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    "and its value}."
    "Do not use variables.\n\n"
)


class Llama3ToolCallFormat:
    """Llama 3's JSON calls: the turn is one or more `{"name", "parameters"}` objects."""

    name = "llama3"

    @property
    def stop_strings(self) -> list[str]:
        """None: a call is the whole turn, which the end-of-turn token ends."""
        return []

    def parse(self, text: str) -> list[ParsedToolCall | ToolCallParseError]:
        """The turn's calls, or [] when it is an answer (no `<|python_tag|>`, no leading `{`)."""
        start = _calls_start(text)
        if start is None:
            return []
        return _calls(_without_turn_end(text), start)

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call as the template writes it (several are joined with `; `)."""
        return dump_json({"name": name, "parameters": dict(arguments)})

    def render_tools(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        """The template's instructions, then each schema as indented JSON."""
        blocks = [dump_json(as_function(schema), indent=4) for schema in schemas]
        return _INSTRUCTIONS + "\n\n".join(blocks)


def _calls_start(text: str) -> int | None:
    """Where the calls begin (the leading `{`, or `<|python_tag|>`), or None for an answer."""
    begin = _SPACE.match(text).end()  # type: ignore[union-attr]
    if text.startswith("{", begin):
        return begin
    tag = text.find(PYTHON_TAG)
    return None if tag == -1 else tag


def _without_turn_end(text: str) -> str:
    """`text` without one trailing end-of-turn token (the decode keeps special tokens)."""
    trimmed = text.rstrip()
    for end in TURN_ENDS:
        if trimmed.endswith(end):
            return trimmed.removesuffix(end)
    return text


def _calls(text: str, start: int) -> list[ParsedToolCall | ToolCallParseError]:
    """The `;`-separated JSON calls from `start`; the first problem ends the list."""
    calls: list[ParsedToolCall | ToolCallParseError] = []
    raw_start = start
    pos = start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start
    while True:
        obj, end, problem = decode_json_prefix(text, pos)
        if problem is not None:
            calls.append(parse_error(text[raw_start:], problem.message))
            return calls
        calls.append(call_from_object(text[raw_start:end], obj, ARGUMENT_KEYS))
        after = _SPACE.match(text, end).end()  # type: ignore[union-attr]
        if after == len(text):
            return calls
        if text[after] != ";":
            message = "unexpected text after the call (only `;` and another call may follow)"
            calls.append(parse_error(text[end:], message))
            return calls
        raw_start = pos = after + 1
