"""What a training run holds (models, engine, reference, optimizer), and the three things a step
does with it besides the math: share rank 0's rollout with every rank, push the new weights to
the engines, and check with the weight canary that they arrived. How a run is built is in
`setup.py`; parallelism enters only through `DistContext` and the `wrap_*` functions, so the
same `Trainer` serves one process and every rank of torchrun.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agent_grpo.rollout.backends.base import GenerationBackend
from agent_grpo.rollout.collector import RolloutResult
from agent_grpo.rollout.config import CanaryConfig
from agent_grpo.rollout.env_pool import EnvPool
from agent_grpo.rollout.sources import RolloutSource
from agent_grpo.trainer.backward_steps import BackwardSteps
from agent_grpo.trainer.canary import (
    Canary,
    CanaryGap,
    canary_from_records,
    check_engines,
    trainer_scores,
)
from agent_grpo.trainer.lora import merged_copy
from agent_grpo.trainer.parallel import DistContext, WrapMode, broadcast_object, full_state_dict
from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = ["Trainer", "engine_copy", "push_weights", "share_rollout", "verify_push"]


@dataclass
class Trainer:
    """The models and engine of a run, as one process holds them."""

    policy: torch.nn.Module
    """The model being trained, as a `wrap_policy` module (alone, DDP or FSDP2)."""
    reference: torch.nn.Module | None
    """pi_ref when `algo.beta > 0`, as a `wrap_reference` module."""
    optimizer: torch.optim.Optimizer
    """AdamW over the policy's (fp32) parameters (FSDP2: this rank's shards)."""
    tokenizer: Any
    """The policy's tokenizer."""
    stop: list[str]
    """Stop strings of the environment's tool-call format."""
    backend: GenerationBackend | None
    """The generation engine; rank 0 only."""
    sampler: torch.nn.Module | None
    """Rank 0's plain model, which the backend samples from and checkpoints save (see
    `sampler_model`); None on other ranks."""
    ctx: DistContext
    """Where this process sits and computes."""
    mode: WrapMode
    """`distributed.mode`: how the policy is split over ranks."""
    rollouts: RolloutSource | None = None
    """Where training rollouts come from (the engine above, or Ray workers); rank 0 only."""
    in_backward: BackwardSteps | None = None
    """With `algo.speed.optimizer_in_backward`, the hooks that step `optimizer` inside backward."""
    canary: Canary | None = None
    """The weight canary (`rollout.canary`), made from the first step's records; rank 0 only."""
    envs: EnvPool | None = None
    """The run's envs between episodes, which its held-out evaluations share with rollouts on
    the trainer's engine (Ray workers keep their own); closed when the run ends."""


def engine_copy(model: torch.nn.Module, backend: GenerationBackend) -> torch.nn.Module:
    """What to hand `backend.update_weights`: the model itself, or for an engine that holds its
    own weights (vLLM) and a LoRA policy, a merged copy of it."""
    shares = getattr(backend, "model", None) is model  # the hf backend samples from the policy
    return model if shares or not hasattr(model, "disable_adapter") else merged_copy(model)


def share_rollout(rollout: RolloutResult | None, ctx: DistContext) -> RolloutResult:
    """Rank 0's rollout on every rank (itself in one process)."""
    shared = broadcast_object(rollout, ctx)
    if shared is None:
        raise RuntimeError("rank 0 sent no rollout")
    return shared


def push_weights(trainer: Trainer, version: int) -> None:
    """Give rank 0's engines the weights of policy `version`; under FSDP2 every rank first helps
    gather them."""
    if trainer.mode == "fsdp":
        state = full_state_dict(trainer.policy)  # the full weights on rank 0, {} elsewhere
        if trainer.sampler is not None:
            trainer.sampler.load_state_dict(state)
    if trainer.backend is not None and trainer.sampler is not None:
        trainer.backend.update_weights(engine_copy(trainer.sampler, trainer.backend))
    if trainer.rollouts is not None and trainer.sampler is not None:
        trainer.rollouts.push(trainer.sampler, version)


def verify_push(
    trainer: Trainer,
    config: CanaryConfig | None,
    records: Sequence[TrajectoryRecord],
    version: int,
) -> CanaryGap | None:
    """After the push of `version`, every `config.every` pushes: each engine scores the canary
    and the trainer its own weights' logprobs of it (agent_grpo/trainer/canary.py); an engine
    without the pushed weights raises `CanaryError`. Rank 0 only; None when it did not run."""
    if config is None or trainer.rollouts is None or trainer.sampler is None:
        return None
    if version % config.every != 0:
        return None
    if trainer.canary is None:
        trainer.canary = canary_from_records(records, config.sequences)
    canary = trainer.canary
    scores = trainer.rollouts.score_canary(canary.sequences, canary.targets)
    return check_engines(scores, canary, trainer_scores(trainer.sampler, canary), version,
                         config.max_gap)  # fmt: skip
