"""What a training run holds (models, engine, reference, optimizer) and how it is built: in one
process, or on every rank of a torchrun job. Parallelism enters only through `DistContext` and
the `wrap_*` functions; the same `Trainer` serves both.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent_grpo.config.base import ConfigError
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.models.loading import load_model, resolve_model_path
from agent_grpo.rollout.backends.base import GenerationBackend
from agent_grpo.rollout.collector import RolloutResult
from agent_grpo.rollout.sources import RolloutSource
from agent_grpo.run_dir.writer import RunWriter
from agent_grpo.trainer.backward_steps import BackwardSteps
from agent_grpo.trainer.lora import load_adapter, merged_copy, wrap_lora
from agent_grpo.trainer.parallel import (
    DistContext,
    LogprobModel,
    WrapMode,
    broadcast_module,
    broadcast_object,
    full_state_dict,
    init_distributed,
    launched_world_size,
    resolve_device,
    unwrap_policy,
    wrap_policy,
    wrap_reference,
)

__all__ = [
    "Trainer",
    "compute_dtype",
    "engine_copy",
    "load_policy",
    "make_reference",
    "model_source",
    "push_weights",
    "sampler_model",
    "share_models",
    "share_rollout",
    "start_distributed",
]


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
    """With `algo.optimizer_in_backward`, the hooks that step `optimizer` inside backward."""


def compute_dtype(config: TrainConfig) -> torch.dtype:
    """`model.dtype` as a torch dtype: what forward passes compute in (parameters stay fp32)."""
    return torch.bfloat16 if config.model.dtype == "bfloat16" else torch.float32


def start_distributed(config: TrainConfig) -> DistContext:
    """Join the torchrun job that `distributed.mode` asks for; refuse a launch that does not fit."""
    mode, world = config.distributed.mode, launched_world_size()
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
    try:
        if mode == "none":
            return DistContext(device=resolve_device(config.model.device))
        return init_distributed(timeout_s=config.distributed.timeout_s, device=config.model.device)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def load_policy(config: TrainConfig, checkpoint: Path | None, ctx: DistContext) -> torch.nn.Module:
    """The policy with fp32 parameters (the optimizer's master weights, whatever `model.dtype`
    says): the base model, or the checkpoint's; with `model.lora`, the base model under a fresh
    adapter or the checkpoint's adapter."""
    source = model_source(config, checkpoint, ctx)
    if config.model.lora is None:
        return load_model(source, dtype=torch.float32)
    base = load_model(resolve_model_path(config.model.name_or_path), dtype=torch.float32)
    if checkpoint is not None and ctx.is_main:
        return load_adapter(base, checkpoint / "model")
    return wrap_lora(base, config.model.lora)


def engine_copy(model: torch.nn.Module, backend: GenerationBackend) -> torch.nn.Module:
    """What to hand `backend.update_weights`: the model itself, or for an engine that holds its
    own weights (vLLM) and a LoRA policy, a merged copy of it."""
    shares = getattr(backend, "model", None) is model  # the hf backend samples from the policy
    return model if shares or not hasattr(model, "disable_adapter") else merged_copy(model)


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
    run: RunWriter | None, policy: torch.nn.Module, config: TrainConfig, resume: bool
) -> torch.nn.Module | None:
    """pi_ref when beta > 0: the policy GRPO starts from (after the warm start).

    On resume that is no longer the policy, so rank 0 keeps it in the run directory.
    """
    if config.algo.beta <= 0 or config.model.lora is not None:  # LoRA: see `share_models`
        return None
    reference = copy.deepcopy(policy).requires_grad_(False)
    if run is None:
        return reference
    path = run.path / "reference"
    if resume and path.exists():
        return load_model(str(path), dtype=torch.float32).requires_grad_(False).eval()
    reference.save_pretrained(path)  # type: ignore[operator]
    return reference.eval()


def share_models(
    policy: torch.nn.Module,
    reference: torch.nn.Module | None,
    config: TrainConfig,
    ctx: DistContext,
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """Rank 0's weights on every rank (a no-op in one process), then each model wrapped for the
    update: alone, under DDP or under FSDP2, on `ctx.device`."""
    mode, dtype = config.distributed.mode, compute_dtype(config)
    policy = wrap_policy(broadcast_module(policy, ctx), mode, ctx, dtype)
    if reference is not None:
        reference = wrap_reference(broadcast_module(reference, ctx), mode, ctx, dtype)
    if config.model.lora is not None and config.algo.beta > 0:  # the same weights, adapter off
        reference = LogprobModel(unwrap_policy(policy), compute_dtype=dtype, adapter_disabled=True)
    return policy, reference


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
