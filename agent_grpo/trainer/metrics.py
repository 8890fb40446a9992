"""Per-step metrics as typed models: GRPO amplifies whatever signal it gets, bad signal included.

`StepMetrics` is one row of `metrics.jsonl`, one field per metric. It is assembled from typed
parts: the rollout's `TrajectorySummary` (shared with evaluation), the batch's `SignalMetrics`,
the sampler/trainer `LogprobMismatch` and the update's `UpdateMetrics`. The update accumulates
`UpdateStats` (sums, so micro-batches and ranks add up, and an empty minibatch is a zero, not a
missing key) and turns them into means once per optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields

import torch
from pydantic import BaseModel

from agent_grpo.algo.groups import counts_in_group, dead_group_mask, group_indices
from agent_grpo.algo.grpo import PolicyLossMetrics
from agent_grpo.evaluation.heldout import EvalResult
from agent_grpo.rollout.collector import RolloutResult
from agent_grpo.rollout.summary import TrajectorySummary, summarize_trajectories
from agent_grpo.run_dir.reader import AFTER_STEPS
from agent_grpo.trajectory.record import Provenance, TrajectoryRecord

__all__ = [
    "LogprobMismatch",
    "SignalMetrics",
    "StepMetrics",
    "StepTimes",
    "UpdateMetrics",
    "UpdateStats",
    "logprob_mismatch",
    "mismatch_by_staleness",
    "reward_means",
    "signal_metrics",
    "step_metrics",
]


class SignalMetrics(BaseModel):
    """How much learning signal a step's groups carry."""

    dead_groups: int
    """Groups with no reward variance among their counted members (no policy gradient)."""
    dead_group_fraction: float
    """dead_groups / groups."""
    excluded_trajectories: int
    """Episodes left out of their group's statistics (infrastructure failure or non-finite
    reward); `error_fraction` counts the first kind alone."""
    dropped_groups: int = 0
    """Groups left with no counted member: out of the loss and the statistics whole (every
    member failed, or with `rollout.on_failure: drop_group` one did)."""
    nonfinite_rewards: int
    """Episodes whose total reward was NaN or infinite."""
    duplicate_fraction: float
    """Members whose model tokens repeat another member's of the same group."""
    len_above_baseline: float
    """Mean model tokens of episodes with a positive advantage."""
    len_below_baseline: float
    """Mean model tokens of episodes with a negative advantage."""
    reward_length_corr: float
    """Pearson correlation of total reward and model tokens (a length-hacking alarm)."""


def _model_tokens(record: TrajectoryRecord) -> tuple[int, ...]:
    """Every sampled id of the episode, over all its branches, in turn order."""
    rows = record.rows()
    return tuple(
        t
        for row in rows
        for t, p in zip(row.token_ids, row.provenance, strict=True)
        if p is Provenance.MODEL
    )


def _duplicate_fraction(records: Sequence[TrajectoryRecord]) -> float:
    duplicates = 0
    for rows in group_indices(records).values():
        duplicates += len(rows) - len({_model_tokens(records[i]) for i in rows})
    return duplicates / max(1, len(records))


def _correlation(xs: Sequence[float], ys: Sequence[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else 0.0


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def signal_metrics(
    records: Sequence[TrajectoryRecord], advantages: Sequence[float]
) -> SignalMetrics:
    """Dead groups, exclusions, duplicates and length bias of a step's records."""
    dead = dead_group_mask(records)
    groups = group_indices(records)
    counted = [r for r in records if counts_in_group(r)]
    lengths = [float(r.lengths.model) for r in records]
    pairs = list(zip(lengths, advantages, strict=True))
    return SignalMetrics(
        dead_groups=sum(dead[rows[0]] for rows in groups.values()),
        dead_group_fraction=_mean([float(dead[rows[0]]) for rows in groups.values()]),
        excluded_trajectories=len(records) - len(counted),
        dropped_groups=sum(
            not any(counts_in_group(records[i]) for i in rows) for rows in groups.values()
        ),
        nonfinite_rewards=sum(not math.isfinite(r.reward) for r in records),
        duplicate_fraction=_duplicate_fraction(records),
        len_above_baseline=_mean([n for n, a in pairs if a > 0]),
        len_below_baseline=_mean([n for n, a in pairs if a < 0]),
        reward_length_corr=_correlation(
            [r.reward for r in counted], [float(r.lengths.model) for r in counted]
        ),
    )


class LogprobMismatch(BaseModel):
    """|trainer - sampler| logprob over model tokens, the trainer taken before the update."""

    logprob_mismatch_mean: float | None
    """Mean over the tokens both scored; None (not measured) when there were none."""
    logprob_mismatch_max: float | None
    """Largest over the tokens both scored; None (not measured) when there were none."""


def logprob_mismatch(
    trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor
) -> LogprobMismatch:
    """Mean and max |trainer - sampler| over `mask` ([B, T] each); tokens the trainer did not
    score (NaN: rows skipped for zero advantage) are left out. No token scored: None, since 0.0
    would read as perfect agreement."""
    mask = mask & torch.isfinite(trainer) & torch.isfinite(sampler)  # [B, T]
    diff = torch.where(mask, (trainer - sampler).abs(), 0.0)  # [B, T]
    count = int(mask.sum())
    if count == 0:
        return LogprobMismatch(logprob_mismatch_mean=None, logprob_mismatch_max=None)
    return LogprobMismatch(
        logprob_mismatch_mean=float(diff.sum()) / count, logprob_mismatch_max=float(diff.max())
    )


def mismatch_by_staleness(
    trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, ages: torch.Tensor
) -> dict[int, float]:
    """Mean |trainer - sampler| over `mask` (`[B, T]` each) of the tokens `k` policy versions
    behind the trainer, for each `k` in `ages` (`[B, T]`, each token's sampling policy's age). At
    `k = 0` the engine sampled with the trainer's own weights, so the gap there is the kernels'
    and dtypes' alone; what grows with `k` is staleness. A `k` with no scored token is left out."""
    out: dict[int, float] = {}
    for k in sorted(set(ages[mask].tolist())):
        mean = logprob_mismatch(trainer, sampler, mask & (ages == k))
        if mean.logprob_mismatch_mean is not None:
            out[int(k)] = mean.logprob_mismatch_mean
    return out


@dataclass
class UpdateStats:
    """Sums over the trained tokens of one optimizer step's micro-batches (and ranks)."""

    tokens: float = 0.0
    """Trained tokens."""
    loss: float = 0.0
    """Sum of micro-batch losses (each already a share of the minibatch loss)."""
    clip_low: float = 0.0
    """Token-weighted sum of `clip_frac_low`."""
    clip_high: float = 0.0
    """Token-weighted sum of `clip_frac_high`."""
    kl_old: float = 0.0
    """Token-weighted sum of `approx_kl_old`."""
    kl_ref: float = 0.0
    """Token-weighted sum of `kl_ref` (0 without a reference)."""
    ratio: float = 0.0
    """Token-weighted sum of `ratio_mean`."""
    tis_capped: float = 0.0
    """Tokens whose importance weight hit `tis_cap`."""
    ratio_max: float = -math.inf
    """Largest ratio."""
    neg_ratio_min: float = -math.inf
    """Minus the smallest ratio (a max, so ranks combine both with one MAX all-reduce)."""

    def add(self, loss: float, metrics: PolicyLossMetrics, tis_capped: int) -> None:
        """Add one micro-batch's loss and metrics."""
        n = float(metrics.num_tokens)
        self.tokens += n
        self.loss += loss
        self.clip_low += metrics.clip_frac_low * n
        self.clip_high += metrics.clip_frac_high * n
        self.kl_old += metrics.approx_kl_old * n
        self.kl_ref += (metrics.kl_ref or 0.0) * n
        self.ratio += metrics.ratio_mean * n
        self.tis_capped += tis_capped
        if n > 0:
            self.ratio_max = max(self.ratio_max, metrics.ratio_max)
            self.neg_ratio_min = max(self.neg_ratio_min, -metrics.ratio_min)

    def sums(self) -> torch.Tensor:
        """The summed fields as one float64 vector `[8]`, for one SUM all-reduce."""
        return torch.tensor(astuple(self)[:8], dtype=torch.float64)

    def extremes(self) -> torch.Tensor:
        """`[ratio_max, -ratio_min]` as float64 `[2]`, for one MAX all-reduce."""
        return torch.tensor([self.ratio_max, self.neg_ratio_min], dtype=torch.float64)

    @classmethod
    def from_tensors(cls, sums: torch.Tensor, extremes: torch.Tensor) -> UpdateStats:
        """Rebuild from `sums()` and `extremes()` (after their all-reduces)."""
        names = [f.name for f in fields(cls)]
        return cls(**dict(zip(names, [*sums.tolist(), *extremes.tolist()], strict=True)))


class UpdateMetrics(BaseModel):
    """The policy update of one step, averaged over its optimizer steps."""

    loss: float
    """GRPO loss (policy term + beta * KL)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    clip_frac_low: float
    """Trained tokens with ratio < 1 - clip_low and A < 0 (gradient cut off)."""
    clip_frac_high: float
    """Trained tokens with ratio > 1 + clip_high and A > 0 (gradient cut off)."""
    clip_frac: float
    """clip_frac_low + clip_frac_high."""
    approx_kl_old: float
    """Mean k3 estimate of KL(pi_old || pi) over trained tokens: how far the update moved."""
    kl_ref: float | None
    """Mean k3 estimate of KL(pi || pi_ref) over trained tokens; None without a reference."""
    ratio_mean: float
    """Mean pi / pi_old over trained tokens (1.0 when there are none)."""
    ratio_min: float
    """Smallest ratio (1.0 when there are no trained tokens)."""
    ratio_max: float
    """Largest ratio (1.0 when there are no trained tokens)."""
    tis_clip_frac: float
    """Trained tokens whose truncated importance weight hit `tis_cap` (0 without TIS)."""
    trained_tokens: float
    """Model tokens in the loss mask of the minibatch, per optimizer step: those whose loss
    terms enter the objective's denominator, whether or not `skip_zero_advantage` ran their
    forward pass (zero-advantage rows count; excluded and dropped rows do not)."""
    optimizer_steps: int
    """Optimizer steps taken (epochs x minibatches, less any skipped or idle)."""
    skipped_steps: int
    """Optimizer steps skipped because the loss or the gradient norm was not finite."""
    idle_steps: int = 0
    """Optimizer steps not taken because the minibatch had no learning signal (every trained
    token's advantage 0, no KL term): AdamW would move the weights along its momentum alone."""

    @classmethod
    def of_step(
        cls,
        stats: UpdateStats,
        grad_norm: float,
        has_ref: bool,
        skipped: bool,
        trained_tokens: float,
        idle: bool = False,
    ) -> UpdateMetrics:
        """The metrics of one optimizer step from its (all-reduced) `stats` and its loss-mask
        token count (`trained_tokens`; `stats.tokens` counts only the rows that were run);
        `idle`: not taken for want of signal."""
        n = stats.tokens or 1.0
        low, high = stats.clip_low / n, stats.clip_high / n
        return cls(
            loss=stats.loss,
            grad_norm=grad_norm,
            clip_frac_low=low,
            clip_frac_high=high,
            clip_frac=low + high,
            approx_kl_old=stats.kl_old / n,
            kl_ref=stats.kl_ref / n if has_ref else None,
            ratio_mean=stats.ratio / n if stats.tokens else 1.0,
            ratio_min=-stats.neg_ratio_min if stats.tokens else 1.0,
            ratio_max=stats.ratio_max if stats.tokens else 1.0,
            tis_clip_frac=stats.tis_capped / n,
            trained_tokens=trained_tokens,
            optimizer_steps=0 if skipped or idle else 1,
            skipped_steps=1 if skipped else 0,
            idle_steps=1 if idle and not skipped else 0,
        )

    @classmethod
    def mean(cls, steps: Sequence[UpdateMetrics]) -> UpdateMetrics:
        """Average over optimizer steps; extremes stay extremes and counts add up."""
        if not steps:
            raise ValueError("no optimizer step to average")
        refs = [s.kl_ref for s in steps if s.kl_ref is not None]
        return cls(
            loss=_mean([s.loss for s in steps]),
            grad_norm=_mean([s.grad_norm for s in steps]),
            clip_frac_low=_mean([s.clip_frac_low for s in steps]),
            clip_frac_high=_mean([s.clip_frac_high for s in steps]),
            clip_frac=_mean([s.clip_frac for s in steps]),
            approx_kl_old=_mean([s.approx_kl_old for s in steps]),
            kl_ref=_mean(refs) if refs else None,
            ratio_mean=_mean([s.ratio_mean for s in steps]),
            ratio_min=min(s.ratio_min for s in steps),
            ratio_max=max(s.ratio_max for s in steps),
            tis_clip_frac=_mean([s.tis_clip_frac for s in steps]),
            trained_tokens=_mean([s.trained_tokens for s in steps]),
            optimizer_steps=sum(s.optimizer_steps for s in steps),
            skipped_steps=sum(s.skipped_steps for s in steps),
            idle_steps=sum(s.idle_steps for s in steps),
        )


class StepTimes(BaseModel):
    """Seconds of each phase of one step, as the loop measured them."""

    step_time_s: float
    """Wall time of the whole step."""
    rollout_wait_time_s: float
    """Seconds the trainer waited for this step's rollouts (with asynchronous workers, what
    sampling ahead did not hide; synchronous, the whole rollout)."""
    old_logprobs_time_s: float = 0.0
    """Seconds of the pi_old forward pass before the update (0 with `algo.single_pass`)."""
    reference_time_s: float = 0.0
    """Seconds of the pi_ref forward pass (0 without a reference)."""
    mismatch_causes_time_s: float = 0.0
    """Seconds of the pass that splits the sampler/trainer gap by cause (0 when it did not
    run, `rollout.mismatch_causes_every`)."""
    update_time_s: float = 0.0
    """Seconds of the optimizer steps (forward, backward, optimizer)."""
    weight_push_time_s: float = 0.0
    """Seconds to give the engines the new weights (the canary's check not included)."""
    canary_time_s: float = 0.0
    """Seconds of the weight canary's check after the push (0 when it did not run)."""
    heldout_time_s: float = 0.0
    """Seconds of the held-out evaluation after the step (`eval.every`; 0 on the steps without
    one); not part of `step_time_s`."""


class StepMetrics(BaseModel):
    """One row of `metrics.jsonl`: everything measured in one training step.

    Composed of typed parts whose field names are distinct, written flat by `row()`.
    """

    step: int
    """GRPO step, 0-based; the same number as the step's trajectory file and checkpoint."""
    rollout: TrajectorySummary
    """What the step's episodes did."""
    signal: SignalMetrics
    """How much learning signal their groups carry."""
    mismatch: LogprobMismatch
    """Sampler vs trainer (before the update) logprobs."""
    update: UpdateMetrics
    """The policy update."""
    rollout_tokens_per_s: float
    """Sampled tokens per second of rollout wall time."""
    rollout_model_time_s: float
    """Seconds spent generating."""
    rollout_env_time_s: float
    """Seconds spent in environment steps (tools)."""
    tool_errors: int
    """Tool calls that failed (parse, validation, exception, timeout, oversized)."""
    env_retries: int
    """Env steps that raised or hung and were retried on a fresh env instance."""
    env_failures: int
    """Env steps that failed again on the retry (those episodes are excluded as errors)."""
    times: StepTimes
    """Seconds of each phase of the step (written flat: `step_time_s`, `update_time_s`, ...)."""
    canary_gap: float | None = None
    """The worst engine's mean |engine - trainer| logprob over the canary's model tokens after
    the push (`rollout.canary`); None when it did not run."""
    reward_means: dict[str, float]
    """Mean of each reward component before weighting (`verifier`, then each extra source by
    name) over the counted episodes; written as `rewards/<name>/mean`, as TRL logs them."""
    staleness: dict[int, int]
    """Histogram {policy versions behind the trainer: records}; written as `staleness/<k>`
    (all at 0 when synchronous)."""
    mismatch_by_staleness: dict[int, float] = {}
    """{k: mean |trainer - sampler| logprob over the model tokens of records k versions behind}
    (`mismatch_by_staleness`): at 0 the kernels' and dtypes' share of the gap, above it
    staleness's too; written as `mismatch_staleness/<k>`."""
    mismatch_causes: dict[str, float] = {}
    """{cause: mean |trainer - sampler|} over the tokens the trainer's own weights sampled, by
    cause (filter, dtype, kernels; `trainer/mismatch.py`), on the steps that measure it
    (`rollout.mismatch_causes_every`); written as `mismatch_cause/<name>`."""
    stale_dropped: int
    """Records dropped for being more than `algo.max_staleness` versions old."""
    stale_masked_tokens: int = 0
    """Model tokens left out of the loss for being more than `algo.max_staleness` versions
    old: the oldest turns of episodes that straddled weight updates (`rollout.partial`)."""
    in_flight_groups: int = 0
    """Groups left in flight after the step's collection, to continue on the new weights
    (`rollout.partial`; 0 otherwise)."""
    worker_failures: int
    """Rollout workers that died during the step (their groups were sent to another)."""
    heldout: EvalResult | None = None
    """The held-out evaluation after this step (`eval.every`), written under the final
    evaluation's names (`eval_success_rate`, ...) with `eval_after_steps` (this step + 1: the
    updates the evaluated policy had); None on the steps without one."""

    def row(self) -> dict[str, float | int | None]:
        """The flat `metrics.jsonl` row: every field of every part under its own name."""
        out: dict[str, float | int | None] = {}
        for name, value in self:
            if name == "heldout":
                out.update(value.row() | {AFTER_STEPS: self.step + 1} if value is not None else {})
            elif isinstance(value, BaseModel):
                out.update(value.model_dump())
            elif name == "reward_means":
                out.update({f"rewards/{k}/mean": v for k, v in value.items()})
            elif name == "staleness":
                out.update({f"staleness/{k}": v for k, v in value.items()})
            elif name == "mismatch_by_staleness":
                out.update({f"mismatch_staleness/{k}": v for k, v in value.items()})
            elif name == "mismatch_causes":
                out.update({f"mismatch_cause/{k}": v for k, v in value.items()})
            else:
                out[name] = value
        return out


def reward_means(records: Sequence[TrajectoryRecord]) -> dict[str, float]:
    """Mean of every reward component over the episodes that count (`counts_in_group`)."""
    counted = [r for r in records if counts_in_group(r)]
    names = dict.fromkeys(k for r in counted for k in r.reward_components)
    return {
        name: _mean([r.reward_components[name] for r in counted if name in r.reward_components])
        for name in names
    }


def step_metrics(
    step: int,
    records: Sequence[TrajectoryRecord],
    advantages: Sequence[float],
    rollout: RolloutResult,
    update: UpdateMetrics,
    mismatch: LogprobMismatch,
    times: StepTimes,
    staleness: dict[int, int],
    canary_gap: float | None = None,
    mismatch_ages: dict[int, float] | None = None,
    stale_masked_tokens: int = 0,
    mismatch_causes: dict[str, float] | None = None,
) -> StepMetrics:
    """The step's `metrics.jsonl` row from what the step produced."""
    return StepMetrics(
        step=step,
        rollout=summarize_trajectories(records),
        signal=signal_metrics(records, advantages),
        mismatch=mismatch,
        update=update,
        rollout_tokens_per_s=rollout.metrics.tokens_per_s,
        rollout_model_time_s=rollout.metrics.model_time_s,
        rollout_env_time_s=rollout.metrics.env_time_s,
        tool_errors=rollout.metrics.tool_errors,
        env_retries=rollout.metrics.env_retries,
        env_failures=rollout.metrics.env_failures,
        times=times,
        canary_gap=canary_gap,
        reward_means=reward_means(records),
        staleness=staleness,
        mismatch_by_staleness=mismatch_ages or {},
        mismatch_causes=mismatch_causes or {},
        stale_dropped=rollout.metrics.stale_dropped,
        stale_masked_tokens=stale_masked_tokens,
        in_flight_groups=rollout.metrics.in_flight_groups,
        worker_failures=rollout.metrics.worker_failures,
    )
