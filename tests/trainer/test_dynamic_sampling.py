"""DAPO dynamic sampling: dead groups (no variance of the total reward) are dropped and fresh
tasks refill the batch."""

from __future__ import annotations

from agent_grpo.algo.groups import dead_group_mask
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.rollout import step as train
from agent_grpo.rollout.collector import RolloutMetrics, RolloutResult, Task
from agent_grpo.rollout.sources import LocalRollouts
from agent_grpo.testing import reward_rules
from agent_grpo.testing.records import minimal_record

MEMBER_INDEX = f"{reward_rules.__name__}:member_index"


def test_dead_groups_are_replaced_by_live_ones(monkeypatch) -> None:
    calls: list[int] = []

    def fake_collect_groups(tasks: list[Task], *args, step: int, run_id: str) -> RolloutResult:
        calls.append(step)
        # odd seeds give a live group (rewards 0 and 1), even seeds a dead one (0 and 0)
        records = [
            minimal_record(f"s{step}-t{t}", i, float(i) if task.seed % 2 else 0.0, group_size=2)
            for t, task in enumerate(tasks)
            for i in range(2)
        ]
        return RolloutResult(records=records, metrics=RolloutMetrics())

    monkeypatch.setattr(train, "collect_groups", fake_collect_groups)
    config = TrainConfig.model_validate({
        "rollout": {"tasks_per_step": 4, "group_size": 2},
        "algo": {"dynamic_sampling": True, "dynamic_sampling_max_rounds": 10},
    })  # fmt: skip
    result = train.collect(config, backend=None, tokenizer=None, stop=[], step=3)  # type: ignore[arg-type]
    assert len(result.records) == 8
    assert not any(dead_group_mask(result.records))
    assert calls[0] == 3 and all(c > 3000 for c in calls[1:])  # extra rounds: distinct group ids
    assert len({r.group_id for r in result.records}) == 4


def test_without_dynamic_sampling_the_batch_is_kept_as_sampled(monkeypatch) -> None:
    def fake_collect_groups(tasks: list[Task], *args, step: int, run_id: str) -> RolloutResult:
        records = [
            minimal_record(f"t{t}", i, 0.0, group_size=2)
            for t in range(len(tasks))
            for i in range(2)
        ]
        return RolloutResult(records=records, metrics=RolloutMetrics())

    monkeypatch.setattr(train, "collect_groups", fake_collect_groups)
    config = TrainConfig.model_validate({"rollout": {"tasks_per_step": 3, "group_size": 2}})
    result = train.collect(config, backend=None, tokenizer=None, stop=[], step=0)  # type: ignore[arg-type]
    assert len(result.records) == 6 and all(dead_group_mask(result.records))


def test_the_local_engine_frees_its_caches_once_the_whole_collection_is_done(monkeypatch) -> None:
    events: list[str] = []

    def fake_collect_groups(tasks: list[Task], *args, step: int, run_id: str) -> RolloutResult:
        events.append("round")
        records = [
            minimal_record(f"s{step}-t{t}", i, float(i) if task.seed % 2 else 0.0, group_size=2)
            for t, task in enumerate(tasks)
            for i in range(2)
        ]
        return RolloutResult(records=records, metrics=RolloutMetrics())

    class Engine:
        def free_caches(self) -> None:
            events.append("free")

    monkeypatch.setattr(train, "collect_groups", fake_collect_groups)
    config = TrainConfig.model_validate({
        "rollout": {"tasks_per_step": 4, "group_size": 2},
        "algo": {"dynamic_sampling": True, "dynamic_sampling_max_rounds": 10},
    })  # fmt: skip
    rollouts = LocalRollouts(config, Engine(), tokenizer=None, stop=[])  # type: ignore[arg-type]
    result = rollouts.collect(step=3, version=3)
    assert events.count("round") > 1  # dynamic sampling took extra rounds
    assert events[-1] == "free" and events.count("free") == 1
    assert {r.policy_version for r in result.records} == {3}


def test_an_evaluation_frees_the_engine_caches_before_training_goes_on(monkeypatch) -> None:
    from types import SimpleNamespace

    from agent_grpo.evaluation import in_training as evaluation

    events: list[str] = []
    summary = SimpleNamespace(success_rate=0.5, tool_call_rate=1.0)
    result = SimpleNamespace(summary=summary, samples_per_task=2, pass_at_k=0.5)

    def fake_evaluate_heldout(*args, **kwargs):  # type: ignore[no-untyped-def]
        events.append("eval")
        return result, []

    class Engine:
        def free_caches(self) -> None:
            events.append("free")

    monkeypatch.setattr(evaluation, "evaluate_heldout", fake_evaluate_heldout)
    config = TrainConfig.model_validate({"eval": {"tasks": 2, "samples": 2}})
    assert evaluation.run_eval(config, Engine(), None, [], "base") is result  # type: ignore[arg-type]
    assert events == ["eval", "free"]


def test_dynamic_sampling_keeps_groups_alive_by_an_extra_reward(monkeypatch) -> None:
    # the verifier's reward is 0 for every member, the member-index rule makes each group live
    calls: list[int] = []

    def verifier_zero(tasks: list[Task], *args, step: int, run_id: str) -> RolloutResult:
        calls.append(step)
        records = [minimal_record(f"s{step}-t{t}", i, 0.0, group_size=2)
                   for t in range(len(tasks)) for i in range(2)]  # fmt: skip
        return RolloutResult(records=records, metrics=RolloutMetrics())

    monkeypatch.setattr(train, "collect_groups", verifier_zero)
    config = TrainConfig.model_validate({
        "rollout": {"tasks_per_step": 2, "group_size": 2},
        "algo": {"dynamic_sampling": True},
        "rewards": [{"type": "rule", "name": "idx", "function": MEMBER_INDEX}],
    })  # fmt: skip
    result = train.collect(config, None, None, [], step=0)  # type: ignore[arg-type]
    assert calls == [0]  # the verifier alone says dead; the total reward says alive
    assert [r.reward for r in result.records] == [0.0, 1.0, 0.0, 1.0]
