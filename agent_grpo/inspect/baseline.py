"""A group's baseline as the run's advantages used it: which members counted, mean, and std.

Replay shows a group's mean and std next to its advantages, so they must be the numbers
`agent_grpo.algo.grpo.group_advantages` divided by, not a fresh summary of whatever records are on
screen: the mean and the *unbiased* std over the members that counted (`counts_in_group`: not
excluded, not an infrastructure failure, a finite reward), and no std at all when the run did not
scale by it (`algo.scale: none`, Dr. GRPO; RLOO's default). The run's `config.yaml` says which.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from agent_grpo.algo.config import AlgoConfig
from agent_grpo.algo.groups import counts_in_group
from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = ["AdvantageNorm", "GroupBaseline", "group_baseline"]


@dataclass(frozen=True)
class AdvantageNorm:
    """How a run turned a group's rewards into advantages (its `algo.scale`, resolved, and
    `algo.leave_one_out`)."""

    scale: Literal["group", "none"] = "group"
    """`group`: divided by the group std; `none`: not (Dr. GRPO, RLOO as published)."""
    leave_one_out: bool = False
    """The baseline is the mean of the other members (RLOO)."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> AdvantageNorm:
        """The norm of a run's config mapping (its `algo` section; defaults when absent)."""
        algo = config.get("algo") or {}
        # AlgoConfig resolves an unset scale (none with leave_one_out, else group): one rule.
        resolved = AlgoConfig(
            scale=algo.get("scale"), leave_one_out=bool(algo.get("leave_one_out", False))
        )
        return cls(scale=resolved.advantage_scale, leave_one_out=resolved.leave_one_out)

    def formula(self) -> str:
        """The advantage formula in words, e.g. `(r - mean) / std`."""
        centred = "n/(n-1) * (r - mean)" if self.leave_one_out else "r - mean"
        name = " (RLOO)" if self.leave_one_out else " (Dr. GRPO)" if self.scale == "none" else ""
        return (f"({centred}) / std" if self.scale == "group" else centred) + name


@dataclass(frozen=True)
class GroupBaseline:
    """One group's statistics exactly as its advantages used them."""

    members: int
    """Records of the group that were looked at."""
    counted: int
    """Members that entered the statistics (`counts_in_group`)."""
    mean: float | None
    """Mean total reward of the counted members; None when none counted."""
    std: float | None
    """Unbiased (n - 1) std of the counted members' rewards; None with fewer than 2."""
    dead: bool
    """Fewer than 2 counted, or all counted rewards equal: every advantage is exactly 0."""
    norm: AdvantageNorm
    """How the run scaled the advantages."""

    def caption(self) -> str:
        """One line: the formula, how many counted, the mean, and the std when it was used."""
        line = f"advantage = {self.norm.formula()} over {self.counted} of {self.members} counted"
        if self.mean is not None:
            line += f": mean {self.mean:.4f}"
        if self.norm.scale == "group" and self.std is not None:
            line += f" std {self.std:.4f} (unbiased)"
        return line + ("; dead group: every advantage 0" if self.dead else "")


def group_baseline(
    records: Sequence[TrajectoryRecord], norm: AdvantageNorm | None = None
) -> GroupBaseline:
    """The baseline of one group's records (pass the whole group: a filtered subset would give
    other numbers than the trainer's)."""
    rewards = [r.reward for r in records if counts_in_group(r)]
    return GroupBaseline(
        members=len(records),
        counted=len(rewards),
        mean=statistics.fmean(rewards) if rewards else None,
        std=statistics.stdev(rewards) if len(rewards) >= 2 else None,
        # The same test as `group_advantages`: exact equality of the counted rewards.
        dead=len(rewards) < 2 or max(rewards) == min(rewards),
        norm=norm or AdvantageNorm(),
    )
