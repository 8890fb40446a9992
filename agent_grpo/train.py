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

import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

from agent_grpo.batch import (
    PackedBatch,
    pack_records,
)
from agent_grpo.checkpoint import TrainerState
from agent_grpo.distributed import (
    broadcast_object,
)
from agent_grpo.env import train_seeds
from agent_grpo.evaluate import env_stop_strings
from agent_grpo.grpo import group_advantages
from agent_grpo.logs import get_logger
from agent_grpo.models import load_model, load_tokenizer
from agent_grpo.rewards import apply_rewards, build_reward_fn
from agent_grpo.rollout.backend import GenerationBackend
from agent_grpo.rollout.collector import CollectorConfig, RolloutResult, Task, collect_groups
from agent_grpo.rollout.factory import build_backend
from agent_grpo.run_phases import (
    evaluate_and_warm_start,
    final_eval,
    open_tensorboard,
    record_step,
)
from agent_grpo.signal_metrics import dead_group_mask, logprob_mismatch, signal_metrics
from agent_grpo.train_config import AlgoConfig, TrainConfig
from agent_grpo.train_setup import (
    Trainer,
    make_reference,
    model_source,
    open_run,
    push_weights,
    restore,
    sampler_model,
    save,
    share_models,
    share_rollout,
    start_distributed,
)
from agent_grpo.trajectory import TrajectoryRecord
from agent_grpo.update import batch_logprobs, grpo_update

__all__ = ["train"]

log = get_logger("train")
console = Console()


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


def advantages_of(records: Sequence[TrajectoryRecord], algo: AlgoConfig) -> torch.Tensor:
    """Group-relative advantages of the records' total rewards."""
    rewards = torch.tensor([r.reward for r in records], dtype=torch.float32)  # [B]
    groups = [r.group_id for r in records]
    return group_advantages(rewards, groups, scale=algo.scale, leave_one_out=algo.leave_one_out)


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
    stop = env_stop_strings(config.env.id, config.env.kwargs)
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
    tensorboard = open_tensorboard(run, config) if run is not None else None
    for step in range(state.step, config.steps):
        metrics, records = train_step(config, trainer, step)
        if run is not None:
            record_step(run, config, step, metrics, records, tensorboard)
        state.step = step + 1
        every = config.run.checkpoint_every
        if state.step == config.steps or (every and state.step % every == 0):
            save(run, trainer, state)
    if run is not None and backend is not None:
        final_eval(config, run, backend, tokenizer, stop, state)
    if ctx.distributed:  # rank 0 may still be evaluating: tear down together
        dist.barrier()
        dist.destroy_process_group()
    return run.path if run is not None else Path(config.run.root) / config.run.name
