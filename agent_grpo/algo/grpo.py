"""Pure GRPO math: group-relative advantages, KL estimators, the clipped policy loss.

Every function here takes tensors and returns tensors (plus float metrics); nothing touches a
model, a tokenizer or a config, so the golden tests in `tests/algo/test_grpo.py` pin each formula.

Shapes: `B` sequences (all groups of a step, flattened), `T` tokens per padded sequence.
`mask` is True exactly on tokens the policy sampled (`Provenance.MODEL`); every other position
(prompt, template, observation, padding) may hold anything, NaN included, and must not change a
result or a gradient. We enforce that with `torch.where` on the *inputs*, never `x * mask`
(`nan * 0` is `nan`, and a NaN that reaches `exp` in the forward poisons the backward even when a
later `where` discards it).

Where we depart from the papers, and why:
- DeepSeekMath GRPO averages each sequence's token losses, then averages sequences. Our default
  `token-mean` divides the batch's token-loss sum by its number of trained tokens instead
  (DAPO's token-level loss), so a long multi-turn episode is not down-weighted per token. The
  paper's form is `seq-mean-token-mean`; Dr. GRPO's length-unbiased form is
  `seq-mean-token-sum-norm`:

      loss = sum_{i in R} sum_t mask_it * l_it / (|R| * L)

  R the minibatch's rows with a trained token, L the constant `algo.max_tokens`. This is verl's
  `seq-mean-token-sum-norm` (0.9: the sum over sequences divided by the mini-batch's sequences,
  then by `loss_scale_factor`; set that to L) and TRL's `loss_type: dr_grpo` (divided by rows
  times `max_completion_length`), so a learning rate or a clip norm carries over. One departure
  from both: they count every row of the batch in |R|, we leave out rows with no trained token
  (excluded episodes, dropped groups, dead groups under `drop_dead_groups`), which is what
  `drop_dead_groups` promises; with neither exclusions nor `drop_dead_groups` the three agree.
  verl's default L (`loss_scale_factor: null`) is the padded response length of each
  micro-batch, which moves from batch to batch; ours is always a constant.
- DeepSeekMath puts the KL in the loss with the k3 estimator and beta=0.04. We default to beta=0
  (DAPO, Dr. GRPO: no reference model to keep in memory) and, when beta > 0, to k2: as a loss,
  k2's expected gradient is that of KL(pi || pi_ref), k3's is that of the reverse KL and k1's is
  zero (see `kl_penalty`). All three stay available. The logged `kl_ref` is always the k3 value
  (an unbiased, non-negative estimate of KL(pi || pi_ref)), whichever estimator is in the loss.
- DAPO's clip-higher is `clip_high > clip_low`; both default to PPO's symmetric 0.2.
- Dr. GRPO drops the division by the group std: `scale="none"`. RLOO's leave-one-out baseline is
  `leave_one_out=True`, unscaled as published unless `scale="group"` is asked for explicitly.
- Members whose episode failed for a reason outside the policy (env exception or timeout, failed
  generation) or whose reward is not finite are left out of their group's statistics and get
  advantage 0 (`group_advantages(valid=...)`); the papers have no such members.
- Groups whose rewards are all equal (or that have one member) get advantage exactly 0 rather
  than `0 / eps` noise; they contribute no policy gradient, only their KL term if beta > 0.
- The ratio is per token as in PPO; `ratio_level="sequence"` is GSPO's per-sequence geometric
  mean instead (`agent_grpo.algo.sequence_ratio`), and `dual_clip_c` adds dual-clip PPO's cap on
  negative advantages (`agent_grpo.algo.dual_clip`). Both are off by default.
- `is_weights` applies truncated importance sampling (Yao et al., "Your efficient RL framework
  secretly brings you off-policy RL training") to the sampler/trainer logprob mismatch; the
  papers assume the two are identical.

The off-policy objective (asynchronous GRPO, `algo.max_staleness > 0`; AReaL's decoupled PPO).
A token y_t was sampled by the behaviour policy mu (the engine, `staleness` versions ago, with
its own kernels); the trainer recomputes the proximal policy pi_prox (its current weights
before this step's update: `old_logprobs: trainer`) and optimises pi_theta:

    w_t   = min(exp(log pi_prox(y_t) - log mu(y_t)), tis_cap)       (detached)
    rho_t = exp(log pi_theta(y_t) - log pi_prox(y_t))
    l_t   = -w_t * min(rho_t * A, clip(rho_t, 1 - clip_low, 1 + clip_high) * A)
            + beta * KL_t(pi_theta || pi_ref)

The ratio is taken against pi_prox, not mu, so the clip bounds each update however stale the
sample; w_t corrects for the sample having come from mu. Departures from AReaL: w_t is
truncated at `tis_cap` (verl and TRL's TIS) instead of left unbounded, and the KL term is not
reweighted. With `staleness = 0` and equal kernels, w_t = 1 and this is plain GRPO.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import Tensor

from agent_grpo.algo.choices import Aggregation, KLKind, RatioLevel, advantage_scale
from agent_grpo.algo.dual_clip import dual_clip
from agent_grpo.algo.sequence_ratio import sequence_log_ratio

__all__ = [
    "Aggregation",
    "KLKind",
    "PolicyLossMetrics",
    "RatioLevel",
    "advantage_scale",
    "dense_group_index",
    "group_advantages",
    "has_reward_variance",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "truncated_is_weights",
]


def dense_group_index(group_ids: Tensor | Sequence[Hashable], device: torch.device) -> Tensor:
    """Map arbitrary group ids to dense indices 0..G-1, one per sample."""
    if isinstance(group_ids, Tensor):
        _, inverse = torch.unique(group_ids, return_inverse=True)  # [B]
        return inverse.to(device)
    dense: dict[Hashable, int] = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in group_ids], device=device)


def has_reward_variance(rewards: Sequence[float]) -> bool:
    """Whether a group's counted rewards carry signal: at least 2 of them, not all equal.

    Exact equality, no tolerance: rewards that differ at all get non-zero advantages from
    `group_advantages` (which applies this same rule to tensors), so any tolerance would call a
    group dead that is trained."""
    return len(rewards) >= 2 and max(rewards) != min(rewards)


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    *,
    valid: Tensor | None = None,
    scale: Literal["group", "none"] | None = None,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantages: `A_i = (r_i - mean_g) / (std_g + eps)` within each group.

    `std_g` is the unbiased (n - 1) sample std of group g. `scale="none"` drops the division
    (Dr. GRPO). `leave_one_out=True` uses the mean of the *other* members as the baseline (RLOO),
    `r_i - (sum_g - r_i) / (n - 1) = n / (n - 1) * (r_i - mean_g)`. Unset, `scale` is resolved
    by `advantage_scale`: RLOO as published does not divide, so `leave_one_out=True` alone is
    unscaled, exactly as `AlgoConfig(leave_one_out=True)` trains.

    `valid` ([B] bool, default all True) marks the members that count: an invalid member (an
    infrastructure failure, a non-finite reward) is left out of its group's mean, std and `n`,
    and gets advantage exactly 0; its reward may be anything, NaN included. Groups with fewer
    than 2 valid members and groups whose valid rewards are all equal get exactly 0.
    Group ids need not be contiguous or sorted. Which groups are live is `has_reward_variance`.
    """
    scale = advantage_scale(scale, leave_one_out)
    rewards = rewards.to(torch.float64)  # [B]; fp64: std of large, close rewards stays precise
    keep = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()  # [B]
    keep = keep & torch.isfinite(rewards)  # [B]
    rewards = torch.where(keep, rewards, 0.0)  # [B]; junk never reaches a sum
    index = dense_group_index(group_ids, rewards.device)  # [B]
    num_groups = int(index.max()) + 1 if index.numel() else 0
    zeros = rewards.new_zeros(num_groups)  # [G]
    count = zeros.index_add(0, index, keep.to(rewards.dtype))  # [G] valid members
    mean = zeros.index_add(0, index, rewards) / count.clamp(min=1)  # [G]
    centered = torch.where(keep, rewards - mean[index], 0.0)  # [B]
    var = zeros.index_add(0, index, centered**2) / (count - 1).clamp(min=1)  # [G]
    std = var.sqrt()[index]  # [B]
    n = count[index]  # [B]
    if leave_one_out:
        centered = centered * n / (n - 1).clamp(min=1)  # [B]
    advantages = centered / (std + eps) if scale == "group" else centered  # [B]
    high = zeros.scatter_reduce(
        0, index, torch.where(keep, rewards, -torch.inf), "amax", include_self=False
    )  # [G]
    low = zeros.scatter_reduce(
        0, index, torch.where(keep, rewards, torch.inf), "amin", include_self=False
    )  # [G]
    degenerate = ~keep | (n < 2) | (high == low)[index]  # [B]; not has_reward_variance
    return torch.where(degenerate, 0.0, advantages).to(torch.float32)  # [B]


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind = "k2") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1/k2/k3).

    With `d = logp_ref - logp`: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1. Same shape as the
    inputs. As *values*, k1 and k3 are unbiased estimates of KL(pi || pi_ref) (k3 is also >= 0);
    k2 is biased. As a *loss* (differentiated through `logp` with the sampled token held fixed,
    which is how the policy loss uses them), their expected gradients under y ~ pi are:

    - k1: `grad logp`, whose expectation is 0. k1 in the loss does nothing but add variance.
    - k2: `(logp - logp_ref) grad logp`, whose expectation is exactly `grad KL(pi || pi_ref)`.
      This is the estimator that does what `beta * KL(pi || pi_ref)` promises.
    - k3: `(1 - pi_ref / pi) grad logp`, whose expectation is `grad KL(pi_ref || pi)`: the reverse
      KL's gradient, not the forward one (DeepSeekMath's choice; close to k2's near pi = pi_ref).

    `tests/test_grpo.py` checks all three against the exact gradients of a small categorical
    policy. The statements hold on-policy (the first pass over a batch); later epochs sample
    from pi_old, not pi, and every estimator is then off by the ratio.
    """
    d = ref_logprobs - logprobs  # [B, T]
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2 or k3")


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is True; masked-out entries (even NaN/inf) are ignored."""
    kept = torch.where(mask, values, 0.0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` where `mask` is True; an empty selection gives 0, not NaN."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


@dataclass(frozen=True)
class PolicyLossMetrics:
    """Diagnostics of one `policy_loss` call, as plain floats (computed without grad)."""

    clip_frac_low: float
    """Fraction of trained tokens with ratio < 1 - clip_low and A < 0 (gradient cut off)."""
    clip_frac_high: float
    """Fraction of trained tokens with ratio > 1 + clip_high and A > 0 (gradient cut off)."""
    clip_frac: float
    """clip_frac_low + clip_frac_high: fraction of trained tokens that get no policy gradient."""
    approx_kl_old: float
    """Mean k3 estimate of KL(pi_old || pi) over trained tokens: how far this update has moved."""
    kl_ref: float | None
    """Mean k3 estimate of KL(pi || pi_ref) over trained tokens, whichever estimator the loss
    uses (k3's value is unbiased and >= 0); None without a reference."""
    ratio_mean: float
    """Mean of pi / pi_old over trained tokens (1.0 when there are none)."""
    ratio_min: float
    """Smallest ratio over trained tokens (1.0 when there are none)."""
    ratio_max: float
    """Largest ratio over trained tokens (1.0 when there are none)."""
    num_tokens: int
    """Number of trained (masked-in) tokens in this call."""

    def as_dict(self) -> dict[str, float]:
        """The metrics as a flat dict of floats, for loggers (`kl_ref` left out when None)."""
        return {k: float(v) for k, v in asdict(self).items() if v is not None}


def _aggregate(
    per_token: Tensor,
    mask: Tensor,
    aggregation: Aggregation,
    max_tokens: int | None,
    denominator: float | Tensor | None,
    sequence_tokens: Tensor | None = None,
) -> Tensor:
    """Reduce a `[B, T]` per-token loss to a scalar (see `policy_loss` for each mode)."""
    if aggregation == "token-mean":
        count = mask.sum().clamp(min=1) if denominator is None else denominator
        return masked_sum(per_token, mask) / count
    if aggregation == "seq-mean-token-mean":
        has_tokens = mask.any(dim=-1)  # [B]
        if sequence_tokens is None:
            seq_means = masked_mean(per_token, mask, dim=-1)  # [B]
        else:  # a row is one branch: its share of its sequence's mean
            seq_means = masked_sum(per_token, mask, dim=-1) / sequence_tokens.clamp(min=1)  # [B]
        count = has_tokens.sum().clamp(min=1) if denominator is None else denominator
        return masked_sum(seq_means, has_tokens) / count
    if aggregation == "seq-mean-token-sum-norm":
        if max_tokens is None:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' needs max_tokens")
        rows = mask.any(dim=-1).sum().clamp(min=1)  # rows with a trained token
        count = rows * max_tokens if denominator is None else denominator
        return masked_sum(per_token, mask) / count
    raise ValueError(f"unknown aggregation {aggregation!r}")


@torch.no_grad()
def _metrics(
    ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    approx_kl_old: Tensor,
    kl_ref: Tensor | None,
) -> PolicyLossMetrics:
    """Clip fractions, KLs and ratio statistics over the masked tokens."""
    low = masked_mean(((ratio < 1 - clip_low) & (advantages < 0)).float(), mask)
    high = masked_mean(((ratio > 1 + clip_high) & (advantages > 0)).float(), mask)
    num_tokens = int(mask.sum())
    has_tokens = num_tokens > 0
    return PolicyLossMetrics(
        clip_frac_low=float(low),
        clip_frac_high=float(high),
        clip_frac=float(low + high),
        approx_kl_old=float(masked_mean(approx_kl_old, mask)),
        kl_ref=None if kl_ref is None else float(masked_mean(kl_ref, mask)),
        ratio_mean=float(masked_mean(ratio, mask)) if has_tokens else 1.0,
        ratio_min=float(ratio[mask].min()) if has_tokens else 1.0,
        ratio_max=float(ratio[mask].max()) if has_tokens else 1.0,
        num_tokens=num_tokens,
    )


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    ref_logprobs: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    beta: float = 0.0,
    kl: KLKind = "k2",
    aggregation: Aggregation = "token-mean",
    max_tokens: int | None = None,
    is_weights: Tensor | None = None,
    denominator: float | Tensor | None = None,
    sequence_tokens: Tensor | None = None,
    ratio_level: RatioLevel = "token",
    dual_clip_c: float | None = None,
) -> tuple[Tensor, PolicyLossMetrics]:
    """Clipped GRPO surrogate: per token `-min(rho*A, clip(rho, 1-lo, 1+hi)*A) + beta*KL`.

    `rho = exp(logprobs - old_logprobs)`; `old_logprobs`, `ref_logprobs` and `is_weights` are
    constants (detached). `advantages` is `[B]` (one per sequence) or `[B, T]`. `is_weights`
    multiplies the policy term only (truncated importance sampling), not the KL term.

    Aggregation of the `[B, T]` per-token loss `l` over the masked tokens:
    - `token-mean`: `sum(l) / number of masked tokens`.
    - `seq-mean-token-mean`: mean over sequences of each one's masked-token mean; sequences with
      no masked token are left out.
    - `seq-mean-token-sum-norm`: `sum(l) / (R * max_tokens)`, R the sequences with a masked
      token (Dr. GRPO; verl's mode of that name, TRL's `dr_grpo`: module docstring).
    `denominator` replaces the divisor (tokens, sequences, or `R * max_tokens`): with gradient
    accumulation over micro-batches, pass the whole batch's count so the summed micro-batch
    losses equal the loss of the whole batch. A sequence may span several rows (the branches
    of a forked episode): `sequence_tokens` `[B]` then gives each row its whole sequence's
    masked-token count, so `seq-mean-token-mean` averages each sequence once.

    `ratio_level="sequence"` is GSPO: every token of a row takes the row's geometric-mean ratio
    (`sequence_ratio.sequence_log_ratio`), clipped per sequence. `dual_clip_c` caps the loss of
    negative advantages at `-c * A` (`dual_clip.dual_clip`).
    """
    mask = mask.bool()  # [B, T]
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)  # [B, T]
    # Clean the inputs first so junk at masked positions never reaches exp() (see module doc).
    logprobs = torch.where(mask, logprobs, 0.0)  # [B, T]
    old = torch.where(mask, old_logprobs.detach(), 0.0)  # [B, T]
    advantages = torch.where(mask, advantages.detach(), 0.0)  # [B, T]
    if ratio_level == "token":
        log_ratio = logprobs - old  # [B, T]
    elif ratio_level == "sequence":
        log_ratio = sequence_log_ratio(logprobs, old, mask)  # [B, T], GSPO-token
    else:
        raise ValueError(f"unknown ratio level {ratio_level!r}; expected token or sequence")
    ratio = torch.exp(log_ratio)  # [B, T]
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)  # [B, T]
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)  # [B, T]
    if dual_clip_c is not None:
        per_token = dual_clip(per_token, advantages, dual_clip_c)  # [B, T]
    if is_weights is not None:
        per_token = per_token * torch.where(mask, is_weights.detach(), 1.0)  # [B, T]
    kl_ref = None
    if ref_logprobs is not None:
        ref = torch.where(mask, ref_logprobs.detach(), 0.0)  # [B, T]
        if beta != 0.0:
            per_token = per_token + beta * kl_penalty(logprobs, ref, kl)  # [B, T]
        kl_ref = kl_penalty(logprobs.detach(), ref, "k3")  # [B, T], for the metric only
    elif beta != 0.0:
        raise ValueError("beta != 0 needs ref_logprobs")
    loss = _aggregate(per_token, mask, aggregation, max_tokens, denominator, sequence_tokens)
    approx_kl_old = kl_penalty(old, logprobs.detach(), "k3")  # [B, T]
    metrics = _metrics(ratio, advantages, mask, clip_low, clip_high, approx_kl_old, kl_ref)
    return loss, metrics


@torch.no_grad()
def truncated_is_weights(
    trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, cap: float
) -> Tensor:
    """Truncated importance weights: `min(exp(trainer - sampler), cap)` masked, 1 elsewhere.

    Corrects for the sampling engine's distribution differing from the trainer's (kernels,
    precision, top-p renormalisation). Detached: the weights are constants in the loss.
    """
    mask = mask.bool()  # [B, T]
    log_ratio = torch.where(mask, trainer_logprobs - sampler_logprobs, 0.0)  # [B, T]
    return torch.where(mask, torch.exp(log_ratio).clamp(max=cap), 1.0)  # [B, T]
