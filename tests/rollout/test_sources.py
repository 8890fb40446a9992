"""Where a step's rollouts come from: the local engine frees its caches once a collection ends;
Ray workers join the configured cluster, or a private local instance, never a stray one; a
checkpoint's partial rollouts resume only on the kind of source that wrote them."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from agent_grpo.config.jobs import TrainConfig
from agent_grpo.rollout import step as rollout_step
from agent_grpo.rollout.collector import RolloutMetrics, RolloutResult, Task
from agent_grpo.rollout.config import RayWorkers
from agent_grpo.rollout.partial import StreamTask
from agent_grpo.rollout.sources import LocalRollouts, RayRollouts, ray_init_args
from agent_grpo.testing.backends import ScriptedBackend
from agent_grpo.testing.records import minimal_record


def test_the_local_engine_frees_its_caches_once_the_whole_collection_is_done(monkeypatch) -> None:
    events: list[str] = []

    def fake_collect_groups(tasks: list[Task], *args, step: int, **kwargs) -> RolloutResult:
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


@pytest.mark.parametrize(
    ("address", "environ", "joins"),
    [
        ("head:6379", {}, "head:6379"),
        ("head:6379", {"RAY_ADDRESS": "other:6379"}, "head:6379"),  # the config wins
        (None, {"RAY_ADDRESS": "job:6379"}, "job:6379"),  # as under `ray job submit`
        (None, {"RAY_ADDRESS": ""}, None),
        (None, {}, None),
    ],
)
def test_workers_join_the_named_cluster_or_start_their_own(
    address: str | None, environ: dict[str, str], joins: str | None
) -> None:
    args = ray_init_args(RayWorkers(num_workers=3, address=address), environ)
    if joins is None:  # a private instance, sized to the workers
        assert args["address"] == "local" and args["num_cpus"] == 3
    else:  # a cluster's size is its own: Ray refuses num_cpus when joining one
        assert args["address"] == joins and "num_cpus" not in args


@pytest.mark.slow
def test_a_cluster_left_by_ray_start_is_not_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ray start` records its cluster in RAY_TMPDIR/ray/ray_current_cluster, which a plain
    `ray.init()` joins: here that address is dead, so only a new local instance starts."""
    ray = pytest.importorskip("ray")
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths
    try:
        (temp / "ray").mkdir()
        (temp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
        monkeypatch.setenv("RAY_TMPDIR", str(temp))
        monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        ray.init(**ray_init_args(RayWorkers(num_workers=2), {}))
        try:
            assert ray.cluster_resources()["CPU"] == 2
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(temp, ignore_errors=True)


class HeldPool:
    """What `RayRollouts.state` asks of a pool: the tasks its workers hold."""

    def __init__(self, held: list[StreamTask]) -> None:
        self.held = held

    def held_tasks(self) -> list[StreamTask]:
        return self.held


def test_partial_rollouts_resume_on_the_kind_of_source_that_wrote_them(tokenizer) -> None:
    partial = {"rollout": {"partial": {}, "workers": {"type": "ray", "num_workers": 1}}}
    config = TrainConfig.model_validate(partial)
    held = [StreamTask(0, 1, Task(env_id=config.env.id, seed=7))]
    ray = RayRollouts(config, HeldPool(held))
    ray.stream.position = 5
    state = ray.state()
    assert state is not None
    again = RayRollouts(config, HeldPool([]))
    again.restore(state)
    assert (again.stream.position, again.stream.requeued) == (5, held)
    # a checkpoint before the requeued tasks were all handed out again keeps the rest
    later = StreamTask(1, 0, Task(env_id=config.env.id, seed=8))
    again.pool = HeldPool([later])
    resumed = RayRollouts(config, HeldPool([]))
    resumed.restore(again.state() or b"")
    assert resumed.stream.requeued == [*held, later]
    with pytest.raises(ValueError, match=r"rollout\.partial is off"):
        RayRollouts(TrainConfig.model_validate({}), HeldPool([])).restore(state)
    local_config = TrainConfig.model_validate({"rollout": {"partial": {}}})
    local = LocalRollouts(local_config, ScriptedBackend(tokenizer, ["x"]), tokenizer, [])
    with pytest.raises(ValueError, match="partial rollouts of Ray workers"):
        local.restore(state)
    with pytest.raises(ValueError, match="partial rollouts of the trainer's own engine"):
        again.restore(local.state() or b"")
