"""How a training run is built, before its first step and once: the run directory, the policy
(plain, LoRA, from a checkpoint), the engine it samples with, the base evaluation and warm start
of a fresh run, pi_ref, the wrapping for 1..W ranks, the optimizer and where rollouts come from.
`set_up` does all of it in that order and returns the `Trainer` the loop steps.

In one process or on every rank of a torchrun job: rank 0 alone opens the run directory, owns the
engine and evaluates; the other ranks receive rank 0's weights (`share_models`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent_grpo.config.base import ConfigError, dump_config, named
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.envs.registry import make_env
from agent_grpo.evaluation.heldout import env_stop_strings
from agent_grpo.evaluation.in_training import run_eval
from agent_grpo.logs import get_logger
from agent_grpo.models.loading import load_model, load_tokenizer, resolve_model_path
from agent_grpo.rollout.backends.base import GenerationBackend
from agent_grpo.rollout.backends.factory import build_backend, rollout_limits
from agent_grpo.rollout.config import VLLMBackendConfig
from agent_grpo.rollout.env_pool import EnvPool
from agent_grpo.rollout.sources import build_rollouts
from agent_grpo.run_dir.reader import AFTER_STEPS, is_step_row
from agent_grpo.run_dir.writer import RunWriter
from agent_grpo.trainer import embedding_grad
from agent_grpo.trainer.backward_steps import BackwardSteps
from agent_grpo.trainer.checkpoint import TrainerState, read_state, restore, save
from agent_grpo.trainer.lora import load_adapter, wrap_lora
from agent_grpo.trainer.optimizer import adamw
from agent_grpo.trainer.parallel import (
    DistContext,
    broadcast_module,
    broadcast_object,
    init_distributed,
    launched_world_size,
    resolve_device,
    unwrap_policy,
    wrap_policy,
    wrap_reference,
)
from agent_grpo.trainer.policy import LogprobModel
from agent_grpo.trainer.progress import RunProgress
from agent_grpo.trainer.recompute import recompute_mlps
from agent_grpo.trainer.trainer import Trainer, engine_copy
from agent_grpo.trainer.warm_start import warm_start

__all__ = [
    "RunStart",
    "compute_dtype",
    "engine_dtype",
    "load_policy",
    "make_reference",
    "model_source",
    "open_run",
    "reference_dtype",
    "resolve_max_tokens",
    "sampler_model",
    "set_up",
    "share_models",
    "start_distributed",
]

log = get_logger("train")


@dataclass
class RunStart:
    """What `set_up` hands the loop."""

    run: RunWriter | None
    """The run directory; rank 0 only."""
    trainer: Trainer
    """What the steps use."""
    state: TrainerState
    """The step to start at and the evaluations made so far (restored on resume)."""


def set_up(
    config: TrainConfig, resume: bool, ctx: DistContext, progress: RunProgress, envs: EnvPool
) -> RunStart:
    """Build everything the loop needs. A fresh run evaluates the base model, warm-starts and
    evaluates again, then saves checkpoint 0, so a resume never repeats those; a resume restores
    the newest checkpoint instead. Evaluations and rollouts on the trainer's engine take their
    envs from `envs`, which the caller closes."""
    run = open_run(config, resume) if ctx.is_main else None
    checkpoint = broadcast_object(run.latest_checkpoint() if run and resume else None, ctx)
    if run is not None and resume:  # exactly once: what ran after the checkpoint runs again
        done = 0 if checkpoint is None else read_state(checkpoint).step
        run.rollback_to(done, _its_evaluations(done) if config.steps > done else None)
    model_path = model_source(config, checkpoint, ctx)
    tokenizer = load_tokenizer(model_path)
    policy = load_policy(config, checkpoint, ctx).to(ctx.device).eval()
    if config.algo.speed.recompute_mlp:
        recompute_mlps(policy)
    if embedding_grad.wanted(ctx.distributed, ctx.device, config.algo.speed.optimizer_in_backward):
        embedding_grad.add_embedding_grad_in_place(policy)
    sampler = sampler_model(policy, config, ctx)
    backend = build_engine(config, sampler, tokenizer, model_path, checkpoint)
    stop = env_stop_strings(config.env.id, config.env.kwargs)
    state = TrainerState(step=0)
    if checkpoint is None and backend is not None:  # a fresh run: base eval, warm start, eval
        progress.phase("base eval")
        state.eval_before = run_eval(config, backend, tokenizer, stop, "base", envs)
        if config.warm_start is not None:
            progress.phase("warm start")
            losses = warm_start(config, policy, tokenizer, compute_dtype(config))
            log.info("warm start: %d steps, nll %.3f -> %.3f", len(losses), losses[0], losses[-1])
            backend.update_weights(engine_copy(policy, backend))
            progress.phase("warm start eval")
            state.eval_warm_start = run_eval(config, backend, tokenizer, stop, "warm start", envs)
    reference = make_reference(run, policy, config, resume and checkpoint is not None)
    policy, reference = share_models(policy, reference, config, ctx)
    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapter alone
    optimizer = adamw(trainable, lr=config.algo.lr, weight_decay=config.algo.weight_decay)
    in_backward = BackwardSteps(optimizer) if config.algo.speed.optimizer_in_backward else None
    rollouts = None
    if backend is not None and sampler is not None:
        rollouts = build_rollouts(config, backend, tokenizer, stop, model_path, envs)
    trainer = Trainer(
        policy=policy, reference=reference, optimizer=optimizer, tokenizer=tokenizer, stop=stop,
        backend=backend, sampler=sampler, ctx=ctx, mode=config.distributed.mode,
        rollouts=rollouts, in_backward=in_backward, envs=envs,
    )  # fmt: skip
    if checkpoint is not None:
        state = restore(checkpoint, trainer)
        log.info("resumed from %s at step %d", checkpoint, state.step)
    else:  # base eval and warm start are done: a resume never repeats them
        save(run, trainer, state, config.run.keep_checkpoints)
    if rollouts is not None and sampler is not None:  # the policy GRPO starts (or resumes) from
        rollouts.push(sampler, state.step)
    return RunStart(run=run, trainer=trainer, state=state)


def _its_evaluations(done: int) -> Callable[[dict[str, Any]], bool]:
    """Which metrics rows a resume that trains past a checkpoint of `done` steps keeps: the
    evaluations of that checkpoint's policy (a finished run's final one), which it never
    repeats; a resume that does not train on evaluates that policy again and drops them."""
    return lambda row: not is_step_row(row) and row.get(AFTER_STEPS) == done


def build_engine(
    config: TrainConfig,
    sampler: torch.nn.Module | None,
    tokenizer: Any,
    model_path: str,
    checkpoint: Path | None,
) -> GenerationBackend | None:
    """Rank 0's generation engine over `sampler` (None on other ranks), sized for the larger of
    a step's rollout and an evaluation."""
    if sampler is None:
        return None
    # A LoRA engine starts from the base model and gets the merged adapter as a weight update.
    lora = config.model.lora is not None
    engine_path = resolve_model_path(config.model.name_or_path) if lora else model_path
    eval_rows = config.eval.tasks * config.eval.samples if config.eval else 0
    limits = rollout_limits(config.rollout, eval_rows)
    backend = build_backend(
        config.rollout.backend, sampler, tokenizer, engine_path, compute_dtype(config), limits
    )
    if lora and checkpoint is not None:
        backend.update_weights(engine_copy(sampler, backend))
    return backend


def open_run(config: TrainConfig, resume: bool) -> RunWriter:
    """The run directory: the existing one when resuming, else a new one with the config."""
    if resume:
        return RunWriter.open(Path(config.run.root) / config.run.name)
    # never mix two runs' records in one directory: a name in use takes a timestamp
    run = RunWriter.create_fresh(config.run.root, config.run.name,
                                 lambda taken: dump_config(named(config, taken)))  # fmt: skip
    taken = str(run.path.relative_to(config.run.root))  # `sweep/a` stays `sweep/a`
    if taken != config.run.name:
        log.warning("%s/%s exists; writing this run to %s (resume it with --resume "
                    "run.name=%s)", config.run.root, config.run.name, run.path,
                    taken)  # fmt: skip
        config.run.name = taken  # records name the run they are in
    return run


def resolve_max_tokens(config: TrainConfig) -> int:
    """The constant normaliser of `seq-mean-token-sum-norm`: `algo.max_tokens`, else the most
    tokens one episode can sample (`rollout.sampling.max_tokens` x the env's `max_turns`)."""
    if config.algo.max_tokens is not None:
        return config.algo.max_tokens
    env = make_env(config.env.id, **config.env.kwargs)
    try:
        turns = getattr(env.unwrapped, "max_turns", None)
    finally:
        env.close()
    if not isinstance(turns, int):
        if config.algo.aggregation == "seq-mean-token-sum-norm":
            raise ConfigError(
                f"{config.env.id} has no max_turns: set algo.max_tokens, the constant "
                "normaliser of aggregation seq-mean-token-sum-norm"
            )
        return config.rollout.sampling.max_tokens  # unused by the other aggregations
    return config.rollout.sampling.max_tokens * turns


def compute_dtype(config: TrainConfig) -> torch.dtype:
    """`model.dtype` as a torch dtype: what forward passes compute in (parameters stay fp32)."""
    return torch.bfloat16 if config.model.dtype == "bfloat16" else torch.float32


def engine_dtype(config: TrainConfig) -> torch.dtype:
    """The dtype the rollout engine samples in: a vLLM engine's own, else `compute_dtype`."""
    backend = config.rollout.backend
    if isinstance(backend, VLLMBackendConfig):
        return torch.bfloat16 if backend.dtype == "bfloat16" else torch.float32
    return compute_dtype(config)


def reference_dtype(config: TrainConfig) -> torch.dtype:
    """`model.reference_dtype` (else `model.dtype`): the frozen reference's weights and forward."""
    if config.model.reference_dtype is None:
        return compute_dtype(config)
    return torch.bfloat16 if config.model.reference_dtype == "bfloat16" else torch.float32


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
        reference = wrap_reference(
            broadcast_module(reference, ctx), mode, ctx, reference_dtype(config)
        )
    if config.model.lora is not None and config.algo.beta > 0:  # the same weights, adapter off
        reference = LogprobModel(unwrap_policy(policy), compute_dtype=dtype, adapter_disabled=True)
    return policy, reference
