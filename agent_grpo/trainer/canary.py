"""The weight canary: after a push, every engine scores a few fixed sequences and the trainer
compares those logprobs with its own, so a push that did not arrive stops the run instead of
training silently on a stale sampler (`rollout.canary`).

The canary is the first step's first trajectories, whole (`canary_from_records`). After a push
of version v the trainer scores them with the weights it pushed; each engine scores them with
what it holds (`RolloutSource.score_canary`). An engine fails the check (`check_engines`,
`CanaryError` with one line naming it) when it reports another version, when its mean gap to
the trainer exceeds `max_gap`, or when its scores did not follow the trainer's since the last
check (moved less than a quarter as far while the trainer's moved more than 1e-4 nats): a push
that did not arrive, caught well below `max_gap` whatever the kernels' own, steady, offset.
Scored at temperature 1 on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from agent_grpo.models.logprobs import token_logprobs
from agent_grpo.rollout.sources import EngineScore
from agent_grpo.trajectory.record import Provenance, TrajectoryRecord

__all__ = [
    "Canary",
    "CanaryError",
    "CanaryGap",
    "EngineScore",
    "canary_from_records",
    "canary_gap",
    "check_canary",
    "check_engines",
    "trainer_scores",
]


class CanaryError(RuntimeError):
    """An engine does not hold the weights the trainer just pushed; the message is one line."""


@dataclass(frozen=True)
class CanaryGap:
    """|engine - trainer| logprob over the canary's model tokens."""

    max: float
    """Largest gap over the compared tokens."""
    mean: float
    """Mean gap over the compared tokens."""
    tokens: int
    """Tokens compared."""


def canary_gap(engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> CanaryGap:
    """The gap of `engine` and `trainer` logprobs (`[N, T]` each) over `mask` (`[N, T]` bool).
    A non-finite value on a masked token is an infinite gap, never a skipped one."""
    if not bool(mask.any()):
        raise ValueError("the canary has no model tokens to compare")
    diff = (engine.double() - trainer.double()).abs()[mask]  # [M]
    diff = torch.where(torch.isfinite(diff), diff, torch.inf)  # [M]
    return CanaryGap(max=float(diff.max()), mean=float(diff.mean()), tokens=int(mask.sum()))


def check_canary(
    engine: str, version: int | None, expected: int, gap: CanaryGap, max_gap: float
) -> None:
    """Raise `CanaryError` naming `engine` when it reports a policy `version` other than
    `expected` (None: the engine does not report one) or its mean `gap` exceeds `max_gap`."""
    if version is not None and version != expected:
        raise CanaryError(
            f"{engine} holds policy version {version} after the push of version {expected}"
        )
    if not gap.mean <= max_gap:
        raise CanaryError(
            f"{engine}: canary logprobs differ from the trainer's by {gap.mean:.3g} on average "
            f"(bound {max_gap:.3g}) after the push of version {expected}: "
            "the weights did not arrive"
        )


@dataclass
class Canary:
    """The fixed sequences and the trainer's logprobs of them at the last check."""

    sequences: list[list[int]]
    """Token ids of each canary sequence."""
    targets: list[list[bool]]
    """True on each sequence's model tokens (the ones compared)."""
    last: torch.Tensor | None = None
    """`[N, T]` the trainer's logprobs at the previous check; None before the first."""
    engines: dict[str, torch.Tensor] = field(default_factory=dict)
    """`[N, T]` each engine's logprobs at the previous check, by engine name."""

    @property
    def mask(self) -> torch.Tensor:
        """`[N, T]` the targets, padded with False."""
        return _padded([[float(t) for t in row] for row in self.targets], 0.0).bool()


def canary_from_records(records: Sequence[TrajectoryRecord], count: int) -> Canary:
    """The first `count` records with a model token, each its own arrays (branch 0)."""
    sequences, targets = [], []
    for record in records:
        wanted = [p == Provenance.MODEL for p in record.provenance]
        if any(wanted):
            sequences.append(list(record.token_ids))
            targets.append(wanted)
        if len(sequences) == count:
            break
    if not sequences:
        raise ValueError("no trajectory of the step has a model token to make the canary of")
    return Canary(sequences, targets)


def _padded(rows: list[list[float]], fill: float) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([row + [fill] * (width - len(row)) for row in rows], dtype=torch.float64)


@torch.no_grad()
def trainer_scores(model: torch.nn.Module, canary: Canary) -> torch.Tensor:
    """`[N, T]` the trainer's logprobs of the canary (0 off targets), one sequence at a time."""
    device = next(model.parameters()).device
    rows = []
    for ids, wanted in zip(canary.sequences, canary.targets, strict=True):
        x = torch.tensor([ids], device=device)  # [1, T]
        mask = torch.tensor([wanted], device=device)  # [1, T]
        values = token_logprobs(model, x, temperature=1.0, target_mask=mask)[0]  # [T]
        rows.append(torch.where(mask[0], values, 0.0).double().cpu().tolist())
    return _padded(rows, 0.0)


FOLLOWED = 4.0
"""An engine whose scores moved less than 1 / FOLLOWED of what the trainer's moved since the
last check did not follow the push."""
MOVED = 1e-4
"""Below this mean move of the trainer's scores (nats) a missed push cannot be told apart."""


def check_engines(
    scores: Sequence[EngineScore],
    canary: Canary,
    trainer: torch.Tensor,
    version: int,
    max_gap: float,
) -> CanaryGap:
    """Check every engine's score of the canary against the trainer's (`trainer`, `[N, T]`) for
    the push of `version` (module docstring); return the worst gap and keep this check's scores
    for the next. Raises `CanaryError` naming the first engine that fails."""  # fmt: skip
    mask = canary.mask
    moved = None if canary.last is None else canary_gap(trainer, canary.last, mask).mean
    worst: CanaryGap | None = None
    for score in scores:
        engine = _padded(score.logprobs, 0.0)  # [N, T]
        gap = canary_gap(engine, trainer, mask)
        check_canary(score.engine, score.version, version, gap, max_gap)
        before = canary.engines.get(score.engine)
        if moved is not None and before is not None and moved > MOVED:
            followed = canary_gap(engine, before, mask).mean
            if followed < moved / FOLLOWED:
                raise CanaryError(
                    f"{score.engine} did not follow the push of version {version}: its canary "
                    f"logprobs moved {followed:.3g} since the last check, the trainer's "
                    f"{moved:.3g}; the weights did not arrive"
                )
        canary.engines[score.engine] = engine
        worst = gap if worst is None or gap.mean > worst.mean else worst
    canary.last = trainer
    assert worst is not None, "no engine scored the canary"
    return worst
