"""Asynchronous GRPO's bound: whatever the workers' speeds, no group is trained more
than `max_staleness` versions after it was sampled, and every group is sampled by one version.

`FifoPool` stands in for `RayRolloutPool` with what Ray guarantees: each actor runs its calls
one at a time, in submission order (a weight load queued before a collection happens before
it). When each actor gets to its queue is random (hypothesis draws the speeds), and a worker can
die with its queue, its blocks going to a survivor, as `RayRolloutPool.wait` does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_grpo.config.jobs import TrainConfig
from agent_grpo.rollout.collector import RolloutMetrics, RolloutResult, Task
from agent_grpo.rollout.sources import RayRollouts, staleness
from agent_grpo.testing.records import minimal_record
from agent_grpo.trajectory.record import Provenance

# A group of three one-prompt-token, two-model-token episodes.
EPISODE = {
    "group_size": 3,
    "token_ids": [5, 6, 7],
    "provenance": [Provenance.PROMPT, Provenance.MODEL, Provenance.MODEL],
}


@dataclass
class Actor:
    """One FIFO worker: a queue of ("load", version) and ("collect", key) calls."""

    queue: list[tuple[str, Any]] = field(default_factory=list)
    version: int = 0
    done: dict[Any, int] = field(default_factory=dict)  # collect key -> version it sampled with
    alive: bool = True

    def run_one(self) -> None:
        kind, value = self.queue.pop(0)
        if kind == "load":
            self.version = value
        else:
            self.done[value] = self.version


class FifoPool:
    """`submit` / `wait` / `update_weights` / `close` over FIFO actors run at random times."""

    def __init__(self, workers: int, group_size: int, rng: random.Random, kill_at: int | None):
        self.actors = [Actor() for _ in range(workers)]
        self.group_size, self.rng, self.kill_at = group_size, rng, kill_at
        self.failures = 0

    def _progress(self) -> None:  # some actors get some work done, at random
        for actor in self.actors:
            while actor.alive and actor.queue and self.rng.random() < 0.5:
                actor.run_one()

    def submit(
        self, tasks: list[Task], step: int, run_id: str, workers: list[int] | None = None
    ) -> Any:
        self._progress()
        chosen = [w % len(self.actors) for w in workers] if workers else range(len(self.actors))
        blocks = [(list(chosen)[i % len(chosen)], i) for i in range(len(tasks))]
        for worker, task in blocks:
            self.actors[worker].queue.append(("collect", (step, task)))
        if self.kill_at == step:  # the worker holding task 0 dies with its queue
            self.actors[blocks[0][0]].alive = False
        return step, blocks

    def wait(self, pending: Any) -> RolloutResult:
        step, blocks = pending
        records = []
        for worker, task in blocks:
            actor = self.actors[worker]
            if not actor.alive:  # re-send to a survivor, behind its queued work
                self.failures += 1
                actor = next(a for a in self.actors if a.alive)
                actor.queue.append(("collect", (step, task)))
            while (step, task) not in actor.done:
                actor.run_one()
            version = actor.done[(step, task)]
            for i in range(self.group_size):
                r = minimal_record(f"s{step}-t{task}", i, float(i), **EPISODE)
                r.policy_version = version
                records.append(r)
        return RolloutResult(records=records, metrics=RolloutMetrics())

    def update_weights(self, state_dict: Any, version: int) -> None:
        self._progress()
        for actor in self.actors:
            actor.queue.append(("load", version))

    def close(self) -> None:
        """Nothing to release."""


class Weights:
    """A model stand-in: `push` only asks for a state dict."""

    def state_dict(self) -> dict[str, Any]:
        return {}


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(0, 3),
    workers=st.integers(1, 3),
    steps=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    kill=st.booleans(),
)
def test_no_group_is_staler_than_the_bound(
    k: int, workers: int, steps: int, seed: int, kill: bool
) -> None:
    config = TrainConfig.model_validate({
        "steps": steps, "rollout": {"tasks_per_step": 3, "group_size": 2,
                                    "workers": {"type": "ray", "num_workers": workers}},
        "algo": {"max_staleness": k},
    })  # fmt: skip
    rng = random.Random(seed)
    pool = FifoPool(workers, 2, rng, kill_at=rng.randrange(steps) if kill and workers > 1 else None)
    rollouts = RayRollouts(config, pool)
    rollouts.push(Weights(), 0)
    for step in range(steps):
        result = rollouts.collect(step, version=step)
        ages = staleness(result, step)
        assert all(0 <= age <= k for age in ages), ages  # the bound, by construction
        assert result.metrics.stale_dropped == 0
        versions: dict[str, set[int]] = {}
        for r in result.records:
            versions.setdefault(r.group_id, set()).add(r.policy_version)
        assert all(len(v) == 1 for v in versions.values())  # one policy per group
        assert len(result.records) == 3 * 2  # every group came back, a dead worker's too
        if k == 0:
            assert ages == {0: 6}  # synchronous: sampled by the policy being trained
        rollouts.push(Weights(), step + 1)


def test_max_staleness_needs_workers_or_partial_rollouts() -> None:
    with pytest.raises(ValueError, match=r"only rollout workers .* or partial rollouts"):
        TrainConfig.model_validate({"algo": {"max_staleness": 1}})
    TrainConfig.model_validate({"algo": {"max_staleness": 1}, "rollout": {"partial": {}}})
