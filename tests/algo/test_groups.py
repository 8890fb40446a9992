"""`group_advantages`' defaults follow `AlgoConfig`'s rule (RLOO unscaled), and one rule
(`has_reward_variance`) says which groups are live for both the advantages and the metrics."""

from __future__ import annotations

import random

import pytest
import torch

from agent_grpo.algo.config import AlgoConfig
from agent_grpo.algo.groups import advantages_of, dead_group_mask
from agent_grpo.algo.grpo import group_advantages, has_reward_variance
from agent_grpo.testing.records import minimal_record
from agent_grpo.trajectory.record import TrajectoryRecord

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0])
SIGNS = torch.tensor([1.0, -1.0, -1.0, 1.0])


def record(group: str, index: int, reward: float) -> TrajectoryRecord:
    """A record of a group of 4 (`minimal_record`)."""
    return minimal_record(group, index, reward, group_size=4)


def test_leave_one_out_alone_is_unscaled_as_the_config_trains_it() -> None:
    # RLOO by hand: r=1 -> 1 - (0 + 0 + 1) / 3 = 2/3; r=0 -> 0 - (1 + 0 + 1) / 3 = -2/3
    got = group_advantages(REWARDS, [0] * 4, leave_one_out=True)
    torch.testing.assert_close(got, SIGNS * 2 / 3)
    # scaled only when asked: std (n - 1) = sqrt(4 * 0.25 / 3) = 0.57735, 0.6667 / it = 1.1547
    got = group_advantages(REWARDS, [0] * 4, leave_one_out=True, scale="group", eps=0.0)
    torch.testing.assert_close(got, SIGNS * 1.1547005)


def test_plain_grpo_stays_scaled_by_default() -> None:
    # mean 0.5, std 0.57735: (1 - 0.5) / 0.57735 = 0.8660254
    got = group_advantages(REWARDS, [0] * 4, eps=0.0)
    torch.testing.assert_close(got, SIGNS * 0.8660254)


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_the_function_default_is_the_config_default(leave_one_out: bool) -> None:
    records = [record("g", i, float(r)) for i, r in enumerate(REWARDS.tolist())]
    algo = AlgoConfig(leave_one_out=leave_one_out)
    expected = advantages_of(records, algo)
    torch.testing.assert_close(group_advantages(REWARDS, [0] * 4, leave_one_out=leave_one_out),
                               expected)  # fmt: skip


def test_rewards_that_differ_at_all_make_a_live_group_for_advantages_and_metrics() -> None:
    rewards = [0.3, 0.3 + 1e-12]
    assert has_reward_variance(rewards)
    assert group_advantages(torch.tensor(rewards, dtype=torch.float64), [0, 0]).ne(0).all()
    assert dead_group_mask([record("g", i, r) for i, r in enumerate(rewards)]) == [False] * 2


def test_dead_groups_are_exactly_the_groups_with_zero_advantages() -> None:
    rng = random.Random(0)
    # differences far below 1e-30 would underflow the float32 advantages to 0 in a live group
    values = [0.0, 1.0, 0.1, 0.1 + 1e-12, 1e-30]
    for _ in range(200):
        size = rng.randint(1, 4)
        rewards = [rng.choice(values) for _ in range(size)]
        records = [record("g", i, r) for i, r in enumerate(rewards)]
        zero = group_advantages(torch.tensor(rewards, dtype=torch.float64), [0] * size).eq(0)
        assert dead_group_mask(records) == [bool(zero.all())] * size, rewards
        assert has_reward_variance(rewards) == (not zero.all()), rewards
