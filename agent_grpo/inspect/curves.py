"""Inspecting a run: `inspect RUN`'s metrics table and curves, and checks of stored records.

`inspect RUN` reads only `metrics.jsonl`, so inspecting a long run reads kilobytes, never the
trajectories. Metric names are matched against a short list of accepted keys per column (the
first key present wins); a column whose keys are all missing at a step shows '-'. The first key
of each column is the canonical name the trainer should log.

The record checks back `replay --verify` and `replay --recompute-logprobs`: `verify_record`
re-runs the environment from the record's seed with its assistant texts and reports the first
observation or reward that differs; `logprob_drift` compares logprobs recomputed with a
checkpoint (plain forward at the record's temperature) against the recorded sampler and old
logprobs, turn by turn.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from agent_grpo.store import RunDir
from agent_grpo.trajectory import TrajectoryRecord

__all__ = [
    "COLUMNS",
    "PLOTS",
    "Divergence",
    "TurnDrift",
    "add_inspect_parser",
    "drift_table",
    "inspect_run",
    "logprob_drift",
    "metric",
    "metrics_table",
    "plot_curves",
    "recompute_logprobs",
    "verify_record",
]

COLUMNS: list[tuple[str, tuple[str, ...]]] = [
    ("reward", ("reward_mean",)),
    ("reward std", ("reward_std",)),
    ("success", ("success_rate",)),
    ("dead groups", ("dead_group_fraction",)),
    ("excluded", ("excluded_trajectories",)),
    ("model tok", ("model_tokens_mean",)),
    ("turns", ("turns_mean",)),
    ("tool calls", ("tool_calls_per_traj",)),
    ("tool errors", ("tool_errors",)),
    ("truncated", ("truncated_fraction",)),
    ("KL ref", ("kl_ref",)),
    ("clip frac", ("clip_frac",)),
    ("lp mismatch", ("logprob_mismatch_mean",)),
    ("eval success", ("eval_success_rate",)),
]
"""Table columns: (header, metric keys). The keys are `StepMetrics` / `EvalResult.row()` field
names; a tuple so that a renamed metric can keep reading old runs."""

PLOTS = ["reward", "success", "model tok", "KL ref", "clip frac", "lp mismatch"]
"""The columns drawn as curves in the PNG, one panel each."""


def metric(row: Mapping[str, Any], keys: Sequence[str]) -> float | None:
    """The first of `keys` present in `row` with a finite number, else None."""
    for key in keys:
        value = row.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            return float(value)
    return None


def _format(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"


def metrics_table(rows: Sequence[Mapping[str, Any]], title: str = "metrics") -> Table:
    """One row per step, one column per `COLUMNS` entry logged at least once in the run;
    a value missing at a step shows '-'."""
    logged = [
        (name, keys) for name, keys in COLUMNS if any(metric(r, keys) is not None for r in rows)
    ]
    cells = [[_format(metric(row, keys)) for _, keys in logged] for row in rows]
    steps = [str(row.get("step", "-")) for row in rows]
    table = Table(title=title)
    for i, header in enumerate(["step", *(name for name, _ in logged)]):
        values = [steps[j] if i == 0 else line[i - 1] for j, line in enumerate(cells)]
        table.add_column(
            header, justify="right", no_wrap=True, min_width=max(map(len, values), default=1)
        )
    for step, line in zip(steps, cells, strict=True):
        table.add_row(step, *line)
    return table


def _series(rows: Sequence[Mapping[str, Any]], column: str) -> tuple[list[float], list[float]]:
    keys = dict(COLUMNS)[column]
    points = [(row.get("step"), metric(row, keys)) for row in rows]
    steps_values = [
        (float(s), v) for s, v in points if isinstance(s, int | float) and v is not None
    ]
    return [s for s, _ in steps_values], [v for _, v in steps_values]


def plot_curves(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    """Draw the `PLOTS` curves (reward with its std band) into a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede importing pyplot
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(12, 6), constrained_layout=True)
    for ax, column in zip(axes.flat, PLOTS, strict=True):
        steps, values = _series(rows, column)
        ax.set_title(column)
        ax.set_xlabel("step")
        if not steps:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.plot(steps, values, marker="o", markersize=3)
        if column == "reward":
            _std_band(ax, rows, steps, values)
    fig.suptitle(title)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _std_band(
    ax: Any, rows: Sequence[Mapping[str, Any]], steps: list[float], means: list[float]
) -> None:
    std_steps, stds = _series(rows, "reward std")
    if std_steps == steps:
        lower = [m - s for m, s in zip(means, stds, strict=True)]
        upper = [m + s for m, s in zip(means, stds, strict=True)]
        ax.fill_between(steps, lower, upper, alpha=0.2)


def inspect_run(path: str | Path, out: Path | None = None, console: Console | None = None) -> Path:
    """Print the metrics table of the run at `path` and write its curves PNG; return the PNG."""
    run = RunDir.open(path)
    rows = run.read_metrics()
    console = console or Console()
    table = metrics_table(rows, title=f"run {run.run_id}")
    # Wider than the terminal beats cut numbers: the terminal wraps, nothing is lost.
    needed = Measurement.get(console, console.options.update_width(10_000), table).maximum
    width, console.width = console.width, max(console.width, needed)
    try:
        console.print(table, crop=False)
    finally:
        console.width = width
    return plot_curves(rows, out or run.path / "curves.png", title=run.run_id)


def _cmd_inspect(args: argparse.Namespace) -> int:
    console = Console()
    png = inspect_run(args.run, args.out, console)
    console.print(f"curves: {png}")
    return 0


def add_inspect_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `inspect RUN [--out PNG]` on an argparse subparsers object."""
    p = subparsers.add_parser("inspect", help="per-step metrics table and curves of a run")
    p.add_argument("run", type=Path, help="run directory")
    p.add_argument("--out", type=Path, help="PNG path (default: RUN/curves.png)")
    p.set_defaults(func=_cmd_inspect)
    return p


# --verify


@dataclass(frozen=True)
class Divergence:
    """The first place a re-run environment disagrees with the record."""

    turn: int | None
    """Assistant turn after which it diverged; None for the initial prompt."""
    what: str
    """prompt, observation, reward or error."""
    expected: Any
    """What the record holds."""
    got: Any
    """What the re-run environment produced."""


def _plain(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as `{"role", "content", "name"?}` dicts, whatever type the env returned."""
    out = []
    for m in messages:
        m = m if isinstance(m, dict) else m.model_dump()
        out.append({k: m[k] for k in ("role", "content", "name") if m.get(k) is not None})
    return out


def _recorded_turns(record: TrajectoryRecord) -> list[tuple[str, list[dict[str, Any]]]]:
    """(assistant text, the messages that follow it) for each recorded turn."""
    turns: list[tuple[str, list[dict[str, Any]]]] = []
    for message in record.messages[record.prompt_messages_count :]:
        if message.role == "assistant":
            turns.append((message.content, []))
        elif turns:
            turns[-1][1].append(message.to_template())
    return turns


def _step(env: Any, turn: int, action: str) -> tuple[Any, float, bool] | Divergence:
    """One env step as (observation, reward, ended), or the error as a divergence."""
    try:
        observation, reward, terminated, truncated, _ = env.step(action)
    except Exception as error:  # any env failure is the divergence we report
        return Divergence(turn, "error", "a step", f"{type(error).__name__}: {error}")
    return observation, float(reward), bool(terminated or truncated)


def _replay_turns(env: Any, record: TrajectoryRecord) -> Divergence | None:
    turns = _recorded_turns(record)
    for turn, (action, expected) in enumerate(turns):
        result = _step(env, turn, action)
        if isinstance(result, Divergence):
            return result
        observation, reward, ended = result
        last = turn == len(turns) - 1
        if ended and not last:
            return Divergence(turn, "termination", "episode goes on", "env ended the episode")
        # The collector keeps no observation from a final step (or never stepped a cut turn).
        if not (last and not expected) and _plain(observation) != expected:
            return Divergence(turn, "observation", expected, _plain(observation))
        if last and ended:
            expected_reward = record.reward_components.get("verifier", record.reward)
            if not math.isclose(reward, expected_reward, rel_tol=1e-6, abs_tol=1e-9):
                return Divergence(turn, "reward", expected_reward, reward)
        if last and not ended and record.termination.kind == "terminated":
            return Divergence(turn, "termination", "env ends the episode", "episode goes on")
    return None


def verify_record(record: TrajectoryRecord, make_env: Callable[[str], Any]) -> Divergence | None:
    """Re-run the env from the record's seed with its assistant texts; the first divergence.

    Checks the prompt, every observation, that the env ends exactly after the last turn when the
    record says it did, and the env's final reward against the record's `verifier` component
    (the env's own reward; other sources are added outside the env).
    """
    env = make_env(record.env_id)
    try:
        messages, _ = env.reset(seed=record.seed)
        prompt = [m.to_template() for m in record.messages[: record.prompt_messages_count]]
        if _plain(messages) != prompt:
            return Divergence(None, "prompt", prompt, _plain(messages))
        return _replay_turns(env, record)
    finally:
        env.close()


# --recompute-logprobs


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

    from agent_grpo.logprobs import token_logprobs

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
    table = Table(*headers, title=f"logprob drift {record.uid}")
    for d in drifts:
        table.add_row(str(d.turn), str(d.tokens), _format(d.sampler_mean), _format(d.sampler_max),
                      _format(d.old_mean), _format(d.old_max))  # fmt: skip
    return table
