"""The objective's binding to the config: what a minibatch's loss is divided by."""

from __future__ import annotations

import torch

from agent_grpo.algo.config import AlgoConfig
from agent_grpo.algo.objective import loss_denominator


def test_loss_denominator_counts_episodes_not_rows() -> None:
    mask = torch.tensor([[True, True], [True, False], [True, False], [False, False]])
    episodes = torch.tensor([0, 0, 1, 2])  # episode 2 trains nothing
    assert loss_denominator(mask, AlgoConfig(), 9, episodes) == 4  # tokens, whatever the rows
    seq = AlgoConfig(aggregation="seq-mean-token-mean")
    assert loss_denominator(mask, seq, 9, episodes) == 2
    assert loss_denominator(mask, seq, 9) == 3  # rows, when no row shares an episode
    norm = AlgoConfig(aggregation="seq-mean-token-sum-norm")
    assert loss_denominator(mask, norm, 9, episodes) == 18
