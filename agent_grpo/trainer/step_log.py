"""Writing a step down: its metrics (JSONL, the trackers, callbacks) and trajectories, and the
step line."""

from __future__ import annotations

from agent_grpo.config.jobs import TrainConfig
from agent_grpo.faults import crash_point
from agent_grpo.logs import get_logger
from agent_grpo.run_dir.writer import RunWriter
from agent_grpo.trainer.metrics import StepMetrics
from agent_grpo.trainer.trackers import Trackers, open_trackers
from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = ["DeadStepWatch", "open_trackers", "record_step", "step_flags"]

log = get_logger("train")


def record_step(
    run: RunWriter,
    config: TrainConfig,
    metrics: StepMetrics,
    records: list[TrajectoryRecord],
    trackers: Trackers | None = None,
) -> None:
    """Write a step's trajectories, then its metrics (JSONL, then the trackers and callbacks);
    log the step line."""
    if config.run.log_trajectories:
        run.write_trajectories(metrics.step, records)
    crash_point("metrics", metrics.step)  # crash tests: the step's records without its metrics
    run.write_metrics(metrics.step, metrics.row())
    if trackers is not None:
        trackers.log(metrics)
    u = metrics.update
    flags = step_flags(metrics)
    log.info("step %d: reward %.3f success %.3f kl %.4f clip %.3f tok/s %.0f (%.0fs)%s",
             metrics.step, metrics.rollout.reward_mean, metrics.rollout.success_rate,
             u.kl_ref or 0.0, u.clip_frac, metrics.rollout_tokens_per_s,
             metrics.times.step_time_s, "".join(f" [{f}]" for f in flags))  # fmt: skip


def step_flags(metrics: StepMetrics) -> list[str]:
    """What a person must see on the step line: no learning signal, failing envs or verifiers,
    malformed calls, truncation, skipped optimizer steps, excluded episodes."""
    r, s, u = metrics.rollout, metrics.signal, metrics.update
    flags = []
    if s.dead_group_fraction == 1.0:
        flags.append(
            "no signal: every group is dead (all rewards equal), loss 0"
            + (", no optimizer step" if u.idle_steps else "")
        )
    if r.error_fraction > 0:
        flags.append(f"env/verifier errors {r.error_fraction:.0%}")
    if s.nonfinite_rewards:
        flags.append(f"non-finite rewards {s.nonfinite_rewards}")
    if r.malformed_call_rate > 0:
        flags.append(f"malformed calls {r.malformed_call_rate:.0%}")
    if r.truncated_fraction > 0:
        flags.append(f"truncated {r.truncated_fraction:.0%}")
    if u.skipped_steps:
        flags.append(f"{u.skipped_steps} optimizer step(s) skipped: non-finite loss")
    return flags


class DeadStepWatch:
    """Counts consecutive steps without learning signal and warns, loudly, at `after`."""

    def __init__(self, after: int = 3) -> None:
        self.after = after
        self.streak = 0

    def see(self, metrics: StepMetrics) -> None:
        """Take one step's metrics; warn once the streak reaches `after` (and every `after`)."""
        self.streak = self.streak + 1 if metrics.signal.dead_group_fraction == 1.0 else 0
        if self.streak and self.streak % self.after == 0:
            log.warning(
                "NO LEARNING SIGNAL for %d steps in a row: every group's members got the same "
                "reward, so every advantage is 0. Check the verifier (agent-grpo replay RUN "
                "--step %d), raise rollout.group_size or the temperature, or warm start.",
                self.streak, metrics.step,
            )  # fmt: skip
