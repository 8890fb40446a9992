"""The tiny test model: SmolLM2-135M's architecture and its real tokenizer at 2 layers of width 64.

Engine and trainer tests run it in well under a second while exercising real token ids and chat
templates. `save_tiny_llama` is the variant vLLM's CPU build can run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from agent_grpo.models.attention import use_grouped_sdpa
from agent_grpo.models.loading import DEFAULT_MODEL, load_tokenizer

__all__ = ["build_tiny_model", "lively", "save_tiny_llama", "save_tiny_model", "tiny_model_config"]


def tiny_model_config() -> LlamaConfig:
    """SmolLM2-135M's architecture (vocab, rope, tied embeddings, ids) at 2 layers of width 64."""
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase | None = None, *, seed: int = 0
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """A randomly initialised tiny SmolLM2-shaped model (same weights for the same seed), its
    vocabulary grown to the tokenizer's when that has added tokens."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(DEFAULT_MODEL)
    config = tiny_model_config()
    # a test template's family tokens (inspect/rewriting_templates.py) come past SmolLM2's ids
    config.vocab_size = max(config.vocab_size, len(tokenizer))
    # Fork so building a test model never disturbs the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    use_grouped_sdpa(model)
    _set_generation_ids(model, config)
    return model.eval(), tokenizer


def _set_generation_ids(model: PreTrainedModel, config: Any) -> None:
    """Make `generate` stop at eos and pad with it, whatever transformers inferred."""
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id


def save_tiny_model(
    path: str | Path, seed: int = 0, *, tokenizer: PreTrainedTokenizerBase | None = None
) -> Path:
    """Write the tiny model (safetensors, config, tokenizer) to `path` for engines needing a dir."""
    path = Path(path)
    model, tokenizer = build_tiny_model(tokenizer, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_llama(path: Path, tokenizer: PreTrainedTokenizerBase) -> LlamaForCausalLM:
    """The tiny model with 2 heads of 32 (vLLM's CPU attention rejects head_dim 16), saved."""
    config = tiny_model_config()
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
    config.initializer_range = 0.2  # peaked enough that greedy is not a coin toss between ties
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def lively(model: torch.nn.Module) -> torch.nn.Module:
    """The tiny model with its matrices x8: at init, tied embeddings make it repeat its last input
    token forever, which would let a broken mask or position id pass a greedy comparison."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and "embed" not in name:
                param.mul_(8.0)
    return model
