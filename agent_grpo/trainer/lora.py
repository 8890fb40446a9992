"""LoRA through peft: the policy is a `PeftModel`, the reference is the same model with its
adapter disabled, and checkpoints hold the adapter alone.

Where we depart from common practice:
- With a warm start, the warm start trains the adapter too, so pi_ref (the adapter disabled) is
  the base model, not the warm-started policy GRPO starts from (as it is in full fine-tuning).
  No second copy of the weights exists either way; TRL does the same with `disable_adapter()`.
- The vLLM engine receives merged weights after each step (a merged copy, `merged_copy`), not
  vLLM's LoRA support: the CPU build we test on does not run LoRA adapters.
- One process only for now: DDP/FSDP2 over a PeftModel are not built (refused at config time).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from agent_grpo.config.jobs import LoraSettings

__all__ = ["is_adapter_dir", "load_adapter", "merged_copy", "wrap_lora"]


def wrap_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """`model` with a fresh adapter (B = 0: the wrapped model computes what `model` does)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules), task_type="CAUSAL_LM",
    )  # fmt: skip
    return get_peft_model(model, config)


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
