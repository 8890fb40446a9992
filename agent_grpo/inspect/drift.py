"""`replay --recompute-logprobs`: logprobs recomputed with a checkpoint (a plain forward at the
record's temperature) against the recorded sampler and old logprobs, turn by turn."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from agent_grpo.inspect.curves import format_value
from agent_grpo.inspect.visible import visible_text
from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = ["TurnDrift", "drift_table", "logprob_drift", "recompute_logprobs"]


@dataclass(frozen=True)
class TurnDrift:
    """How far recomputed logprobs of one turn's model tokens are from the recorded ones."""

    turn: int
    """Turn index."""
    tokens: int
    """Model tokens compared."""
    sampler_mean: float
    """Mean |recomputed - sampler logprob|."""
    sampler_max: float
    """Largest |recomputed - sampler logprob|."""
    old_mean: float | None
    """Mean |recomputed - old logprob|; None when the record has no old logprobs."""
    old_max: float | None
    """Largest |recomputed - old logprob|; None when the record has no old logprobs."""


def recompute_logprobs(model: Any, record: TrajectoryRecord) -> list[float | None]:
    """Logprobs of `record`'s model tokens under `model` (plain forward, record temperature)."""
    import torch

    from agent_grpo.models.logprobs import token_logprobs

    ids = torch.tensor([record.token_ids])  # [1, T]
    with torch.no_grad():
        values = token_logprobs(model, ids, temperature=record.sampling_temperature)[0]  # [T]
    return [float(v) if m else None for v, m in zip(values.tolist(), record.loss_mask, strict=True)]


def _drift(new: list[float | None], old: Sequence[float | None], span: range) -> list[float]:
    return [
        abs(n - o) for n, o in ((new[i], old[i]) for i in span) if n is not None and o is not None
    ]


def logprob_drift(record: TrajectoryRecord, recomputed: list[float | None]) -> list[TurnDrift]:
    """Per-turn mean/max |recomputed - sampler| and |recomputed - old| over model tokens."""
    out = []
    for turn in record.turns:
        span = range(turn.token_start, turn.token_end)
        vs_sampler = _drift(recomputed, record.sampler_logprobs, span)
        vs_old = _drift(recomputed, record.old_logprobs, span) if record.old_logprobs else []
        out.append(
            TurnDrift(
                turn=turn.index,
                tokens=len(vs_sampler),
                sampler_mean=statistics.fmean(vs_sampler) if vs_sampler else 0.0,
                sampler_max=max(vs_sampler, default=0.0),
                old_mean=statistics.fmean(vs_old) if vs_old else None,
                old_max=max(vs_old) if vs_old else None,
            )
        )
    return out


def drift_table(record: TrajectoryRecord, drifts: Sequence[TurnDrift]) -> Table:
    """Per-turn drift of one record as a table."""
    headers = ("turn", "tokens", "|new-sampler| mean", "max", "|new-old| mean", "max")
    table = Table(*headers, title=visible_text(f"logprob drift {record.uid}"))
    for d in drifts:
        table.add_row(
            str(d.turn),
            str(d.tokens),
            format_value(d.sampler_mean),
            format_value(d.sampler_max),
            format_value(d.old_mean),
            format_value(d.old_max),
        )
    return table
