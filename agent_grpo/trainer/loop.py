"""GRPO for multi-turn tool agents, top to bottom: rollout with rewards -> advantage ->
pi_old/pi_ref -> update -> weights to the engine -> metrics -> log -> checkpoint. How the run is
built is in `setup.py`; this file is the algorithm and the loop.

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

import contextlib
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from agent_grpo.algo.groups import advantages_of, trainable_rows, turn_advantages_of
from agent_grpo.algo.staleness import within_staleness
from agent_grpo.config.base import ConfigError
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.evaluation.in_training import print_summary, run_eval
from agent_grpo.faults import crash_point
from agent_grpo.preflight import preflight_train
from agent_grpo.rollout.env_pool import EnvPool
from agent_grpo.rollout.sources import staleness
from agent_grpo.run_dir.reader import AFTER_STEPS
from agent_grpo.trainer.batch import PackedBatch, pack_records, token_versions
from agent_grpo.trainer.checkpoint import save
from agent_grpo.trainer.metrics import (
    StepMetrics,
    StepTimes,
    logprob_mismatch,
    mismatch_by_staleness,
    step_metrics,
)
from agent_grpo.trainer.mismatch import (
    EngineView,
    causes_sampling,
    engine_view,
    mismatch_causes,
)
from agent_grpo.trainer.parallel import broadcast_object
from agent_grpo.trainer.progress import RunProgress
from agent_grpo.trainer.resume import check_resume, record_changes
from agent_grpo.trainer.setup import (
    RunStart,
    compute_dtype,
    engine_dtype,
    resolve_max_tokens,
    set_up,
    start_distributed,
)
from agent_grpo.trainer.step_log import DeadStepWatch, record_step
from agent_grpo.trainer.trackers import StepCallback, check_trackers, open_trackers
from agent_grpo.trainer.trainer import Trainer, push_weights, share_rollout, verify_push
from agent_grpo.trainer.update import batch_logprobs, grpo_update
from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = ["train", "train_checked", "train_step"]

_KEPT_UNTIL_EXIT: list[object] = []
"""A distributed run's objects, never freed before the rank's process ends (see `train_checked`)."""


def train_step(
    config: TrainConfig,
    trainer: Trainer,
    step: int,
    max_tokens: int,
    progress: RunProgress | None = None,
) -> tuple[StepMetrics, list[TrajectoryRecord]]:
    """One GRPO step; returns its metrics and its (annotated) trajectory records."""
    algo, ctx, clock = config.algo, trainer.ctx, PhaseClock()
    progress = progress or RunProgress.off()
    # 1. rollout with rewards, on rank 0 (the one process with an engine); every rank gets it
    rollout = None
    if trainer.rollouts is not None:
        progress.phase(f"step {step}: rollout")
        rollout = trainer.rollouts.collect(step, version=step)
    rollout = share_rollout(rollout, ctx)
    waited = clock.lap()
    records = rollout.records
    # 2. advantage: within each group only
    advantages = advantages_of(records, algo)  # [B]
    for record, a in zip(records, advantages.tolist(), strict=True):
        record.advantage = a
    if algo.turn_credit is not None:  # each turn's own: the episode's plus its step advantage
        for record, per_turn in zip(records, turn_advantages_of(records, algo, advantages),
                                    strict=True):  # fmt: skip
            for turn, a in zip(record.turns, per_turn, strict=True):
                turn.advantage = a
    batch = pack_records(records, trainer.tokenizer.pad_token_id)  # [B, T] per token
    batch.loss_mask &= trainable_rows(records, algo)[batch.episode_index][:, None]  # per branch
    versions = token_versions(records, batch.input_ids.shape[1])  # [B, T] who sampled each
    fresh = within_staleness(versions, step, algo.max_staleness)  # [B, T]
    stale_masked = int((batch.loss_mask & ~fresh).sum())  # partial rollouts' oldest turns
    batch.loss_mask &= fresh
    # 3. pi_old and pi_ref on the sampled tokens. The trainer scores pi_old itself before any
    #    update, unless the loss's own first pass is pi_old (`single_pass`); `old_logprobs:
    #    sampler` puts the sampler's logprobs in the ratio instead.
    temperature = records[0].sampling_temperature
    progress.phase(f"step {step}: update")
    trainer_pi_old = None
    if not algo.single_pass:
        trainer_pi_old = batch_logprobs(trainer.policy, batch, temperature, algo, ctx)  # [B, T]
    old_s = clock.lap()
    pi_old = batch.sampler_logprobs if algo.old_logprobs == "sampler" else trainer_pi_old
    pi_ref = None
    if trainer.reference is not None:
        pi_ref = batch_logprobs(trainer.reference, batch, temperature, algo, ctx)  # [B, T]
    ref_s = clock.lap()
    # the gap's causes are scored by the weights that sampled: before the update
    own = batch.loss_mask & (versions == step)  # [B, T] sampled by the weights trained now
    view = _engine_view(config, trainer, batch, own, temperature, step)
    view_s = clock.lap()
    # 4. loss and optimizer steps
    update, first_pass = grpo_update(
        trainer.policy, trainer.optimizer, batch, pi_old, pi_ref, algo, temperature, max_tokens,
        seed=config.seed * 100_003 + step, ctx=ctx, in_backward=trainer.in_backward,
    )  # fmt: skip
    update_s = clock.lap()
    if trainer_pi_old is None:  # single pass: the first pass scored every row before its update
        trainer_pi_old = first_pass
    # 5. the engines get the new weights: policy version step + 1
    push_weights(trainer, step + 1)
    push_s = clock.lap()
    canary = verify_push(trainer, config.rollout.canary, records, step + 1)  # did they arrive?
    canary_s = clock.lap()
    # 6. what the step did
    _annotate(records, trainer_pi_old, pi_ref, batch)
    times = StepTimes(
        step_time_s=clock.total(), rollout_wait_time_s=waited, old_logprobs_time_s=old_s,
        reference_time_s=ref_s, mismatch_causes_time_s=view_s, update_time_s=update_s,
        weight_push_time_s=push_s, canary_time_s=canary_s,
    )  # fmt: skip
    mismatch = logprob_mismatch(trainer_pi_old, batch.sampler_logprobs, batch.loss_mask)
    by_age = mismatch_by_staleness(
        trainer_pi_old, batch.sampler_logprobs, batch.loss_mask, step - versions
    )
    causes = None
    if view is not None:
        causes = mismatch_causes(view, batch.sampler_logprobs, trainer_pi_old, own,
                                 view.sampling, compute_dtype(config)).measured()  # fmt: skip
    metrics = step_metrics(
        step, records, advantages.tolist(), rollout, update, mismatch, times,
        staleness(rollout, step), None if canary is None else canary.mean, by_age, stale_masked,
        causes,
    )  # fmt: skip
    return metrics, records


def _engine_view(
    config: TrainConfig,
    trainer: Trainer,
    batch: PackedBatch,
    own: torch.Tensor,
    temperature: float,
    step: int,
) -> EngineView | None:
    """The engine's view of the tokens these weights sampled, on the steps that split the
    sampler/trainer gap by cause (`rollout.mismatch_causes_every`; rank 0, which samples)."""
    every = config.rollout.mismatch_causes_every
    if every == 0 or step % every != 0 or trainer.sampler is None:
        return None
    sampling = causes_sampling(config.rollout.sampling, temperature)
    return engine_view(trainer.sampler, batch, own, sampling, engine_dtype(config))


class PhaseClock:
    """Seconds between successive `lap` calls: the step's phase timings."""

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the last lap (or since the clock started)."""
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds

    def total(self) -> float:
        """Seconds since the clock started."""
        return time.perf_counter() - self.started


def _annotate(
    records: Sequence[TrajectoryRecord],
    trainer_pi_old: torch.Tensor,
    pi_ref: torch.Tensor | None,
    batch: PackedBatch,
) -> None:
    """Store the trainer's logprobs on each row of each record (batch rows are the records'
    `rows()` in order): None where the trainer scored no token."""

    def row(values: torch.Tensor, b: int, n: int) -> list[float | None]:
        mask = batch.loss_mask[b, :n].tolist()
        return [v if m and math.isfinite(v) else None
                for v, m in zip(values[b, :n].tolist(), mask, strict=True)]  # fmt: skip

    rows = [(record, r) for record in records for r in record.rows()]
    for b, (record, r) in enumerate(rows):
        n = len(r.token_ids)
        ref = None if pi_ref is None else row(pi_ref, b, n)
        record.set_row_logprobs(r.branch, row(trainer_pi_old, b, n), ref)


def heldout_due(config: TrainConfig, step: int) -> bool:
    """Whether the held-out evaluation runs after `step` (`eval.every`); the last step's is the
    final evaluation."""
    every = config.eval.every if config.eval is not None else 0
    return every > 0 and (step + 1) % every == 0 and step + 1 < config.steps


def checkpoint_due(config: TrainConfig, done: int, saved_at: float) -> bool:
    """Whether to checkpoint after `done` steps: at the end, every `checkpoint_every` steps, and
    once `checkpoint_every_s` seconds have passed since the last save (rank 0's clock decides)."""
    every, every_s = config.run.checkpoint_every, config.run.checkpoint_every_s
    by_steps = every > 0 and done % every == 0
    by_time = every_s > 0 and time.monotonic() - saved_at >= every_s
    return done == config.steps or by_steps or by_time


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    accept_config_change: bool = False,
    callbacks: Sequence[StepCallback] = (),
) -> Path:
    """Run the whole job described by `config`; returns the run directory. `resume` continues
    the run `run.name` from its newest checkpoint, with the config it started with unless
    `accept_config_change` (trainer/resume.py). Each of `callbacks` gets every step's metrics
    once they are written (trainer/trackers.py).

    Under torchrun every rank runs this: rank 0 alone samples, evaluates and writes the run
    directory, and every rank takes part in each update.
    """
    preflight_train(config)  # a config mistake is one line here, before any model or run dir
    return train_checked(
        config, resume=resume, accept_config_change=accept_config_change, callbacks=callbacks
    )


def train_checked(
    config: TrainConfig,
    *,
    resume: bool = False,
    accept_config_change: bool = False,
    callbacks: Sequence[StepCallback] = (),
) -> Path:
    """`train` of a config `preflight_train` has already checked: the CLI checks it before it
    imports this module (torch and transformers take seconds to import), and the checks start
    envs and MCP servers, which are not run twice."""
    check_trackers(config)
    if accept_config_change and not resume:
        raise ConfigError("accept_config_change (--accept-config-change) needs --resume")
    changes = check_resume(config, accept_config_change=accept_config_change) if resume else []
    ctx = start_distributed(config)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    max_tokens = resolve_max_tokens(config)
    display = RunProgress(config.steps) if ctx.is_main else RunProgress.off()
    # the run's envs (MCP servers, say), shared by its evaluations and rollouts, stop when it ends
    with display as progress, EnvPool() as envs:
        start = set_up(config, resume, ctx, progress, envs)
        if start.run is not None:
            record_changes(start.run.path, start.state.step, changes)
        try:
            _loop(config, start, max_tokens, progress, callbacks)
        except BaseException:
            with contextlib.suppress(Exception):  # the run's own error is the one to report
                _close_rollouts(start)  # envs kept between steps (MCP servers) stop now
            raise
        _finish(config, start, progress)
    # Rank 0's directory on every rank: it may have taken a fresh name (`setup.open_run`).
    path = broadcast_object(start.run.path if start.run is not None else None, ctx)
    assert path is not None, "rank 0 always opens the run"
    if ctx.distributed:  # rank 0 may still be evaluating: tear down together
        dist.barrier()
        # Freed at this return, the DDP reducer (which holds the gloo group) would destroy the
        # group with the GIL held, joining a gloo thread that may still need the GIL to drop the
        # barrier's work: a deadlock (seen in CI, both stacks in a dump). A torchrun rank ends
        # through `end_rank`, which skips that teardown, so the run's objects live until then.
        _KEPT_UNTIL_EXIT.append(start)
        dist.destroy_process_group()
    return path


def _loop(
    config: TrainConfig,
    start: RunStart,
    max_tokens: int,
    progress: RunProgress,
    callbacks: Sequence[StepCallback] = (),
) -> None:
    """The GRPO steps from `start.state.step` on: step, write it down, checkpoint when due."""
    run, trainer, state = start.run, start.trainer, start.state
    path = run.path if run is not None else None
    trackers = open_trackers(path, config, callbacks, resumed=state.step > 0)
    saved_at, watch = time.monotonic(), DeadStepWatch()
    progress.start_at(state.step)
    try:
        for step in range(state.step, config.steps):
            metrics, records = train_step(config, trainer, step, max_tokens, progress)
            if heldout_due(config, step) and trainer.backend is not None:
                progress.phase(f"step {step}: held-out eval")
                started = time.perf_counter()
                metrics.heldout = run_eval(config, trainer.backend, trainer.tokenizer,
                                           trainer.stop, f"after step {step}",
                                           trainer.envs)  # fmt: skip
                metrics.times.heldout_time_s = time.perf_counter() - started
            if run is not None:
                record_step(run, config, metrics, records, trackers)
                watch.see(metrics)
            crash_point("after_step", step)  # crash tests: recorded, not checkpointed
            state.step = step + 1
            progress.step()
            if broadcast_object(checkpoint_due(config, state.step, saved_at), ctx=trainer.ctx):
                progress.phase(f"checkpoint after step {step}")
                save(run, trainer, state, config.run.keep_checkpoints)
                saved_at = time.monotonic()
    except BaseException:
        trackers.close(failed=True)  # a tracker's run must not stay RUNNING
        raise
    trackers.close()


def _finish(config: TrainConfig, start: RunStart, progress: RunProgress) -> None:
    """The rollouts close (Ray actors, partial episodes in flight), then the final evaluation
    on the run's envs and the before/after table (rank 0), then the engine closes."""
    run, trainer, state = start.run, start.trainer, start.state
    _close_rollouts(start)
    if run is not None and trainer.backend is not None:
        progress.phase("final eval")
        final = run_eval(config, trainer.backend, trainer.tokenizer, trainer.stop, "final",
                         trainer.envs)  # fmt: skip
        if final is not None:
            run.write_metrics(config.steps, final.row() | {AFTER_STEPS: config.steps})
        progress.close()  # the table goes below, not under a live display
        print_summary(state.eval_before, state.eval_warm_start, final)
    if trainer.backend is not None:
        trainer.backend.close()


def _close_rollouts(start: RunStart) -> None:
    """Close the rollouts (their envs, Ray actors) once; closing them again does nothing."""
    rollouts, start.trainer.rollouts = start.trainer.rollouts, None
    if rollouts is not None:
        rollouts.close()
