"""Held-out evaluation: success rate, mean reward, pass@k, tool use, turns and tokens.

pass@k for every k up to the samples taken uses the unbiased estimator of Chen et al. (2021,
"Evaluating Large Language Models Trained on Code"): with n samples of a task and c of them
correct, `1 - C(n - c, k) / C(n, k)`, averaged over tasks. It is the chance that k samples drawn
without replacement from the n include a correct one; at k = n it is "any of the n solved"
(`pass_at_k`, kept under that name), and at k = 1 the success rate.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import heldout_seeds
from agent_grpo.rollout.backends.base import GenerationBackend, SamplingConfig
from agent_grpo.rollout.collector import CollectOptions, Task, collect_groups
from agent_grpo.rollout.env_pool import EnvPool
from agent_grpo.rollout.summary import TrajectorySummary, summarize_trajectories
from agent_grpo.trajectory.record import TrajectoryRecord

if TYPE_CHECKING:
    from agent_grpo.config.jobs import EnvConfig, EvalConfig

__all__ = [
    "EvalResult",
    "env_stop_strings",
    "evaluate",
    "evaluate_heldout",
    "pass_at",
    "pass_at_curve",
    "summarise_eval",
]


class EvalResult(BaseModel):
    """Held-out metrics of one evaluation: the shared trajectory summary plus pass@k."""

    tasks: int
    """Distinct held-out tasks."""
    samples_per_task: int
    """k: samples drawn per task."""
    pass_at_k: float
    """Fraction of tasks solved by at least one of their k samples."""
    pass_at: dict[int, float] = {}
    """Unbiased pass@k for k = 1 .. the fewest samples any task got (`pass_at_curve`)."""
    summary: TrajectorySummary
    """What the evaluation episodes did (success rate, reward, turns, tool use, ...)."""

    def row(self) -> dict[str, float]:
        """Flat `eval_<name>` metrics for `metrics.jsonl`."""
        flat = {
            "tasks": self.tasks,
            "samples_per_task": self.samples_per_task,
            "pass_at_k": self.pass_at_k,
            **self.summary.model_dump(),
        }
        flat |= {f"pass_at_{k}": v for k, v in self.pass_at.items()}
        return {f"eval_{k}": float(v) for k, v in flat.items()}


def pass_at(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task: `1 - C(n - c, k) / C(n, k)` for n samples, c correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_curve(counts: Sequence[tuple[int, int]]) -> dict[int, float]:
    """Mean unbiased pass@k over tasks given as (samples, correct), for k = 1 .. the fewest
    samples of any task (a larger k is not defined for that task)."""
    if not counts:
        return {}
    most = min(n for n, _ in counts)
    return {k: sum(pass_at(n, c, k) for n, c in counts) / len(counts) for k in range(1, most + 1)}


def summarise_eval(records: Sequence[TrajectoryRecord]) -> EvalResult:
    """Aggregate evaluation records (grouped by task id) into an EvalResult."""
    by_task: dict[str, list[TrajectoryRecord]] = defaultdict(list)
    for record in records:
        by_task[record.task_id].append(record)
    counts = [(len(g), sum(r.success for r in g)) for g in by_task.values()]
    return EvalResult(
        tasks=len(by_task),
        samples_per_task=max((len(v) for v in by_task.values()), default=0),
        pass_at_k=sum(any(r.success for r in g) for g in by_task.values()) / max(1, len(by_task)),
        pass_at=pass_at_curve(counts),
        summary=summarize_trajectories(records),
    )


def evaluate(
    backend: GenerationBackend,
    tokenizer: Any,
    env_id: str,
    seeds: Sequence[int],
    *,
    env_kwargs: dict[str, Any] | None = None,
    samples: int = 1,
    temperature: float = 0.0,
    max_tokens: int = 96,
    max_context_tokens: int = 1024,
    seed: int = 0,
    step: int = 0,
    stop: Sequence[str] = (),
    progress: bool = True,
    envs: EnvPool | None = None,
) -> tuple[EvalResult, list[TrajectoryRecord]]:
    """Run `samples` episodes on each held-out seed and summarise them (`progress`: a rollout
    progress bar of its own; off inside a training run, whose display covers it). Envs come
    from `envs` (a training run's pool: `reusable` ones are reset, not built, and stay in it),
    else are built for this call and closed at its end."""
    tasks = [Task(env_id=env_id, seed=s, env_kwargs=env_kwargs or {}) for s in seeds]
    sampling = SamplingConfig(
        temperature=temperature, max_tokens=max_tokens, seed=seed, stop=list(stop)
    )
    options = CollectOptions(
        group_size=samples,
        sampling=sampling,
        max_context_tokens=max_context_tokens,
        show_progress=progress,
    )
    result = collect_groups(tasks, backend, tokenizer, options, step=step, envs=envs)
    return summarise_eval(result.records), result.records


def env_stop_strings(env_id: str, env_kwargs: dict[str, Any] | None = None) -> list[str]:
    """Stop strings of an environment's tool-call format (end a turn right after a call)."""
    env = make_env(env_id, **(env_kwargs or {}))
    try:
        return list(getattr(env.unwrapped, "stop_strings", []))
    finally:
        env.close()


def evaluate_heldout(
    backend: GenerationBackend,
    tokenizer: Any,
    env: EnvConfig,
    eval_config: EvalConfig,
    *,
    max_context_tokens: int,
    seed: int,
    stop: Sequence[str],
    progress: bool = True,
    envs: EnvPool | None = None,
) -> tuple[EvalResult, list[TrajectoryRecord]]:
    """`evaluate` on the first `eval_config.tasks` held-out seeds, as configured."""
    return evaluate(
        backend, tokenizer, env.id, heldout_seeds(eval_config.tasks), env_kwargs=env.kwargs,
        samples=eval_config.samples, temperature=eval_config.temperature,
        max_tokens=eval_config.max_tokens, max_context_tokens=max_context_tokens, seed=seed,
        stop=stop, progress=progress, envs=envs,
    )  # fmt: skip
