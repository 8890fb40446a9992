"""Masking corrections of the sampler/trainer mismatch, beside truncation (TIS).

The engine samples y from mu (its kernels, its precision, maybe an older policy); the trainer's
pi_old differs. With the per-token ratio k_t = pi_old(y_t) / mu(y_t) (detached), each correction
is a weight w_t on the policy term of the loss:

- TIS, truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training"): `w_t = min(k_t, cap)` (`grpo.truncated_is_weights`).
- MIS, masked IS (Yao, Liu et al. 2025, the same authors' follow-up "When speed kills
  stability"; verl's `rollout_rs` thresholds): tokens whose ratio leaves the band
  [low, high] are dropped, the rest keep their IS weight:
      token level:    w_t = k_t * 1[low <= k_t <= high]
      sequence level: K_i = prod_t k_it over the row's trained tokens (the sequence's IS ratio,
                      verl's `rollout_is: sequence`), w_it = K_i * 1[low <= K_i <= high]
- IcePop (Ling Team 2025, "Every Step Evolves: Scaling RL for Trillion-Scale Thinking Model",
  arXiv:2510.18855, section on IcePop): token-level MIS with the band [0.5, 5],
  `M(k) = k if alpha <= k <= beta else 0`.

A dropped token keeps its place in the loss's denominator (its weight is 0, as in the IcePop
objective's 1/|y| normalisation), so masking never changes how a minibatch is split.
"""

from __future__ import annotations

import torch
from torch import Tensor

from agent_grpo.algo.choices import MaskLevel

__all__ = ["MaskLevel", "masked_is_weights"]


@torch.no_grad()
def masked_is_weights(
    trainer_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    low: float,
    high: float,
    level: MaskLevel = "token",
) -> Tensor:
    """`[B, T]` masked importance weights (module docstring); 1 off the mask, detached."""
    mask = mask.bool()  # [B, T]
    log_k = torch.where(mask, trainer_logprobs - sampler_logprobs, 0.0)  # [B, T]
    if level == "sequence":
        log_k = log_k.sum(-1, keepdim=True).expand_as(log_k)  # [B, T], log K_i on every token
    elif level != "token":
        raise ValueError(f"unknown masking level {level!r}; expected token or sequence")
    k = torch.exp(log_k)  # [B, T]
    kept = (k >= low) & (k <= high)  # [B, T]
    return torch.where(mask, torch.where(kept, k, 0.0), 1.0)  # [B, T]
