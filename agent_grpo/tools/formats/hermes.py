"""Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Each call is a JSON object between `<tool_call>` and `</tool_call>`, several per turn allowed;
tools are announced as one JSON schema per line inside `<tools></tools>`, the way Qwen2.5's and
Qwen3's chat templates write them. Tool results are the template's business
(`<tool_response>...</tool_response>` in a user turn): the env sends them as `tool` messages.

It is also the format of our own ChatML tokenizers (the embedded SmolLM2 and the tiny test
model), whose templates know no tool markup: Hermes is the ChatML convention.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent_grpo.tools.formats.base import (
    ParsedToolCall,
    ToolCallParseError,
    as_function,
    decode_call_json,
    dump_json,
    find_tagged_blocks,
    parse_error,
)

__all__ = ["HermesToolCallFormat"]

_INSTRUCTIONS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class HermesToolCallFormat:
    """Hermes/Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several per turn."""

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    @property
    def stop_strings(self) -> list[str]:
        """End the turn after the first complete call."""
        return [self.close_tag]

    def parse(self, text: str) -> list[ParsedToolCall | ToolCallParseError]:
        """Every `<tool_call>` block of the turn, in order."""
        return [
            decode_call_json(raw, inner)
            if inner is not None
            else parse_error(raw, f"{self.open_tag} is never closed")
            for raw, inner in find_tagged_blocks(text, self.open_tag, self.close_tag)
        ]

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call laid out as the tool block shows it (for expert policies and SFT data);
        `dump_json` writes a `</tool_call>` inside an argument as `<\\/tool_call>`."""
        body = dump_json({"name": name, "arguments": dict(arguments)})
        return f"{self.open_tag}\n{body}\n{self.close_tag}"

    def render_tools(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        """Qwen2.5's tool block: one `{"type": "function", "function": schema}` per line."""
        lines = [dump_json(as_function(schema)) for schema in schemas]
        return _INSTRUCTIONS.format(tools="\n".join(lines))
