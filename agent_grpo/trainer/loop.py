"""GRPO for multi-turn tool agents, top to bottom: rollout -> reward -> advantage -> pi_old/pi_ref
-> update -> weights to the engine -> log -> checkpoint.

Where we depart from the papers, and why:
- DeepSeekMath GRPO puts the KL term in the loss with the k3 estimator; we default to beta = 0
  (DAPO, Dr. GRPO: with a short run the reference mostly costs a forward pass) and, with beta > 0,
  to k2, whose gradient as a loss is that of KL(pi || pi_ref) (agent_grpo/algo/grpo.py).
- Advantages are group-normalised by the unbiased std (as TRL and verl); `algo.scale: none` gives
  Dr. GRPO's unscaled advantages and `algo.leave_one_out` RLOO's (unscaled) baseline.
- Episodes that failed outside the policy (env exception or timeout, failed generation) or got
  a non-finite reward are left out of their group's statistics and of the loss, and counted.
- The loss is averaged over valid model tokens of the whole minibatch (DAPO's token-mean) by
  default, with the global token count as the denominator across gradient-accumulation
  micro-batches and ranks, so splitting a batch never changes the update.
- Multi-turn: only tokens the policy sampled are trained on; tool output and chat-template tokens
  condition the policy but never enter the loss (see agent_grpo/trajectory/tokens.py).
- pi_old is recomputed by the trainer (the sampler's numerics differ); the sampler/trainer gap is
  logged every step and can be corrected with truncated importance sampling (`algo.tis_cap`).
- Warm start: a supervised pass on the environment's expert trajectories precedes GRPO, because a
  135M model never calls a tool unaided and GRPO cannot learn from all-zero groups.
- Under torchrun (`distributed.mode` ddp or fsdp) rank 0 alone samples, rewards, evaluates and
  writes the run directory; every rank receives its records and trains on its share of the
  groups with the same update code as one process (agent_grpo/trainer/update.py). verl and
  OpenRLHF sample on every rank; one sampler keeps rollouts identical to a one-process run.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from agent_grpo.algo.grpo import group_advantages
from agent_grpo.config.base import ConfigError, dump_config
from agent_grpo.config.jobs import AlgoConfig, TrainConfig
from agent_grpo.envs.registry import make_env
from agent_grpo.evaluation.heldout import env_stop_strings
from agent_grpo.evaluation.in_training import print_summary, run_eval
from agent_grpo.faults import crash_point
from agent_grpo.logs import get_logger
from agent_grpo.models.loading import load_tokenizer, resolve_model_path
from agent_grpo.preflight import preflight_train
from agent_grpo.rollout.backends.factory import build_backend, rollout_limits
from agent_grpo.rollout.sources import build_rollouts, staleness
from agent_grpo.rollout.summary import summarize_trajectories
from agent_grpo.run_dir.writer import RunWriter
from agent_grpo.trainer.backward_steps import BackwardSteps
from agent_grpo.trainer.batch import PackedBatch, pack_records
from agent_grpo.trainer.checkpoint import TrainerState, read_state, restore, save
from agent_grpo.trainer.metrics import (
    StepMetrics,
    counts_in_group,
    dead_group_mask,
    logprob_mismatch,
    reward_means,
    signal_metrics,
)
from agent_grpo.trainer.optimizer import adamw
from agent_grpo.trainer.parallel import DistContext, broadcast_object
from agent_grpo.trainer.progress import RunProgress
from agent_grpo.trainer.recompute import recompute_mlps
from agent_grpo.trainer.step_log import DeadStepWatch, open_tensorboard, record_step
from agent_grpo.trainer.trainer import (
    Trainer,
    compute_dtype,
    engine_copy,
    load_policy,
    make_reference,
    model_source,
    push_weights,
    sampler_model,
    share_models,
    share_rollout,
    start_distributed,
)
from agent_grpo.trainer.update import batch_logprobs, grpo_update
from agent_grpo.trainer.warm_start import warm_start
from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = ["advantages_of", "resolve_max_tokens", "train", "train_step", "trainable_rows"]

log = get_logger("train")


def advantages_of(records: Sequence[TrajectoryRecord], algo: AlgoConfig) -> torch.Tensor:
    """Group-relative advantages `[B]` of the records' total rewards, built in fp64 (float32
    rewards of 1000.0001 and 1000.0002 are one number); excluded members count for nothing."""
    rewards = torch.tensor([r.reward for r in records], dtype=torch.float64)  # [B]
    valid = torch.tensor([counts_in_group(r) for r in records], dtype=torch.bool)  # [B]
    return group_advantages(
        rewards, [r.group_id for r in records], valid=valid, scale=algo.advantage_scale,
        leave_one_out=algo.leave_one_out,
    )  # fmt: skip


def trainable_rows(records: Sequence[TrajectoryRecord], algo: AlgoConfig) -> torch.Tensor:
    """`[B]` bool: the rows whose model tokens enter the loss (and its denominator): not
    excluded, and with `drop_dead_groups` not in a group without reward variance."""
    keep = torch.tensor([counts_in_group(r) for r in records], dtype=torch.bool)  # [B]
    if algo.drop_dead_groups:
        keep &= ~torch.tensor(dead_group_mask(records), dtype=torch.bool)  # [B]
    return keep


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


def train_step(
    config: TrainConfig,
    trainer: Trainer,
    step: int,
    max_tokens: int,
    progress: RunProgress | None = None,
) -> tuple[StepMetrics, list[TrajectoryRecord]]:
    """One GRPO step; returns its metrics and its (annotated) trajectory records."""
    algo, ctx, started = config.algo, trainer.ctx, time.perf_counter()
    progress = progress or RunProgress.off()
    # 1-2. rollout and reward on rank 0 (the one process with an engine); every rank packs them
    rollout = None
    if trainer.rollouts is not None:
        progress.phase(f"step {step}: rollout")
        rollout = trainer.rollouts.collect(step, version=step)
    rollout = share_rollout(rollout, ctx)
    waited = time.perf_counter() - started
    records = rollout.records
    # 3. advantage: within each group only
    advantages = advantages_of(records, algo)  # [B]
    for record, a in zip(records, advantages.tolist(), strict=True):
        record.advantage = a
    batch = pack_records(records, trainer.tokenizer.pad_token_id, advantages.tolist())
    batch.loss_mask &= trainable_rows(records, algo)[:, None]  # [B, T]
    # 4. pi_old (the trainer's, before any update) and pi_ref on the sampled tokens. With a
    #    single pass the loss's own forward pass is pi_old, so no extra pass is needed.
    temperature = records[0].sampling_temperature
    progress.phase(f"step {step}: update")
    clock = PhaseClock()
    before = None
    if not algo.single_pass:
        before = batch_logprobs(trainer.policy, batch, temperature, algo, ctx)  # [B, T]
    old_s = clock.lap()
    old = batch.sampler_logprobs if algo.old_logprobs == "sampler" else before  # [B, T]
    ref = None
    if trainer.reference is not None:
        ref = batch_logprobs(trainer.reference, batch, temperature, algo, ctx)  # [B, T]
    ref_s = clock.lap()
    # 5. loss and optimizer steps
    update, first_pass = grpo_update(
        trainer.policy, trainer.optimizer, batch, old, ref, algo, temperature, max_tokens,
        seed=config.seed * 100_003 + step, ctx=ctx, in_backward=trainer.in_backward,
    )  # fmt: skip
    update_s = clock.lap()
    trainer_old = first_pass if before is None else before  # [B, T]
    # 6. the engines get the new weights: policy version step + 1
    push_weights(trainer, step + 1)
    push_s = clock.lap()
    # 7. what the step did
    _annotate(records, trainer_old, ref, batch)
    metrics = StepMetrics(
        step=step,
        rollout=summarize_trajectories(records),
        signal=signal_metrics(records, advantages.tolist()),
        mismatch=logprob_mismatch(trainer_old, batch.sampler_logprobs, batch.loss_mask),
        update=update,
        rollout_tokens_per_s=rollout.metrics.tokens_per_s,
        rollout_model_time_s=rollout.metrics.model_time_s,
        rollout_env_time_s=rollout.metrics.env_time_s,
        tool_errors=rollout.metrics.tool_errors,
        env_retries=rollout.metrics.env_retries,
        env_failures=rollout.metrics.env_failures,
        step_time_s=time.perf_counter() - started,
        rollout_wait_time_s=waited,
        old_logprobs_time_s=old_s,
        reference_time_s=ref_s,
        update_time_s=update_s,
        weight_push_time_s=push_s,
        reward_means=reward_means(records),
        staleness=staleness(rollout, step),
        stale_dropped=rollout.metrics.stale_dropped,
        worker_failures=rollout.metrics.worker_failures,
    )
    return metrics, records


class PhaseClock:
    """Seconds between successive `lap` calls: the step's phase timings."""

    def __init__(self) -> None:
        self.last = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the last lap (or since the clock started)."""
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds


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


def checkpoint_due(config: TrainConfig, done: int, saved_at: float) -> bool:
    """Whether to checkpoint after `done` steps: at the end, every `checkpoint_every` steps, and
    once `checkpoint_every_s` seconds have passed since the last save (rank 0's clock decides)."""
    every, every_s = config.run.checkpoint_every, config.run.checkpoint_every_s
    by_steps = every > 0 and done % every == 0
    by_time = every_s > 0 and time.monotonic() - saved_at >= every_s
    return done == config.steps or by_steps or by_time


def open_run(config: TrainConfig, resume: bool) -> RunWriter:
    """The run directory: the existing one when resuming, else a new one with the config."""
    if resume:
        return RunWriter.open(Path(config.run.root) / config.run.name)
    name = config.run.name
    if (Path(config.run.root) / name).exists():  # never mix two runs' records in one directory
        name = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        log.warning("%s/%s exists; writing this run to %s/%s", config.run.root,
                    config.run.name, config.run.root, name)  # fmt: skip
    return RunWriter.create(config.run.root, run_id=name, config_text=dump_config(config))


def train(config: TrainConfig, *, resume: bool = False) -> Path:
    """Run the whole job described by `config`; returns the run directory.

    Under torchrun every rank runs this: rank 0 alone samples, evaluates and writes the run
    directory, and every rank takes part in each update.
    """
    preflight_train(config)  # a config mistake is one line here, before any model or run dir
    ctx = start_distributed(config)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    max_tokens = resolve_max_tokens(config)
    display = RunProgress(config.steps) if ctx.is_main else RunProgress.off()
    with display as progress:
        path = _train(config, resume, ctx, max_tokens, progress)
    if ctx.distributed:  # rank 0 may still be evaluating: tear down together
        dist.barrier()
        dist.destroy_process_group()
    return path


def _train(
    config: TrainConfig, resume: bool, ctx: DistContext, max_tokens: int, progress: RunProgress
) -> Path:
    """`train`'s body, inside the run's progress display."""
    run = open_run(config, resume) if ctx.is_main else None
    checkpoint = broadcast_object(run.latest_checkpoint() if run and resume else None, ctx)
    if run is not None and resume:  # exactly once: what ran after the checkpoint runs again
        run.rollback_to(0 if checkpoint is None else read_state(checkpoint).step)
    model_path = model_source(config, checkpoint, ctx)
    tokenizer = load_tokenizer(model_path)
    dtype = compute_dtype(config)
    policy = load_policy(config, checkpoint, ctx).to(ctx.device).eval()
    if config.algo.recompute_mlp:
        recompute_mlps(policy)
    sampler = sampler_model(policy, config, ctx)
    backend = None
    if sampler is not None:
        engine_path = (
            resolve_model_path(config.model.name_or_path) if config.model.lora else model_path
        )
        eval_rows = config.eval.tasks * config.eval.samples if config.eval else 0
        limits = rollout_limits(config.rollout, eval_rows)
        backend = build_backend(
            config.rollout.backend, sampler, tokenizer, engine_path, dtype, limits
        )
        if config.model.lora and checkpoint is not None:  # an engine started from the base
            backend.update_weights(engine_copy(sampler, backend))
    stop = env_stop_strings(config.env.id, config.env.kwargs)
    state = TrainerState(step=0)
    if checkpoint is None and backend is not None:  # a fresh run: base eval, warm start, eval
        progress.phase("base eval")
        state.eval_before = run_eval(config, backend, tokenizer, stop, "base")
        if config.warm_start is not None:
            progress.phase("warm start")
            losses = warm_start(config, policy, tokenizer, dtype)
            log.info("warm start: %d steps, nll %.3f -> %.3f", len(losses), losses[0], losses[-1])
            backend.update_weights(engine_copy(policy, backend))
            progress.phase("warm start eval")
            state.eval_warm_start = run_eval(config, backend, tokenizer, stop, "warm start")
    reference = make_reference(run, policy, config, resume and checkpoint is not None)
    policy, reference = share_models(policy, reference, config, ctx)
    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapter alone
    optimizer = adamw(trainable, lr=config.algo.lr, weight_decay=config.algo.weight_decay)
    in_backward = BackwardSteps(optimizer) if config.algo.optimizer_in_backward else None
    rollouts = None
    if backend is not None and sampler is not None:
        rollouts = build_rollouts(config, backend, tokenizer, stop, model_path)
    trainer = Trainer(
        policy=policy, reference=reference, optimizer=optimizer, tokenizer=tokenizer, stop=stop,
        backend=backend, sampler=sampler, ctx=ctx, mode=config.distributed.mode,
        rollouts=rollouts, in_backward=in_backward,
    )  # fmt: skip
    keep = config.run.keep_checkpoints
    if checkpoint is not None:
        state = restore(checkpoint, trainer)
        log.info("resumed from %s at step %d", checkpoint, state.step)
    else:  # base eval and warm start are done: a resume never repeats them
        save(run, trainer, state, keep)
    if rollouts is not None and sampler is not None:  # the policy GRPO starts (or resumes) from
        rollouts.push(sampler, state.step)
    tensorboard = open_tensorboard(run, config) if run is not None else None
    saved_at, watch = time.monotonic(), DeadStepWatch()
    progress.start_at(state.step)
    for step in range(state.step, config.steps):
        metrics, records = train_step(config, trainer, step, max_tokens, progress)
        if run is not None:
            record_step(run, config, metrics, records, tensorboard)
            watch.see(metrics)
        crash_point("after_step", step)  # crash tests: recorded, not checkpointed
        state.step = step + 1
        progress.step()
        if broadcast_object(checkpoint_due(config, state.step, saved_at), ctx):
            progress.phase(f"checkpoint after step {step}")
            save(run, trainer, state, keep)
            saved_at = time.monotonic()
    if run is not None and backend is not None:
        progress.phase("final eval")
        after = run_eval(config, backend, tokenizer, stop, "final")
        if after is not None:
            run.write_metrics(config.steps, after.row())
        progress.close()  # the table goes below, not under a live display
        print_summary(state, after)
    if rollouts is not None:
        rollouts.close()
    if backend is not None:
        backend.close()
    # Rank 0's directory on every rank: it may have taken a fresh name (`open_run`).
    path = broadcast_object(run.path if run is not None else None, ctx)
    assert path is not None, "rank 0 always opens the run"
    return path
