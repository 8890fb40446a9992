"""Held-out evaluation: success rate, mean reward, pass@k, tool use, turns and tokens."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import heldout_seeds
from agent_grpo.rollout.backends.base import GenerationBackend, SamplingConfig
from agent_grpo.rollout.collector import CollectOptions, Task, collect_groups
from agent_grpo.rollout.summary import TrajectorySummary, summarize_trajectories
from agent_grpo.trajectory.record import TrajectoryRecord

if TYPE_CHECKING:
    from agent_grpo.config.jobs import EnvConfig, EvalConfig

__all__ = [
    "EvalResult",
    "env_stop_strings",
    "evaluate",
    "evaluate_heldout",
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
        return {f"eval_{k}": float(v) for k, v in flat.items()}


def summarise_eval(records: Sequence[TrajectoryRecord]) -> EvalResult:
    """Aggregate evaluation records (grouped by task id) into an EvalResult."""
    by_task: dict[str, list[TrajectoryRecord]] = defaultdict(list)
    for record in records:
        by_task[record.task_id].append(record)
    return EvalResult(
        tasks=len(by_task),
        samples_per_task=max((len(v) for v in by_task.values()), default=0),
        pass_at_k=sum(any(r.success for r in g) for g in by_task.values()) / max(1, len(by_task)),
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
) -> tuple[EvalResult, list[TrajectoryRecord]]:
    """Run `samples` episodes on each held-out seed and summarise them (`progress`: a rollout
    progress bar of its own; off inside a training run, whose display covers it)."""
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
    result = collect_groups(tasks, backend, tokenizer, options, step=step)
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
) -> tuple[EvalResult, list[TrajectoryRecord]]:
    """`evaluate` on the first `eval_config.tasks` held-out seeds, as configured."""
    return evaluate(
        backend, tokenizer, env.id, heldout_seeds(eval_config.tasks), env_kwargs=env.kwargs,
        samples=eval_config.samples, temperature=eval_config.temperature,
        max_tokens=eval_config.max_tokens, max_context_tokens=max_context_tokens, seed=seed,
        stop=stop, progress=progress,
    )  # fmt: skip
