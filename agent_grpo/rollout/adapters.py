"""LoRA adapters on rollout workers: what a push carries (the adapter alone, in peft's naming),
and how an engine holds it (a peft model for `hf`, vLLM's own LoRA support for `vllm`).

The trainer's policy is a peft model (`agent_grpo/trainer/lora.py`); a worker builds the same
adapter on the same base (`lora_config`), so the adapter's tensors are all that changes between
versions: a push moves `r * (d_in + d_out)` numbers per adapted matrix instead of the model.

Where we depart from peers: vLLM loads an adapter from a directory (verl patches vLLM's worker
to take tensors in memory); a vLLM worker writes each received adapter to a local directory in
peft's format (`write_adapter`) and lets vLLM load it from there, its documented path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agent_grpo.config.jobs import LoraSettings

__all__ = ["adapter_state", "load_adapter_state", "lora_config", "vllm_lora_args", "write_adapter"]

ADAPTER_FILE = "adapter_model.safetensors"
"""peft's file name for an adapter's tensors (vLLM reads it)."""
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for `max_lora_rank` (its `MaxLoRARanks`)."""


def lora_config(settings: LoraSettings) -> Any:
    """The peft `LoraConfig` of `settings` (the trainer's adapter and every worker's)."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules), task_type="CAUSAL_LM",
    )  # fmt: skip


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a peft model, named as peft saves them (no adapter name)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Set a peft model's adapter to `state` (from `adapter_state`); every tensor must land."""
    from peft import set_peft_model_state_dict

    unexpected = set_peft_model_state_dict(model, state).unexpected_keys  # type: ignore[attr-defined]
    if unexpected:
        raise KeyError(f"adapter tensors the model has no place for: {unexpected[:3]}")


def write_adapter(path: Path, settings: LoraSettings, state: dict[str, torch.Tensor]) -> Path:
    """`state` saved in peft's directory format at `path` (config and tensors), for vLLM."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    lora_config(settings).save_pretrained(str(path))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / ADAPTER_FILE))
    return path


def vllm_lora_args(settings: LoraSettings, adapters: int) -> dict[str, Any]:
    """`vllm.LLM` arguments for an engine that holds up to `adapters` versions of the adapter at
    once (loaded and in memory, the least recently used dropped first). The rank vLLM
    reserves is the smallest it accepts that holds `settings.r`."""
    rank = next((r for r in VLLM_RANKS if r >= settings.r), None)
    if rank is None:
        raise ValueError(f"model.lora.r={settings.r} is above vLLM's largest LoRA rank, 512")
    return {"enable_lora": True, "max_loras": adapters, "max_cpu_loras": adapters,
            "max_lora_rank": rank}  # fmt: skip
