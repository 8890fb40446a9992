"""`rollout.on_failure`: an infrastructure failure excludes its episode (`exclude`) or takes its
whole group out of the loss and the statistics (`drop_group`); both are counted."""

from __future__ import annotations

import pytest

from agent_grpo.algo.groups import advantages_of, counts_in_group, trainable_rows
from agent_grpo.config.base import ConfigError, load_config
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.rollout.collector import RolloutMetrics, RolloutResult
from agent_grpo.rollout.step import score
from agent_grpo.testing.records import minimal_record
from agent_grpo.trainer.metrics import signal_metrics
from agent_grpo.trajectory.record import TrajectoryRecord


def record(group: str, index: int, reward: float, kind: str = "terminated") -> TrajectoryRecord:
    """A record of a group of 4 (`minimal_record`)."""
    return minimal_record(group, index, reward, group_size=4, kind=kind)


def step(on_failure: str | None, records: list[TrajectoryRecord]) -> list[TrajectoryRecord]:
    rollout = {} if on_failure is None else {"on_failure": on_failure}
    config = TrainConfig.model_validate({"rollout": rollout})
    return score(config, RolloutResult(records=records, metrics=RolloutMetrics())).records


def batch() -> list[TrajectoryRecord]:
    """Group a: member 2 failed in its env; group b: all fine."""
    a = [
        record("a", 0, 1.0),
        record("a", 1, 0.0),
        record("a", 2, 0.0, "error"),
        record("a", 3, 1.0),
    ]
    return a + [record("b", i, r) for i, r in enumerate([1.0, 0.0, 0.0, 0.0])]


def test_exclude_is_the_default_and_trains_the_rest_of_the_group() -> None:
    records = step(None, batch())
    assert [counts_in_group(r) for r in records] == [True, True, False, True] + [True] * 4
    # the survivors 1, 0, 1 still have a baseline (2/3) and non-zero advantages
    assert advantages_of(records, TrainConfig().algo)[[0, 1, 3]].ne(0).all()
    signal = signal_metrics(records, [0.0] * 8)
    assert (signal.excluded_trajectories, signal.dropped_groups) == (1, 0)


def test_drop_group_takes_the_failed_episodes_group_out_of_loss_and_statistics() -> None:
    records = step("drop_group", batch())
    assert [counts_in_group(r) for r in records] == [False] * 4 + [True] * 4
    assert records[0].excluded == "group dropped: member 2 infrastructure failure: env raised"
    assert records[2].excluded == "infrastructure failure: env raised"  # its own reason kept
    algo = TrainConfig().algo
    advantages = advantages_of(records, algo)
    assert advantages[:4].eq(0).all() and advantages[4:].ne(0).all()
    assert trainable_rows(records, algo).tolist() == [False] * 4 + [True] * 4
    signal = signal_metrics(records, advantages.tolist())
    assert (signal.excluded_trajectories, signal.dropped_groups) == (4, 1)
    assert signal.dead_groups == 1  # a dropped group carries no signal either


def test_a_non_finite_reward_also_drops_its_group() -> None:
    records = [record("a", 0, 1.0), record("a", 1, float("nan"))]
    records = step("drop_group", records)
    assert not any(counts_in_group(r) for r in records)


def test_a_group_whose_members_all_failed_counts_as_dropped_under_exclude() -> None:
    records = step("exclude", [record("a", i, 0.0, "error") for i in range(2)])
    assert signal_metrics(records, [0.0, 0.0]).dropped_groups == 1


def test_an_unknown_policy_is_a_one_line_error(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  on_failure: retry\n")
    with pytest.raises(ConfigError) as error:
        load_config(TrainConfig, path)
    assert str(error.value).endswith(
        "rollout.on_failure: Input should be 'exclude' or 'drop_group'"
    )
    assert "\n" not in str(error.value)
