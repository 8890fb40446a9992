"""Where a step's rollouts come from: the local engine frees its caches once a collection ends."""

from __future__ import annotations

from agent_grpo.config.jobs import TrainConfig
from agent_grpo.rollout import step as rollout_step
from agent_grpo.rollout.collector import RolloutMetrics, RolloutResult, Task
from agent_grpo.rollout.sources import LocalRollouts
from agent_grpo.testing.records import minimal_record


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

    monkeypatch.setattr(rollout_step, "collect_groups", fake_collect_groups)
    config = TrainConfig.model_validate({
        "rollout": {"tasks_per_step": 4, "group_size": 2},
        "algo": {"dynamic_sampling": True, "dynamic_sampling_max_rounds": 10},
    })  # fmt: skip
    rollouts = LocalRollouts(config, Engine(), tokenizer=None, stop=[])  # type: ignore[arg-type]
    result = rollouts.collect(step=3, version=3)
    assert events.count("round") > 1  # dynamic sampling took extra rounds
    assert events[-1] == "free" and events.count("free") == 1
    assert {r.policy_version for r in result.records} == {3}
