"""Partial rollouts: groups carried across weight updates, each turn tagged with its sampler's
version, the stream of tasks, and the groups in flight kept by a checkpoint."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_grpo.algo.staleness import within_staleness
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.rollout.backends.base import SamplingConfig
from agent_grpo.rollout.collector import Collection, CollectOptions, Task, collect_groups
from agent_grpo.rollout.config import RolloutConfig
from agent_grpo.rollout.partial import PartialCollector, StreamTask, TaskStream
from agent_grpo.rollout.step import step_tasks
from agent_grpo.testing.backends import SeededFinal
from agent_grpo.testing.envs import long_tail_seeds as seeds_taking
from agent_grpo.trainer.batch import pack_records, token_versions
from agent_grpo.trajectory.record import TrajectoryRecord

ENV = "agent_grpo.testing.envs:LongTailEnv"


def collector(tokenizer: Any, group_size: int = 2) -> PartialCollector:
    options = CollectOptions.from_config(
        RolloutConfig(group_size=group_size, sampling=SamplingConfig(max_tokens=16))
    )
    # every turn answers `Answer: <seed % 10>`: what an episode samples depends on its seeds only
    return PartialCollector(Collection(SeededFinal(tokenizer, []), tokenizer, options))


def stream(step: int, seeds: list[int]) -> list[StreamTask]:
    return [StreamTask(step, i, Task(env_id=ENV, seed=s)) for i, s in enumerate(seeds)]


def test_a_step_takes_the_oldest_finished_groups_and_carries_the_rest(tokenizer) -> None:
    partial = collector(tokenizer)
    first = partial.collect(stream(0, seeds_taking([6, 1, 2])), want=2, step=0, version=0)
    assert [r.group_id for r in first.records] == ["s0-t1", "s0-t1", "s0-t2", "s0-t2"]
    assert first.metrics.in_flight_groups == 1  # the 6-turn group, 2 turns in
    assert {r.step for r in first.records} == {0}
    second = partial.collect(stream(1, seeds_taking([1, 1])), want=2, step=1, version=1)
    assert [r.group_id for r in second.records][::2] == ["s1-t0", "s1-t1"]
    third = partial.collect([], want=1, step=2, version=2)  # runs until the long one ends
    assert [r.group_id for r in third.records] == ["s0-t0", "s0-t0"] and third.records[0].step == 2
    for record in third.records:
        # step 0's two turns, step 1's one, then the rest at version 2: each keeps its own
        assert [t.policy_version for t in record.turns] == [0, 0, 1, 2, 2, 2]
        assert record.policy_version == 0  # the first turn's: the group's, every member's
    assert partial.in_flight == 0


def test_partial_collection_samples_what_a_whole_collection_does(tokenizer) -> None:
    seeds = seeds_taking([6, 1, 2, 1, 6, 2])
    partial = collector(tokenizer)
    got: dict[str, TrajectoryRecord] = {}
    admit = stream(0, seeds[:3]) + stream(1, seeds[3:])
    for step in range(6):
        result = partial.collect(admit if step == 0 else [], want=1, step=step, version=step)
        got.update({r.uid: r for r in result.records})
    options = collector(tokenizer).collection.config
    whole = [
        *collect_groups(
            [t.task for t in stream(0, seeds[:3])], SeededFinal(tokenizer, []), tokenizer, options
        ).records,
        *collect_groups(
            [t.task for t in stream(1, seeds[3:])], SeededFinal(tokenizer, []), tokenizer,
            options, step=1,
        ).records,
    ]  # fmt: skip
    assert sorted(got) == sorted(r.uid for r in whole)
    for record in whole:  # the same ids, messages and rewards, whenever each was taken
        mine = got[record.uid]
        assert mine.token_ids == record.token_ids and mine.provenance == record.provenance
        assert mine.messages == record.messages and mine.reward == record.reward


def test_a_restored_collector_continues_the_groups_in_flight(tokenizer) -> None:
    seeds = seeds_taking([6, 1, 6, 2])
    partial = collector(tokenizer)
    partial.collect(stream(0, seeds), want=2, step=0, version=0)
    assert partial.in_flight == 2
    state = partial.state()
    restored = collector(tokenizer)
    restored.restore(state)
    for step in (1, 2, 3, 4, 5):
        want = partial.collect([], want=1, step=step, version=step)
        got = restored.collect([], want=1, step=step, version=step)
        # the envs were replayed to where they were: an env restarted from its reset would end
        # its episode turns later, and these would differ
        assert [_timeless(r) for r in got.records] == [_timeless(r) for r in want.records]
    assert partial.in_flight == restored.in_flight == 0


def _timeless(record: TrajectoryRecord) -> dict[str, Any]:
    """Everything a record holds but the env's wall-clock latencies."""
    return record.model_dump(exclude={"turns": {"__all__": {"env_latency_s"}}})


def test_the_task_stream_runs_through_the_steps_tasks_in_order() -> None:
    config = TrainConfig.model_validate({"rollout": {"tasks_per_step": 3}})
    tasks = TaskStream(config)
    head, tail = tasks.take(4), tasks.take(3)
    assert [(t.step, t.index) for t in head + tail] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)
    ]  # fmt: skip
    assert [t.task for t in head[:3]] == step_tasks(config, 0)
    assert [t.task for t in head[3:] + tail[:2]] == step_tasks(config, 1)
    assert tasks.position == 7 and TaskStream(config, 7).take(1)[0].task == step_tasks(config, 2)[1]


def test_requeued_tasks_are_handed_out_first_and_the_stream_goes_on_after_them() -> None:
    config = TrainConfig.model_validate(
        {"env": {"id": ENV}, "rollout": {"tasks_per_step": 2}}
    )  # fmt: skip
    tasks = TaskStream(config, position=3)
    again = [StreamTask(0, 1, step_tasks(config, 0)[1]), StreamTask(1, 0, step_tasks(config, 1)[0])]
    tasks.requeued = list(again)
    first = tasks.take(1)
    assert first == again[:1] and tasks.position == 3
    rest = tasks.take(2)
    assert rest[0] == again[1] and (rest[1].step, rest[1].index) == (1, 1)
    assert tasks.position == 4 and tasks.requeued == []


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lengths=st.lists(st.sampled_from([1, 2, 6]), min_size=2, max_size=8),
    per_step=st.integers(1, 3),
    over=st.integers(1, 3),
    k=st.integers(0, 2),
)
def test_every_group_is_trained_once_and_no_trained_token_is_staler_than_the_bound(
    tokenizer, lengths: list[int], per_step: int, over: int, k: int
) -> None:
    seeds = seeds_taking(lengths)
    queue = stream(0, seeds)  # one stream; groups admitted as the in-flight ones are taken
    partial, taken, step = collector(tokenizer, group_size=1), [], 0
    while queue or partial.in_flight:
        admit, queue = (
            queue[: per_step + over - partial.in_flight],
            queue[per_step + over - partial.in_flight :],
        )
        result = partial.collect(admit, want=min(per_step, partial.in_flight + len(admit)),
                                 step=step, version=step)  # fmt: skip
        assert partial.in_flight <= over or not queue
        records = result.records
        taken += [r.group_id for r in records]
        for record in records:
            assert record.termination is not None and record.step == step
            versions = [t.policy_version for t in record.turns]
            assert versions == sorted(versions) and versions[-1] <= step
            assert record.policy_version == versions[0]
        if records:
            batch = pack_records(records, tokenizer.pad_token_id)
            fresh = within_staleness(token_versions(records, batch.input_ids.shape[1]), step, k)
            trained = batch.loss_mask & fresh
            for b, record in enumerate(records):  # one row each: nothing here forks
                want = [
                    t for turn in record.turns if step - turn.policy_version <= k
                    for t in range(turn.token_start, turn.token_end)
                ]  # fmt: skip
                assert trained[b].nonzero().flatten().tolist() == want
        step += 1
    assert sorted(taken) == sorted(f"s0-t{i}" for i in range(len(seeds)))  # each exactly once
