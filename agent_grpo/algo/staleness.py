"""The staleness bound per token: a sampled token trains only while it is at most
`algo.max_staleness` policy versions older than the weights it trains.

Each token's version is the policy that sampled its turn (`TurnRecord.policy_version`, else the
record's `policy_version`). Without partial rollouts every token of an episode has one version
and the rollout sources already keep it within the bound, so this mask changes nothing. With
partial rollouts (`rollout.partial`) a long episode straddles weight updates; its turns older
than the bound stay in the row as context (the policy still conditions on them) but leave the
loss. The episode's reward and its group's statistics are unchanged: what the bound removes is
the gradient of tokens whose behaviour policy is too far from the trainer's for the decoupled
objective to correct. (AReaL bounds how stale a trajectory may be when it starts; a bound per
trained token is ours.)
"""

from __future__ import annotations

import torch

__all__ = ["within_staleness"]


def within_staleness(versions: torch.Tensor, version: int, max_staleness: int) -> torch.Tensor:
    """True where a token sampled by policy `versions` ([B, T]) may train policy `version`:
    `version - versions <= max_staleness`. A version newer than the trainer's is impossible and
    raises (it would mean a mislabelled turn, not a fresh one)."""
    ages = version - versions  # [B, T]
    if bool((ages < 0).any()):
        raise ValueError(f"a token is tagged with a policy newer than the trainer's ({version})")
    return ages <= max_staleness  # [B, T]
