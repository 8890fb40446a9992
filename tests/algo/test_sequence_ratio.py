"""GSPO's sequence ratio by hand, and against its sequence form's gradient (GSPO paper)."""

from __future__ import annotations

import math

import pytest
import torch

from agent_grpo.algo.grpo import policy_loss
from agent_grpo.algo.sequence_ratio import sequence_log_ratio


def test_value_is_the_rows_mean_log_ratio_by_hand() -> None:
    # row 0: log ratios 0.3, -0.1 on its two trained tokens -> mean 0.1; junk at the third.
    # row 1: no trained token -> 0.
    logp = torch.tensor([[-1.0, -2.0, 5.0], [-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.3, -1.9, -9.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    got = sequence_log_ratio(logp, old, mask)
    torch.testing.assert_close(got[0, :2], torch.tensor([0.1, 0.1]))
    torch.testing.assert_close(got[1], torch.zeros(3))
    assert math.isclose(float(torch.exp(got[0, 0])), math.exp(0.1), rel_tol=1e-6)


def test_token_form_gradient_equals_the_sequence_forms() -> None:
    # GSPO eq. 13 vs eq. 5: with seq-mean-token-mean and one A per sequence, the gradients agree.
    torch.manual_seed(0)
    logp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    old = logp.detach() + 0.05 * torch.randn(3, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    n = mask.sum(-1)
    token_form = torch.exp(sequence_log_ratio(logp, old, mask)) * adv[:, None]
    (torch.where(mask, token_form, 0.0).sum(-1) / n).mean().backward()
    grad_token = logp.grad.clone()
    logp.grad = None
    s = torch.exp(torch.where(mask, logp - old, 0.0).sum(-1) / n)  # [B], eq. 5's s_i
    (s * adv).mean().backward()
    torch.testing.assert_close(grad_token, logp.grad)


def test_policy_loss_with_sequence_ratios_by_hand() -> None:
    # One row, log ratios 0.3 and -0.1: s = e^0.1 on both tokens, A = 1, token-mean over 2.
    # Unclipped (clip 0.2): loss = -s, and d loss / d log pi_t = -s / 2 on each token.
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.3, -1.9]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    s = math.exp(0.1)
    loss, metrics = policy_loss(logp, old, torch.tensor([1.0]), mask, ratio_level="sequence")
    loss.backward()
    assert math.isclose(float(loss.detach()), -s, rel_tol=1e-6)
    torch.testing.assert_close(logp.grad, torch.full((1, 2), -s / 2))
    assert math.isclose(metrics.ratio_max, s, rel_tol=1e-6) and metrics.clip_frac == 0.0
    # Clipped per sequence (clip_high 0.05 < 0.105): loss -1.05 on both tokens, no gradient,
    # though token 1's own ratio e^-0.1 lies inside the band.
    logp.grad = None
    loss, metrics = policy_loss(
        logp, old, torch.tensor([1.0]), mask, ratio_level="sequence", clip_high=0.05
    )
    loss.backward()
    assert math.isclose(float(loss.detach()), -1.05, rel_tol=1e-6)
    torch.testing.assert_close(logp.grad, torch.zeros(1, 2))
    assert metrics.clip_frac_high == 1.0


def test_the_token_level_ratio_differs_where_the_sequence_ratio_clips() -> None:
    logp = torch.tensor([[-1.0, -2.0]])
    old = torch.tensor([[-1.3, -1.9]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([1.0])
    token, _ = policy_loss(logp, old, adv, mask, clip_high=0.05)
    # token level: ratios e^0.3 (clipped to 1.05) and e^-0.1 -> -(1.05 + 0.9048) / 2
    assert math.isclose(float(token), -(1.05 + math.exp(-0.1)) / 2, rel_tol=1e-6)


def test_an_unknown_ratio_level_is_refused() -> None:
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="ratio level"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), mask,
                    ratio_level="episode")  # type: ignore[arg-type]  # fmt: skip


def trl_sequence_loss(
    logp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    loss_type: str,
) -> torch.Tensor:
    """TRL 1.16's `GRPOConfig(importance_sampling_level="sequence")`, written from its docs: the
    log ratios averaged over a sequence's valid tokens give one ratio s_i per sequence (the
    gradient flows through that average), clipped to [1 - epsilon, 1 + epsilon_high], each token's
    loss `-min(s_i * A_i, clip(s_i) * A_i)`; `loss_type="grpo"` averages a sequence's tokens and
    then the sequences, `"dapo"` sums the tokens over the batch's active tokens."""
    m = mask.to(logp.dtype)
    s = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1))  # [B]
    per_seq = -torch.minimum(s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv)  # [B]
    per_token = per_seq[:, None].expand_as(logp)  # [B, T]
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    return (per_token * m).sum() / m.sum()


@pytest.mark.parametrize(
    ("loss_type", "aggregation"), [("grpo", "seq-mean-token-mean"), ("dapo", "token-mean")]
)
def test_equals_trl_sequence_level_importance_sampling(loss_type: str, aggregation: str) -> None:
    # GSPO-token (ours) and TRL's sequence form agree in value and gradient wherever the loss
    # weights a sequence's tokens alike: the token form's gradient s_i * grad log pi_t summed
    # over a row's tokens is the sequence form's |y_i| * (s_i / |y_i|) * grad log pi_t.
    # Rows 0 and 2 leave the band (s above 1 + 0.05, below 1 - 0.03), row 1 stays inside.
    torch.manual_seed(1)
    base = torch.randn(3, 5, dtype=torch.float64)
    shift = torch.tensor([0.2, 0.01, -0.15], dtype=torch.float64)[:, None]
    old = base - shift + 0.02 * torch.randn(3, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.5, -0.7, -1.0], dtype=torch.float64)
    ours_logp = base.clone().requires_grad_(True)
    ours, metrics = policy_loss(
        ours_logp,
        old,
        adv,
        mask,
        ratio_level="sequence",
        aggregation=aggregation,  # type: ignore[arg-type]
        clip_low=0.03,
        clip_high=0.05,
    )
    ours.backward()
    theirs_logp = base.clone().requires_grad_(True)
    theirs = trl_sequence_loss(theirs_logp, old, adv, mask, 0.03, 0.05, loss_type)
    theirs.backward()
    torch.testing.assert_close(ours.detach(), theirs.detach())
    assert ours_logp.grad is not None and theirs_logp.grad is not None
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad)
    assert 0 < metrics.clip_frac < 1  # both branches, clipped and not, are compared
