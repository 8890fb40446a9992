"""Chat templates we give a converted model whose GGUF ships none (a base model).

Written for the provenance builder (`agent_grpo.trajectory.tokens`): every message's content is
rendered exactly once, in order and verbatim (no `trim`, no escaping), and an assistant turn is
closed by a special token, so `turn_end_ids` finds it.
"""

from __future__ import annotations

__all__ = ["GEMMA_TURNS"]

GEMMA_TURNS = (
    "{{- bos_token -}}"
    "{%- set fold = messages | length > 1 and messages[0].role == 'system'"
    " and messages[1].role == 'user' -%}"
    "{%- for message in messages -%}"
    "{%- if fold and loop.index0 == 0 -%}"
    "{{- '<start_of_turn>user\\n' + message.content + '\\n\\n' -}}"
    "{%- elif fold and loop.index0 == 1 -%}"
    "{{- message.content + '<end_of_turn>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<start_of_turn>model\\n' + message.content + '<end_of_turn>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<start_of_turn>user\\n<tool_response>\\n' + message.content"
    " + '\\n</tool_response><end_of_turn>\\n' -}}"
    "{%- else -%}"
    "{{- '<start_of_turn>user\\n' + message.content + '<end_of_turn>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)
"""Gemma's public turn format, `<start_of_turn>{user|model}\\n...<end_of_turn>\\n` after one
`<bos>`, with the generation prompt `<start_of_turn>model\\n`. Gemma has two roles only, so:

- a leading system message is folded into the first user turn as Gemma's own template does
  (`system + "\\n\\n" + user`), but with both contents verbatim (Gemma's trims them); a system
  message anywhere else is a user turn of its own;
- a tool result is a user turn `<tool_response>\\n...\\n</tool_response>`, the Hermes/Qwen2.5
  wrapper that goes with the Hermes `<tool_call>` format the environments announce;
- `<end_of_turn>` (a special token) closes every turn, the model's included: it is the turn end,
  and the tokenizer's `<eos>` is a second stop id.
"""
