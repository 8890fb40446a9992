"""Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
Reinforcement Learning", arXiv:1912.09729).

With a negative advantage, PPO's clipped loss `-min(rho * A, clip(rho) * A)` grows without bound
as the ratio rho grows: one token the policy now finds far likelier than the sampler did can
dominate the update. Dual-clip caps that loss at `-c * A` (c > 1):

    l = max(-rho * A, -clip(rho, 1 - lo, 1 + hi) * A)     (PPO)
    l = min(l, -c * A)                                    where A < 0

so for A < 0 and rho > c the gradient is 0. verl's `clip_ratio_c` (default 3) is this c.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["dual_clip"]


def dual_clip(per_token: Tensor, advantages: Tensor, c: float) -> Tensor:
    """`[B, T]` PPO-clip losses with those of negative advantages capped at `-c * A`."""
    if c <= 1.0:
        raise ValueError(f"dual-clip c must be > 1, got {c}")
    capped = torch.minimum(per_token, -c * advantages)  # [B, T]
    return torch.where(advantages < 0, capped, per_token)  # [B, T]
