"""Signal-quality metrics with hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from agent_grpo.algo.groups import dead_group_mask
from agent_grpo.rollout.summary import summarize_trajectories
from agent_grpo.testing.records import minimal_record
from agent_grpo.trainer.metrics import logprob_mismatch, mismatch_by_staleness, signal_metrics
from agent_grpo.trajectory.record import Provenance, ToolCallRecord, TrajectoryRecord, TurnRecord


def record(
    group: str, reward: float, model_ids: list[int], calls: int = 0, malformed: int = 0
) -> TrajectoryRecord:
    """A one-turn episode after a one-token prompt, with `calls` tool calls in its turn."""
    ids = [1, *model_ids]
    turn = TurnRecord(
        index=0,
        model_text="x",
        token_start=1,
        token_end=len(ids),
        finish_reason="stop",
        tool_calls=[ToolCallRecord(name="t") for _ in range(calls)],
    )
    return minimal_record(
        group,
        reward=reward,
        group_size=2,
        token_ids=ids,
        provenance=[Provenance.PROMPT] + [Provenance.MODEL] * len(model_ids),
        success=reward > 0,
        turns=[turn],
        malformed_tool_calls=malformed,
    )


def test_dead_groups_and_duplicates() -> None:
    records = [
        record("a", 1.0, [5, 6], calls=1),
        record("a", 0.0, [7], calls=1, malformed=1),
        record("b", 0.5, [9, 9, 9]),
        record("b", 0.5, [9, 9, 9]),  # dead and duplicated
    ]
    assert dead_group_mask(records) == [False, False, True, True]
    m = signal_metrics(records, advantages=[0.7, -0.7, 0.0, 0.0])
    s = summarize_trajectories(records)
    assert m.dead_groups == 1
    assert m.dead_group_fraction == 0.5
    assert m.duplicate_fraction == 0.25  # one of four records repeats a group-mate
    assert s.reward_mean == 0.5
    assert math.isclose(s.reward_std, math.sqrt((0.25 + 0.25 + 0 + 0) / 4))
    assert m.len_above_baseline == 2.0 and m.len_below_baseline == 1.0
    assert s.tool_calls_per_traj == 0.5
    assert s.malformed_call_rate == 0.5
    # rewards [1, 0, .5, .5] vs lengths [2, 1, 3, 3]: centred (.5,-.5,0,0)·(-.25,-1.25,.75,.75)
    # = -.125 + .625 = .5; |r| = sqrt(.5), |l| = sqrt(.0625+1.5625+.5625+.5625) = sqrt(2.75)
    assert math.isclose(m.reward_length_corr, 0.5 / math.sqrt(0.5 * 2.75))


def test_logprob_mismatch_ignores_masked_junk() -> None:
    trainer = torch.tensor([[0.0, -1.0, -2.0], [float("nan"), -0.5, 9.0]])
    sampler = torch.tensor([[5.0, -1.5, -2.0], [1.0, -0.25, float("inf")]])
    mask = torch.tensor([[False, True, True], [False, True, False]])
    out = logprob_mismatch(trainer, sampler, mask)
    assert out.logprob_mismatch_mean == pytest.approx((0.5 + 0.0 + 0.25) / 3)
    assert out.logprob_mismatch_max == pytest.approx(0.5)


def test_mismatch_by_staleness_splits_the_gap_by_each_tokens_age() -> None:
    trainer = torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-3.0, 0.0]])
    sampler = torch.tensor([[-1.5, -2.0], [-2.0, -4.0], [float("nan"), 7.0]])
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    # row 0 is fresh (gaps 0.5, 0), row 1 two versions behind (1, 3); row 2, also fresh, has no
    # token both scored, so it adds nothing to age 0; the unmasked token's age 5 is no key
    ages = torch.tensor([[0, 0], [2, 2], [0, 5]])
    out = mismatch_by_staleness(trainer, sampler, mask, ages)
    assert out == {0: pytest.approx(0.25), 2: pytest.approx(2.0)}
    assert mismatch_by_staleness(trainer, sampler, mask & False, ages) == {}
    # an episode that straddled an update: its first token one version behind (gap 0.5), its
    # second fresh (gap 0); each counts under its own age
    straddled = torch.tensor([[1, 0], [2, 2], [0, 5]])
    out = mismatch_by_staleness(trainer, sampler, mask, straddled)
    assert out == {0: pytest.approx(0.0), 1: pytest.approx(0.5), 2: pytest.approx(2.0)}
