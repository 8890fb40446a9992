"""Turn-level credit for multi-turn episodes: a step-level group advantage in the manner of GiGPO
(Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training",
arXiv:2505.10978).

GRPO gives every token of an episode the episode's advantage A^E_i. GiGPO adds a second,
step-level one. The turns of a group's episodes that start from the same environment state s (an
"anchor state") form a step group. Each turn's return (its reward-to-go) is compared within its
step group, and the two advantages are added for every token of the turn:

    R_it   = sum_{k >= t} gamma^(k - t) r_ik          r_ik: turn rewards, the episode's reward
                                                       added to its last turn
    A^S_it = (R_it - mean_{step group} R) / std       GiGPO (std only with `scale: group`)
    A_it   = A^E_i + omega * A^S_it

Where we depart from the paper:

- **An unbiased mode.** With `algo.leave_one_out` the step baseline is the mean return of the
  *other* turns in the step group, and a turn alone in its step group takes the episode's
  leave-one-out baseline (the mean reward of the group's other episodes) instead of GiGPO's 0.
  Both baselines are functions of other episodes only, which are independent of the turn's own
  tokens, so `E[A^S_it grad log pi(turn t)]` is the policy gradient's turn-t term and
  `E[A_it ...]` is exactly (1 + omega) times it. This mode is unscaled (`scale: none`): dividing
  by a step group's std would weight states by how little their returns vary. GiGPO's own mode
  (a step group's own member in its mean, singletons 0, std scaling optional) shrinks each
  state's share by (n - 1) / n and drops states seen once; `bench/bias.py` measures both.
- **The state.** GiGPO hashes the environment's observation. An env names the state in
  `info["state"]` (reset's info for the first turn, each step's info for the turn after it);
  otherwise it is a digest of the whole conversation the turn is written after, so only turns
  with identical histories share a step group (every first turn of a group does).
- **Turn rewards** come from `info["turn_reward"]` of each step (0 when absent); the episode's
  reward (verifier, rules, reward model) is the last turn's. The episode advantage A^E stays that
  of the episode's reward, as in GRPO.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

import torch
from torch import Tensor

from agent_grpo.algo.grpo import dense_group_index, group_advantages

__all__ = ["others_mean", "returns_to_go", "step_advantages", "turn_advantages"]


def returns_to_go(
    turn_rewards: Tensor, final: Tensor, num_turns: Tensor, discount: float
) -> Tensor:
    """`[B, K]` each turn's return: its reward, plus `discount` times the next turn's return;
    the episode's `final` reward `[B]` is added to turn `num_turns - 1`. Entries at or past
    `num_turns` `[B]` are 0 (and `turn_rewards` there is ignored)."""
    batch, width = turn_rewards.shape
    turn = torch.arange(width, device=turn_rewards.device)  # [K]
    live = turn[None, :] < num_turns[:, None]  # [B, K]
    last = turn[None, :] == (num_turns - 1)[:, None]  # [B, K]
    rewards = torch.where(live, turn_rewards.to(torch.float64), 0.0)  # [B, K]
    rewards = rewards + torch.where(last, final.to(torch.float64)[:, None], 0.0)  # [B, K]
    returns = torch.zeros(batch, width + 1, dtype=torch.float64, device=rewards.device)
    for k in range(width - 1, -1, -1):  # K is a handful of turns
        returns[:, k] = rewards[:, k] + discount * returns[:, k + 1]
    return torch.where(live, returns[:, :width], 0.0)  # [B, K]


def others_mean(rewards: Tensor, group_ids: Tensor | Sequence[Hashable], valid: Tensor) -> Tensor:
    """`[B]` the mean reward of each member's *other* valid group members (RLOO's baseline);
    a member with none takes its own reward (no baseline to subtract)."""
    rewards = torch.where(valid, rewards.to(torch.float64), 0.0)  # [B]
    index = dense_group_index(group_ids, rewards.device)  # [B]
    zeros = rewards.new_zeros(int(index.max()) + 1 if index.numel() else 0)  # [G]
    total = zeros.index_add(0, index, rewards)[index]  # [B]
    count = zeros.index_add(0, index, valid.to(rewards.dtype))[index]  # [B]
    others = count - valid.to(rewards.dtype)  # [B]
    mean = (total - rewards) / others.clamp(min=1)  # [B]
    return torch.where(others > 0, mean, rewards)  # [B]


def step_advantages(
    returns: Tensor,
    step_groups: Tensor | Sequence[Hashable],
    fallback_baseline: Tensor,
    *,
    valid: Tensor,
    scale: Literal["group", "none"],
    leave_one_out: bool,
) -> Tensor:
    """`[M]` A^S of `M` turns: `returns` `[M]` compared within `step_groups` (a group's turns
    from one state), by `group_advantages` (its mean or leave-one-out baseline, its scale, 0 for
    invalid turns and groups without variance). With `leave_one_out`, a valid turn alone in its
    step group gets `returns - fallback_baseline` (`[M]`, the episode's `others_mean`); without,
    0 (GiGPO)."""
    adv = group_advantages(returns, step_groups, valid=valid, scale=scale,
                           leave_one_out=leave_one_out).to(torch.float64)  # fmt: skip  # [M]
    if not leave_one_out:
        return adv
    index = dense_group_index(step_groups, returns.device)  # [M]
    zeros = returns.new_zeros(int(index.max()) + 1 if index.numel() else 0, dtype=torch.float64)
    alone = zeros.index_add(0, index, valid.to(torch.float64))[index] == 1  # [M]
    single = returns.to(torch.float64) - fallback_baseline.to(torch.float64)  # [M]
    return torch.where(alone & valid, single, adv)  # [M]


def turn_advantages(
    episode: Tensor,
    rewards: Tensor,
    turn_rewards: Tensor,
    num_turns: Tensor,
    step_groups: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    *,
    valid: Tensor,
    weight: float,
    discount: float,
    scale: Literal["group", "none"],
    leave_one_out: bool,
) -> Tensor:
    """`[B, K]` each turn's advantage, `A^E + weight * A^S`: `episode` `[B]` (the episode
    advantages), `rewards` `[B]` (the episodes' rewards), `turn_rewards` `[B, K]`, `num_turns`
    `[B]`, `step_groups` `[B, K]` (equal ids for turns of one group from one state; any value
    at or past `num_turns`), `group_ids` `[B]` and `valid` `[B]` (the episodes that count).
    0 at or past `num_turns` and on every turn of an episode that does not count."""
    batch, width = turn_rewards.shape
    live = torch.arange(width)[None, :] < num_turns[:, None]  # [B, K]
    safe = torch.where(valid, rewards.to(torch.float64), 0.0)  # [B]; junk never reaches a sum
    returns = returns_to_go(turn_rewards, safe, num_turns, discount)  # [B, K]
    baseline = others_mean(safe, group_ids, valid)[:, None].expand(batch, width)  # [B, K]
    counted = valid[:, None] & live  # [B, K]
    steps = step_advantages(returns[live], step_groups[live], baseline[live], valid=counted[live],
                            scale=scale, leave_one_out=leave_one_out)  # fmt: skip  # [M]
    out = torch.zeros(batch, width, dtype=torch.float64)  # [B, K]
    out[live] = episode.to(torch.float64)[:, None].expand(batch, width)[live] + weight * steps
    return torch.where(counted, out, 0.0)  # [B, K]
