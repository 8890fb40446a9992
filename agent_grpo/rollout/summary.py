"""One summary of a list of trajectories, shared by rollouts, evaluation and the step metrics.

Pure: records in, a typed summary out. Every place that reports "success", "turns" or
"truncated" reads it from here, so a name means one thing everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel

from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = ["TrajectorySummary", "summarize_trajectories"]


class TrajectorySummary(BaseModel):
    """What a set of episodes did, each figure a mean over episodes unless it says otherwise."""

    trajectories: int
    """Number of episodes summarised."""
    reward_mean: float
    """Mean total reward (episodes with a non-finite reward left out)."""
    reward_std: float
    """Population std of the total reward (same episodes)."""
    success_rate: float
    """Fraction the verifier judged solved."""
    tool_call_rate: float
    """Fraction that made at least one tool call."""
    tool_calls_per_traj: float
    """Tool calls per episode."""
    malformed_call_rate: float
    """Malformed tool calls per tool call."""
    turns_mean: float
    """Assistant turns per episode."""
    model_tokens_mean: float
    """Sampled (model) tokens per episode."""
    truncated_fraction: float
    """Fraction ended by a limit (max turns, max tokens, context)."""
    error_fraction: float
    """Fraction ended by an infrastructure failure (env exception or timeout, failed
    generation): these are left out of their group's statistics."""


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize_trajectories(records: Sequence[TrajectoryRecord]) -> TrajectorySummary:
    """The `TrajectorySummary` of `records` (all zeros for none)."""
    rewards = [r.reward for r in records if math.isfinite(r.reward)]
    mean = _mean(rewards)
    calls = sum(len(t.tool_calls) for r in records for t in r.turns)
    return TrajectorySummary(
        trajectories=len(records),
        reward_mean=mean,
        reward_std=math.sqrt(_mean([(r - mean) ** 2 for r in rewards])),
        success_rate=_mean([float(r.success) for r in records]),
        tool_call_rate=_mean([float(any(t.tool_calls for t in r.turns)) for r in records]),
        tool_calls_per_traj=calls / max(1, len(records)),
        malformed_call_rate=sum(r.malformed_tool_calls for r in records) / max(1, calls),
        turns_mean=_mean([float(len(r.turns)) for r in records]),
        model_tokens_mean=_mean([float(r.lengths.model) for r in records]),
        truncated_fraction=_mean([float(r.termination.kind == "truncated") for r in records]),
        error_fraction=_mean([float(r.termination.kind == "error") for r in records]),
    )
