"""Masked importance weights (MIS, IcePop) by hand; junk off the mask never matters."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from agent_grpo.algo.config import AlgoConfig, MaskConfig
from agent_grpo.algo.masking import masked_is_weights
from agent_grpo.algo.objective import grpo_micro_batch_loss

LN2 = math.log(2.0)
NAN = float("nan")
# row 0: k = 2, 1/4, 8 on three tokens, junk at the fourth; row 1: k = 2, 2 on two tokens.
TRAINER = torch.tensor([[LN2, -2 * LN2, 3 * LN2, NAN], [LN2, LN2, NAN, NAN]])
SAMPLER = torch.zeros(2, 4)
MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])


def test_token_level_is_icepops_band() -> None:
    # band [0.5, 5]: 2 kept, 1/4 dropped, 8 dropped; off the mask 1.
    got = masked_is_weights(TRAINER, SAMPLER, MASK, 0.5, 5.0)
    torch.testing.assert_close(got, torch.tensor([[2.0, 0.0, 0.0, 1.0], [2.0, 2.0, 1.0, 1.0]]))


def test_sequence_level_uses_the_product_ratio() -> None:
    # row 0: K = 2 * 1/4 * 8 = 4 -> kept, every token weighted 4; row 1: K = 4 -> kept.
    got = masked_is_weights(TRAINER, SAMPLER, MASK, 0.5, 5.0, level="sequence")
    torch.testing.assert_close(got, torch.tensor([[4.0, 4.0, 4.0, 1.0], [4.0, 4.0, 1.0, 1.0]]))
    # a band [0.5, 3] drops both rows whole
    got = masked_is_weights(TRAINER, SAMPLER, MASK, 0.5, 3.0, level="sequence")
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0]]))


def test_the_objective_drops_tokens_outside_the_band() -> None:
    # On-policy (pi_old = this pass), A = 1: each token's loss is -w_t with IcePop's weights
    # 2, 0, 0 | 2, 2 above; token-mean over the 5 trained tokens, the dropped ones included.
    logprobs = TRAINER.clone().requires_grad_()
    algo = AlgoConfig(mask=MaskConfig())
    out = grpo_micro_batch_loss(logprobs, None, None, SAMPLER, torch.ones(2), MASK, algo,
                                max_tokens=4, denominator=5.0)  # fmt: skip
    out.loss.backward()
    torch.testing.assert_close(out.loss, torch.tensor(-6.0 / 5))
    expected = torch.tensor([[-0.4, 0.0, 0.0, 0.0], [-0.4, -0.4, 0.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)
    assert out.tis_capped == 2


def test_masking_is_one_correction_and_needs_the_trainers_pi_old() -> None:
    assert (MaskConfig().low, MaskConfig().high) == (0.5, 5.0)  # IcePop's band
    with pytest.raises(ValidationError, match="set one"):
        AlgoConfig(mask=MaskConfig(), tis_cap=2.0)
    with pytest.raises(ValidationError, match="every ratio would be 1"):
        AlgoConfig(mask=MaskConfig(), old_logprobs="sampler")
    with pytest.raises(ValidationError, match="low"):
        MaskConfig(low=1.5)


def verl_rollout_is_band(
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    low: float,
    high: float,
    level: str,
) -> torch.Tensor:
    """verl 0.9's `rollout_is` with a `"lower_upper"` threshold (IcePop), written from its
    `RolloutCorrectionConfig` docs: the IS weight is pi_old / pi_rollout per token (`"token"`) or
    its product over the sequence's response tokens (`"sequence"`), zeroed outside
    [lower, upper]."""
    log_r = (old - rollout) * mask
    if level == "sequence":
        log_r = log_r.sum(-1, keepdim=True).expand_as(log_r)
    r = log_r.exp()
    return torch.where((r >= low) & (r <= high), r, 0.0)


def verl_rejection_then_tis(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl 0.9's MIS: `rollout_rs="token_k1"` with a `"lower_upper"` threshold rejects tokens
    whose `k1 = -log r` leaves [log lower, log upper] (they leave the response mask), so its band
    is on 1/r: our band [low, high] is verl's threshold `f"{1/high}_{1/low}"`. `rollout_is="token"`
    with threshold `high` weights the rest by r capped there (no kept r exceeds it).
    Returns (weights, the mask that is left)."""
    k1 = -(old - rollout) * mask  # verl's token_k1, -log r
    verl_lower, verl_upper = 1 / high, 1 / low
    kept = mask & (k1 >= math.log(verl_lower)) & (k1 <= math.log(verl_upper))
    return (-k1).exp().clamp(max=high), kept


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_equals_verls_icepop_weights(level: str) -> None:
    torch.manual_seed(0)
    sampler = -torch.rand(6, 5) * 3
    trainer = sampler + (torch.rand(6, 5) * 4 - 1.5) / (2 if level == "sequence" else 1)
    mask = torch.rand(6, 5) < 0.8
    ours = masked_is_weights(trainer, sampler, mask, 0.5, 5.0, level)  # type: ignore[arg-type]
    theirs = verl_rollout_is_band(trainer, sampler, mask, 0.5, 5.0, level)
    torch.testing.assert_close(ours[mask], theirs[mask])
    dropped = (ours[mask] == 0).float().mean()
    assert 0 < dropped < 1  # the case has tokens (rows) both kept and dropped


def test_token_mis_equals_verls_rejection_with_tis_on_the_tokens_it_keeps() -> None:
    # The weights agree wherever verl keeps a token; where it rejects one we weight it 0. The one
    # difference: verl's rejected tokens leave the loss's denominator, ours stay in it (module
    # docstring of agent_grpo.algo.masking), so a minibatch's split never changes its loss.
    torch.manual_seed(1)
    sampler = -torch.rand(6, 5) * 3
    trainer = sampler + torch.rand(6, 5) * 4 - 1.5
    mask = torch.rand(6, 5) < 0.8
    ours = masked_is_weights(trainer, sampler, mask, 0.5, 5.0)
    weights, kept = verl_rejection_then_tis(trainer, sampler, mask, 0.5, 5.0)
    torch.testing.assert_close(ours[kept], weights[kept])
    assert torch.equal(ours[mask] != 0, kept[mask])
    assert 0 < int(kept.sum()) < int(mask.sum())
