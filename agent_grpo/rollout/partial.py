"""Partial rollouts (`rollout.partial`): a weight update does not wait for the episodes in flight.

An engine keeps `tasks_per_step + over_sample` groups in flight. A step takes the first
`tasks_per_step` groups to finish (oldest first); the others stay in flight and continue from
where they are on the weights the step then pushes, so one long episode no longer holds a whole
step back. Every turn records the policy version that sampled it (`TurnRecord.policy_version`);
the trainer trains a token only while it is at most `algo.max_staleness` versions old
(`agent_grpo/algo/staleness.py`), with the decoupled objective's correction per token, and keeps
older turns as context.

Tasks come from one stream (`TaskStream`), step 0's tasks then step 1's and so on (`step_tasks`, a
pure function of the seed): a group keeps the id and the sampling seeds of the step whose tasks
it came from (`s{step}-t{i}`), and its records carry the step that trained them.

Here a worker runs turns only inside a step's call. On Ray workers `keep_sampling` runs them on
a loop of the worker's own instead, between calls too, loading each push between two turns as it
arrives (`agent_grpo/rollout/streaming.py`).

Where we depart from peers: AReaL and verl's fully asynchronous mode can interrupt a generation
mid-turn; here weights change only between turns (one turn is one backend call for every episode
in flight), so each turn is one policy's sample. Kimi k1.5 cuts long generations at a token
budget; here a group is carried whole, and only the trained tokens are bounded. A carried turn's
KV is recomputed with the new weights at its next turn (the engines drop their caches on a push).

A checkpoint keeps the groups in flight (`PartialCollector.state`): episodes as their token trees
and turns, their environments rebuilt on restore by replaying the episode's actions on a fresh
instance (environments are deterministic given seed and actions, as the collector's retry
already assumes), so a resumed run continues the run that never died.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from agent_grpo.config.jobs import TrainConfig
from agent_grpo.rollout.collector import Collection, RolloutResult, Task, finish_metrics, replay_env
from agent_grpo.rollout.step import step_tasks

__all__ = ["PartialCollector", "StreamTask", "TaskStream", "oldest_first"]


@dataclass(frozen=True)
class StreamTask:
    """One task of the training stream and where it came from."""

    step: int
    """The step whose tasks it is one of (its group id and sampling seeds say so)."""
    index: int
    """Its place among that step's tasks."""
    task: Task
    """The task."""


def oldest_first(tasks: Iterable[StreamTask]) -> list[StreamTask]:
    """`tasks` in stream order: by the step they came from, then their place in it."""
    return sorted(tasks, key=lambda t: (t.step, t.index))


class TaskStream:
    """The training tasks in order, step 0's then step 1's and so on; `take` hands out the next
    ones. Its `position` and the tasks handed back (`requeued`) are all a checkpoint needs to
    continue it."""

    def __init__(self, config: TrainConfig, position: int = 0) -> None:
        self.config, self.position = config, position
        self.requeued: list[StreamTask] = []
        """Tasks handed out and given back to start over (a checkpoint's groups in flight on
        Ray workers); `take` hands them out first, oldest first."""

    def take(self, count: int) -> list[StreamTask]:
        """The next `count` tasks: the requeued ones first, then the stream's."""
        count = max(0, count)
        out, self.requeued = self.requeued[:count], self.requeued[count:]
        per_step, fresh = self.config.rollout.tasks_per_step, count - len(out)
        for p in range(self.position, self.position + fresh):
            step, index = divmod(p, per_step)
            out.append(StreamTask(step, index, step_tasks(self.config, step)[index]))
        self.position += fresh
        return out


class PartialCollector:
    """A collection kept across weight updates: groups are admitted, run until enough have
    finished, and taken; the rest stay in flight (one engine's, or one Ray actor's)."""

    def __init__(self, collection: Collection) -> None:
        self.collection = collection

    @property
    def in_flight(self) -> int:
        """Groups admitted and not yet taken."""
        return len(self.collection.groups)

    def collect(
        self, admit: Sequence[StreamTask], want: int, step: int, version: int
    ) -> RolloutResult:
        """Admit `admit`, run turns (tagged `version`) until `want` groups have finished, and
        take the oldest `want` of them as records of `step`; the metrics are this call's."""
        started = time.perf_counter()
        for item in admit:
            self.collection.admit([item.task], item.step, first_index=item.index)
        while len(self.collection.finished()) < want and self.collection.run_turn(version):
            pass
        result = self.collection.take(self.collection.finished()[:want], step)
        finish_metrics(result, time.perf_counter() - started)
        result.metrics.in_flight_groups = self.in_flight
        return result

    def state(self) -> bytes:
        """The groups in flight, for a checkpoint (their environments are not kept)."""
        groups = {
            group: [dataclasses.replace(ep, env=None) for ep in members]
            for group, members in self.collection.groups.items()
        }
        buffer = io.BytesIO()
        _TokenizerPickler(buffer, self.collection.tokenizer).dump(groups)
        return buffer.getvalue()

    def restore(self, state: bytes) -> None:
        """Continue from `state`: its groups in flight, each unfinished episode's environment
        rebuilt by replaying its actions."""
        self.collection.close()
        groups = _TokenizerUnpickler(io.BytesIO(state), self.collection.tokenizer).load()
        for members in groups.values():
            for ep in members:
                if not ep.done:
                    ep.env = replay_env(ep, self.collection.envs)
        self.collection.groups = groups

    def close(self) -> None:
        """Close the environments still in flight."""
        self.collection.close()


class _TokenizerPickler(pickle.Pickler):
    """Pickles episodes without their tokenizer (the restoring run supplies its own)."""

    def __init__(self, file: io.BytesIO, tokenizer: Any) -> None:
        super().__init__(file)
        self.tokenizer = tokenizer

    def persistent_id(self, obj: Any) -> str | None:
        return "tokenizer" if obj is self.tokenizer else None


class _TokenizerUnpickler(pickle.Unpickler):
    """Unpickles episodes, handing them this run's tokenizer."""

    def __init__(self, file: io.BytesIO, tokenizer: Any) -> None:
        super().__init__(file)
        self.tokenizer = tokenizer

    def persistent_load(self, pid: Any) -> Any:
        if pid != "tokenizer":
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return self.tokenizer
