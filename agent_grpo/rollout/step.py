"""A training step's rollout and reward: the step's tasks, G samples each, every reward source,
and the episodes that must not count marked as such.

DAPO's dynamic sampling is the one variant here (`top_up_live_groups`): it decides which groups
are dead on the *total* reward, after every extra source, since that is what the advantage uses.

Failures outside the policy are excluded episode by episode (`mark_excluded`); with
`rollout.on_failure: drop_group` an exclusion takes its whole group with it (`drop_failed_groups`),
as tinker-cookbook and NeMo-RL do, so no partial group is trained (RolloutConfig.on_failure
weighs the two biases).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from agent_grpo.algo.groups import dead_group_mask
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.envs.text_env import train_seeds
from agent_grpo.rewards import apply_rewards, build_reward_fn
from agent_grpo.rollout.backends.base import GenerationBackend
from agent_grpo.rollout.collector import CollectOptions, RolloutResult, Task, collect_groups
from agent_grpo.rollout.env_pool import EnvPool
from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = [
    "collect",
    "collector_config",
    "drop_failed_groups",
    "mark_excluded",
    "score",
    "step_tasks",
    "top_up_live_groups",
]


def step_tasks(config: TrainConfig, step: int, round_: int = 0) -> list[Task]:
    """The tasks of one step (and dynamic-sampling round): a pure function of (seed, step,
    round), so a resumed run sees the same."""
    key = f"{config.seed}/{step}" + (f"/extra{round_}" if round_ else "")
    seeds = train_seeds(config.rollout.tasks_per_step, random.Random(key))
    return [Task(env_id=config.env.id, seed=s, env_kwargs=config.env.kwargs) for s in seeds]


def mark_excluded(records: Sequence[TrajectoryRecord]) -> None:
    """Set `excluded` on episodes that must stay out of their group's statistics and the loss:
    infrastructure failures (their reward says nothing about the policy) and non-finite rewards
    (they would turn the group's advantages, and then the weights, into NaN). An episode
    already excluded (a reward source that could not score it) keeps its first reason."""
    for record in records:
        if record.excluded is not None:
            continue
        if record.termination.kind == "error":
            record.excluded = f"infrastructure failure: {record.termination.reason}"
        elif not math.isfinite(record.reward):
            parts = ", ".join(f"{k}={v!r}" for k, v in record.reward_components.items())
            record.excluded = f"non-finite reward {record.reward!r} ({parts})"


def drop_failed_groups(records: Sequence[TrajectoryRecord]) -> None:
    """Exclude every member of a group that has an excluded member (`on_failure: drop_group`),
    naming the member that took the group down."""
    failed: dict[str, TrajectoryRecord] = {}
    for record in records:
        if record.excluded is not None:
            failed.setdefault(record.group_id, record)
    for record in records:
        first = failed.get(record.group_id)
        if first is not None and record.excluded is None:
            record.excluded = f"group dropped: member {first.index_in_group} {first.excluded}"


def _sample(
    config: TrainConfig,
    backend: GenerationBackend,
    tokenizer: Any,
    collector: CollectOptions,
    tasks: list[Task],
    step_id: int,
    envs: EnvPool | None,
) -> RolloutResult:
    """Collect groups for `tasks`, score them with every reward source, mark exclusions."""
    result = collect_groups(tasks, backend, tokenizer, collector, step=step_id,
                            run_id=config.run.name, envs=envs)  # fmt: skip
    return score(config, result)


def score(config: TrainConfig, result: RolloutResult) -> RolloutResult:
    """Score `result`'s records with every reward source and mark the exclusions (in place)."""
    apply_rewards(result.records, [(c, build_reward_fn(c)) for c in config.rewards])
    mark_excluded(result.records)
    if config.rollout.on_failure == "drop_group":
        drop_failed_groups(result.records)
    return result


def collector_config(config: TrainConfig, stop: list[str]) -> CollectOptions:
    """The collector's options for a training step: the env's stop strings unless the config
    names some, and no progress bar of its own (the run's display shows the rollout phase)."""
    return CollectOptions.from_config(config.rollout, stop=stop)


def collect(
    config: TrainConfig,
    backend: GenerationBackend,
    tokenizer: Any,
    stop: list[str],
    step: int,
    envs: EnvPool | None = None,
) -> RolloutResult:
    """Sample and reward this step's groups, with envs from `envs` (a pool the caller keeps
    across steps) or new ones; with dynamic sampling, top up until groups carry signal."""
    collector = collector_config(config, stop)
    result = _sample(config, backend, tokenizer, collector, step_tasks(config, step), step, envs)
    if not config.algo.dynamic_sampling:
        return result
    return top_up_live_groups(config, result, lambda round_: _sample(
        config, backend, tokenizer, collector, step_tasks(config, step, round_),
        step * 1000 + round_, envs,
    ))  # fmt: skip


def _live(records: Sequence[TrajectoryRecord]) -> list[TrajectoryRecord]:
    dead = dead_group_mask(records)
    return [r for r, d in zip(records, dead, strict=True) if not d]


def top_up_live_groups(
    config: TrainConfig, result: RolloutResult, sample_round: Any
) -> RolloutResult:
    """DAPO dynamic sampling: drop dead groups and sample fresh tasks (`sample_round(k)` for
    round k = 1, 2, ...) to refill the batch. All dead after the last round: the batch is kept
    as sampled (it trains on nothing but its KL term) rather than failing the step."""
    want = config.rollout.tasks_per_step * config.rollout.group_size
    live = _live(result.records)
    for round_ in range(1, config.algo.dynamic_sampling_max_rounds + 1):
        if len(live) >= want:
            break
        live += _live(sample_round(round_).records)
    records = live[:want] or result.records
    return RolloutResult(records=records, metrics=result.metrics)
