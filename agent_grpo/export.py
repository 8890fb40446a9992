"""`agent-grpo export RUN`: the run's latest weights as a plain Hugging Face model directory.

A LoRA run's checkpoint holds the adapter alone; its export holds the base model with the
adapter merged (`OUT/model`, loadable by anything that loads transformers models) and the
adapter itself (`OUT/adapter`, for peft or vLLM's LoRA support).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from agent_grpo.config.base import ConfigError
from agent_grpo.models.loading import load_model, load_tokenizer
from agent_grpo.run_dir.writer import RunWriter
from agent_grpo.trainer.lora import is_adapter_dir

__all__ = ["export_run"]


def export_run(run_path: str | Path, out: str | Path) -> Path:
    """Write the latest checkpoint of `run_path` to `out` (see the module docstring)."""
    try:
        run = RunWriter.open(run_path)
    except FileNotFoundError as error:
        raise ConfigError(str(error)) from None
    checkpoint = run.latest_checkpoint()
    if checkpoint is None:
        raise ConfigError(f"{run.path} has no checkpoint to export")
    source, out = checkpoint / "model", Path(out)
    if out.exists():
        raise ConfigError(f"{out} exists; export writes a new directory")
    load_model(source).save_pretrained(out / "model")  # merged when `source` is an adapter
    load_tokenizer(source).save_pretrained(out / "model")
    if is_adapter_dir(source):
        shutil.copytree(source, out / "adapter")
    return out
