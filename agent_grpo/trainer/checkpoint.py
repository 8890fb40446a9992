"""Checkpoints that resume exactly: model weights, optimizer state, RNG states and the step."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from pydantic import BaseModel

from agent_grpo.evaluation.heldout import EvalResult
from agent_grpo.faults import crash_point
from agent_grpo.run_dir.writer import RunDirWriteError
from agent_grpo.trainer.optimizer import load_optimizer_state
from agent_grpo.trainer.parallel import (
    broadcast_object,
    full_optimizer_state,
    load_full_optimizer_state,
)

if TYPE_CHECKING:
    from agent_grpo.run_dir.writer import RunWriter
    from agent_grpo.trainer.trainer import Trainer

__all__ = [
    "TrainerState",
    "load_checkpoint",
    "prune_checkpoints",
    "read_state",
    "restore",
    "save",
    "save_checkpoint",
]


class TrainerState(BaseModel):
    """Everything besides weights that a resumed run needs."""

    step: int
    """Number of GRPO steps completed."""
    eval_before: EvalResult | None = None
    """Base-model evaluation, kept so the final table survives a resume."""
    eval_warm_start: EvalResult | None = None
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


def _fsync_tree(root: Path) -> None:
    """fsync every file below `root`, then each directory: the bytes are on disk before the
    rename that publishes them (a power cut must not leave a whole-looking empty checkpoint)."""
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


ROLLOUTS_FILE = "rollouts.bin"
"""A checkpoint's file for what its rollout source must continue (partial rollouts' groups in
flight), present only when there is something."""


def save_checkpoint(
    path: Path,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    state: TrainerState,
    rollouts: bytes | None = None,
) -> Path:
    """Write a checkpoint directory atomically: into `NAME.tmp`, fsynced, then renamed to
    `NAME`. `RunWriter.latest_checkpoint` only counts names without a suffix, so a save that
    crashes half way is never taken for the latest; the next save starts its temp dir over.
    `rollouts`: the rollout source's `state()`, when it has one."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        torch.save({"optimizer": optimizer.state_dict(), "rng": _rng_state()}, tmp / "trainer.pt")
        if rollouts is not None:
            (tmp / ROLLOUTS_FILE).write_bytes(rollouts)
        crash_point("checkpoint", state.step)  # crash tests: weights written, state not yet
        (tmp / "state.json").write_text(state.model_dump_json(indent=1))
        _fsync_tree(tmp)
    except (OSError, RuntimeError) as error:  # torch.save reports a full disk as RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)  # the half-written one must not fill the disk
        raise RunDirWriteError(
            f"cannot write checkpoint {path}: {error}; the previous checkpoint and every "
            "recorded step are intact: free space, then resume the run"
        ) from error
    if path.exists():  # the same step saved again: keep the old one until the new is in place
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old)
    else:
        tmp.rename(path)
    return path


def prune_checkpoints(folder: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoint directories under `folder` (and temp dirs
    older than the newest); returns what was deleted."""
    whole = sorted(p for p in folder.iterdir() if p.is_dir() and "." not in p.name)
    doomed = whole[:-keep] + [p for p in folder.iterdir() if p.is_dir() and "." in p.name]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def read_state(path: Path) -> TrainerState:
    """The `TrainerState` of checkpoint `path` (no tensors loaded)."""
    return TrainerState.model_validate_json((path / "state.json").read_text())


def load_checkpoint(path: Path, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Restore optimizer and RNG states from `path`; the caller loads `path / "model"`."""
    blob = torch.load(path / "trainer.pt", weights_only=False)
    if isinstance(optimizer, torch.optim.Optimizer):
        load_optimizer_state(optimizer, blob["optimizer"])
    else:  # the torchrun holder of the full state
        optimizer.load_state_dict(blob["optimizer"])
    _set_rng_state(blob["rng"])
    return TrainerState.model_validate_json((path / "state.json").read_text())


class FullOptimizerState:
    """Stands in for the optimizer in `save_checkpoint` and `load_checkpoint` under torchrun:
    they call `state_dict()` / `load_state_dict()`, and this holds the full (gathered) state."""

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self.state = state or {}

    def state_dict(self) -> dict[str, Any]:
        """The held state."""
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hold `state`."""
        self.state = state


def save(run: RunWriter | None, trainer: Trainer, state: TrainerState, keep: int = 2) -> None:
    """Rank 0 writes a checkpoint; under torchrun every rank first helps gather the optimizer.

    The layout is the one-process one, so either kind of run resumes the other's checkpoints.
    Only the newest `keep` checkpoints stay.
    """
    optimizer = trainer.optimizer
    if trainer.ctx.distributed:
        full = FullOptimizerState(full_optimizer_state(trainer.optimizer))
        optimizer = cast(torch.optim.Optimizer, full)
    if run is not None and trainer.sampler is not None:
        path = run.checkpoint_dir(state.step)
        rollouts = trainer.rollouts.state() if trainer.rollouts is not None else None
        save_checkpoint(path, trainer.sampler, trainer.tokenizer, optimizer, state, rollouts)
        run.record_checkpoint(path)  # the manifest's entry, after the rename (crash: adopted)
        crash_point("prune", state.step)  # crash tests: the new checkpoint whole, old ones kept
        for pruned in prune_checkpoints(path.parent, keep):
            run.record_checkpoint_removed(pruned)


def restore(checkpoint: Path, trainer: Trainer) -> TrainerState:
    """A checkpoint's optimizer, RNG, trainer state and the rollout source's state; under
    torchrun rank 0 reads it and sends the state and the whole optimizer state to every rank
    (each keeps its shards)."""
    if trainer.rollouts is not None and (checkpoint / ROLLOUTS_FILE).exists():
        trainer.rollouts.restore((checkpoint / ROLLOUTS_FILE).read_bytes())
    if not trainer.ctx.distributed:
        return load_checkpoint(checkpoint, trainer.optimizer)
    holder = FullOptimizerState()
    state = (
        load_checkpoint(checkpoint, cast(torch.optim.Optimizer, holder))
        if trainer.ctx.is_main
        else None
    )
    state, full = broadcast_object((state, holder.state), trainer.ctx)
    load_full_optimizer_state(trainer.optimizer, full)
    assert state is not None
    return state
