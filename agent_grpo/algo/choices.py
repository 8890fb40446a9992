"""The objective's named choices, as configs spell them: the KL estimator, the aggregation, the
ratio and mask levels, and the advantage scale a config resolves to. Kept free of torch so a
config validates (and a mistake in it is reported) without loading torch; the math that
takes them lives in `grpo.py` and `masking.py`."""

from __future__ import annotations

from typing import Literal

__all__ = ["Aggregation", "KLKind", "MaskLevel", "RatioLevel", "advantage_scale"]

KLKind = Literal["k1", "k2", "k3"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
RatioLevel = Literal["token", "sequence"]
MaskLevel = Literal["token", "sequence"]


def advantage_scale(
    scale: Literal["group", "none"] | None, leave_one_out: bool
) -> Literal["group", "none"]:
    """The advantage scale `scale` means: unset, `none` for RLOO (as published) and `group`
    otherwise. `group_advantages` and `AlgoConfig` both resolve it here, so the function's
    defaults and the config's agree."""
    if scale is not None:
        return scale
    return "none" if leave_one_out else "group"
