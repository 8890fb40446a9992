"""Chat templates that rewrite history, written from the families' public formats, for tests and
`agent-grpo conform`: the tree builder must fork on them, train every turn once and forge no
control token.
"""

from __future__ import annotations

import copy

from transformers import PreTrainedTokenizerBase

__all__ = ["QWEN3_STYLE", "TEST_TEMPLATES", "THINKING_PROMPT", "with_template"]

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

TEST_TEMPLATES = {"qwen3-style": QWEN3_STYLE, "thinking-prompt": THINKING_PROMPT}
"""The history-rewriting templates the tests (and `make test`'s conform run) use, by name."""


def with_template(tokenizer: PreTrainedTokenizerBase, template: str) -> PreTrainedTokenizerBase:
    """A copy of `tokenizer` with another chat template (the original is never mutated)."""
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other
