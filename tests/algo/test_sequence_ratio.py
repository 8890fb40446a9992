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
