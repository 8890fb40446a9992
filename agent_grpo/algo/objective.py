"""The GRPO objective of one micro-batch, as `AlgoConfig` configures it.

`agent_grpo.algo.grpo` holds the formulas; this file only binds them to the config: which pi_old
(the trainer's, this pass's own, or the sampler's), the truncated or masked importance weights,
the ratio's level (per token, or GSPO's per sequence), dual-clip, the KL estimator and the
aggregation with a denominator shared by every micro-batch of a minibatch, so how a minibatch
is split (into micro-batches, or over ranks) never changes its loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from agent_grpo.algo.config import AlgoConfig
from agent_grpo.algo.grpo import PolicyLossMetrics, policy_loss, truncated_is_weights
from agent_grpo.algo.masking import masked_is_weights

__all__ = ["MicroBatchLoss", "grpo_micro_batch_loss", "loss_denominator"]


def loss_denominator(
    loss_mask: Tensor, algo: AlgoConfig, max_tokens: int, episode_index: Tensor | None = None
) -> int:
    """What the summed token losses of a `[B, T]` batch are divided by: its model tokens
    (`token-mean`), its sequences with a model token (`seq-mean-token-mean`) or those sequences
    times the constant `max_tokens` (`seq-mean-token-sum-norm`). A sequence is an episode: the
    rows of one `episode_index` value (`[B]`, the branches of a forked episode) count once;
    without it each row is one. Rows with no token in the loss (excluded episodes, dropped
    groups, dead groups under `drop_dead_groups`) are in no denominator. May be 0; callers clamp
    it after summing over ranks."""
    if algo.aggregation == "token-mean":
        return int(loss_mask.sum())
    trains = loss_mask.any(dim=1)  # [B]
    rows = int(trains.sum()) if episode_index is None else len(set(episode_index[trains].tolist()))
    if algo.aggregation == "seq-mean-token-mean":
        return rows
    return rows * max_tokens


@dataclass(frozen=True)
class MicroBatchLoss:
    """The loss of one micro-batch and what it says about the update."""

    loss: Tensor
    """Scalar, this micro-batch's share of the minibatch loss (differentiable)."""
    metrics: PolicyLossMetrics
    """Clip fractions, KLs and ratio statistics over its trained tokens."""
    tis_capped: int
    """Trained tokens whose importance weight was cut: capped at `tis_cap` (TIS) or zeroed
    outside `algo.mask`'s band (MIS); 0 without either."""


def grpo_micro_batch_loss(
    logprobs: Tensor,
    old: Tensor | None,
    ref: Tensor | None,
    sampler: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    algo: AlgoConfig,
    *,
    max_tokens: int,
    denominator: float,
    sequence_tokens: Tensor | None = None,
) -> MicroBatchLoss:
    """The GRPO loss of a micro-batch as a share of its minibatch's (`denominator`).

    `logprobs` (trainer, with grad), `old`, `ref`, `sampler` and `loss_mask` are `[b, t]`;
    `advantages` is `[b]`, `sequence_tokens` (optional, `[b]`) each row's episode's model-token
    count (`policy_loss`). `old=None` means on-policy: pi_old is `logprobs` detached (ratio 1).
    Truncated importance weights `min(exp(pi_old - sampler), tis_cap)`, or masked ones
    (`algo.mask`), multiply the policy term.
    """
    pi_old = logprobs.detach() if old is None else old  # [b, t]
    weights = None
    capped = 0
    if algo.tis_cap is not None:
        weights = truncated_is_weights(pi_old, sampler, loss_mask, algo.tis_cap)  # [b, t]
        capped = int(((weights >= algo.tis_cap) & loss_mask).sum())
    elif algo.mask is not None:
        band = algo.mask
        weights = masked_is_weights(pi_old, sampler, loss_mask, band.low, band.high, band.level)
        capped = int(((weights == 0) & loss_mask).sum())
    loss, metrics = policy_loss(
        logprobs,
        pi_old,
        advantages,
        loss_mask,
        ref_logprobs=ref,
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        beta=algo.beta,
        kl=algo.kl,
        aggregation=algo.aggregation,
        max_tokens=max_tokens,
        is_weights=weights,
        denominator=denominator,
        sequence_tokens=sequence_tokens,
        ratio_level=algo.ratio,
        dual_clip_c=algo.dual_clip,
    )
    return MicroBatchLoss(loss=loss, metrics=metrics, tis_capped=capped)
