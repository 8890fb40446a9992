"""Chat prompts as the token ids a backend is given."""

from __future__ import annotations

from typing import Any

__all__ = ["chat_ids"]


def chat_ids(tokenizer: Any, question: str, system: str | None = None) -> list[int]:
    """The ids of a one-question chat, ending with the assistant's generation prompt."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))
