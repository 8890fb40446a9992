"""Was the machine quiet? The CPU other processes used while a benchmark measured.

On a 2-core machine a second busy process makes every OpenMP job several times slower, and the
1-minute load average cannot tell a busy machine from the benchmark's own threads (a run at 2
threads puts it near 2 by itself). So we measure the foreign CPU directly: over a window, the
machine's busy CPU seconds (`/proc/stat`: user, nice, system, irq, softirq and steal, which a
hypervisor takes for other guests) minus the CPU seconds of this process and of the children it
has reaped (`getrusage`, which includes their own reaped descendants, such as a vLLM engine
process), divided by the wall seconds: how many cores something else kept busy on average.

A mean hides a burst (a 30-second compile during a 2-minute run averages 0.25 cores but slows
one step threefold), so a window that is sampled (`sample()`, which `isolated.run_isolated`
calls while it waits) also keeps its busiest `BURST_S` seconds. A window with a mean above
`--max-foreign-cores` (default `MAX_FOREIGN_CORES`), or a burst above `MAX_BURST_CORES`, is
*busy*: its figures are marked so, `summarise` steps leave it out, and `bench/report.py`
quotes no busy result. Kernel threads working for us (page reclaim, say) count as foreign: the
check can only call a run busy that was quiet, never the other way.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "BURST_S",
    "MAX_BURST_CORES",
    "MAX_FOREIGN_CORES",
    "LoadWindow",
    "TreeCpu",
    "machine_busy_s",
    "own_cpu_s",
    "process_tree_cpu_s",
]

MAX_FOREIGN_CORES = 0.25
"""Cores' worth of other work above which a measurement is busy: a quarter core is about what
one more Python process polling in a loop takes, enough to move a 2-core result measurably."""

MAX_BURST_CORES = 0.75
"""Cores' worth of other work over any `BURST_S` seconds above which a window is busy."""
BURST_S = 5.0
"""The span bursts are measured over."""

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""`/proc/stat` cpu columns that are work: user nice system (idle iowait) irq softirq steal."""


def machine_busy_s() -> float:
    """CPU seconds every process on the machine has run since boot (all cores)."""
    line = Path("/proc/stat").read_text().splitlines()[0].split()
    ticks = [int(v) for v in line[1:]]
    return sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks)) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of every child it has reaped (and theirs)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _processes() -> tuple[dict[int, list[int]], dict[int, tuple[float, float]]]:
    """Every process's children, and its own and its reaped children's CPU seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    usage: dict[int, tuple[float, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after the name: state ppid ... utime(12) stime(13) cutime(14) cstime(15)
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        own = (int(fields[11]) + int(fields[12])) / tick
        usage[int(entry.name)] = (own, (int(fields[13]) + int(fields[14])) / tick)
    return children, usage


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds a running process and its running descendants have used so far (from
    `/proc/PID/stat`), for a burst span before the process is reaped; 0 for one that is gone."""
    children, usage = _processes()
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += sum(usage.get(current, (0.0, 0.0)))
        todo += children.get(current, [])
    return total


class TreeCpu:
    """`own_cpu` for a bench whose descendants can die unreaped: Ray kills an actor, whose own
    children (a vLLM engine process) are then re-parented, so their CPU never reaches any
    ancestor's reaped-children count and `process_tree_cpu_s` would lose it, calling the bench's
    own work foreign. A thread reads the tree every `every_s` seconds and keeps the last CPU it
    saw of each process, gone or not. Only processes' own times are summed (a reaped child's
    is in its parent's reaped count as well), so one that lived less than `every_s` unseen is
    missed: the error is on the side of calling a run busy."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        import threading

        self.pid, self.every_s = pid, every_s
        self.seen: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.read()
        threading.Thread(target=self._poll, name="tree-cpu", daemon=True).start()

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            self.read()

    def read(self) -> float:
        """The tree's CPU seconds so far, its dead members' included."""
        children, usage = _processes()
        todo, tree = [self.pid], []
        while todo:
            current = todo.pop()
            tree.append(current)
            todo += children.get(current, [])
        with self._lock:
            for pid in tree:
                if pid in usage:
                    self.seen[pid] = usage[pid][0]
            # own times only: a reaped child's time is in its parent's reaped count too
            return sum(self.seen.values())

    def __call__(self) -> float:
        return self.read()

    def close(self) -> None:
        """Stop the polling thread."""
        self._stop.set()


@dataclass
class LoadWindow:
    """`with LoadWindow() as w: ...`; then `w.foreign_cores` and `w.busy`."""

    max_foreign_cores: float = MAX_FOREIGN_CORES
    loadavg_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """The 1/5/15-minute load averages when the window opened."""
    loadavg_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """The same when it closed."""
    foreign_cores: float = 0.0
    """Cores other processes kept busy on average over the window."""
    wall_s: float = 0.0
    burst_cores: float = 0.0
    """The most cores other processes kept busy over any `BURST_S` seconds between samples
    (0 when the window was not sampled)."""
    own_cpu: Callable[[], float] = own_cpu_s
    """This benchmark's own CPU seconds so far: by default this process and its reaped
    children; a bench whose helpers outlive the window (Ray's raylet and actors) passes
    `lambda: process_tree_cpu_s(os.getpid())`, which also counts running descendants."""
    _start: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0), repr=False)
    _last: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0), repr=False)

    def __enter__(self) -> LoadWindow:
        self.loadavg_before = os.getloadavg()
        self._start = self._last = (time.monotonic(), machine_busy_s(), self.own_cpu())
        return self

    def sample(self, own_running_s: Callable[[], float] = lambda: 0.0) -> None:
        """Close a burst span if `BURST_S` have passed since the last one. `own_running_s`:
        the CPU seconds the caller's running (not yet reaped) children have used so far, which
        `getrusage` cannot see yet (`process_tree_cpu_s`)."""
        now = time.monotonic()
        if now - self._last[0] < BURST_S:
            return
        busy, own = machine_busy_s(), self.own_cpu() + own_running_s()
        foreign = (busy - self._last[1]) - (own - self._last[2])
        self.burst_cores = max(self.burst_cores, max(0.0, foreign) / (now - self._last[0]))
        self._last = (now, busy, own)

    def __exit__(self, *exc: object) -> None:
        wall0, busy0, own0 = self._start
        self.wall_s = time.monotonic() - wall0
        foreign = (machine_busy_s() - busy0) - (self.own_cpu() - own0)
        self.foreign_cores = max(0.0, foreign) / max(self.wall_s, 1e-9)
        self.loadavg_after = os.getloadavg()

    @property
    def busy(self) -> bool:
        """More foreign work than the thresholds: the window's figures are not quotable."""
        return self.foreign_cores > self.max_foreign_cores or self.burst_cores > MAX_BURST_CORES

    def as_dict(self) -> dict[str, object]:
        """What a results file keeps of the window."""
        return {
            "loadavg_before": list(self.loadavg_before),
            "loadavg_after": list(self.loadavg_after),
            "foreign_cores": round(self.foreign_cores, 3),
            "burst_cores": round(self.burst_cores, 3),
            "max_foreign_cores": self.max_foreign_cores,
            "clean": not self.busy,
        }
