"""GSPO's sequence-level importance ratio (Zheng et al. 2025, "Group Sequence Policy
Optimization", arXiv:2507.18071).

GSPO replaces each token's ratio pi(y_t) / pi_old(y_t) by one ratio per sequence, the geometric
mean of its token ratios over its trained tokens, and clips that:

    s_i = exp( (1 / |y_i|) * sum_t (log pi(y_it) - log pi_old(y_it)) )
    J   = mean_i min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i)

We use the paper's token form (GSPO-token, its eq. 13), which has s_i's value at every token and
the gradient s_i * grad log pi(y_it):

    s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]

Averaged over a sequence's tokens (`aggregation: seq-mean-token-mean`) with one advantage per
sequence, its gradient is exactly the sequence form's, `s_i * A_i * (1/|y_i|) sum_t grad log pi`;
other aggregations weight the same per-token terms differently. verl's `policy_loss: gspo` is this
token form too. A sequence here is a row: the branches of a forked episode are each their own.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sequence_log_ratio"]


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """`[B, T]` log of GSPO-token's ratio: `log pi - sg[log pi] + sg[mean_t(log pi - log pi_old)]`.

    Its value is the row's mean log ratio over `mask` (0 off the mask and on rows without a
    trained token); its gradient is that of `log pi` token by token. Inputs must be clean (finite)
    off the mask, as `policy_loss` makes them."""
    mask = mask.bool()  # [B, T]
    token = torch.where(mask, logprobs - old_logprobs, 0.0)  # [B, T]
    mean = token.sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    return logprobs - logprobs.detach() + mean.detach()[:, None]  # [B, T]
