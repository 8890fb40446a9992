"""Chat templates written from the families' public formats, for tests and `agent-grpo conform`:
templates that rewrite history (Qwen3's dropped reasoning, a generation prompt that opens it), and
templates that render calls only from structured `tool_calls` (gpt-oss's Harmony, DeepSeek V3).
The tree builder must fork where they rewrite, train every turn once and forge no control token.
The structured ones need their family's special tokens, which `with_template` adds to a copy of
the tokenizer (the tiny test model grows its vocabulary to match).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

__all__ = [
    "DEEPSEEK_V3_STYLE",
    "HARMONY_STYLE",
    "QWEN3_STYLE",
    "TEST_TEMPLATES",
    "THINKING_PROMPT",
    "FamilyTemplate",
    "with_template",
]

# Qwen3's published logic (its tool block, never filled here, shows Hermes calls): an assistant
# turn's reasoning (before `</think>`) is kept, normalised to `<think>\n...\n</think>\n\n`, only
# for turns after the last real user message, and dropped from older ones; consecutive tool
# results share one user turn inside `<tool_response>` tags.
QWEN3_STYLE = (
    "{%- if tools -%}{{- '<|im_start|>system\\n# Tools\\n<tools>\\n' -}}"
    "{%- for t in tools -%}{{- t | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\nReturn each call in <tool_call></tool_call> tags.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and reasoning -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Qwen3-Thinking-2507 and DeepSeek-R1: the generation prompt opens the reasoning (`<think>\n`),
# which the rendering of history never shows, so every turn's context is rewritten: a fork per
# turn, whatever the model samples.
THINKING_PROMPT = QWEN3_STYLE.replace(
    "{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
    "{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}",
)
assert THINKING_PROMPT != QWEN3_STYLE

# gpt-oss's published logic, with calls in Harmony's own header order (`<|channel|>commentary
# to=functions.f <|constrain|>json`, as the harmony renderer and the model write them; the
# published template writes `to=` before the channel and leaves out `<|constrain|>`, so there a
# call turn never renders back as sampled). A fixed system message (the published one holds
# today's date), the first system message as the developer's instructions. An assistant message
# with `tool_calls` keeps its `thinking` (the analysis channel) until a later final message; a
# final message keeps its analysis only as the last message without a generation prompt, and
# ends with `<|return|>` there, `<|end|>` in history. A tool result goes out as
# `functions.NAME` (the last call's name) and is written through `tojson`. The published
# template writes the first call only; this one writes each.
HARMONY_STYLE = (
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n"
    "Knowledge cutoff: 2024-06\\n\\nReasoning: medium\\n\\n# Valid channels: analysis, commentary, "
    "final. Channel must be included for every message.' -}}"
    "{%- if tools -%}{{- '\\nCalls to these tools must go to the commentary channel: "
    "\\'functions\\'.' -}}{%- endif -%}"
    "{{- '<|end|>' -}}"
    "{%- if messages[0].role == 'system' -%}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + messages[0].content"
    " + '\\n\\n<|end|>' -}}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- set last = namespace(name=none) -%}"
    "{%- for m in loop_messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}"
    "{%- set later = namespace(final=false) -%}"
    "{%- for f in loop_messages[loop.index:] -%}"
    "{%- if f.role == 'assistant' and not f.tool_calls -%}{%- set later.final = true -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if m.thinking and not later.final -%}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- for call in m.tool_calls -%}"
    "{{- '<|start|>assistant<|channel|>commentary to=functions.' + call.function.name"
    " + ' <|constrain|>json<|message|>' + (call.function.arguments | tojson) + '<|call|>' -}}"
    "{%- set last.name = call.function.name -%}"
    "{%- endfor -%}"
    "{%- elif m.role == 'assistant' and loop.last and not add_generation_prompt -%}"
    "{%- if m.thinking -%}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' -}}"
    "{%- endif -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|return|>' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|start|>functions.' + (last.name or m.name or 'tool') + ' to=assistant<|channel|>"
    "commentary<|message|>' + (m.content | tojson) + '<|end|>' -}}"
    "{%- else -%}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)

# DeepSeek V3 as vLLM's tool template for it writes it (the original tokenizer template keeps
# one "first call" flag for the whole conversation, so a second call turn loses its
# `<｜tool▁calls▁begin｜>`): system messages joined at the top, a user message followed by
# `<｜Assistant｜>`, calls from `tool_calls` as ```` ```json ```` blocks inside the calls markers,
# tool results in an outputs block closed before the next assistant message (the generation
# prompt after a tool result is that closing alone).
DEEPSEEK_V3_STYLE = (
    "{%- set ns = namespace(system='', first_system=true, is_tool=false, output_first=true,"
    " last_user=false) -%}"
    "{%- for m in messages -%}{%- if m.role == 'system' -%}"
    "{%- set ns.system = m.content if ns.first_system else ns.system + '\\n\\n' + m.content -%}"
    "{%- set ns.first_system = false -%}"
    "{%- endif -%}{%- endfor -%}"
    "{{- '<｜begin▁of▁sentence｜>' + ns.system -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}"
    "{%- set ns.is_tool = false -%}{%- set ns.last_user = true -%}"
    "{{- '<｜User｜>' + m.content + '<｜Assistant｜>' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set ns.last_user = false -%}"
    "{%- if ns.is_tool -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- endif -%}"
    "{%- set ns.is_tool = false -%}"
    "{%- if m.tool_calls -%}"
    "{%- set ns.output_first = true -%}"
    "{{- m.content + '<｜tool▁calls▁begin｜>' -}}"
    "{%- for call in m.tool_calls -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<｜tool▁call▁begin｜>' + call.type + '<｜tool▁sep｜>' + call.function.name"
    " + '\\n```json\\n' + (call.function.arguments | tojson) + '\\n```<｜tool▁call▁end｜>' -}}"
    "{%- endfor -%}"
    "{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' -}}"
    "{%- else -%}{{- m.content + '<｜end▁of▁sentence｜>' -}}{%- endif -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- set ns.last_user = false -%}{%- set ns.is_tool = true -%}"
    "{%- if ns.output_first -%}{{- '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' -}}"
    "{%- set ns.output_first = false -%}"
    "{%- else -%}{{- '\\n<｜tool▁output▁begin｜>' -}}{%- endif -%}"
    "{{- m.content + '<｜tool▁output▁end｜>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.is_tool -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- endif -%}"
    "{%- if add_generation_prompt and not ns.last_user and not ns.is_tool -%}"
    "{{- '<｜Assistant｜>' -}}{%- endif -%}"
)

HARMONY_TOKENS = (
    "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>",
)  # fmt: skip
DEEPSEEK_V3_TOKENS = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
)  # fmt: skip


@dataclass(frozen=True)
class FamilyTemplate:
    """A test chat template and what its family's tokenizer has that SmolLM2's lacks."""

    text: str
    """The chat template."""
    special_tokens: tuple[str, ...] = ()
    """Special tokens the template writes, added to the tokenizer."""
    eos: str | None = None
    """The family's EOS token, when it is not SmolLM2's `<|im_end|>`."""


TEST_TEMPLATES = {
    "qwen3-style": FamilyTemplate(QWEN3_STYLE),
    "thinking-prompt": FamilyTemplate(THINKING_PROMPT),
    "harmony-style": FamilyTemplate(HARMONY_STYLE, HARMONY_TOKENS, "<|return|>"),
    "deepseek-v3-style": FamilyTemplate(
        DEEPSEEK_V3_STYLE, DEEPSEEK_V3_TOKENS, "<｜end▁of▁sentence｜>"
    ),
}
"""The test templates (and `make test`'s conform runs) by name."""


def with_template(
    tokenizer: PreTrainedTokenizerBase, template: str | FamilyTemplate
) -> PreTrainedTokenizerBase:
    """A copy of `tokenizer` with another chat template, and the family's special tokens and EOS
    when `template` names them (the original is never mutated)."""
    family = template if isinstance(template, FamilyTemplate) else FamilyTemplate(template)
    other = copy.deepcopy(tokenizer)
    other.chat_template = family.text
    if family.special_tokens:
        other.add_tokens(list(family.special_tokens), special_tokens=True)
    if family.eos is not None:
        other.eos_token = family.eos
    return other
