"""Build the configured generation backend."""

from __future__ import annotations

from typing import Any

import torch

from agent_grpo.rollout.backend import GenerationBackend
from agent_grpo.rollout.config import (
    BackendConfig,
    HFBackendConfig,
    OpenAIBackendConfig,
    VLLMBackendConfig,
)

__all__ = ["build_backend"]


def build_backend(
    config: BackendConfig,
    policy: torch.nn.Module,
    tokenizer: Any,
    model_path: str,
    compute_dtype: torch.dtype | None = None,
) -> GenerationBackend:
    """The backend named by `config.type`; `hf` shares the policy's weights in-process and
    samples under `compute_dtype` autocast (bf16 from fp32 master weights)."""
    if isinstance(config, HFBackendConfig):
        from agent_grpo.rollout.hf_backend import HFBackend

        return HFBackend(
            policy, tokenizer, max_batch_size=config.max_batch_size, compute_dtype=compute_dtype
        )
    if isinstance(config, VLLMBackendConfig):
        from agent_grpo.rollout.vllm_backend import VLLMBackend

        return VLLMBackend(
            model_path,
            max_model_len=config.max_model_len,
            gpu_memory_utilization=config.gpu_memory_utilization,
            **config.engine_kwargs,
        )
    assert isinstance(config, OpenAIBackendConfig)
    from agent_grpo.rollout.openai_backend import OpenAIBackend
    from agent_grpo.tokens import turn_end_ids

    return OpenAIBackend(
        config.base_url,
        config.model,
        timeout_s=config.timeout_s,
        max_retries=config.max_retries,
        max_concurrency=config.max_concurrency,
        stop_token_ids=turn_end_ids(tokenizer).stop_ids,
    )
