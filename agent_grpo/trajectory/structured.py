"""Assistant turns as structured messages, for chat templates that render calls from them.

Most chat templates render an assistant message from its text (`content`), and a sampled turn is
handed to them as the decode of its ids. gpt-oss (Harmony) and DeepSeek V3 templates render a
tool call only from the message's `tool_calls` (name, arguments) and gpt-oss its reasoning only
from `thinking`; given the raw text they write it as a final answer, or drop the call. For them,
a turn is handed over as the fields its own tool format's parser reads from the text
(`StructuresTurns.structure`: Harmony's analysis channel as reasoning and its final channel as
content, DeepSeek's text before the calls block as content, the calls), and the template writes
the markup around them. A turn the parser cannot read in the family's layout (a malformed call,
text after the calls) is handed over as its text, as for any other template.

Which view a template gets is read off the template (`assistant_view`): one that shows a
structuring family's markers (`tools.formats.registry.detect_tool_format`) and reads
`tool_calls`. Whether it wants a call's arguments as an object (`tojson` in the template, as
transformers' templates do) or as JSON text (the original DeepSeek V3 template concatenates
them) is probed by rendering one call. How the fields are located in the rendering, and when the
rendering reproduces the sampled turn, is in `segments.py`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from agent_grpo.tools.formats.base import StructuredTurn, StructuresTurns
from agent_grpo.tools.formats.registry import detect_tool_format, get_tool_format

__all__ = ["ARGUMENTS", "CONTENT", "PLAIN", "REASONING", "AssistantView", "assistant_view"]

CONTENT, REASONING, ARGUMENTS = 0, 1, 2
"""Field numbers of a structured message: its text, its reasoning, and call j's arguments at
`ARGUMENTS + j`. A message rendered from its text has the one field `CONTENT`."""

_PROBE_ARGUMENTS = "\ue000arguments\ue001"


@dataclass(frozen=True)
class AssistantView:
    """How a chat template takes an assistant message: as its text, or as structured fields."""

    structurer: StructuresTurns | None = None
    """The tool format that reads a turn's fields from its text; None: the text is the message."""
    family: str = ""
    """That format's name (`harmony`, `deepseek_v3`); empty for a plain view."""
    reasoning_key: str = "thinking"
    """The message key the template reads reasoning from (gpt-oss: `thinking`)."""
    arguments_as_text: bool = False
    """Whether the template takes a call's arguments as JSON text rather than an object."""

    def structure(self, text: str) -> StructuredTurn | None:
        """The turn `text` as fields, or None when it is handed over as its text."""
        return None if self.structurer is None else self.structurer.structure(text)

    def fields(self, turn: StructuredTurn) -> dict[int, Any]:
        """The turn's non-empty fields by number, as the template receives them (the arguments
        an object, or JSON text as `json.dumps` writes it)."""
        values: dict[int, Any] = {CONTENT: turn.content, REASONING: turn.reasoning or ""}
        out = {k: v for k, v in values.items() if v}
        for j, call in enumerate(turn.calls):
            arguments = call.arguments
            out[ARGUMENTS + j] = (
                json.dumps(arguments, ensure_ascii=False) if self.arguments_as_text else arguments
            )
        return out

    def message(self, turn: StructuredTurn, replace: Mapping[int, Any]) -> dict[str, Any]:
        """The assistant message handed to the template, field k replaced by `replace[k]` (a
        slot marker) where given."""
        fields = self.fields(turn) | dict(replace)
        message: dict[str, Any] = {"role": "assistant", "content": fields.get(CONTENT, "")}
        if turn.reasoning is not None:
            message[self.reasoning_key] = fields.get(REASONING, turn.reasoning)
        if turn.calls:
            message["tool_calls"] = [
                {
                    "type": "function",
                    "function": {"name": c.name, "arguments": fields[ARGUMENTS + j]},
                }
                for j, c in enumerate(turn.calls)
            ]
        return message


PLAIN = AssistantView()
"""The view of every template that renders an assistant message from its text."""


def assistant_view(tokenizer: PreTrainedTokenizerBase) -> AssistantView:
    """How `tokenizer`'s chat template takes assistant messages (see the module docstring)."""
    template = tokenizer.chat_template
    return _view(template) if isinstance(template, str) else PLAIN


@functools.lru_cache(maxsize=64)
def _view(template: str) -> AssistantView:
    name = detect_tool_format(template)
    structurer = get_tool_format(name) if name is not None else None
    if not isinstance(structurer, StructuresTurns) or "tool_calls" not in template:
        return PLAIN
    reasoning_key = "reasoning_content" if "reasoning_content" in template else "thinking"
    assert name is not None
    return AssistantView(structurer, name, reasoning_key, _takes_text_arguments(template))


def _takes_text_arguments(template: str) -> bool:
    """Whether the template writes a call's arguments as given (JSON text) rather than through
    `tojson`, seen by rendering one call with a marker for its arguments."""
    call = {"type": "function", "function": {"name": "f", "arguments": _PROBE_ARGUMENTS}}
    probe: list[dict[str, Any]] = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    try:  # (the rendered texts, the assistant masks), whatever its annotation says
        rendered: Any = render_jinja_template([probe], chat_template=template)
    except Exception:  # a template that wants more than the probe gives: the usual object form
        return False
    text = str(rendered[0][0])
    return _PROBE_ARGUMENTS in text and json.dumps(_PROBE_ARGUMENTS, ensure_ascii=False) not in text
