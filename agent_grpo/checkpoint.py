"""Checkpoints that resume exactly: model weights, optimizer state, RNG states and the step."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel

__all__ = ["TrainerState", "load_checkpoint", "save_checkpoint"]


class TrainerState(BaseModel):
    """Everything besides weights that a resumed run needs."""

    step: int
    """Number of GRPO steps completed."""
    eval_before: dict[str, Any] | None = None
    """Base-model evaluation, kept so the final table survives a resume."""
    eval_warm_start: dict[str, Any] | None = None
    """Evaluation after the warm start."""


def _rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(
    path: Path, model: Any, tokenizer: Any, optimizer: torch.optim.Optimizer, state: TrainerState
) -> Path:
    """Write a checkpoint directory atomically (a temp dir renamed into place)."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    torch.save({"optimizer": optimizer.state_dict(), "rng": _rng_state()}, tmp / "trainer.pt")
    (tmp / "state.json").write_text(state.model_dump_json(indent=1))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def load_checkpoint(path: Path, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Restore optimizer and RNG states from `path`; the caller loads `path / "model"`."""
    blob = torch.load(path / "trainer.pt", weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    _set_rng_state(blob["rng"])
    return TrainerState.model_validate_json((path / "state.json").read_text())
