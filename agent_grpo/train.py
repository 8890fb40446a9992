"""GRPO for multi-turn tool agents, top to bottom: rollout -> reward -> advantage -> loss -> step.

Where we depart from the papers, and why:
- DeepSeekMath GRPO puts the KL term in the loss with the k3 estimator; so do we (`beta`), but the
  default is beta = 0 (DAPO, Dr. GRPO): with a short run the reference mostly costs a forward pass.
- Advantages are group-normalised by the unbiased std (as TRL and verl); `algo.scale: none` gives
  Dr. GRPO's unscaled advantages and `algo.leave_one_out` RLOO's baseline.
- The loss is averaged over valid model tokens of the whole minibatch (DAPO's token-mean) by
  default, with the global token count as the denominator across gradient-accumulation
  micro-batches, so splitting a batch never changes the update.
- Multi-turn: only tokens the policy sampled are trained on; tool output and chat-template tokens
  condition the policy but never enter the loss (see agent_grpo/tokens.py).
- pi_old is recomputed by the trainer (the sampler's numerics differ); the sampler/trainer gap is
  logged every step and can be corrected with truncated importance sampling (`algo.tis_cap`).
- Warm start: a supervised pass on the environment's expert trajectories precedes GRPO, because a
  135M model never calls a tool unaided and GRPO cannot learn from all-zero groups.
- Under torchrun (`distributed.mode` ddp or fsdp) rank 0 alone samples, rewards, evaluates and
  writes the run directory; every rank receives its records and trains on its share of the
  groups, and the step equals the one-process step (agent_grpo/distributed.py). verl and OpenRLHF
  sample on every rank; one sampler keeps rollouts identical to a one-process run.
"""

from __future__ import annotations

import copy
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from agent_grpo.batch import (
    PackedBatch,
    loss_denominator,
    micro_batch_loss,
    micro_batches,
    pack_records,
    rows_with_loss,
)
from agent_grpo.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from agent_grpo.config import ConfigError, dump_config
from agent_grpo.distributed import (
    DistContext,
    WrapMode,
    broadcast_module,
    broadcast_object,
    distributed_batch_logprobs,
    distributed_minibatch_update,
    full_optimizer_state,
    full_state_dict,
    init_distributed,
    load_full_optimizer_state,
    wrap_policy,
    wrap_reference,
)
from agent_grpo.env import heldout_seeds, train_seeds
from agent_grpo.evaluate import EvalResult, evaluate
from agent_grpo.grpo import group_advantages
from agent_grpo.logprobs import micro_batch_logprobs
from agent_grpo.logs import get_logger
from agent_grpo.models import load_model, load_tokenizer, resolve_model_path
from agent_grpo.registry import make_env
from agent_grpo.rewards import apply_rewards, build_reward_fn
from agent_grpo.rollout.backend import GenerationBackend
from agent_grpo.rollout.collector import CollectorConfig, RolloutResult, Task, collect_groups
from agent_grpo.rollout.factory import build_backend
from agent_grpo.sft import expert_record, train_sft
from agent_grpo.signal_metrics import dead_group_mask, logprob_mismatch, signal_metrics
from agent_grpo.store import RunDir
from agent_grpo.train_config import AlgoConfig, TrainConfig
from agent_grpo.trajectory import TrajectoryRecord

__all__ = ["train"]

log = get_logger("train")
console = Console()


# ---- plumbing: tasks, rollouts, batches ---------------------------------------------------------


def step_tasks(config: TrainConfig, step: int) -> list[Task]:
    """The tasks of one step: a pure function of (seed, step), so a resumed run sees the same."""
    rng = random.Random(f"{config.seed}/{step}")
    seeds = train_seeds(config.rollout.tasks_per_step, rng)
    return [Task(env_id=config.env.id, seed=s, env_kwargs=config.env.kwargs) for s in seeds]


def collect(
    config: TrainConfig, backend: GenerationBackend, tokenizer: Any, stop: list[str], step: int
) -> RolloutResult:
    """Sample this step's groups; with dynamic sampling, top up until groups carry signal."""
    sampling = config.rollout.sampling.model_copy(
        update={"stop": config.rollout.sampling.stop or stop}
    )
    collector = CollectorConfig(
        group_size=config.rollout.group_size,
        max_context_tokens=config.rollout.max_context_tokens,
        env_step_timeout_s=config.rollout.env_step_timeout_s,
        sampling=sampling,
    )
    result = collect_groups(
        step_tasks(config, step), backend, tokenizer, collector, step=step, run_id=config.run.name
    )
    if not config.algo.dynamic_sampling:
        return result
    return top_up_live_groups(config, backend, tokenizer, collector, step, result)


def top_up_live_groups(
    config: TrainConfig,
    backend: GenerationBackend,
    tokenizer: Any,
    collector: CollectorConfig,
    step: int,
    result: RolloutResult,
) -> RolloutResult:
    """DAPO dynamic sampling: drop dead groups and sample fresh tasks to refill the batch."""
    want = config.rollout.tasks_per_step * config.rollout.group_size
    live = [
        r
        for r, dead in zip(result.records, dead_group_mask(result.records), strict=True)
        if not dead
    ]
    for round_ in range(1, config.algo.dynamic_sampling_max_rounds + 1):
        if len(live) >= want:
            break
        rng = random.Random(f"{config.seed}/{step}/extra{round_}")
        tasks = [
            Task(env_id=config.env.id, seed=s, env_kwargs=config.env.kwargs)
            for s in train_seeds(config.rollout.tasks_per_step, rng)
        ]
        extra = collect_groups(
            tasks, backend, tokenizer, collector, step=step * 1000 + round_, run_id=config.run.name
        )
        live += [
            r
            for r, dead in zip(extra.records, dead_group_mask(extra.records), strict=True)
            if not dead
        ]
    records = live[:want] or result.records  # all dead: train on nothing rather than crash
    return RolloutResult(records=records, metrics=result.metrics)


@torch.no_grad()
def batch_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    temperature: float,
    algo: AlgoConfig,
    ctx: DistContext | None = None,
) -> torch.Tensor:
    """Per-token logprobs [B, T] of a whole batch, micro-batch by micro-batch (no grad); under
    torchrun (`ctx`) each rank scores its groups and every rank gets all rows."""
    if ctx is not None and ctx.distributed:
        return distributed_batch_logprobs(model, batch, temperature, algo, ctx)
    out = torch.full(batch.input_ids.shape, float("nan"))  # [B, T]
    for rows in micro_batches(batch, algo.micro_batch_tokens, by_group=algo.shared_prefix):
        part = batch.select(rows)
        values = micro_batch_logprobs(
            model,
            part.input_ids,
            part.attention_mask,
            part.loss_mask,
            temperature=temperature,
            shared_prefix=algo.shared_prefix,
        )  # [b, t]
        out[rows, : values.shape[1]] = values.float()
    return out


# ---- the algorithm: advantages, loss, update ---------------------------------------------------


def advantages_of(records: Sequence[TrajectoryRecord], algo: AlgoConfig) -> torch.Tensor:
    """Group-relative advantages of the records' total rewards."""
    rewards = torch.tensor([r.reward for r in records], dtype=torch.float32)  # [B]
    groups = [r.group_id for r in records]
    return group_advantages(rewards, groups, scale=algo.scale, leave_one_out=algo.leave_one_out)


def merge_metrics(parts: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Merge micro-batch metrics: min/max stay min/max, counts add, the rest token-weighted."""
    total = sum(w for w, _ in parts) or 1.0
    merged: dict[str, float] = {}
    for key in parts[0][1]:
        values = [m[key] for _, m in parts if key in m]
        if key == "ratio_min":
            merged[key] = min(values)
        elif key == "ratio_max":
            merged[key] = max(values)
        elif key in ("num_tokens", "loss"):
            merged[key] = sum(values)
        else:
            merged[key] = sum(w * m[key] for w, m in parts if key in m) / total
    return merged


def minibatch_update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: PackedBatch,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    algo: AlgoConfig,
    temperature: float,
) -> tuple[dict[str, float], torch.Tensor]:
    """One optimizer step over a minibatch, accumulating gradients over token-sized micro-batches.

    `old=None` means on-policy: pi_old is this very forward pass, detached (ratio 1), which saves
    a separate no-grad pass. Returns the metrics and the trainer's logprobs [B, T] (detached).
    """
    max_tokens = algo.max_tokens or int(batch.loss_mask.sum(dim=1).max())
    denominator = max(1, loss_denominator(batch, algo.aggregation, max_tokens))
    # with beta = 0 (no ref), a zero-advantage row adds exactly 0: its forward pass is skipped
    skip = algo.skip_zero_advantage and ref is None
    seen = torch.full(batch.input_ids.shape, float("nan"))  # [B, T]
    parts: list[tuple[float, dict[str, float]]] = []
    for rows in micro_batches(
        batch,
        algo.micro_batch_tokens,
        by_group=algo.shared_prefix,
        rows=rows_with_loss(batch, skip_zero_advantage=skip),
    ):
        part = batch.select(rows)
        width = part.input_ids.shape[1]
        logprobs = micro_batch_logprobs(
            policy,
            part.input_ids,
            part.attention_mask,
            part.loss_mask,
            temperature=temperature,
            shared_prefix=algo.shared_prefix,
        )  # [b, t]
        seen[rows, :width] = logprobs.detach()
        loss, metrics = micro_batch_loss(
            logprobs,
            part,
            None if old is None else old[rows, :width],
            None if ref is None else ref[rows, :width],
            algo,
            loss_mask=part.loss_mask,
            max_tokens=max_tokens,
            denominator=denominator,
        )
        loss.backward()
        parts.append(
            (float(part.num_model_tokens), {"loss": float(loss.detach()), **metrics.as_dict()})
        )
    merged = merge_metrics(parts) if parts else {"loss": 0.0, "num_tokens": 0.0}
    merged["grad_norm"] = float(
        torch.nn.utils.clip_grad_norm_(policy.parameters(), algo.max_grad_norm)
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return merged, seen


def grpo_update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: PackedBatch,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    algo: AlgoConfig,
    temperature: float,
    seed: int,
    ctx: DistContext | None = None,
) -> tuple[dict[str, float], torch.Tensor]:
    """`epochs` passes of `minibatches` optimizer steps over the step's batch.

    Returns the mean metrics and the logprobs of the first pass (= pi_old when on-policy). Under
    torchrun (`ctx`) every rank passes the same batch and each trains on its groups.
    """
    policy.train()
    generator = torch.Generator().manual_seed(seed)
    rows = batch.input_ids.shape[0]
    first_pass = torch.full(batch.input_ids.shape, float("nan"))  # [B, T]
    history: list[dict[str, float]] = []
    for epoch in range(algo.epochs):
        order = torch.randperm(rows, generator=generator)
        for chunk in order.chunk(algo.minibatches):
            index = chunk.tolist()
            part = batch.select(index)
            width = part.input_ids.shape[1]
            part_old = None if old is None else old[index, :width]  # [b, t]
            part_ref = None if ref is None else ref[index, :width]  # [b, t]
            if ctx is not None and ctx.distributed:
                metrics, seen = distributed_minibatch_update(
                    policy, optimizer, part, part_old, part_ref, algo, temperature, ctx
                )
            else:
                metrics, seen = minibatch_update(
                    policy, optimizer, part, part_old, part_ref, algo, temperature
                )
            history.append(metrics)
            if epoch == 0:
                first_pass[index, :width] = seen
    policy.eval()
    return {key: sum(h[key] for h in history) / len(history) for key in history[0]}, first_pass


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


def train_step(
    config: TrainConfig, trainer: Trainer, step: int
) -> tuple[dict[str, float], list[TrajectoryRecord]]:
    """One GRPO step; returns its metrics and its (annotated) trajectory records."""
    algo, ctx, started = config.algo, trainer.ctx, time.perf_counter()
    rollout = None
    if trainer.backend is not None:  # rank 0, the one process with an engine
        # 1. rollout: G trajectories per task, every group batched together
        rollout = collect(config, trainer.backend, trainer.tokenizer, trainer.stop, step)
        # 2. reward: verifier plus any configured sources, every component recorded
        apply_rewards(rollout.records, [(c, build_reward_fn(c)) for c in config.rewards])
    rollout = share_rollout(rollout, ctx)  # under torchrun every rank packs the same batch
    records = rollout.records
    # 3. advantage: within each group only
    advantages = advantages_of(records, algo)  # [B]
    for record, a in zip(records, advantages.tolist(), strict=True):
        record.advantage = a
    batch = pack_records(records, trainer.tokenizer.pad_token_id, advantages.tolist())
    if algo.drop_dead_groups:
        dead = torch.tensor(dead_group_mask(records))  # [B]
        batch.loss_mask &= ~dead[:, None]
    # 4. pi_old and pi_ref on the sampled tokens. With one pass over the batch the update is
    #    on-policy and pi_old is the loss's own forward pass (detached), so no extra pass is needed.
    temperature = records[0].sampling_temperature
    on_policy = algo.epochs == 1 and algo.minibatches == 1
    old: torch.Tensor | None = None
    if algo.old_logprobs == "sampler":
        old = batch.sampler_logprobs
    elif not on_policy:
        old = batch_logprobs(trainer.policy, batch, temperature, algo, ctx)  # [B, T]
    ref = (
        None
        if trainer.reference is None
        else batch_logprobs(trainer.reference, batch, temperature, algo, ctx)
    )  # [B, T]
    # 5. loss and optimizer steps, then the engine gets the new weights
    update, first_pass = grpo_update(
        trainer.policy, trainer.optimizer, batch, old, ref, algo, temperature,
        seed=config.seed * 100_003 + step, ctx=ctx,
    )  # fmt: skip
    trainer_old = first_pass if old is None or algo.old_logprobs == "sampler" else old
    push_weights(trainer)
    _annotate(records, trainer_old, ref, batch)
    metrics = {
        "step": float(step),
        **signal_metrics(records, advantages.tolist()),
        **logprob_mismatch(trainer_old, batch.sampler_logprobs, batch.loss_mask),
        **update,
        "rollout_tokens_per_s": rollout.metrics.tokens_per_s,
        "rollout_model_time_s": rollout.metrics.model_time_s,
        "rollout_env_time_s": rollout.metrics.env_time_s,
        "tool_errors": float(rollout.metrics.tool_errors),
        "step_time_s": time.perf_counter() - started,
    }
    return metrics, records


def _annotate(
    records: Sequence[TrajectoryRecord],
    old: torch.Tensor,
    ref: torch.Tensor | None,
    batch: PackedBatch,
) -> None:
    """Store trainer logprobs on each record: None where the trainer scored no token."""

    def row(values: torch.Tensor, b: int, n: int) -> list[float | None]:
        mask = batch.loss_mask[b, :n].tolist()
        return [v if m and math.isfinite(v) else None
                for v, m in zip(values[b, :n].tolist(), mask, strict=True)]  # fmt: skip

    for b, record in enumerate(records):
        n = len(record.token_ids)
        record.old_logprobs = row(old, b, n)
        if ref is not None:
            record.ref_logprobs = row(ref, b, n)


# ---- the run: eval -> warm start -> GRPO -> eval ------------------------------------------------


def run_eval(
    config: TrainConfig, backend: GenerationBackend, tokenizer: Any, stop: list[str], label: str
) -> EvalResult | None:
    """Evaluate on held-out seeds (None when evaluation is off)."""
    if config.eval is None:
        return None
    result, _ = evaluate(
        backend,
        tokenizer,
        config.env.id,
        heldout_seeds(config.eval.tasks),
        env_kwargs=config.env.kwargs,
        samples=config.eval.samples,
        temperature=config.eval.temperature,
        max_tokens=config.eval.max_tokens,
        max_context_tokens=config.rollout.max_context_tokens,
        seed=config.seed,
        stop=stop,
    )
    log.info(
        "eval %s: success %.3f, pass@%d %.3f, tool calls %.2f",
        label,
        result.success_rate,
        result.samples_per_task,
        result.pass_at_k,
        result.tool_call_rate,
    )
    return result


def warm_start(config: TrainConfig, policy: torch.nn.Module, tokenizer: Any) -> list[float]:
    """Supervised pass on expert demonstrations from training seeds."""
    assert config.warm_start is not None
    ws = config.warm_start
    rng = random.Random(f"{config.seed}/warm-start")
    demos = [
        expert_record(tokenizer, config.env.id, s, config.env.kwargs)
        for s in train_seeds(ws.demos, rng)
    ]
    return train_sft(
        policy,
        demos,
        pad_id=tokenizer.pad_token_id,
        epochs=ws.epochs,
        batch_size=ws.batch_size,
        lr=ws.lr,
        micro_batch_tokens=config.algo.micro_batch_tokens,
        seed=config.seed,
    )


def env_stop_strings(config: TrainConfig) -> list[str]:
    """Stop strings of the environment's tool-call format (end a turn right after a call)."""
    env = make_env(config.env.id, **config.env.kwargs)
    try:
        return list(getattr(env.unwrapped, "stop_strings", []))
    finally:
        env.close()


def print_summary(state: TrainerState, after: EvalResult | None) -> None:
    """The before/after table."""
    table = Table(title="held-out evaluation")
    table.add_column("model")
    for column in ("success", "pass@k", "reward", "tool calls", "turns", "tokens"):
        table.add_column(column, justify="right")
    rows = [
        ("base", state.eval_before),
        ("warm start", state.eval_warm_start),
        ("GRPO", None if after is None else after.model_dump()),
    ]
    for name, result in rows:
        if result is not None:
            table.add_row(
                name,
                *(
                    f"{result[k]:.3f}"
                    for k in (
                        "success_rate",
                        "pass_at_k",
                        "mean_reward",
                        "tool_call_rate",
                        "mean_turns",
                        "mean_model_tokens",
                    )
                ),
            )
    console.print(table)


def train(config: TrainConfig, *, resume: bool = False) -> Path:
    """Run the whole job described by `config`; returns the run directory.

    Under torchrun every rank runs this: rank 0 alone samples, evaluates and writes the run
    directory, and every rank takes part in each update.
    """
    ctx = start_distributed(config)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    run = open_run(config, resume) if ctx.is_main else None
    checkpoint = broadcast_object(run.latest_checkpoint() if run and resume else None, ctx)
    model_path = model_source(config, checkpoint, ctx)
    tokenizer = load_tokenizer(model_path)
    policy = load_model(model_path, dtype=getattr(torch, config.model.dtype)).eval()
    sampler = sampler_model(policy, config, ctx)
    backend = (
        None
        if sampler is None
        else build_backend(config.rollout.backend, sampler, tokenizer, model_path)
    )
    stop = env_stop_strings(config)
    state = TrainerState(step=0)
    if checkpoint is None and backend is not None:
        state = evaluate_and_warm_start(config, policy, backend, tokenizer, stop)
    reference = make_reference(run, policy, config, resume)
    policy, reference = share_models(policy, reference, config, ctx)
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=config.algo.lr, weight_decay=config.algo.weight_decay
    )
    trainer = Trainer(
        policy=policy, reference=reference, optimizer=optimizer, tokenizer=tokenizer, stop=stop,
        backend=backend, sampler=sampler, ctx=ctx, mode=config.distributed.mode,
    )  # fmt: skip
    if checkpoint is not None:
        state = restore(checkpoint, trainer)
        if run is not None:
            log.info("resumed from %s at step %d", checkpoint, state.step)
    for step in range(state.step, config.steps):
        metrics, records = train_step(config, trainer, step)
        if run is not None:
            record_step(run, config, step, metrics, records)
        state.step = step + 1
        every = config.run.checkpoint_every
        if state.step == config.steps or (every and state.step % every == 0):
            save(run, trainer, state)
    if run is not None and backend is not None:
        final_eval(config, run, backend, tokenizer, stop, state)
    if ctx.distributed:
        dist.destroy_process_group()
    return Path(config.run.root) / config.run.name


def evaluate_and_warm_start(
    config: TrainConfig,
    policy: torch.nn.Module,
    backend: GenerationBackend,
    tokenizer: Any,
    stop: list[str],
) -> TrainerState:
    """A fresh run's start (rank 0): base eval, then the warm start and its eval."""
    state = TrainerState(step=0)
    before = run_eval(config, backend, tokenizer, stop, "base")
    state.eval_before = None if before is None else before.model_dump()
    if config.warm_start is not None:
        losses = warm_start(config, policy, tokenizer)
        log.info("warm start: %d steps, nll %.3f -> %.3f", len(losses), losses[0], losses[-1])
        backend.update_weights(policy)
        after_ws = run_eval(config, backend, tokenizer, stop, "warm start")
        state.eval_warm_start = None if after_ws is None else after_ws.model_dump()
    return state


def record_step(
    run: RunDir,
    config: TrainConfig,
    step: int,
    metrics: dict[str, float],
    records: list[TrajectoryRecord],
) -> None:
    """Write a step's metrics and trajectories, and log its headline numbers."""
    run.write_metrics(step, metrics)
    if config.run.log_trajectories:
        run.write_trajectories(step, records)
    log.info(
        "step %d: reward %.3f success %.3f kl %.4f clip %.3f tok/s %.0f (%.0fs)",
        step,
        metrics["reward_mean"],
        metrics["success_rate"],
        metrics.get("kl_ref_mean", 0.0),
        metrics.get("clip_fraction", 0.0),
        metrics["rollout_tokens_per_s"],
        metrics["step_time_s"],
    )


def final_eval(
    config: TrainConfig,
    run: RunDir,
    backend: GenerationBackend,
    tokenizer: Any,
    stop: list[str],
    state: TrainerState,
) -> None:
    """Evaluate the trained policy, record it, print the before/after table, close the engine."""
    after = run_eval(config, backend, tokenizer, stop, "final")
    if after is not None:
        run.write_metrics(
            config.steps, {f"eval_{k}": float(v) for k, v in after.model_dump().items()}
        )
    print_summary(state, after)
    backend.close()


# ---- plumbing: one process, or every rank of a torchrun job -------------------------------------


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
    return RunDir.create(config.run.root, run_id=config.run.name, config_text=dump_config(config))


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
