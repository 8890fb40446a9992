"""What a training run holds (models, engine, reference, optimizer) and how it is built, shared,
saved and restored: in one process, or on every rank of a torchrun job.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from agent_grpo.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from agent_grpo.config import ConfigError, dump_config
from agent_grpo.distributed import (
    DistContext,
    WrapMode,
    broadcast_module,
    broadcast_object,
    full_optimizer_state,
    full_state_dict,
    init_distributed,
    load_full_optimizer_state,
    wrap_policy,
    wrap_reference,
)
from agent_grpo.logs import get_logger
from agent_grpo.models import load_model, resolve_model_path
from agent_grpo.rollout.backend import GenerationBackend
from agent_grpo.rollout.collector import RolloutResult
from agent_grpo.store import RunDir
from agent_grpo.train_config import TrainConfig

__all__ = [
    "FullOptimizerState",
    "Trainer",
    "make_reference",
    "model_source",
    "open_run",
    "push_weights",
    "restore",
    "sampler_model",
    "save",
    "share_models",
    "share_rollout",
    "start_distributed",
]

log = get_logger("train")


@dataclass
class Trainer:
    """The models and engine of a run, as one process holds them."""

    policy: torch.nn.Module
    """The model being trained; under torchrun a `wrap_policy` module."""
    reference: torch.nn.Module | None
    """pi_ref when `algo.beta > 0` (under torchrun a `wrap_reference` module)."""
    optimizer: torch.optim.Optimizer
    """AdamW over the policy's parameters (FSDP2: this rank's shards)."""
    tokenizer: Any
    """The policy's tokenizer."""
    stop: list[str]
    """Stop strings of the environment's tool-call format."""
    backend: GenerationBackend | None
    """The generation engine; rank 0 only."""
    sampler: torch.nn.Module | None
    """Rank 0's plain model, which the backend samples from and checkpoints save (see
    `sampler_model`); None on other ranks."""
    ctx: DistContext = field(default_factory=DistContext)
    """Where this process sits; one process by default."""
    mode: WrapMode = "none"
    """`distributed.mode`: how the policy is split over ranks."""


def start_distributed(config: TrainConfig) -> DistContext:
    """Join the torchrun job that `distributed.mode` asks for; refuse a launch that does not fit."""
    mode, world = config.distributed.mode, int(os.environ.get("WORLD_SIZE", "1"))
    if mode == "none" and world > 1:
        raise ConfigError(
            f"distributed.mode=none under torchrun with {world} processes would train {world} "
            "separate models; set distributed.mode=ddp or fsdp"
        )
    if mode != "none" and world < 2:
        raise ConfigError(
            f"distributed.mode={mode} needs 2+ processes (WORLD_SIZE={world}): launch with "
            "`torchrun --nproc_per_node N -m agent_grpo.cli train ...` or set mode=none"
        )
    if mode == "none":
        return DistContext()
    return init_distributed(timeout_s=config.distributed.timeout_s)


def open_run(config: TrainConfig, resume: bool) -> RunDir:
    """The run directory: the existing one when resuming, else a new one with the config."""
    if resume:
        return RunDir.open(Path(config.run.root) / config.run.name)
    name = config.run.name
    if (Path(config.run.root) / name).exists():  # never mix two runs' records in one directory
        name = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        log.warning("%s/%s exists; writing this run to %s/%s", config.run.root,
                    config.run.name, config.run.root, name)  # fmt: skip
    return RunDir.create(config.run.root, run_id=name, config_text=dump_config(config))


def model_source(config: TrainConfig, checkpoint: Path | None, ctx: DistContext) -> str:
    """Where this rank loads the policy from: rank 0 resumes from the checkpoint; the other
    ranks load the base model, and `share_models` gives them rank 0's weights."""
    if checkpoint is not None and ctx.is_main:
        return str(checkpoint / "model")
    return resolve_model_path(config.model.name_or_path)


def sampler_model(
    policy: torch.nn.Module, config: TrainConfig, ctx: DistContext
) -> torch.nn.Module | None:
    """What rank 0 samples from (None on other ranks): the policy itself, except under FSDP2,
    whose shards only run with every rank taking part; then a full copy on rank 0's device,
    refreshed after every step (`push_weights`)."""
    if not ctx.is_main:
        return None
    if config.distributed.mode == "fsdp":
        return copy.deepcopy(policy).to(ctx.device)
    return policy


def make_reference(
    run: RunDir | None, policy: torch.nn.Module, config: TrainConfig, resume: bool
) -> torch.nn.Module | None:
    """pi_ref when beta > 0: the policy GRPO starts from (after the warm start).

    On resume that is no longer the policy, so rank 0 keeps it in the run directory.
    """
    if config.algo.beta <= 0:
        return None
    reference = copy.deepcopy(policy).requires_grad_(False)
    return reference if run is None else _persist_reference(run, reference, resume, config)


def share_models(
    policy: torch.nn.Module,
    reference: torch.nn.Module | None,
    config: TrainConfig,
    ctx: DistContext,
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """Under torchrun: rank 0's weights on every rank, then wrapped for DDP or FSDP2."""
    if not ctx.distributed:
        return policy, reference
    mode = config.distributed.mode
    policy = wrap_policy(broadcast_module(policy, ctx), mode, ctx)
    if reference is not None:
        reference = wrap_reference(broadcast_module(reference, ctx), mode, ctx)
    return policy, reference


def share_rollout(rollout: RolloutResult | None, ctx: DistContext) -> RolloutResult:
    """Rank 0's rollout on every rank (itself in one process)."""
    shared = broadcast_object(rollout, ctx)
    if shared is None:
        raise RuntimeError("rank 0 sent no rollout")
    return shared


def push_weights(trainer: Trainer) -> None:
    """Give rank 0's engine the new weights; under FSDP2 every rank first helps gather them."""
    if trainer.mode == "fsdp":
        state = full_state_dict(trainer.policy)  # the full weights on rank 0, {} elsewhere
        if trainer.sampler is not None:
            trainer.sampler.load_state_dict(state)
    if trainer.backend is not None and trainer.sampler is not None:
        trainer.backend.update_weights(trainer.sampler)


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


def save(run: RunDir | None, trainer: Trainer, state: TrainerState) -> None:
    """Rank 0 writes a checkpoint; under torchrun every rank first helps gather the optimizer.

    The layout is the one-process one, so either kind of run resumes the other's checkpoints.
    """
    optimizer = trainer.optimizer
    if trainer.ctx.distributed:
        full = FullOptimizerState(full_optimizer_state(trainer.optimizer))
        optimizer = cast(torch.optim.Optimizer, full)
    if run is not None and trainer.sampler is not None:
        path = run.checkpoint_dir(state.step)
        save_checkpoint(path, trainer.sampler, trainer.tokenizer, optimizer, state)


def restore(checkpoint: Path, trainer: Trainer) -> TrainerState:
    """A checkpoint's optimizer, RNG and trainer state; under torchrun rank 0 reads it and sends
    the state and the whole optimizer state to every rank (each keeps its shards)."""
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


def _persist_reference(
    run: RunDir, reference: torch.nn.Module, resume: bool, config: TrainConfig
) -> torch.nn.Module:
    path = run.path / "reference"
    if resume and path.exists():
        return load_model(str(path), dtype=getattr(torch, config.model.dtype)).eval()
    reference.save_pretrained(path)  # type: ignore[operator]
    return reference.eval()
