"""Held-out evaluation inside a training run: before, after the warm start, at the end; and
the before/after table. Rank 0 only under torchrun.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from agent_grpo.config.jobs import TrainConfig
from agent_grpo.evaluation.heldout import EvalResult, evaluate_heldout
from agent_grpo.logs import get_logger
from agent_grpo.rollout.backends.base import GenerationBackend
from agent_grpo.rollout.env_pool import EnvPool

__all__ = ["print_summary", "run_eval"]

log = get_logger("train")


def run_eval(
    config: TrainConfig,
    backend: GenerationBackend,
    tokenizer: Any,
    stop: list[str],
    label: str,
    envs: EnvPool | None = None,
) -> EvalResult | None:
    """Evaluate on held-out seeds (None when evaluation is off), with envs from `envs` (the
    run's pool) where given; then the engine frees its caches."""
    if config.eval is None:
        return None
    result, _ = evaluate_heldout(
        backend,
        tokenizer,
        config.env,
        config.eval,
        max_context_tokens=config.rollout.max_context_tokens,
        seed=config.seed,
        stop=stop,
        progress=False,
        envs=envs,
    )
    # Training comes next, and its warm start and update can use what the eval cached.
    backend.free_caches()
    log.info(
        "eval %s: success %.3f, pass@%d %.3f, tool calls %.2f",
        label,
        result.summary.success_rate,
        result.samples_per_task,
        result.pass_at_k,
        result.summary.tool_call_rate,
    )
    return result


def print_summary(
    base: EvalResult | None, warm_start: EvalResult | None, final: EvalResult | None
) -> None:
    """The before/after table: the base model, after the warm start, after GRPO."""
    table = Table(title="held-out evaluation")
    table.add_column("model")
    for column in ("success", "pass@k", "reward", "tool calls", "turns", "tokens"):
        table.add_column(column, justify="right")
    rows = [("base", base), ("warm start", warm_start), ("GRPO", final)]
    for name, result in rows:
        if result is not None:
            s = result.summary
            values = (
                s.success_rate,
                result.pass_at_k,
                s.reward_mean,
                s.tool_call_rate,
                s.turns_mean,
                s.model_tokens_mean,
            )
            table.add_row(name, *(f"{v:.3f}" for v in values))
    Console().print(table)
