"""Rollouts on Ray: each worker is an actor with its own model, generation backend and envs.

`RayRolloutPool.collect(tasks, step)` deals whole tasks (a task's G samples stay on one worker,
so a group never straddles two policies' weights) in contiguous blocks to the workers, runs
`collect_groups` in each, and returns the records in task order with the group ids a single
`collect_groups` call would give. Sampling seeds come from (seed, step, task, index, turn) in the
collector, so which worker ran a task does not change its trajectory. `update_weights` reaches
the actors by broadcast over a weight group of the trainer and the actors
(`agent_grpo/rollout/weight_sync.py`; the default) or through the object store (one copy that
every actor reads); either way each actor loads it after the collections queued before it.

Ray is imported only when a pool is built: the single-process path (`collect_groups` with a
backend in the trainer process) stays the default and needs no Ray. The caller owns `ray.init`
(`address="auto"` on a cluster); the pool never starts or stops a cluster.

Where we depart from common practice:
- Workers are whole rollout processes (model + backend + environments), not remote generation
  servers with environments left in the trainer (verl, OpenRLHF): tool calls run next to the model
  that issued them, and a worker needs only the model directory and the env registry.
- Blocks are balanced by task count, not by expected tokens (every task has G samples; lengths
  are unknown in advance). Metrics of a collection add up counts; times are the slowest worker's.
- A broadcast is received beside a collection in progress (a Ray concurrency group of its own)
  and kept until the actor's queue reaches its load, so a push never waits for a collection;
  the price is one more copy of the weights per actor while it waits (the object store's copy
  costs the same). verl and OpenRLHF instead push when the engines are idle.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from agent_grpo.config.jobs import LoraSettings
from agent_grpo.models.loading import load_tokenizer
from agent_grpo.rollout.backends.factory import EngineLimits, rollout_limits
from agent_grpo.rollout.collector import (
    Collection,
    CollectOptions,
    RolloutMetrics,
    RolloutResult,
    Task,
    collect_groups,
    group_id_of,
)
from agent_grpo.rollout.config import BackendConfig, HFBackendConfig, RolloutConfig
from agent_grpo.rollout.engine_weights import EngineSpec, start_engine
from agent_grpo.rollout.env_pool import EnvPool
from agent_grpo.rollout.partial import PartialCollector, StreamTask, TaskStream, oldest_first
from agent_grpo.rollout.streaming import SamplingLoop
from agent_grpo.rollout.weight_sync import (
    GroupAddress,
    TensorSpec,
    WeightReceiver,
    WeightSender,
    distinct_tensors,
    payload_bytes,
    tensor_specs,
)
from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = ["PendingCollection", "RayRolloutPool", "RolloutWorker", "merge_metrics", "split_tasks"]

WEIGHTS_GROUP = "weights"
"""The actors' concurrency group for weight-group calls, which run beside a collection."""
WeightSync = Literal["object_store", "broadcast"]


def split_tasks(num_tasks: int, num_workers: int) -> list[range]:
    """Contiguous blocks of task indices, sizes differing by at most one (empty ones dropped)."""
    base, extra = divmod(num_tasks, num_workers)
    blocks, start = [], 0
    for w in range(num_workers):
        stop = start + base + (w < extra)
        blocks.append(range(start, stop))
        start = stop
    return [b for b in blocks if len(b)]


def _shares(total: int, workers: int) -> list[int]:
    """`total` split over `workers`, sizes differing by at most one, in worker order."""
    base, extra = divmod(total, workers)
    return [base + (w < extra) for w in range(workers)]


def _renumber(
    records: Sequence[TrajectoryRecord], step: int, first_task: int, group_size: int
) -> list[TrajectoryRecord]:
    """Give a block's records the group ids of their tasks' places in the whole task list."""
    out = []
    for j, record in enumerate(records):
        group = group_id_of(step, first_task + j // group_size)
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
        in_flight_groups=sum(p.in_flight_groups for p in parts),
    )


class RolloutWorker:
    """One rollout process: its engine, where pushes go, and collector settings (what each actor
    holds). Calls run one at a time in order, except those of the `weights` concurrency group
    (joining the weight group, receiving a broadcast; with `keep_sampling` also pushes, canary
    scores and closing), which run beside a collection."""

    def __init__(
        self, engine: EngineSpec, collector: CollectOptions, keep_sampling: bool = False
    ) -> None:
        """`keep_sampling`: partial rollouts run on a `SamplingLoop` that samples between
        calls and takes pushes between turns (`rollout.partial.keep_sampling`)."""
        self.tokenizer = load_tokenizer(engine.model_path)
        self.backend, self.weights = start_engine(engine, self.tokenizer)
        self.collector = collector
        self.version = 0
        """The policy version of the weights this worker samples with (see `update_weights`)."""
        self.receiver: WeightReceiver | None = None
        """This worker's side of the trainer's weight group (`weight_sync: broadcast`)."""
        self.received: dict[int, dict[str, torch.Tensor]] = {}
        """Broadcast weights by version, kept until `apply_weights` loads them in turn."""
        self.lock = threading.Lock()
        """Guards `received` between the `weights` group's thread and the default one."""
        self.partial: PartialCollector | None = None
        """With partial rollouts, the groups this worker keeps in flight between calls."""
        self.envs = EnvPool()
        """This worker's envs between episodes (`reusable` ones are reset, not built, each call)."""
        self.loop: SamplingLoop | None = None
        """With `keep_sampling`, what owns the engine and the groups in flight."""
        if keep_sampling:
            collection = Collection(self.backend, self.tokenizer, collector, envs=self.envs)
            self.loop = SamplingLoop(collection, self.weights)

    def collect(self, tasks: list[Task], step: int, run_id: str) -> RolloutResult:
        """`collect_groups` over these tasks, numbered from 0 (the pool renumbers groups); every
        record is tagged with this worker's policy version. An actor runs one call at a time, so
        a collection never straddles a weight update."""
        if self.loop is not None:  # it owns the engine: a second caller would race it
            raise RuntimeError("a worker that keeps sampling takes partial collections only")
        result = collect_groups(tasks, self.backend, self.tokenizer, self.collector, step=step,
                                run_id=run_id, envs=self.envs)  # fmt: skip
        for record in result.records:
            record.policy_version = self.version
        self.backend.free_caches()  # the trainer's update, on this machine too, needs the memory
        return result

    def collect_partial(
        self, admit: list[StreamTask], want: int, step: int, run_id: str
    ) -> RolloutResult:
        """Partial rollouts (`rollout/partial.py`): admit `admit` into the groups this worker
        keeps in flight, run turns until `want` of them have finished and return those; the
        others continue at the next call, on whatever weights were loaded in between. Each turn
        is tagged with this worker's policy version. With `keep_sampling` the loop runs the
        turns, between calls too; this only admits and waits."""
        if self.loop is not None:
            self.loop.admit(admit)
            return self.loop.take(want, step, run_id).result()
        if self.partial is None:
            collection = Collection(self.backend, self.tokenizer, self.collector, run_id=run_id,
                                    envs=self.envs)  # fmt: skip
            self.partial = PartialCollector(collection)
        result = self.partial.collect(admit, want, step, self.version)
        self.backend.free_caches()
        return result

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int = 0) -> None:
        """Load pushed weights (or a LoRA adapter) into the engine; it drops its caches. With
        `keep_sampling`, the loop loads them before its next turn."""
        if self.loop is not None:
            self.loop.load(dict(weights), version)
            return
        self.weights.load(dict(weights), version)
        self.version = version

    def join_weight_group(self, address: GroupAddress, rank: int) -> None:
        """Join the trainer's weight group as `rank` (leaving an earlier one); in the `weights`
        concurrency group, beside any collection."""
        import ray

        if self.receiver is not None:
            self.receiver.close()
        self.receiver = WeightReceiver(address, rank, ray.util.get_node_ip_address())

    def receive_weights(self, specs: list[TensorSpec], version: int) -> None:
        """Take part in the trainer's broadcast of `version` and keep the tensors until
        `apply_weights`; in the `weights` concurrency group, beside any collection."""
        if self.receiver is None:
            raise RuntimeError("receive_weights before join_weight_group")
        nccl = self.receiver.address.backend == "nccl"
        tensors = self.receiver.receive(specs, torch.device("cuda" if nccl else "cpu"))
        if self.loop is not None:  # no `apply_weights` follows: the loop takes them at once
            self.loop.load(tensors, version)
            return
        with self.lock:
            self.received[version] = tensors

    def apply_weights(self, version: int) -> None:
        """Load the received weights of `version` (in turn: after the collections queued
        before it)."""
        with self.lock:
            weights = self.received.pop(version)
        self.update_weights(weights, version)

    def score(
        self, sequences: list[list[int]], targets: list[list[bool]]
    ) -> tuple[int, list[list[float]]]:
        """The version this worker holds and its backend's logprobs of `sequences` at
        temperature 1 (the weight canary). With `keep_sampling`, between two of the loop's
        turns, after the weights pushed so far are loaded."""
        if self.loop is not None:
            scored = self.loop.call(lambda v: (v, self.backend.score(sequences, targets, 1.0)))
            return scored.result()
        return self.version, self.backend.score(sequences, targets, 1.0)

    def sampled_turns(self) -> int:
        """Turns its sampling loop has run (`keep_sampling`; 0 without): a turn is one backend
        call for every episode in flight."""
        return 0 if self.loop is None else self.loop.turns

    def ping(self) -> bool:
        """Alive (for tests and health checks)."""
        return True

    def node(self) -> str:
        """The id of the Ray node this worker runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def close(self) -> None:
        """Release the backend, the weight group and every env (in flight or idle)."""
        if self.loop is not None:
            self.loop.close()
        if self.partial is not None:
            self.partial.close()
        self.envs.close()
        self.backend.close()
        self.weights.close()
        if self.receiver is not None:
            self.receiver.close()


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
    wants: list[int] | None = None
    """Partial rollouts: how many finished groups each worker returns (`submit_partial`);
    None for a whole collection of `tasks`."""
    workers: list[Any] | None = None
    """Partial rollouts: the worker each future belongs to."""


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
        resources: Mapping[str, float] | None = None,
        weight_sync: WeightSync = "broadcast",
        lora: LoraSettings | None = None,
        adapters: int = 1,
        keep_sampling: bool = False,
    ) -> None:
        """`resources`: custom Ray resources each actor needs (placement); `weight_sync`: how
        `update_weights` reaches the actors; `lora`: pushes are this adapter's tensors, and a
        vLLM engine keeps `adapters` versions of it loaded; `keep_sampling`: partial rollouts
        keep sampling between calls and take pushes between turns (`rollout/streaming.py`)."""
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
        actor = ray.remote(
            num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker,
            resources=dict(resources or {}), concurrency_groups={WEIGHTS_GROUP: 1},
        )(RolloutWorker)  # fmt: skip
        engine = EngineSpec(model_path, backend or HFBackendConfig(), limits, dtype, lora, adapters)
        spread = actor.options(scheduling_strategy="SPREAD")
        self.workers = [spread.remote(engine, self.collector, keep_sampling)
                        for _ in range(num_workers)]  # fmt: skip
        self.keep_sampling = keep_sampling
        """Pushes, canary scores and closes go beside a waiting call (the `weights` group)."""
        self.weight_sync = weight_sync
        self.actor_gpus = num_gpus_per_worker
        self.sender: WeightSender | None = None
        """The trainer's side of the weight group (`broadcast`), formed on the first push."""
        self.members: list[Any] = []
        """The workers `sender`'s group was formed with."""
        self.last_push_bytes = 0
        """Bytes of the tensors of the last `update_weights` (each actor receives them once)."""
        self.held: dict[Any, dict[str, StreamTask]] = {w: {} for w in self.workers}
        """Partial rollouts: each worker's groups admitted and not yet returned, by group id."""
        self.owed: dict[Any, int] = {w: 0 for w in self.workers}
        """Partial rollouts: finished groups each worker's submitted calls will return."""

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

    def submit_partial(
        self, stream: TaskStream, want: int, over: int, step: int, run_id: str
    ) -> PendingCollection:
        """Partial rollouts: every worker tops its groups in flight up to its share of
        `want + over` from `stream` and returns its share of `want` finished groups; the rest
        stay in flight on the worker (`RolloutWorker.collect_partial`). Calls queue on each
        actor in order, behind the weights pushed before them."""
        workers = list(self.workers)
        wants, overs = _shares(want, len(workers)), _shares(over, len(workers))
        futures = []
        for worker, share, extra in zip(workers, wants, overs, strict=True):
            in_flight = len(self.held[worker]) - self.owed[worker]  # once its queue has run
            admit = stream.take(share + extra - in_flight)
            self.held[worker].update({group_id_of(t.step, t.index): t for t in admit})
            self.owed[worker] += share
            futures.append(worker.collect_partial.remote(admit, share, step, run_id))
        return PendingCollection([], step, run_id, [], futures, time.perf_counter(), wants,
                                 workers)  # fmt: skip

    def held_tasks(self) -> list[StreamTask]:
        """Partial rollouts: the tasks of every group handed to a worker and not yet returned
        (in flight, or finished and not yet collected), oldest first."""
        return oldest_first(task for tasks in self.held.values() for task in tasks.values())

    def wait(self, pending: PendingCollection) -> RolloutResult:
        """The submitted collection's result. A block whose worker died (its actor killed, its
        node gone) is sent again to a surviving worker; `metrics.worker_failures` counts it.
        With partial rollouts, the groups the dead worker held start over on a live one."""
        if pending.wants is not None:
            return self._wait_partial(pending)
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

    def _wait_partial(self, pending: PendingCollection) -> RolloutResult:
        """Each worker's finished groups (records keep the ids of the step their tasks came
        from). A worker that died hands its groups in flight, as tasks, to a live one, which
        returns the dead one's share of finished groups in its place."""
        assert pending.wants is not None and pending.workers is not None
        results: list[RolloutResult] = []
        failures = 0
        for worker, future, want in zip(pending.workers, pending.futures, pending.wants,
                                        strict=True):  # fmt: skip
            while True:
                try:
                    result = self._ray.get(future)
                    break
                except self._ray.exceptions.RayActorError:
                    failures += 1
                    worker, future = self._readmit(worker, want, pending)
            self.owed[worker] -= want
            for record in result.records:
                self.held[worker].pop(record.group_id, None)
            results.append(result)
        records = [r for result in results for r in result.records]
        metrics = merge_metrics([r.metrics for r in results], time.perf_counter() - pending.started)
        metrics.worker_failures = failures
        return RolloutResult(records=records, metrics=metrics)

    def _readmit(self, dead: Any, want: int, pending: PendingCollection) -> tuple[Any, Any]:
        """Move a dead worker's groups in flight (as tasks, to start over) and what it owed to
        a live worker; returns that worker and its call for `want` finished groups."""
        self.workers = self._live([w for w in self.workers if w is not dead])
        worker = self.workers[0]
        tasks, owed = self.held.pop(dead, {}), self.owed.pop(dead, 0)
        self.held[worker].update(tasks)
        self.owed[worker] += owed
        admit = list(tasks.values())
        return worker, worker.collect_partial.remote(admit, want, pending.step, pending.run_id)

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

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int = 0) -> None:
        """Send new weights, tagged `version`, to every worker; each loads them after its
        submitted collections (a collection submitted later samples with them), or with
        `keep_sampling` before its loop's next turn. A tied weight's second name is dropped:
        one copy travels.

        `object_store`: one `ray.put` that every actor reads; returns at once. `broadcast`:
        returns once every actor has received its copy (beside any collection in progress).
        Pass `policy.state_dict()`, `agent_grpo.trainer.parallel.full_state_dict` under FSDP2,
        or with `lora` the adapter's tensors (`agent_grpo.rollout.adapters.adapter_state`).
        """
        distinct = distinct_tensors(weights)
        specs = tensor_specs(distinct)
        self.last_push_bytes = payload_bytes(specs)
        if self.weight_sync == "broadcast":
            self._broadcast(distinct, specs, version)
            return
        shared = self._ray.put({k: v.detach().to("cpu") for k, v in distinct.items()})
        for worker in self.workers:
            self._beside(worker.update_weights).remote(shared, version)

    def _broadcast(
        self, weights: dict[str, torch.Tensor], specs: list[TensorSpec], version: int
    ) -> None:
        """Broadcast `weights` to every live worker, then queue each one's load. The group is
        formed again when workers died; a broadcast that fails is retried once."""
        for attempt in (1, 2):
            try:
                self._form_group(next(iter(weights.values())).device)
                assert self.sender is not None
                receive = [w.receive_weights.options(concurrency_group=WEIGHTS_GROUP)
                           for w in self.workers]  # fmt: skip
                received = [call.remote(specs, version) for call in receive]
                self.sender.send(weights, specs)
                self._ray.get(received)
                break
            except (RuntimeError, self._ray.exceptions.RayError):
                if self.sender is not None:
                    self.sender.close()
                self.sender, self.members = None, []
                if attempt == 2:
                    raise
        if self.keep_sampling:  # each actor's loop took its copy as it arrived
            return
        for worker in self.workers:
            worker.apply_weights.remote(version)

    def _form_group(self, device: torch.device) -> None:
        """The weight group of the trainer and the live workers (again, when a worker died
        since it was formed). NCCL for CUDA weights when actors have GPUs, else gloo."""
        self.workers = self._live(self.workers)
        if self.sender is not None and self.members == self.workers:
            return
        if self.sender is not None:
            self.sender.close()
        nccl = device.type == "cuda" and self.actor_gpus > 0
        host = self._ray.util.get_node_ip_address()
        self.sender = WeightSender(host, len(self.workers), "nccl" if nccl else "gloo")
        joined = [
            w.join_weight_group.options(concurrency_group=WEIGHTS_GROUP).remote(
                self.sender.address, rank
            )
            for rank, w in enumerate(self.workers, start=1)
        ]
        self.sender.connect()
        self._ray.get(joined)
        self.members = list(self.workers)

    def _live(self, workers: list[Any]) -> list[Any]:
        """The workers that answer a ping in their `weights` group (at once, mid-collection)."""
        pings = [w.ping.options(concurrency_group=WEIGHTS_GROUP).remote() for w in workers]
        alive = []
        for worker, ping in zip(workers, pings, strict=True):
            try:
                self._ray.get(ping, timeout=60)
                alive.append(worker)
            except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
                continue
        if not alive:
            raise RuntimeError("every rollout worker died")
        return alive

    def score(
        self, sequences: list[list[int]], targets: list[list[bool]]
    ) -> list[tuple[int, list[list[float]]]]:
        """Each worker's (version, logprobs) of the canary, in worker order; each call runs
        after that actor's queued collections and weight loads (with `keep_sampling`, between
        two of its turns, after the pushes so far)."""
        calls = [self._beside(w.score).remote(sequences, targets) for w in self.workers]
        return self._ray.get(calls)

    def _beside(self, method: Any) -> Any:
        """`method` in the `weights` group with `keep_sampling` (beside a call waiting for
        finished groups, which would otherwise hold it back for a whole step), else as is."""
        return method.options(concurrency_group=WEIGHTS_GROUP) if self.keep_sampling else method

    def nodes(self) -> list[str]:
        """The Ray node id of each worker, in worker order."""
        return list(self._ray.get([w.node.remote() for w in self.workers]))

    def close(self) -> None:
        """Release every worker's backend and the weight group, and end the actors."""
        self._ray.get([self._beside(worker.close).remote() for worker in self.workers])
        if self.sender is not None:
            self.sender.close()
        for worker in self.workers:
            self._ray.kill(worker)
        self.workers = []

    def __enter__(self) -> RayRolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
