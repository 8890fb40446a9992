"""Per-step signal-quality metrics: GRPO amplifies whatever signal it gets, bad signal included.

All functions are pure: records (and advantages) in, floats out.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from agent_grpo.trajectory import Provenance, TrajectoryRecord

__all__ = ["dead_group_mask", "logprob_mismatch", "signal_metrics"]


def _groups(records: Sequence[TrajectoryRecord]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for i, record in enumerate(records):
        groups[record.group_id].append(i)
    return groups


def dead_group_mask(records: Sequence[TrajectoryRecord], tol: float = 1e-9) -> list[bool]:
    """Per record: True when every member of its group got the same reward (no signal)."""
    dead = [False] * len(records)
    for rows in _groups(records).values():
        rewards = [records[i].reward for i in rows]
        flat = max(rewards) - min(rewards) <= tol
        for i in rows:
            dead[i] = flat
    return dead


def _model_tokens(record: TrajectoryRecord) -> tuple[int, ...]:
    return tuple(
        t for t, p in zip(record.token_ids, record.provenance, strict=True) if p is Provenance.MODEL
    )


def _duplicate_fraction(records: Sequence[TrajectoryRecord]) -> float:
    duplicates = 0
    for rows in _groups(records).values():
        seen = {_model_tokens(records[i]) for i in rows}
        duplicates += len(rows) - len(seen)
    return duplicates / max(1, len(records))


def _correlation(xs: Sequence[float], ys: Sequence[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else 0.0


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def signal_metrics(
    records: Sequence[TrajectoryRecord], advantages: Sequence[float]
) -> dict[str, float]:
    """Reward spread, dead groups, duplicates, length bias, tool-call and malformed rates."""
    rewards = [r.reward for r in records]
    lengths = [float(r.lengths.model) for r in records]
    dead = dead_group_mask(records)
    groups = _groups(records)
    calls = sum(len(t.tool_calls) for r in records for t in r.turns)
    mean = _mean(rewards)
    return {
        "reward_mean": mean,
        "reward_std": math.sqrt(_mean([(r - mean) ** 2 for r in rewards])),
        "success_rate": _mean([float(r.success) for r in records]),
        "dead_groups": float(sum(dead[rows[0]] for rows in groups.values())),
        "dead_group_fraction": _mean([float(dead[rows[0]]) for rows in groups.values()]),
        "duplicate_fraction": _duplicate_fraction(records),
        "len_above_baseline": _mean([n for n, a in zip(lengths, advantages, strict=True) if a > 0]),
        "len_below_baseline": _mean([n for n, a in zip(lengths, advantages, strict=True) if a < 0]),
        "reward_length_corr": _correlation(rewards, lengths),
        "tool_calls_per_traj": calls / max(1, len(records)),
        "malformed_call_rate": sum(r.malformed_tool_calls for r in records) / max(1, calls),
        "model_tokens_mean": _mean(lengths),
        "turns_mean": _mean([float(len(r.turns)) for r in records]),
        "truncated_fraction": _mean([float(r.termination.kind == "truncated") for r in records]),
        "error_fraction": _mean([float(r.termination.kind == "error") for r in records]),
    }


def logprob_mismatch(
    trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Mean and max |trainer - sampler| logprob over model tokens (engine/trainer mismatch).

    Tokens the trainer did not score (NaN: rows skipped for zero advantage) are left out.
    """
    mask = mask & torch.isfinite(trainer) & torch.isfinite(sampler)  # [B, T]
    diff = torch.where(mask, (trainer - sampler).abs(), 0.0)  # [B, T]
    count = int(mask.sum())
    return {
        "logprob_mismatch_mean": float(diff.sum()) / max(1, count),
        "logprob_mismatch_max": float(diff.max()) if count else 0.0,
    }
