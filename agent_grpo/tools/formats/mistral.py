"""Mistral: calls after the `[TOOL_CALLS]` token, in the two layouts mistral-common writes.

- `mistral` (tokenizers v2 to v7: Mistral 7B v0.3, Mixtral 8x22B, Nemo, Small 3.1):
  `[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "6 * 7"}}, ...]`, a JSON list
  of calls (an `"id"` key is allowed).
- `mistral_v11` (tokenizers v11+: Small 3.2, Magistral, Devstral):
  `[TOOL_CALLS]calculator[ARGS]{"expression": "6 * 7"}`, one `[TOOL_CALLS]` per call, and
  `[TOOL_CALLS]NAME[CALL_ID]id[ARGS]{...}` with a call id.

Tools are announced as mistral-common writes them: `[AVAILABLE_TOOLS]` followed by the JSON list
of `{"type": "function", "function": ...}` and `[/AVAILABLE_TOOLS]` (the template puts the block
before the last user message; ToolEnv puts every format's block in the system message). The turn
ends with `</s>`, so there is no stop string; a trailing `</s>` in the text is dropped.

Each layout parses only its own calls. What the parser refuses (`parse` errors): `[TOOL_CALLS]`
followed by anything but the layout (a list that never closes, text after it, a v11 call without
`[ARGS]`), JSON that is not an object where a call or arguments belong.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent_grpo.tools.formats.base import (
    ParsedToolCall,
    ToolCallParseError,
    arguments_call,
    as_function,
    call_from_object,
    decode_json_prefix,
    dump_json,
    parse_error,
)

__all__ = ["MistralToolCallFormat", "MistralV11ToolCallFormat"]

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
EOS = "</s>"
_SPACE = re.compile(r"\s*")

Parsed = list[ParsedToolCall | ToolCallParseError]


def _segments(text: str) -> list[str]:
    """The text after each `[TOOL_CALLS]`, up to the next one (a trailing `</s>` dropped)."""
    pieces = text.split(TOOL_CALLS)[1:]
    if pieces and pieces[-1].rstrip().endswith(EOS):
        pieces[-1] = pieces[-1].rstrip().removesuffix(EOS)
    return pieces


def _render_tools(schemas: Sequence[Mapping[str, Any]]) -> str:
    return f"[AVAILABLE_TOOLS]{dump_json([as_function(s) for s in schemas])}[/AVAILABLE_TOOLS]"


class MistralToolCallFormat:
    """Mistral v2-v7: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`."""

    name = "mistral"

    @property
    def stop_strings(self) -> list[str]:
        """None: the calls end the turn, which `</s>` ends."""
        return []

    def parse(self, text: str) -> Parsed:
        """Every call of every `[TOOL_CALLS]` list in the turn, in order."""
        return [call for segment in _segments(text) for call in _call_list(segment)]

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call as a one-element list."""
        return f"{TOOL_CALLS}{dump_json([{'name': name, 'arguments': dict(arguments)}])}"

    def render_tools(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        """`[AVAILABLE_TOOLS][...][/AVAILABLE_TOOLS]`."""
        return _render_tools(schemas)


def _call_list(segment: str) -> Parsed:
    """The calls of one `[TOOL_CALLS][...]` list; the first problem ends it."""
    raw = TOOL_CALLS + segment
    pos = _SPACE.match(segment).end()  # type: ignore[union-attr]
    if not segment.startswith("[", pos):
        return [parse_error(raw, f"{TOOL_CALLS} must be followed by a JSON list of calls")]
    calls: Parsed = []
    pos = _SPACE.match(segment, pos + 1).end()  # type: ignore[union-attr]
    if segment.startswith("]", pos):
        return [parse_error(raw, f"{TOOL_CALLS} lists no call")]
    while True:
        obj, end, problem = decode_json_prefix(segment, pos)
        if problem is not None:
            return [*calls, parse_error(raw, problem.message)]
        calls.append(call_from_object(segment[pos:end], obj))
        pos = _SPACE.match(segment, end).end()  # type: ignore[union-attr]
        if segment.startswith(",", pos):
            pos += 1
        elif segment.startswith("]", pos):
            break
        else:
            return [*calls, parse_error(raw, f"the {TOOL_CALLS} list is never closed")]
    if segment[pos + 1 :].strip():
        return [*calls, parse_error(raw, f"unexpected text after the {TOOL_CALLS} list")]
    return calls


class MistralV11ToolCallFormat:
    """Mistral v11+: `[TOOL_CALLS]NAME[ARGS]{...}`, one `[TOOL_CALLS]` per call."""

    name = "mistral_v11"

    @property
    def stop_strings(self) -> list[str]:
        """None: the calls end the turn, which `</s>` ends."""
        return []

    def parse(self, text: str) -> Parsed:
        """Every `[TOOL_CALLS]NAME[ARGS]{...}` of the turn, in order."""
        return [_named_call(segment) for segment in _segments(text)]

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call; several are written one after another."""
        return f"{TOOL_CALLS}{name}{ARGS}{dump_json(dict(arguments))}"

    def render_tools(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        """`[AVAILABLE_TOOLS][...][/AVAILABLE_TOOLS]`."""
        return _render_tools(schemas)


def _named_call(segment: str) -> ParsedToolCall | ToolCallParseError:
    """The call of one `[TOOL_CALLS]NAME[ARGS]{...}` (a `[CALL_ID]id` before `[ARGS]` allowed)."""
    raw = TOOL_CALLS + segment
    head, found, arguments = segment.partition(ARGS)
    if not found:
        return parse_error(raw, f"{TOOL_CALLS}NAME must be followed by {ARGS} and the arguments")
    name = head.partition(CALL_ID)[0].strip()
    return arguments_call(raw, name, arguments)
