"""LoRA through peft: the policy is a `PeftModel`, the reference is the same model with its
adapter disabled, and checkpoints hold the adapter alone.

Where we depart from common practice:
- With a warm start, the warm start trains the adapter too, so pi_ref (the adapter disabled) is
  the base model, not the warm-started policy GRPO starts from (as it is in full fine-tuning).
  No second copy of the weights exists either way; TRL does the same with `disable_adapter()`.
- The trainer's own vLLM engine receives merged weights after each step (a merged copy,
  `merged_copy`). Ray rollout workers receive the adapter alone and run it with peft (`hf`) or
  vLLM's LoRA support (`vllm`; agent_grpo/rollout/adapters.py).
- One process only for now: DDP/FSDP2 over a PeftModel are not built (refused at config time).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from agent_grpo.config.jobs import LoraSettings
from agent_grpo.rollout.adapters import lora_config

__all__ = ["is_adapter_dir", "load_adapter", "merged_copy", "wrap_lora"]


def wrap_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """`model` with a fresh adapter (B = 0: the wrapped model computes what `model` does)."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(settings))  # the config Ray workers build too


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` holds a peft adapter (a LoRA checkpoint's `model/`)."""
    return (Path(path) / "adapter_config.json").is_file()


def load_adapter(base: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """`base` with the saved adapter at `path`, trainable (for `--resume`)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(path), is_trainable=True)


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain model with the adapter merged into a copy of the weights (`model` untouched)."""
    return copy.deepcopy(model).merge_and_unload()  # type: ignore[operator]
