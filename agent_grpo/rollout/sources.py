"""Where a step's rollouts come from: the trainer's own engine, or Ray rollout workers that
sample up to `algo.max_staleness` policy versions ahead of the trainer (asynchronous GRPO).

`LocalRollouts` and `RayRollouts` have one interface: `collect(step, version)` returns the
step's scored records, `push(model, version)` hands the engines the weights of policy `version`
(the number of optimizer steps taken; 0 is the policy GRPO starts from).

Asynchrony, and its bound. With `max_staleness = k`, the step-s collection is submitted when the
trainer starts step s - k, right after the weights of version s - k were pushed; a Ray actor
runs one call at a time in order, so those groups are sampled with version s - k (or newer, when
a dead worker's block is re-sent) and trained at version s: staleness at most k by construction.
Whole groups go to one worker and every record carries its sampling version; a group older than
k is dropped and counted all the same. k = 0 is synchronous: a step's groups are submitted only
after the previous update reached every worker, and the run equals the local path's.

Where we depart from common practice: AReaL, verl `fully_async` and SkyRL stream single
trajectories and may interrupt a generation for a weight update; on Ray workers we keep whole
collections per version, which keeps every group on one policy, at the cost of some idle time at
the end of a collection. `rollout.partial` carries unfinished groups across updates instead
(agent_grpo/rollout/partial.py), and with `keep_sampling` Ray actors sample while the trainer
updates, taking each push between two turns (agent_grpo/rollout/streaming.py). Weights go
through Ray's object store (one put, many gets) or a broadcast over a gloo/NCCL group of the
trainer and the actors (`rollout.workers.weight_sync`, docs/scaling.md); with LoRA only the
adapter travels.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from agent_grpo.config.jobs import TrainConfig
from agent_grpo.logs import get_logger
from agent_grpo.models.loading import resolve_model_path
from agent_grpo.rollout.adapters import adapter_state
from agent_grpo.rollout.backends.base import GenerationBackend
from agent_grpo.rollout.backends.factory import rollout_limits
from agent_grpo.rollout.collector import Collection, RolloutResult
from agent_grpo.rollout.config import RayWorkers
from agent_grpo.rollout.env_pool import EnvPool
from agent_grpo.rollout.partial import PartialCollector, StreamTask, TaskStream, oldest_first
from agent_grpo.rollout.step import collect, collector_config, score, step_tasks

__all__ = [
    "EngineScore",
    "LocalRollouts",
    "RayPartialState",
    "RayRollouts",
    "RolloutSource",
    "build_rollouts",
    "ray_init_args",
    "staleness",
]

log = get_logger("train")


@dataclass(frozen=True)
class EngineScore:
    """What one engine made of the weight canary (agent_grpo/trainer/canary.py)."""

    engine: str
    """Its name in errors (`the trainer's engine`, `rollout worker 2`)."""
    version: int | None
    """The policy version it says it holds; None when it does not track one."""
    logprobs: list[list[float]]
    """Per sequence, per token: the token's logprob given the ones before (0 off targets)."""


class RolloutSource(Protocol):
    """What the loop asks for a step's rollouts."""

    def collect(self, step: int, version: int) -> RolloutResult:
        """The step's scored groups, sampled by policy `version` or (async) older ones."""
        ...

    def push(self, model: torch.nn.Module, version: int) -> None:
        """The weights of policy `version`, to every engine that samples."""
        ...

    def score_canary(
        self, sequences: list[list[int]], targets: list[list[bool]]
    ) -> list[EngineScore]:
        """Every engine's logprobs of the canary at temperature 1, after the pushes so far."""
        ...

    def state(self) -> bytes | None:
        """What a checkpoint must keep to continue these rollouts exactly (partial rollouts'
        groups in flight); None: nothing."""
        ...

    def restore(self, state: bytes) -> None:
        """Continue from a checkpoint's `state()`."""
        ...

    def close(self) -> None:
        """Release the workers."""
        ...


def ray_init_args(workers: RayWorkers, environ: Mapping[str, str]) -> dict[str, Any]:
    """`ray.init` arguments for the configured workers: join `workers.address`, else the cluster
    in `RAY_ADDRESS` (what `ray job submit` sets for its entry point), else start a private
    local instance sized to the workers.

    The last is `address="local"`, not Ray's default: with no address, `ray.init` joins the
    cluster a `ray start` last left on this machine (its `ray_current_cluster` file), where our
    `num_cpus` fails the start, or the actors would land on someone else's cluster."""
    address = workers.address or environ.get("RAY_ADDRESS")
    if address:
        return {"address": address, "log_to_driver": False}
    return {"address": "local", "num_cpus": max(2, workers.num_workers),
            "include_dashboard": False, "log_to_driver": False}  # fmt: skip


def staleness(result: RolloutResult, version: int) -> dict[int, int]:
    """Histogram {staleness: records} of `result` trained at policy `version`."""
    out: dict[int, int] = {}
    for record in result.records:
        age = version - record.policy_version
        out[age] = out.get(age, 0) + 1
    return dict(sorted(out.items()))


class LocalRollouts:
    """Rollouts on the trainer's engine, synchronous (the default path); with `rollout.partial`
    the groups still running when a step has its groups continue into the next step."""

    def __init__(
        self,
        config: TrainConfig,
        backend: GenerationBackend,
        tokenizer: Any,
        stop: list[str],
        envs: EnvPool | None = None,
    ) -> None:
        self.config, self.backend, self.tokenizer, self.stop = config, backend, tokenizer, stop
        self.envs = envs if envs is not None else EnvPool()
        """The run's envs between episodes (`reusable` ones are reset, not built, each step);
        a pool given here is its giver's to close (the run's, which evaluations share)."""
        self._own_envs = envs is None
        self.partial: PartialCollector | None = None
        self.stream = TaskStream(config)
        if config.rollout.partial is not None:
            collection = Collection(backend, tokenizer, collector_config(config, stop),
                                    run_id=config.run.name, envs=self.envs)  # fmt: skip
            self.partial = PartialCollector(collection)

    def collect(self, step: int, version: int) -> RolloutResult:
        """`rollout.step.collect`, each record tagged with `version` (partial: the first groups
        to finish, each turn tagged with the version that sampled it); then the engine frees
        its caches."""
        if self.partial is None:
            result = collect(self.config, self.backend, self.tokenizer, self.stop, step,
                             self.envs)  # fmt: skip
            for record in result.records:
                record.policy_version = version
        else:
            per_step, partial = self.config.rollout.tasks_per_step, self.config.rollout.partial
            assert partial is not None
            if self.partial.in_flight == 0:  # a stream (re)started at `step` starts with its tasks
                self.stream.position = max(self.stream.position, step * per_step)
            admit = self.stream.take(per_step + partial.over_sample - self.partial.in_flight)
            result = score(self.config, self.partial.collect(admit, per_step, step, version))
        # Its caches are of the weights the update is about to change: let the update use that
        # memory (the `hf` loop's packed weights and prefix KV).
        self.backend.free_caches()
        return result

    def push(self, model: torch.nn.Module, version: int) -> None:
        """Nothing here: `trainer.push_weights` already updated the trainer's own engine."""

    def score_canary(
        self, sequences: list[list[int]], targets: list[list[bool]]
    ) -> list[EngineScore]:
        """The trainer's engine, which tracks no version."""
        logprobs = self.backend.score(sequences, targets, 1.0)
        return [EngineScore("the trainer's engine", None, logprobs)]

    def state(self) -> bytes | None:
        """Partial rollouts' groups in flight and the task stream's position; else None."""
        if self.partial is None:
            return None
        return pickle.dumps((self.stream.position, self.partial.state()))

    def restore(self, state: bytes) -> None:
        """Continue the groups in flight and the task stream of a checkpoint's `state()`."""
        if self.partial is None:
            raise ValueError("the checkpoint holds partial rollouts, but rollout.partial is off")
        saved = pickle.loads(state)
        if isinstance(saved, RayPartialState):
            raise ValueError("the checkpoint holds partial rollouts of Ray workers: resume "
                             "with the run's rollout.workers")  # fmt: skip
        self.stream.position, collector = saved
        self.partial.restore(collector)

    def close(self) -> None:
        """Close partial rollouts' environments in flight and the envs kept between steps; the
        engine is the trainer's."""
        if self.partial is not None:
            self.partial.close()
        if self._own_envs:
            self.envs.close()


@dataclass(frozen=True)
class RayPartialState:
    """What a checkpoint keeps of partial rollouts on Ray workers."""

    position: int
    """The task stream's position."""
    in_flight: list[StreamTask]
    """The tasks of the groups the workers held (in flight, or finished and not yet trained):
    a resumed run starts them over, so none is lost and none trains twice."""


class RayRollouts:
    """Rollouts on Ray actors (`rollout.workers`), up to `algo.max_staleness` steps ahead."""

    def __init__(self, config: TrainConfig, pool: Any, started_ray: bool = False) -> None:
        """Around a `RayRolloutPool` (or anything with its submit / wait / update_weights /
        close); `started`: this process started Ray and shuts it down on `close`."""
        self.config, self.k, self.pool, self.started_ray = (
            config, config.algo.max_staleness, pool, started_ray,
        )  # fmt: skip
        self.pending: dict[int, Any] = {}
        self.submitted = -1
        self.stream = TaskStream(config)
        """Partial rollouts' tasks, handed to the workers as their groups finish."""
        self.restored = False
        """Whether the stream came from a checkpoint (`restore`)."""

    @classmethod
    def start(cls, config: TrainConfig, model_path: str, stop: list[str]) -> RayRollouts:
        """Join the configured Ray cluster (or start a local instance) and start the actors."""
        import ray

        from agent_grpo.rollout.ray_pool import RayRolloutPool

        workers = config.rollout.workers
        assert isinstance(workers, RayWorkers)
        started = not ray.is_initialized()
        if started:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            ray.init(**ray_init_args(workers, os.environ))
        lora, partial = config.model.lora, config.rollout.partial
        if lora is not None:  # actors start from the base model; pushes set the adapter
            model_path = resolve_model_path(config.model.name_or_path)
        pool = RayRolloutPool(
            workers.num_workers, model_path, config.rollout.backend,
            collector_config(config, stop), limits=rollout_limits(config.rollout),
            num_cpus_per_worker=workers.num_cpus_per_worker,
            num_gpus_per_worker=workers.num_gpus_per_worker, resources=workers.resources,
            weight_sync=workers.weight_sync, lora=lora, adapters=config.algo.max_staleness + 1,
            keep_sampling=partial is not None and partial.keep_sampling,
        )  # fmt: skip
        return cls(config, pool, started)

    def _submit_through(self, last: int) -> None:
        """Submit every step up to `last`. Synchronous, a step is split over all workers;
        asynchronous, whole steps go to the workers in turn, so the k steps in flight sample
        at once on different actors (each actor runs one collection at a time). With partial
        rollouts every step asks every worker for its share of finished groups."""
        partial, run = self.config.rollout.partial, self.config.run.name
        for step in range(self.submitted + 1, min(last, self.config.steps - 1) + 1):
            if partial is not None:
                want, over = self.config.rollout.tasks_per_step, partial.over_sample
                self.pending[step] = self.pool.submit_partial(self.stream, want, over, step, run)
            else:
                workers = None if self.k == 0 else [step]
                self.pending[step] = self.pool.submit(step_tasks(self.config, step), step, run,
                                                      workers)  # fmt: skip
            self.submitted = step

    def collect(self, step: int, version: int) -> RolloutResult:
        """The step's groups (submitting the next `k` steps' first), scored; groups sampled
        more than `k` versions ago are dropped and counted in `metrics.stale_dropped`. Partial
        rollouts drop none: a carried group's turns older than `k` are masked per token by the
        trainer instead (agent_grpo/algo/staleness.py)."""
        if self.submitted < step - 1:  # a resumed run starts submitting (and streaming) here
            self.submitted = step - 1
            if not self.restored:
                self.stream.position = step * self.config.rollout.tasks_per_step
        self._submit_through(step + self.k)
        result = score(self.config, self.pool.wait(self.pending.pop(step)))
        if self.config.rollout.partial is not None:
            return result
        fresh = [r for r in result.records if version - r.policy_version <= self.k]
        dropped = len(result.records) - len(fresh)
        if dropped:
            log.warning("step %d: dropped %d records sampled more than %d versions ago",
                        step, dropped, self.k)  # fmt: skip
        if not fresh:
            raise RuntimeError(f"step {step}: every group was staler than {self.k} versions")
        result.records = fresh
        result.metrics.stale_dropped = dropped
        return result

    def push(self, model: torch.nn.Module, version: int) -> None:
        """The weights (with LoRA, the adapter's tensors alone) to every actor, by
        `rollout.workers.weight_sync`; each loads them after its queued work (with
        `keep_sampling`, before its next turn)."""
        lora = self.config.model.lora is not None
        self.pool.update_weights(adapter_state(model) if lora else model.state_dict(), version)

    def score_canary(
        self, sequences: list[list[int]], targets: list[list[bool]]
    ) -> list[EngineScore]:
        """Every actor's score, each queued behind its submitted collections and the push (so
        this waits for them); with `keep_sampling`, between two of its turns, after the push."""
        scores = self.pool.score(sequences, targets)
        return [EngineScore(f"rollout worker {i}", v, lp) for i, (v, lp) in enumerate(scores)]

    def state(self) -> bytes | None:
        """Partial rollouts: the stream's position and the tasks of the groups the workers
        held (`RayPartialState`; their token trees stay on the actors, so a resume starts them
        over). Otherwise nothing: the collections in flight are resubmitted on resume."""
        if self.config.rollout.partial is None:
            return None
        # the tasks a resumed run has not handed out again yet are as much in flight
        in_flight = oldest_first(self.stream.requeued + self.pool.held_tasks())
        return pickle.dumps(RayPartialState(self.stream.position, in_flight))

    def restore(self, state: bytes) -> None:
        """Continue the task stream of a checkpoint's `state()`, the groups in flight first."""
        if self.config.rollout.partial is None:
            raise ValueError("the checkpoint holds partial rollouts, but rollout.partial is off")
        saved = pickle.loads(state)
        if not isinstance(saved, RayPartialState):
            raise ValueError("the checkpoint holds partial rollouts of the trainer's own engine: "
                             "resume without rollout.workers")  # fmt: skip
        self.stream.position, self.stream.requeued = saved.position, list(saved.in_flight)
        self.restored = True

    def close(self) -> None:
        """End the actors (and the local Ray instance this started)."""
        self.pool.close()
        if self.started_ray:
            import ray

            ray.shutdown()


def build_rollouts(
    config: TrainConfig, backend: GenerationBackend, tokenizer: Any, stop: list[str],
    model_path: str, envs: EnvPool | None = None,
) -> RolloutSource:  # fmt: skip
    """The rollout source `rollout.workers` asks for; rollouts on the trainer's engine take
    their envs from `envs` (the run's pool) where given (Ray workers keep their own)."""
    if isinstance(config.rollout.workers, RayWorkers):
        return RayRollouts.start(config, model_path, stop)
    return LocalRollouts(config, backend, tokenizer, stop, envs)
