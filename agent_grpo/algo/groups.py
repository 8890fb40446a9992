"""Which episodes count in their group, and which groups carry a signal: the rules the
advantage (`grpo.group_advantages`), the loss's rows and the step metrics all follow.

An episode counts unless it was excluded (an infrastructure failure, a reward source that could
not score, a non-finite reward); a group is dead when its counted members' rewards are all equal
(`grpo.has_reward_variance`, exact equality), so every advantage in it is 0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from agent_grpo.algo.config import AlgoConfig
from agent_grpo.algo.grpo import group_advantages, has_reward_variance
from agent_grpo.algo.turn_credit import turn_advantages
from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = [
    "advantages_of",
    "counts_in_group",
    "dead_group_mask",
    "group_indices",
    "trainable_rows",
    "turn_advantages_of",
]


def counts_in_group(record: TrajectoryRecord) -> bool:
    """Whether an episode enters its group's statistics: not excluded by the trainer, not an
    infrastructure failure, and a finite reward."""
    return (
        record.excluded is None
        and record.termination.kind != "error"
        and math.isfinite(record.reward)
    )


def group_indices(records: Sequence[TrajectoryRecord]) -> dict[str, list[int]]:
    """Each group id -> the positions of its members in `records`, in order."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, record in enumerate(records):
        groups[record.group_id].append(i)
    return groups


def dead_group_mask(records: Sequence[TrajectoryRecord]) -> list[bool]:
    """Per record: True when its group carries no signal (`has_reward_variance` of its counted
    members' total rewards, the rule `group_advantages` applies)."""
    dead = [False] * len(records)
    for rows in group_indices(records).values():
        rewards = [records[i].reward for i in rows if counts_in_group(records[i])]
        flat = not has_reward_variance(rewards)
        for i in rows:
            dead[i] = flat
    return dead


def advantages_of(records: Sequence[TrajectoryRecord], algo: AlgoConfig) -> torch.Tensor:
    """Group-relative advantages `[B]` of the records' total rewards, built in fp64 (float32
    rewards of 1000.0001 and 1000.0002 are one number); excluded members count for nothing."""
    rewards = torch.tensor([r.reward for r in records], dtype=torch.float64)  # [B]
    valid = torch.tensor([counts_in_group(r) for r in records], dtype=torch.bool)  # [B]
    return group_advantages(
        rewards,
        [r.group_id for r in records],
        valid=valid,
        scale=algo.advantage_scale,
        leave_one_out=algo.leave_one_out,
    )


def turn_advantages_of(
    records: Sequence[TrajectoryRecord], algo: AlgoConfig, episode: torch.Tensor
) -> list[list[float]]:
    """Each record's per-turn advantages under `algo.turn_credit` (`turn_credit.turn_advantages`):
    `episode` `[B]` (`advantages_of`) plus `weight` times the turn's step advantage, its return
    compared with those of the group's turns from the same state (`TurnRecord.state`)."""
    credit = algo.turn_credit
    assert credit is not None
    width = max((len(r.turns) for r in records), default=0)
    turn_rewards = torch.zeros(len(records), width, dtype=torch.float64)  # [B, K]
    step_groups = torch.zeros(len(records), width, dtype=torch.long)  # [B, K]
    ids: dict[tuple[str, str], int] = {}
    for b, record in enumerate(records):
        for t, turn in enumerate(record.turns):
            turn_rewards[b, t] = turn.reward
            step_groups[b, t] = ids.setdefault((record.group_id, turn.state), len(ids))
    advantages = turn_advantages(
        episode,
        torch.tensor([r.reward for r in records], dtype=torch.float64),
        turn_rewards,
        torch.tensor([len(r.turns) for r in records], dtype=torch.long),
        step_groups,
        [r.group_id for r in records],
        valid=torch.tensor([counts_in_group(r) for r in records], dtype=torch.bool),
        weight=credit.weight,
        discount=credit.discount,
        scale=algo.advantage_scale,
        leave_one_out=algo.leave_one_out,
    )  # [B, K]
    return [advantages[b, : len(r.turns)].tolist() for b, r in enumerate(records)]


def trainable_rows(records: Sequence[TrajectoryRecord], algo: AlgoConfig) -> torch.Tensor:
    """`[B]` bool: the rows whose model tokens enter the loss (and its denominator): not
    excluded, and with `drop_dead_groups` not in a group without reward variance."""
    keep = torch.tensor([counts_in_group(r) for r in records], dtype=torch.bool)  # [B]
    if algo.drop_dead_groups:
        keep &= ~torch.tensor(dead_group_mask(records), dtype=torch.bool)  # [B]
    return keep
