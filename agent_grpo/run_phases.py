"""The phases around GRPO in a run: held-out evaluation, the warm start, logging a step, and
the before/after table. Rank 0 only under torchrun.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from agent_grpo.checkpoint import TrainerState
from agent_grpo.env import train_seeds
from agent_grpo.evaluate import EvalResult, evaluate_heldout
from agent_grpo.logs import get_logger
from agent_grpo.rollout.backend import GenerationBackend
from agent_grpo.sft import expert_record, train_sft
from agent_grpo.store import RunDir
from agent_grpo.train_config import TrainConfig
from agent_grpo.trajectory import TrajectoryRecord

__all__ = [
    "evaluate_and_warm_start",
    "final_eval",
    "open_tensorboard",
    "print_summary",
    "record_step",
    "run_eval",
    "warm_start",
]

log = get_logger("train")
console = Console()


def run_eval(
    config: TrainConfig, backend: GenerationBackend, tokenizer: Any, stop: list[str], label: str
) -> EvalResult | None:
    """Evaluate on held-out seeds (None when evaluation is off)."""
    if config.eval is None:
        return None
    result, _ = evaluate_heldout(
        backend, tokenizer, config.env, config.eval,
        max_context_tokens=config.rollout.max_context_tokens, seed=config.seed, stop=stop,
    )  # fmt: skip
    log.info(
        "eval %s: success %.3f, pass@%d %.3f, tool calls %.2f",
        label,
        result.success_rate,
        result.samples_per_task,
        result.pass_at_k,
        result.tool_call_rate,
    )
    return result


def warm_start(config: TrainConfig, policy: torch.nn.Module, tokenizer: Any) -> list[float]:
    """Supervised pass on expert demonstrations from training seeds."""
    assert config.warm_start is not None
    ws = config.warm_start
    rng = random.Random(f"{config.seed}/warm-start")
    demos = [
        expert_record(tokenizer, config.env.id, s, config.env.kwargs)
        for s in train_seeds(ws.demos, rng)
    ]
    return train_sft(
        policy,
        demos,
        pad_id=tokenizer.pad_token_id,
        epochs=ws.epochs,
        batch_size=ws.batch_size,
        lr=ws.lr,
        micro_batch_tokens=config.algo.micro_batch_tokens,
        seed=config.seed,
    )


def print_summary(state: TrainerState, after: EvalResult | None) -> None:
    """The before/after table."""
    table = Table(title="held-out evaluation")
    table.add_column("model")
    for column in ("success", "pass@k", "reward", "tool calls", "turns", "tokens"):
        table.add_column(column, justify="right")
    rows = [
        ("base", state.eval_before),
        ("warm start", state.eval_warm_start),
        ("GRPO", None if after is None else after.model_dump()),
    ]
    for name, result in rows:
        if result is not None:
            table.add_row(
                name,
                *(
                    f"{result[k]:.3f}"
                    for k in (
                        "success_rate",
                        "pass_at_k",
                        "mean_reward",
                        "tool_call_rate",
                        "mean_turns",
                        "mean_model_tokens",
                    )
                ),
            )
    console.print(table)


def evaluate_and_warm_start(
    config: TrainConfig,
    policy: torch.nn.Module,
    backend: GenerationBackend,
    tokenizer: Any,
    stop: list[str],
) -> TrainerState:
    """A fresh run's start (rank 0): base eval, then the warm start and its eval."""
    state = TrainerState(step=0)
    before = run_eval(config, backend, tokenizer, stop, "base")
    state.eval_before = None if before is None else before.model_dump()
    if config.warm_start is not None:
        losses = warm_start(config, policy, tokenizer)
        log.info("warm start: %d steps, nll %.3f -> %.3f", len(losses), losses[0], losses[-1])
        backend.update_weights(policy)
        after_ws = run_eval(config, backend, tokenizer, stop, "warm start")
        state.eval_warm_start = None if after_ws is None else after_ws.model_dump()
    return state


def open_tensorboard(run: RunDir, config: TrainConfig) -> Any:
    """A TensorBoard writer under `{run}/tensorboard`, or None when turned off."""
    if not config.run.tensorboard:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run.path / "tensorboard"))


def record_step(
    run: RunDir,
    config: TrainConfig,
    step: int,
    metrics: dict[str, float],
    records: list[TrajectoryRecord],
    tensorboard: Any = None,
) -> None:
    """Write a step's metrics (JSONL, TensorBoard) and trajectories; log the headline numbers."""
    run.write_metrics(step, metrics)
    if tensorboard is not None:
        for key, value in metrics.items():
            tensorboard.add_scalar(key, value, step)
        tensorboard.flush()
    if config.run.log_trajectories:
        run.write_trajectories(step, records)
    log.info(
        "step %d: reward %.3f success %.3f kl %.4f clip %.3f tok/s %.0f (%.0fs)",
        step,
        metrics["reward_mean"],
        metrics["success_rate"],
        metrics.get("kl_ref", 0.0),
        metrics.get("clip_frac", 0.0),
        metrics["rollout_tokens_per_s"],
        metrics["step_time_s"],
    )


def final_eval(
    config: TrainConfig,
    run: RunDir,
    backend: GenerationBackend,
    tokenizer: Any,
    stop: list[str],
    state: TrainerState,
) -> None:
    """Evaluate the trained policy, record it, print the before/after table, close the engine."""
    after = run_eval(config, backend, tokenizer, stop, "final")
    if after is not None:
        run.write_metrics(
            config.steps, {f"eval_{k}": float(v) for k, v in after.model_dump().items()}
        )
    print_summary(state, after)
    backend.close()
