"""Inspecting a run: `inspect RUN`'s metrics table and curves, and checks of stored records.

`inspect RUN` reads only `metrics.jsonl`, so inspecting a long run reads kilobytes, never the
trajectories. Metric names are matched against a short list of accepted keys per column (the
first key present wins); a column whose keys are all missing at a step shows '-'. The first key
of each column is the canonical name the trainer should log. Each reward component's mean
(`rewards/<name>/mean`, as TRL logs them) gets a column, and a last column flags what a mean
hides (`agent_grpo.inspect.flags`: dead groups, env/verifier errors, malformed calls,
truncation). `curves.png` draws them over integer step ticks, the held-out eval's success beside
the training success.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from agent_grpo._moved import moved_names
from agent_grpo.inspect.flags import row_flags
from agent_grpo.inspect.visible import visible, visible_text
from agent_grpo.run_dir.reader import AFTER_STEPS
from agent_grpo.run_dir.writer import RunWriter

__all__ = [
    "COLUMNS",
    "PLOTS",
    "Curve",
    "add_inspect_parser",
    "curves_figure",
    "format_value",
    "inspect_run",
    "metric",
    "metrics_table",
    "panel_curves",
    "plot_curves",
    "reward_component_keys",
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
names; a tuple so that a renamed metric can keep reading old runs. The run's reward components
(`rewards/<name>/mean`) follow "reward std", and a "flags" column (`row_flags`) comes last."""

PLOTS = [
    "reward", "success", "reward components", "model tok",
    "truncated", "KL ref", "clip frac", "lp mismatch",
]  # fmt: skip
"""The panels of the PNG, in a 2 x 4 grid: a `COLUMNS` header each, except "reward
components" (one line per `rewards/<name>/mean`); "success" also draws the held-out eval."""

_COMPONENT = re.compile(r"rewards/(.+)/mean")


def metric(row: Mapping[str, Any], keys: Sequence[str]) -> float | None:
    """The first of `keys` present in `row` with a finite number, else None."""
    for key in keys:
        value = row.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            return float(value)
    return None


def reward_component_keys(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The `rewards/<name>/mean` keys of the run, in the order they first appear."""
    keys = (k for row in rows for k in row if _COMPONENT.fullmatch(k))
    return list(dict.fromkeys(keys))


def _columns(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, tuple[str, ...]]]:
    """`COLUMNS` with the run's reward components after "reward std"."""
    at = [name for name, _ in COLUMNS].index("reward std") + 1
    components = [(key, (key,)) for key in reward_component_keys(rows)]
    return [*COLUMNS[:at], *components, *COLUMNS[at:]]


def format_value(value: float | None) -> str:
    """A metric for a table cell: 4 significant figures, '-' when missing."""
    if value is None:
        return "-"
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"


def _step_label(row: Mapping[str, Any]) -> str:
    """The row's step as an integer (JSON may hold `3.0`), or '-'."""
    step = row.get("step")
    if isinstance(step, int | float) and math.isfinite(step) and step == int(step):
        return str(int(step))
    return "-" if step is None else str(step)


def metrics_table(rows: Sequence[Mapping[str, Any]], title: str = "metrics") -> Table:
    """One row per step, one column per metric (`COLUMNS` and the reward components) logged at
    least once in the run, a value missing at a step shown as '-'; then the step's flags when
    any step has one."""
    logged = [
        (name, keys)
        for name, keys in _columns(rows)
        if any(metric(r, keys) is not None for r in rows)
    ]
    cells = [[format_value(metric(row, keys)) for _, keys in logged] for row in rows]
    headers = ["step", *(name for name, _ in logged)]
    flags = ["; ".join(row_flags(row)) for row in rows]
    if any(flags):
        headers.append("flags")
        cells = [[*line, flag] for line, flag in zip(cells, flags, strict=True)]
    # metric keys and odd steps come from the run directory: shown, never obeyed as terminal
    # controls or read as rich markup
    lines = [[visible(_step_label(row)), *map(visible, line)] for row, line in
             zip(rows, cells, strict=True)]  # fmt: skip
    table = Table(title=visible_text(title))
    for i, header in enumerate(headers):
        width = max((len(line[i]) for line in lines), default=1)
        table.add_column(visible_text(header), justify="left" if header == "flags" else "right",
                         no_wrap=True, min_width=width)  # fmt: skip
    for line in lines:
        table.add_row(*map(Text, line))
    return table


@dataclass(frozen=True)
class Curve:
    """One line of a panel: a label and its (step, value) points."""

    label: str
    """Legend text."""
    steps: list[float]
    """x: the steps that logged a finite value."""
    values: list[float]
    """y, one per step."""


def _series(
    rows: Sequence[Mapping[str, Any]], keys: Sequence[str], at: str = "step"
) -> tuple[list[float], list[float]]:
    """(x, value) of the first of `keys` each row has; x is the row's `at` (else its step)."""
    points = [(row.get(at, row.get("step")), metric(row, keys)) for row in rows]
    steps_values = [
        (float(s), v) for s, v in points if isinstance(s, int | float) and v is not None
    ]
    return [s for s, _ in steps_values], [v for _, v in steps_values]


def _curve(
    rows: Sequence[Mapping[str, Any]], label: str, keys: Sequence[str], at: str = "step"
) -> Curve:
    steps, values = _series(rows, keys, at)
    return Curve(label, steps, values)


def panel_curves(rows: Sequence[Mapping[str, Any]], panel: str) -> list[Curve]:
    """The curves one `PLOTS` panel draws, those without a point left out."""
    columns = dict(COLUMNS)
    if panel == "reward components":
        keys = reward_component_keys(rows)
        curves = [
            _curve(rows, k.removeprefix("rewards/").removesuffix("/mean"), (k,)) for k in keys
        ]
    elif panel == "success":
        curves = [
            _curve(rows, "train", columns["success"]),
            # an evaluation between steps scored the policy after its step's update: plotted
            # where that policy's own rollouts would be, as the final one is
            _curve(rows, "eval (held-out)", columns["eval success"], AFTER_STEPS),
        ]
    else:
        curves = [_curve(rows, panel, columns[panel])]
    return [c for c in curves if c.steps]


def _step_range(rows: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """The x range of the curves: every step of the run, at least one step wide either side of a
    single one (narrower, no integer lies between the ticks)."""
    steps = [float(s) for row in rows if isinstance(s := row.get("step"), int | float)]
    low, high = min(steps, default=0.0), max(steps, default=0.0)
    pad = 0.5 if high - low >= 1 else 1.0
    return low - pad, high + pad


def curves_figure(rows: Sequence[Mapping[str, Any]], title: str = "") -> Any:
    """The matplotlib figure of the `PLOTS` panels (reward with its std band), steps as
    integer ticks."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede importing pyplot
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    # One step axis for every panel: a metric logged at a single step (the final eval) sits
    # where it happened, not alone on an axis of its own around that step.
    fig, axes = plt.subplots(2, 4, figsize=(16, 6), constrained_layout=True, sharex=True)
    axes.flat[0].set_xlim(*_step_range(rows))
    for ax, panel in zip(axes.flat, PLOTS, strict=True):
        ax.set_title(panel)
        ax.set_xlabel("step")
        # Steps are whole numbers: no "0.5" tick between two of them.
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        curves = panel_curves(rows, panel)
        if not curves:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
            continue
        for curve in curves:
            ax.plot(curve.steps, curve.values, marker="o", markersize=3, label=_label(curve.label))
        if panel == "reward":
            _std_band(ax, rows, curves[0])
        if len(curves) > 1 or panel == "reward components":
            ax.legend(fontsize="small")
    fig.suptitle(_label(title))
    return fig


def _label(text: str) -> str:
    """A name from the run directory as matplotlib text: `$` not read as mathtext (a metric
    key `a$\\foo{$` stopped the plot), lone surrogates not passed to the font code."""
    return visible(text).encode("utf-8", "replace").decode("utf-8").replace("$", r"\$")


def plot_curves(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    """Draw `curves_figure(rows)` into a PNG at `path`: written beside it and renamed over it,
    so a symlink there (a run directory's author put it) is replaced, never written through."""
    fig = curves_figure(rows, title)
    import matplotlib.pyplot as plt  # after `curves_figure` chose the Agg backend

    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(partial, dpi=80, format=path.suffix.removeprefix(".") or "png")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
        plt.close(fig)
    return path


def _std_band(ax: Any, rows: Sequence[Mapping[str, Any]], mean: Curve) -> None:
    std_steps, stds = _series(rows, dict(COLUMNS)["reward std"])
    if std_steps == mean.steps:
        lower = [m - s for m, s in zip(mean.values, stds, strict=True)]
        upper = [m + s for m, s in zip(mean.values, stds, strict=True)]
        ax.fill_between(mean.steps, lower, upper, alpha=0.2)


def inspect_run(path: str | Path, out: Path | None = None, console: Console | None = None) -> Path:
    """Print the metrics table of the run at `path` and write its curves PNG; return the PNG."""
    run = RunWriter.open(path)
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
    console.print(visible_text(f"curves: {png}"))
    return 0


def add_inspect_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `inspect RUN [--out PNG]` on an argparse subparsers object."""
    p = subparsers.add_parser("inspect", help="per-step metrics table and curves of a run")
    p.add_argument("run", type=Path, help="run directory")
    p.add_argument("--out", type=Path, help="PNG path (default: RUN/curves.png)")
    p.set_defaults(func=_cmd_inspect)
    return p


if not TYPE_CHECKING:  # hidden from the type checker, which would otherwise accept any name here
    __getattr__ = moved_names(
        __name__,
        dict.fromkeys(("Divergence", "verify_record"), "agent_grpo.inspect.verify")
        | dict.fromkeys(
            ("TurnDrift", "drift_table", "logprob_drift", "recompute_logprobs"),
            "agent_grpo.inspect.drift",
        ),
    )
