"""The tool-call formats by name, and which one a tokenizer's chat template speaks.

`model.tool_format: auto` (the default) asks `tool_format_for`, which reads the chat template:

- a template that shows one family's markers is that family (`detect_tool_format`, markers in
  `MARKERS`, the most specific family first: Qwen3-Coder's template also holds `<tool_call>`);
  `<tool_response>` alone (how Hermes templates wrap a tool result, and how our Gemma template
  for a base model does) is Hermes too;
- a ChatML template (`<|im_start|>`) with no tool markup at all is `hermes`: that is the
  embedded SmolLM2 and the tiny test model, which learnt no tool format, and Hermes is the
  ChatML convention;
- anything else is refused with a one-line error: no template, a template with tool markup of
  no family we know (DeepSeek V3.1, Llama 4, Command R, ...), a non-ChatML template without tool
  markup. Setting `model.tool_format` to a name skips detection.
"""

from __future__ import annotations

from agent_grpo.tools.formats.base import ToolCallFormat
from agent_grpo.tools.formats.deepseek_v3 import DeepSeekV3ToolCallFormat
from agent_grpo.tools.formats.harmony import HarmonyToolCallFormat
from agent_grpo.tools.formats.hermes import HermesToolCallFormat
from agent_grpo.tools.formats.llama3 import Llama3ToolCallFormat
from agent_grpo.tools.formats.mistral import MistralToolCallFormat, MistralV11ToolCallFormat
from agent_grpo.tools.formats.qwen3_coder import Qwen3CoderToolCallFormat

__all__ = [
    "AUTO",
    "MARKERS",
    "TOOL_FORMATS",
    "detect_tool_format",
    "get_tool_format",
    "known_formats",
    "tool_format_for",
]

AUTO = "auto"
"""The `model.tool_format` value that means: detect it from the chat template."""

TOOL_FORMATS: dict[str, type[ToolCallFormat]] = {
    "hermes": HermesToolCallFormat,
    "qwen3_coder": Qwen3CoderToolCallFormat,
    "llama3": Llama3ToolCallFormat,
    "mistral": MistralToolCallFormat,
    "mistral_v11": MistralV11ToolCallFormat,
    "harmony": HarmonyToolCallFormat,
    "deepseek_v3": DeepSeekV3ToolCallFormat,
}
"""Every format by its name (each class's `name`)."""

MARKERS: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("harmony", ("<|channel|>", "<|message|>"), ("<|constrain|>", "<|call|>", "to=functions")),
    ("deepseek_v3", ("<｜tool▁calls▁begin｜>", "```json"), ()),
    ("mistral_v11", ("[TOOL_CALLS]", "[ARGS]"), ()),
    ("mistral", ("[TOOL_CALLS]",), ()),
    ("qwen3_coder", ("<function=", "<parameter="), ()),
    ("llama3", ("<|start_header_id|>",), ("<|python_tag|>", "ipython", '"parameters"')),
    ("hermes", (), ("<tool_call>", "<tool_response>")),
]
"""(format, text the template must hold, text it must hold one of), tried in order."""

_TOOL_WORDS = ("tool", "function")
"""A template that mentions neither (in any case) shows no tool markup."""


def known_formats() -> str:
    """The names `model.tool_format` takes, for error messages: `auto, deepseek_v3, ...`."""
    return ", ".join([AUTO, *sorted(TOOL_FORMATS)])


def get_tool_format(name: str) -> ToolCallFormat:
    """A new instance of the format `name`; ValueError listing the known ones otherwise."""
    cls = TOOL_FORMATS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call format {name!r}; known formats: {known_formats()}")
    return cls()


def detect_tool_format(chat_template: str | None) -> str | None:
    """The format a chat template's markers show, `hermes` for ChatML without tool markup, or
    None (no template, or one `tool_format_for` refuses)."""
    if not chat_template:
        return None
    for name, required, one_of in MARKERS:
        if all(m in chat_template for m in required) and (
            not one_of or any(m in chat_template for m in one_of)
        ):
            return name
    if "<|im_start|>" in chat_template and not _shows_tools(chat_template):
        return "hermes"
    return None


def _shows_tools(chat_template: str) -> bool:
    lowered = chat_template.lower()
    return any(word in lowered for word in _TOOL_WORDS)


def tool_format_for(setting: str, chat_template: str | None) -> str:
    """The format `model.tool_format: setting` means for a tokenizer with `chat_template`;
    ValueError saying why when `auto` cannot decide."""
    if setting != AUTO:
        get_tool_format(setting)  # the name must exist
        return setting
    detected = detect_tool_format(chat_template)
    if detected is not None:
        return detected
    if not chat_template:
        why = "the tokenizer has no chat template"
    elif _shows_tools(chat_template):
        why = "the chat template shows tool-call markup of no known format"
    else:
        why = "the chat template shows no tool-call format and is not ChatML"
    names = ", ".join(sorted(TOOL_FORMATS))
    raise ValueError(f"model.tool_format=auto: {why}; set model.tool_format to one of {names}")
