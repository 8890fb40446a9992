"""`seq-mean-token-sum-norm` (Dr. GRPO) against hand-derived numbers and against verl's mode of
that name and TRL's `dr_grpo`, each written here from its documentation."""

from __future__ import annotations

import pytest
import torch

from agent_grpo.algo.config import AlgoConfig
from agent_grpo.algo.grpo import policy_loss
from agent_grpo.algo.objective import loss_denominator

L = 8
"""The constant normaliser (`algo.max_tokens`; verl's `loss_scale_factor`, TRL's
`max_completion_length`)."""
NAN = float("nan")


def case(with_empty_row: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row 0: A = 1 on 3 tokens; row 1: A = -2 on 2 tokens; optional row 2: no trained token
    (an excluded episode), junk everywhere. Ratio 1, so each token's loss is -A."""
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    advantages = torch.tensor([1.0, -2.0, NAN])
    if not with_empty_row:
        mask, advantages = mask[:2], advantages[:2]
    logprobs = torch.where(mask, -1.0, NAN)  # junk off the mask
    return logprobs, advantages, mask


def ours(with_empty_row: bool) -> float:
    logprobs, advantages, mask = case(with_empty_row)
    loss, _ = policy_loss(logprobs, logprobs, advantages, mask,
                          aggregation="seq-mean-token-sum-norm", max_tokens=L)  # fmt: skip
    return float(loss)


def per_token(with_empty_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _, advantages, mask = case(with_empty_row)
    loss = torch.where(mask, -advantages[:, None].nan_to_num(0.0), 0.0)
    return loss, mask.float()


def verl(loss_mat: torch.Tensor, loss_mask: torch.Tensor, global_batch_size: int | None) -> float:
    """verl 0.9 `agg_loss(..., "seq-mean-token-sum-norm", loss_scale_factor=L)`: per-sequence
    token sums, summed over sequences with a token, over `global_batch_size` (the mini-batch's
    sequences; unset, those with a token), over the scale factor."""
    seq_losses = (loss_mat * loss_mask).sum(-1)
    seq_mask = (loss_mask.sum(-1) > 0).float()
    count = seq_mask.sum() if global_batch_size is None else global_batch_size
    return float((seq_losses * seq_mask).sum() / count / L)


def trl(per_token_loss: torch.Tensor, mask: torch.Tensor) -> float:
    """TRL `loss_type="dr_grpo"`: sum over tokens / (rows x max_completion_length)."""
    return float((per_token_loss * mask).sum() / (per_token_loss.size(0) * L))


def test_by_hand() -> None:
    # token sums: row 0 -> 3 * -1 = -3, row 1 -> 2 * 2 = 4; total 1 over 2 rows x L = 16
    assert ours(with_empty_row=False) == 1 / 16
    # the row with no trained token is in no denominator: still 1 / 16, not 1 / 24
    assert ours(with_empty_row=True) == 1 / 16


def test_equals_verl_and_trl_when_every_row_trains() -> None:
    loss_mat, mask = per_token(with_empty_row=False)
    assert ours(False) == verl(loss_mat, mask, global_batch_size=2) == trl(loss_mat, mask)


def test_leaves_out_rows_without_a_trained_token_as_verls_local_form_does() -> None:
    loss_mat, mask = per_token(with_empty_row=True)
    assert ours(True) == verl(loss_mat, mask, global_batch_size=None)
    # the peers' whole-batch counts would put the excluded row in (1 / 24)
    assert trl(loss_mat, mask) == verl(loss_mat, mask, global_batch_size=3)
    assert trl(loss_mat, mask) == pytest.approx(1 / 24, rel=1e-6)  # float32


def test_the_trainers_shared_denominator_counts_rows_with_a_trained_token() -> None:
    _, _, mask = case(with_empty_row=True)
    algo = AlgoConfig(aggregation="seq-mean-token-sum-norm", max_tokens=L)
    assert loss_denominator(mask, algo, L) == 2 * L
