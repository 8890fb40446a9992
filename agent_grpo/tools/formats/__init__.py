"""Tool-call formats: how each model family announces tools and writes calls, one module each.

`base.py` holds what they share (the `ToolCallFormat` protocol, `ParsedToolCall` and
`ToolCallParseError`, hostile-safe JSON, `parse_tool_calls`); `registry.py` names them and picks
one from a tokenizer's chat template. docs/models.md lists the families and their markers.
"""

from __future__ import annotations

from agent_grpo.tools.formats.base import (
    MAX_JSON_DEPTH,
    ParsedToolCall,
    SupportsArgs,
    ToolCallFormat,
    ToolCallParseError,
    TypesArguments,
    after_reasoning,
    decode_call_json,
    dump_json,
    find_tagged_blocks,
    parse_tool_calls,
    short_repr,
)
from agent_grpo.tools.formats.deepseek_v3 import DeepSeekV3ToolCallFormat
from agent_grpo.tools.formats.harmony import HarmonyToolCallFormat
from agent_grpo.tools.formats.hermes import HermesToolCallFormat
from agent_grpo.tools.formats.llama3 import Llama3ToolCallFormat
from agent_grpo.tools.formats.mistral import MistralToolCallFormat, MistralV11ToolCallFormat
from agent_grpo.tools.formats.qwen3_coder import Qwen3CoderToolCallFormat
from agent_grpo.tools.formats.registry import (
    TOOL_FORMATS,
    detect_tool_format,
    get_tool_format,
    tool_format_for,
)

__all__ = [
    "MAX_JSON_DEPTH",
    "TOOL_FORMATS",
    "DeepSeekV3ToolCallFormat",
    "HarmonyToolCallFormat",
    "HermesToolCallFormat",
    "Llama3ToolCallFormat",
    "MistralToolCallFormat",
    "MistralV11ToolCallFormat",
    "ParsedToolCall",
    "Qwen3CoderToolCallFormat",
    "SupportsArgs",
    "ToolCallFormat",
    "ToolCallParseError",
    "TypesArguments",
    "after_reasoning",
    "decode_call_json",
    "detect_tool_format",
    "dump_json",
    "find_tagged_blocks",
    "get_tool_format",
    "parse_tool_calls",
    "short_repr",
    "tool_format_for",
]
