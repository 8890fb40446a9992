"""A training step's rollout: with DAPO dynamic sampling, dead groups (no variance of the total
reward) are dropped and fresh tasks refill the batch; without it, the batch is kept as sampled."""

from __future__ import annotations

from agent_grpo.algo.groups import dead_group_mask
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.rollout import step as rollout_step
from agent_grpo.rollout.collector import RolloutMetrics, RolloutResult, Task
from agent_grpo.testing import reward_rules
from agent_grpo.testing.records import minimal_record

MEMBER_INDEX = f"{reward_rules.__name__}:member_index"


def test_dead_groups_are_replaced_by_live_ones(monkeypatch) -> None:
    calls: list[int] = []

    def fake_collect_groups(tasks: list[Task], *args, step: int, **kwargs) -> RolloutResult:
        calls.append(step)
        # odd seeds give a live group (rewards 0 and 1), even seeds a dead one (0 and 0)
        records = [
            minimal_record(f"s{step}-t{t}", i, float(i) if task.seed % 2 else 0.0, group_size=2)
            for t, task in enumerate(tasks)
            for i in range(2)
        ]
        return RolloutResult(records=records, metrics=RolloutMetrics())

    monkeypatch.setattr(rollout_step, "collect_groups", fake_collect_groups)
    config = TrainConfig.model_validate({
        "rollout": {"tasks_per_step": 4, "group_size": 2},
        "algo": {"dynamic_sampling": True, "dynamic_sampling_max_rounds": 10},
    })  # fmt: skip
    result = rollout_step.collect(config, backend=None, tokenizer=None, stop=[], step=3)  # type: ignore[arg-type]
    assert len(result.records) == 8
    assert not any(dead_group_mask(result.records))
    assert calls[0] == 3 and all(c > 3000 for c in calls[1:])  # extra rounds: distinct group ids
    assert len({r.group_id for r in result.records}) == 4


def test_without_dynamic_sampling_the_batch_is_kept_as_sampled(monkeypatch) -> None:
    def fake_collect_groups(tasks: list[Task], *args, step: int, **kwargs) -> RolloutResult:
        records = [
            minimal_record(f"t{t}", i, 0.0, group_size=2)
            for t in range(len(tasks))
            for i in range(2)
        ]
        return RolloutResult(records=records, metrics=RolloutMetrics())

    monkeypatch.setattr(rollout_step, "collect_groups", fake_collect_groups)
    config = TrainConfig.model_validate({"rollout": {"tasks_per_step": 3, "group_size": 2}})
    result = rollout_step.collect(config, backend=None, tokenizer=None, stop=[], step=0)  # type: ignore[arg-type]
    assert len(result.records) == 6 and all(dead_group_mask(result.records))


def test_dynamic_sampling_keeps_groups_alive_by_an_extra_reward(monkeypatch) -> None:
    # the verifier's reward is 0 for every member, the member-index rule makes each group live
    calls: list[int] = []

    def verifier_zero(tasks: list[Task], *args, step: int, **kwargs) -> RolloutResult:
        calls.append(step)
        records = [minimal_record(f"s{step}-t{t}", i, 0.0, group_size=2)
                   for t in range(len(tasks)) for i in range(2)]  # fmt: skip
        return RolloutResult(records=records, metrics=RolloutMetrics())

    monkeypatch.setattr(rollout_step, "collect_groups", verifier_zero)
    config = TrainConfig.model_validate({
        "rollout": {"tasks_per_step": 2, "group_size": 2},
        "algo": {"dynamic_sampling": True},
        "rewards": [{"type": "rule", "name": "idx", "function": MEMBER_INDEX}],
    })  # fmt: skip
    result = rollout_step.collect(config, None, None, [], step=0)  # type: ignore[arg-type]
    assert calls == [0]  # the verifier alone says dead; the total reward says alive
    assert [r.reward for r in result.records] == [0.0, 1.0, 0.0, 1.0]
