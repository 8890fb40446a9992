"""Rollouts on Ray: each worker is an actor with its own model, generation backend and envs.

`RayRolloutPool.collect(tasks, step)` deals whole tasks (a task's G samples stay on one worker,
so a group never straddles two policies' weights) in contiguous blocks to the workers, runs
`collect_groups` in each, and returns the records in task order with the group ids a single
`collect_groups` call would give. Sampling seeds come from (seed, step, task, index, turn) in the
collector, so which worker ran a task does not change its trajectory. `update_weights` puts the
state dict in the object store once; every actor loads that one copy.

Ray is imported only when a pool is built: the single-process path (`collect_groups` with a
backend in the trainer process) stays the default and needs no Ray. The caller owns `ray.init`
(`address="auto"` on a cluster); the pool never starts or stops a cluster.

Where we depart from common practice:
- Workers are whole rollout processes (model + backend + environments), not remote generation
  servers with environments left in the trainer (verl, OpenRLHF): tool calls run next to the model
  that issued them, and a worker needs only the model directory and the env registry.
- Blocks are balanced by task count, not by expected tokens (every task has G samples; lengths
  are unknown in advance). Metrics of a collection add up counts; times are the slowest worker's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agent_grpo.models.loading import load_model, load_tokenizer
from agent_grpo.rollout.backends.factory import EngineLimits, build_backend, rollout_limits
from agent_grpo.rollout.collector import (
    CollectOptions,
    RolloutMetrics,
    RolloutResult,
    Task,
    collect_groups,
)
from agent_grpo.rollout.config import BackendConfig, HFBackendConfig, RolloutConfig
from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = ["PendingCollection", "RayRolloutPool", "RolloutWorker", "merge_metrics", "split_tasks"]


def split_tasks(num_tasks: int, num_workers: int) -> list[range]:
    """Contiguous blocks of task indices, sizes differing by at most one (empty ones dropped)."""
    base, extra = divmod(num_tasks, num_workers)
    blocks, start = [], 0
    for w in range(num_workers):
        stop = start + base + (w < extra)
        blocks.append(range(start, stop))
        start = stop
    return [b for b in blocks if len(b)]


def _group_id(step: int, task_index: int) -> str:
    """`collect_groups`' group id of task `task_index` of a call (kept in step with collector)."""
    return f"s{step}-t{task_index}"


def _renumber(
    records: Sequence[TrajectoryRecord], step: int, first_task: int, group_size: int
) -> list[TrajectoryRecord]:
    """Give a block's records the group ids of their tasks' places in the whole task list."""
    out = []
    for j, record in enumerate(records):
        group = _group_id(step, first_task + j // group_size)
        members = [f"{group}/{i}" for i in range(record.group_size)]
        out.append(record.model_copy(update={"group_id": group, "group_member_ids": members}))
    return out


def merge_metrics(parts: Sequence[RolloutMetrics], wall_time_s: float) -> RolloutMetrics:
    """One collection's metrics from its workers': counts add up, times are the slowest's."""
    trajectories = sum(p.trajectories for p in parts)
    generated = sum(p.generated_tokens for p in parts)
    turns = sum(p.turns_mean * p.trajectories for p in parts)
    return RolloutMetrics(
        trajectories=trajectories,
        generated_tokens=generated,
        model_time_s=max((p.model_time_s for p in parts), default=0.0),
        env_time_s=max((p.env_time_s for p in parts), default=0.0),
        wall_time_s=wall_time_s,
        tokens_per_s=generated / max(wall_time_s, 1e-9),
        turns_mean=turns / max(1, trajectories),
        tool_calls=sum(p.tool_calls for p in parts),
        tool_errors=sum(p.tool_errors for p in parts),
        truncated=sum(p.truncated for p in parts),
        errors=sum(p.errors for p in parts),
        reused_prefix_tokens=sum(p.reused_prefix_tokens for p in parts),
        env_retries=sum(p.env_retries for p in parts),
        env_failures=sum(p.env_failures for p in parts),
        worker_failures=sum(p.worker_failures for p in parts),
    )


class RolloutWorker:
    """One rollout process: model, backend and collector settings (what each actor holds)."""

    def __init__(
        self,
        model_path: str,
        backend: BackendConfig,
        collector: CollectOptions,
        limits: EngineLimits,
        dtype: str = "float32",
    ) -> None:
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_model(model_path, dtype=getattr(torch, dtype))
        self.backend = build_backend(backend, self.model, self.tokenizer, model_path, None, limits)
        self.collector = collector
        self.version = 0
        """The policy version of the weights this worker samples with (see `update_weights`)."""

    def collect(self, tasks: list[Task], step: int, run_id: str) -> RolloutResult:
        """`collect_groups` over these tasks, numbered from 0 (the pool renumbers groups); every
        record is tagged with this worker's policy version. An actor runs one call at a time, so
        a collection never straddles a weight update."""
        result = collect_groups(
            tasks, self.backend, self.tokenizer, self.collector, step=step, run_id=run_id
        )
        for record in result.records:
            record.policy_version = self.version
        self.backend.free_caches()  # the trainer's update, on this machine too, needs the memory
        return result

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int = 0) -> None:
        """Load new weights into the model, then hand them to the backend (drops its caches)."""
        self.model.load_state_dict(dict(state_dict))
        self.backend.update_weights(self.model)
        self.version = version

    def score(
        self, sequences: list[list[int]], targets: list[list[bool]]
    ) -> tuple[int, list[list[float]]]:
        """The version this worker holds and its backend's logprobs of `sequences` at
        temperature 1 (the weight canary)."""
        return self.version, self.backend.score(sequences, targets, 1.0)

    def ping(self) -> bool:
        """Alive (for tests and health checks)."""
        return True

    def close(self) -> None:
        """Release the backend."""
        self.backend.close()


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise ImportError("RayRolloutPool needs Ray: pip install 'agent-grpo[ray]'") from error
    return ray


@dataclass
class PendingCollection:
    """A collection handed to the workers and not yet returned."""

    tasks: list[Task]
    """Every task of the collection, in order."""
    step: int
    """The step the groups are for."""
    run_id: str
    """Run id stamped on the records."""
    blocks: list[range]
    """The task indices each worker got."""
    futures: list[Any]
    """Ray object refs of each block's `RolloutResult`."""
    started: float
    """`time.perf_counter()` at submission."""


class RayRolloutPool:
    """`num_workers` Ray actors that collect groups in parallel; call `ray.init` first."""

    def __init__(
        self,
        num_workers: int,
        model_path: str,
        backend: BackendConfig | None = None,
        collector: CollectOptions | None = None,
        *,
        limits: EngineLimits | None = None,
        dtype: str = "float32",
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float = 0.0,
    ) -> None:
        ray = _import_ray()
        if not ray.is_initialized():
            raise RuntimeError("call ray.init() (or ray.init(address='auto')) before the pool")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._ray = ray
        defaults = RolloutConfig()
        collector = collector or CollectOptions.from_config(defaults)
        # A progress display inside an actor is only noise in the driver's log.
        self.collector = dataclasses.replace(collector, show_progress=False)
        limits = limits or rollout_limits(defaults)
        actor = ray.remote(num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker)(
            RolloutWorker
        )
        self.workers = [
            actor.options(scheduling_strategy="SPREAD").remote(
                model_path, backend or HFBackendConfig(), self.collector, limits, dtype
            )
            for _ in range(num_workers)
        ]

    def collect(self, tasks: Sequence[Task], step: int = 0, run_id: str = "") -> RolloutResult:
        """Every task's group, collected across the workers; records in task order."""
        return self.wait(self.submit(tasks, step, run_id))

    def submit(
        self,
        tasks: Sequence[Task],
        step: int = 0,
        run_id: str = "",
        workers: Sequence[int] | None = None,
    ) -> PendingCollection:
        """Start collecting on `workers` (indices; default all); `wait` returns the result.
        Calls queue on each actor in order, so a collection submitted before an
        `update_weights` samples with the older weights."""
        chosen = [self.workers[i % len(self.workers)] for i in workers or range(len(self.workers))]
        blocks = split_tasks(len(tasks), len(chosen))
        futures = [
            worker.collect.remote([tasks[i] for i in block], step, run_id)
            for worker, block in zip(chosen, blocks, strict=False)
        ]
        return PendingCollection(list(tasks), step, run_id, blocks, futures, time.perf_counter())

    def wait(self, pending: PendingCollection) -> RolloutResult:
        """The submitted collection's result. A block whose worker died (its actor killed, its
        node gone) is sent again to a surviving worker; `metrics.worker_failures` counts it."""
        results: list[RolloutResult] = []
        failures = 0
        for block, future in zip(pending.blocks, pending.futures, strict=True):
            while True:
                try:
                    results.append(self._ray.get(future))
                    break
                except self._ray.exceptions.RayActorError:
                    failures += 1
                    future = self._resend(pending, block)
        records: list[TrajectoryRecord] = []
        for block, result in zip(pending.blocks, results, strict=True):
            records += _renumber(result.records, pending.step, block.start,
                                 self.collector.group_size)  # fmt: skip
        wall = time.perf_counter() - pending.started
        metrics = merge_metrics([r.metrics for r in results], wall)
        metrics.worker_failures = failures
        return RolloutResult(records=records, metrics=metrics)

    def _resend(self, pending: PendingCollection, block: range) -> Any:
        """Drop dead workers and give `block` to a live one (the least recently handed one)."""
        alive = []
        for worker in self.workers:
            try:
                self._ray.get(worker.ping.remote(), timeout=60)
                alive.append(worker)
            except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
                continue
        if not alive:
            raise RuntimeError("every rollout worker died")
        self.workers = alive
        worker = alive[block.start % len(alive)]
        tasks = [pending.tasks[i] for i in block]
        return worker.collect.remote(tasks, pending.step, pending.run_id)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int = 0) -> None:
        """Send new weights, tagged `version`, to every worker: one object-store copy that every
        actor reads. Queued behind each actor's submitted collections; returns at once (a later
        collection on that actor runs after the load).

        Pass `policy.state_dict()`, or `agent_grpo.trainer.parallel.full_state_dict` under FSDP2.
        """
        cpu = {k: v.detach().to("cpu") for k, v in state_dict.items()}
        shared = self._ray.put(cpu)
        for worker in self.workers:
            worker.update_weights.remote(shared, version)

    def score(
        self, sequences: list[list[int]], targets: list[list[bool]]
    ) -> list[tuple[int, list[list[float]]]]:
        """Each worker's (version, logprobs) of the canary, in worker order; each call runs
        after that actor's queued collections and weight loads."""
        return self._ray.get([w.score.remote(sequences, targets) for w in self.workers])

    def close(self) -> None:
        """Release every worker's backend and end the actors."""
        self._ray.get([worker.close.remote() for worker in self.workers])
        for worker in self.workers:
            self._ray.kill(worker)
        self.workers = []

    def __enter__(self) -> RayRolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
