"""The staleness bound per token, by hand."""

from __future__ import annotations

import pytest
import torch

from agent_grpo.algo.staleness import within_staleness


def test_a_token_trains_while_it_is_at_most_the_bound_behind() -> None:
    # trainer at version 5; tokens sampled by 5 (age 0), 4 (1), 3 (2) and 0 (5)
    versions = torch.tensor([[5, 4, 3], [0, 5, 4]])
    assert within_staleness(versions, 5, 0).tolist() == [[True, False, False], [False, True, False]]
    assert within_staleness(versions, 5, 1).tolist() == [[True, True, False], [False, True, True]]
    assert within_staleness(versions, 5, 5).all()


def test_a_token_newer_than_the_trainer_is_refused() -> None:
    with pytest.raises(ValueError, match="newer than the trainer"):
        within_staleness(torch.tensor([[3, 4]]), 3, 1)
