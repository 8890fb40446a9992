"""The tiny test model in a shape vLLM's CPU build can run (shared by the vLLM and openai tests)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from agent_grpo.models.loading import tiny_model_config


def save_tiny_llama(path: Path, tokenizer: PreTrainedTokenizerBase) -> LlamaForCausalLM:
    """The project's tiny model with 2 heads of 32 (vLLM's CPU attention rejects head_dim 16)."""
    config = tiny_model_config()
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
    config.initializer_range = 0.2  # peaked enough that greedy is not a coin toss between ties
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model
