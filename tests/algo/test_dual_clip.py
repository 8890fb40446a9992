"""Dual-clip by hand, and against verl's `clip_ratio_c` formula written from its docs."""

from __future__ import annotations

import pytest
import torch

from agent_grpo.algo.dual_clip import dual_clip
from agent_grpo.algo.grpo import policy_loss

RATIO = torch.tensor([[0.5, 1.0, 2.0, 4.0, 4.0]])
ADV = torch.tensor([[-1.0, -1.0, -1.0, -1.0, 1.0]])


def ppo(ratio: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    return -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)


def test_by_hand() -> None:
    # A = -1: PPO loss = max(rho, clip(rho)) = 0.8, 1.0, 2.0, 4.0; capped at c = 3 -> 3.0.
    # A = +1, rho = 4: -min(4, 1.2) = -1.2, untouched.
    got = dual_clip(ppo(RATIO, ADV), ADV, 3.0)
    torch.testing.assert_close(got, torch.tensor([[0.8, 1.0, 2.0, 3.0, -1.2]]))


def test_equals_verl_clip_ratio_c() -> None:
    """verl's docs: pg_losses3 = -A * c; clip_pg_losses2 = min(pg_losses3, max(pg1, pg2));
    the loss is clip_pg_losses2 where A < 0, max(pg1, pg2) elsewhere."""
    torch.manual_seed(0)
    ratio, adv = torch.rand(4, 6) * 5, torch.randn(4, 6)
    clip1 = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    verl = torch.where(adv < 0, torch.minimum(-adv * 3.0, clip1), clip1)
    torch.testing.assert_close(dual_clip(ppo(ratio, adv), adv, 3.0), verl)


def test_c_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="> 1"):
        dual_clip(ppo(RATIO, ADV), ADV, 1.0)


def test_policy_loss_with_dual_clip_by_hand() -> None:
    # A = -1 on both tokens, ratios 2 and 4 (clip 0.2): PPO losses 2 and 4, gradients rho = 2, 4.
    # With c = 3 the second is capped at 3 and has no gradient; token-mean over 2 tokens.
    logp = torch.log(torch.tensor([[2.0, 4.0]])).requires_grad_()
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([-1.0])
    loss, _ = policy_loss(logp, old, adv, mask, dual_clip_c=3.0)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(2.5))
    torch.testing.assert_close(logp.grad, torch.tensor([[1.0, 0.0]]))
    # without it: (2 + 4) / 2, gradients 2 / 2 and 4 / 2
    logp.grad = None
    loss, _ = policy_loss(logp, old, adv, mask)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(3.0))
    torch.testing.assert_close(logp.grad, torch.tensor([[1.0, 2.0]]))
