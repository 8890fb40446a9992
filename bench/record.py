"""What every benchmark records next to its numbers: the machine, the date, the load, the sizes.

Each script runs `with bench_run(name, args) as run:`, fills `run.results`, and gets one JSON file
in `bench/results/` (`NAME.json`, or `NAME.quick.json` for a `--quick` smoke run, which
`bench/report.py` ignores). On a small shared machine other processes compete for the cores, and
a reader must be able to see that: the 1-minute load average is taken at the start and at the
end, and the CPU other processes used over the whole run is measured (`load.py`). A run where it
passed `--max-foreign-cores` is recorded with `"clean": false`, says so on the console, and
`bench/report.py` does not quote it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from load import MAX_FOREIGN_CORES, LoadWindow
from rich.console import Console
from rich.table import Table

__all__ = [
    "RESULTS_DIR",
    "BenchRun",
    "add_common_flags",
    "bench_run",
    "cpu_model",
    "machine_info",
    "print_table",
    "set_threads",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
_INTERNAL_FLAGS = frozenset({"worker", "spec", "result", "length"})
"""Flags a script passes to its own child processes; not settings of the run."""
console = Console()
if not console.is_terminal:  # piped to a log: do not squeeze tables into 80 columns
    console.width = 150


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (`platform.processor()` is often empty)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gb() -> float:
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return round(pages * size / 2**30, 1)


def machine_info() -> dict[str, Any]:
    """CPU, cores, memory, library versions and the torch thread count of this process."""
    import torch
    import transformers

    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_gb": _memory_gb(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def set_threads(threads: int) -> None:
    """Use `threads` intra-op threads here and in every child process started afterwards."""
    import torch

    torch.set_num_threads(threads)
    # Children (workers, `vllm serve`) read these at start-up.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """`--quick`, `--threads` and `--out`, shared by every benchmark script."""
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a small shared machine two OpenMP threads "
        "spin against each other and against other processes)",
    )
    parser.add_argument("--out", type=Path, default=None, help="results JSON path")
    parser.add_argument(
        "--max-foreign-cores",
        type=float,
        default=MAX_FOREIGN_CORES,
        help="cores of other processes' work above which a measurement is busy: marked "
        f"not clean, left out of medians, not quoted in the docs (default {MAX_FOREIGN_CORES})",
    )


@dataclass
class BenchRun:
    """One benchmark run: its settings, machine, timing and load, and the results it fills in."""

    name: str
    settings: dict[str, Any]
    quick: bool
    machine: dict[str, Any] = field(default_factory=machine_info)
    started_at: str = field(default_factory=lambda: dt.datetime.now().astimezone().isoformat())
    loadavg_start: tuple[float, float, float] = field(default_factory=os.getloadavg)
    results: dict[str, Any] = field(default_factory=dict)
    load: LoadWindow = field(default_factory=LoadWindow)
    """Other processes' CPU over the whole run (opened by `bench_run`)."""
    busy_parts: list[str] = field(default_factory=list)
    """Measurements the script found busy on their own (children), each as one line."""

    @property
    def clean(self) -> bool:
        """No other process took more than the threshold, over the run or in any part."""
        return not self.load.busy and not self.busy_parts

    def to_json(self, wall_s: float) -> dict[str, Any]:
        """Everything, with the end-of-run load average taken now."""
        return {
            "clean": self.clean,
            "foreign_cores": round(self.load.foreign_cores, 3),
            "busy_parts": self.busy_parts,
            "benchmark": self.name,
            "quick": self.quick,
            "started_at": self.started_at,
            "wall_s": round(wall_s, 1),
            "loadavg_start": list(self.loadavg_start),
            "loadavg_end": list(os.getloadavg()),
            "machine": self.machine,
            "settings": self.settings,
            "results": self.results,
        }


@contextmanager
def bench_run(
    name: str, args: argparse.Namespace, own_cpu: Callable[[], float] | None = None
) -> Iterator[BenchRun]:
    """Record machine and load around a benchmark, then write its JSON (also on failure);
    `own_cpu`: what counts as the benchmark's own CPU (`LoadWindow.own_cpu`)."""
    settings = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k not in _INTERNAL_FLAGS
    }
    run = BenchRun(name, settings, bool(args.quick))
    run.load.max_foreign_cores = getattr(args, "max_foreign_cores", MAX_FOREIGN_CORES)
    if own_cpu is not None:
        run.load.own_cpu = own_cpu
    started = time.perf_counter()
    try:
        with run.load:
            yield run
    finally:
        out = args.out or RESULTS_DIR / (f"{name}.quick.json" if args.quick else f"{name}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = run.to_json(time.perf_counter() - started)
        out.write_text(json.dumps(payload, indent=2) + "\n")
        load = payload["loadavg_start"][0], payload["loadavg_end"][0]
        console.print(
            f"[dim]{run.machine['cpu_model']}, {run.machine['usable_cores']} cores, "
            f"{run.machine['torch_threads']} torch threads; 1-min load {load[0]:.2f} -> "
            f"{load[1]:.2f}; other processes {run.load.foreign_cores:.2f} cores; wrote {out}[/dim]"
        )
        if not run.clean:
            parts = "; ".join(run.busy_parts) or f"{run.load.foreign_cores:.2f} cores over the run"
            console.print(
                f"[red]busy machine: this result is recorded as not clean and is not quoted "
                f"({parts}; threshold {run.load.max_foreign_cores} cores)[/red]"
            )


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain table on the console; floats get 3 significant figures."""
    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(_cell(v) for v in row))
    console.print(table)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)
