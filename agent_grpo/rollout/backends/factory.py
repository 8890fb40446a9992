"""Build the configured generation backend."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from agent_grpo.rollout.backends.base import GenerationBackend
from agent_grpo.rollout.config import (
    BackendConfig,
    HFBackendConfig,
    OpenAIBackendConfig,
    RolloutConfig,
    VLLMBackendConfig,
)

if TYPE_CHECKING:
    from agent_grpo.rollout.backends.vllm import VLLMBackend

__all__ = [
    "EngineLimits",
    "build_backend",
    "build_vllm",
    "kv_cache_bytes",
    "rollout_limits",
    "vllm_engine_args",
]

_KV_BLOCK = 128
"""Tokens per KV block we round a sequence up to (vLLM's CPU blocks are at most this long)."""


@dataclass(frozen=True)
class EngineLimits:
    """What the job asks of an engine at most, from which a vLLM engine is sized."""

    max_seqs: int
    """Most sequences sampled at once (a step's tasks x group size, or an evaluation's)."""
    max_len: int
    """Longest sequence in tokens (the job's `max_context_tokens`)."""


def rollout_limits(config: RolloutConfig, eval_rows: int = 0) -> EngineLimits:
    """The limits of a job that samples `config`'s steps (and evaluations of `eval_rows`)."""
    rows = max(config.tasks_per_step * config.group_size, eval_rows)
    return EngineLimits(max_seqs=rows, max_len=config.max_context_tokens)


def kv_cache_bytes(model_path: str, seqs: int, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of a KV cache holding `seqs` sequences of `tokens` tokens for this model: keys and
    values of every layer's KV heads, each sequence rounded up to whole blocks, plus 10%."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * head_dim * dtype.itemsize
    blocks = -(-tokens // _KV_BLOCK)
    return int(1.1 * per_token * seqs * blocks * _KV_BLOCK)


def vllm_engine_args(
    config: VLLMBackendConfig, model_path: str, limits: EngineLimits
) -> dict[str, Any]:
    """`vllm.LLM` arguments sized to the job: its longest sequence, its largest batch, and a KV
    cache that holds exactly those (vLLM's CPU default reserves half the machine)."""
    max_len = config.max_model_len or limits.max_len
    seqs = config.max_num_seqs or limits.max_seqs
    args: dict[str, Any] = {"dtype": config.dtype, "max_model_len": max_len, "max_num_seqs": seqs}
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        dtype = getattr(torch, config.dtype)
        args["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes or kv_cache_bytes(
            model_path, seqs, max_len, dtype
        )
    return {**args, **config.engine_kwargs}


def build_vllm(
    config: VLLMBackendConfig, model_path: str, limits: EngineLimits | None = None
) -> VLLMBackend:
    """An in-process vLLM engine over the model at `model_path`, sized by `limits`
    (`vllm_engine_args`; vLLM's own defaults without them)."""
    from agent_grpo.rollout.backends.vllm import VLLMBackend

    limits = limits or EngineLimits(max_seqs=256, max_len=4096)  # vLLM's own defaults
    return VLLMBackend(
        model_path,
        gpu_memory_utilization=config.gpu_memory_utilization,
        **vllm_engine_args(config, model_path, limits),
    )


def build_backend(
    config: BackendConfig,
    policy: torch.nn.Module,
    tokenizer: Any,
    model_path: str,
    compute_dtype: torch.dtype | None = None,
    limits: EngineLimits | None = None,
) -> GenerationBackend:
    """The backend named by `config.type`; `hf` shares the policy's weights in-process and
    samples under `compute_dtype` autocast (bf16 from fp32 master weights); `vllm` is sized by
    `limits` (`vllm_engine_args`)."""
    if isinstance(config, HFBackendConfig):
        from agent_grpo.rollout.backends.hf import HFBackend

        return HFBackend(
            policy,
            tokenizer,
            max_batch_size=config.max_batch_size,
            compute_dtype=compute_dtype,
            packed_decode=config.packed_decode,
            shared_prefix_attention=config.shared_prefix_attention,
        )
    if isinstance(config, VLLMBackendConfig):
        return build_vllm(config, model_path, limits)
    assert isinstance(config, OpenAIBackendConfig)
    from agent_grpo.rollout.backends.openai import OpenAIBackend
    from agent_grpo.trajectory.tokens import turn_end_ids

    return OpenAIBackend(
        config.base_url,
        config.model,
        timeout_s=config.timeout_s,
        max_retries=config.max_retries,
        max_concurrency=config.max_concurrency,
        stop_token_ids=turn_end_ids(tokenizer).stop_ids,
    )
