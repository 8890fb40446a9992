"""The vLLM engine is sized from the job (its longest episode, its largest batch, a KV cache that
holds exactly those) instead of vLLM's CPU default of half the machine's memory."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from agent_grpo.rollout.backends.base import SamplingConfig
from agent_grpo.rollout.backends.factory import (
    EngineLimits,
    build_backend,
    kv_cache_bytes,
    rollout_limits,
    vllm_engine_args,
)
from agent_grpo.rollout.config import RolloutConfig, VLLMBackendConfig
from agent_grpo.testing.tiny_model import save_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-llama-sizing")
    save_tiny_llama(path, tokenizer)
    return path


def test_kv_bytes_by_hand(tiny_dir) -> None:
    c = AutoConfig.from_pretrained(tiny_dir)
    # keys and values, each layer, each KV head, each dim, fp32; 300 tokens round up to 384
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    assert kv_cache_bytes(str(tiny_dir), 8, 300, torch.float32) == int(1.1 * per_token * 8 * 384)
    assert kv_cache_bytes(str(tiny_dir), 8, 300, torch.bfloat16) * 2 == pytest.approx(
        kv_cache_bytes(str(tiny_dir), 8, 300, torch.float32), abs=1
    )


def test_engine_args_from_the_job(tiny_dir, monkeypatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    rollout = RolloutConfig(tasks_per_step=3, group_size=4, max_context_tokens=700)
    limits = rollout_limits(rollout, eval_rows=20)  # evaluation samples more at once
    assert limits == EngineLimits(max_seqs=20, max_len=700)
    args = vllm_engine_args(VLLMBackendConfig(), str(tiny_dir), limits)
    assert args["max_model_len"] == 700 and args["max_num_seqs"] == 20
    assert args["kv_cache_memory_bytes"] == kv_cache_bytes(str(tiny_dir), 20, 700, torch.float32)
    # what the user set wins, field by field, and engine_kwargs over everything
    mine = VLLMBackendConfig(max_model_len=512, kv_cache_memory_bytes=1 << 26,
                             engine_kwargs={"max_num_seqs": 2})  # fmt: skip
    args = vllm_engine_args(mine, str(tiny_dir), limits)
    assert (args["max_model_len"], args["kv_cache_memory_bytes"], args["max_num_seqs"]) == (
        512, 1 << 26, 2,
    )  # fmt: skip
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM's own variable, in GiB, wins
    assert "kv_cache_memory_bytes" not in vllm_engine_args(
        VLLMBackendConfig(), str(tiny_dir), limits
    )


@pytest.mark.slow
def test_engine_starts_sized_and_samples(tiny_dir, tokenizer, monkeypatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    limits = EngineLimits(max_seqs=4, max_len=256)
    config = VLLMBackendConfig(engine_kwargs={"enforce_eager": True})
    backend = build_backend(config, torch.nn.Linear(1, 1), tokenizer, str(tiny_dir), None, limits)
    try:
        vllm_config = backend.llm.llm_engine.vllm_config  # type: ignore[attr-defined]
        assert vllm_config.model_config.max_model_len == 256
        assert vllm_config.scheduler_config.max_num_seqs == 4
        expected = kv_cache_bytes(str(tiny_dir), 4, 256, torch.float32)
        assert vllm_config.cache_config.kv_cache_memory_bytes == expected
        out = backend.generate([[1, 520, 9531]] * 4, SamplingConfig(max_tokens=5), [0, 1, 2, 3])
        assert all(1 <= len(g.token_ids) <= 5 for g in out)
    finally:
        backend.close()


def test_an_engine_shorter_than_the_episodes_is_refused_at_load() -> None:
    from agent_grpo.config.jobs import EvalRunConfig, TrainConfig

    short = {"type": "vllm", "max_model_len": 512}
    with pytest.raises(ValueError, match=r"rollout\.backend\.max_model_len=512 is shorter"):
        TrainConfig.model_validate({"rollout": {"backend": short, "max_context_tokens": 768}})
    with pytest.raises(ValueError, match=r"backend\.max_model_len=512 is shorter"):
        EvalRunConfig.model_validate({"backend": short, "max_context_tokens": 768})
    TrainConfig.model_validate({"rollout": {"backend": short, "max_context_tokens": 512}})
