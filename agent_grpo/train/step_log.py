"""Writing a step down: its metrics (JSONL, TensorBoard) and trajectories, and the step line."""

from __future__ import annotations

from typing import Any

from agent_grpo.logs import get_logger
from agent_grpo.store import RunDir
from agent_grpo.train.config import TrainConfig
from agent_grpo.train.metrics import StepMetrics
from agent_grpo.trajectory import TrajectoryRecord

__all__ = ["open_tensorboard", "record_step"]

log = get_logger("train")


def open_tensorboard(run: RunDir, config: TrainConfig) -> Any:
    """A TensorBoard writer under `{run}/tensorboard`, or None when turned off."""
    if not config.run.tensorboard:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run.path / "tensorboard"))


def record_step(
    run: RunDir,
    config: TrainConfig,
    metrics: StepMetrics,
    records: list[TrajectoryRecord],
    tensorboard: Any = None,
) -> None:
    """Write a step's trajectories, then its metrics (JSONL, TensorBoard); log the step line."""
    if config.run.log_trajectories:
        run.write_trajectories(metrics.step, records)
    row = metrics.row()
    run.write_metrics(metrics.step, row)
    if tensorboard is not None:
        for key, value in row.items():
            if value is not None:
                tensorboard.add_scalar(key, value, metrics.step)
        tensorboard.flush()
    u = metrics.update
    log.info("step %d: reward %.3f success %.3f kl %.4f clip %.3f tok/s %.0f (%.0fs)",
             metrics.step, metrics.rollout.reward_mean, metrics.rollout.success_rate,
             u.kl_ref or 0.0, u.clip_frac, metrics.rollout_tokens_per_s,
             metrics.step_time_s)  # fmt: skip
