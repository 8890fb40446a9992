"""Was the machine quiet? The CPU other processes used while a benchmark measured.

On a 2-core machine a second busy process makes every OpenMP job several times slower, and the
1-minute load average cannot tell a busy machine from the benchmark's own threads (a run at 2
threads puts it near 2 by itself). So we measure the foreign CPU directly: over a window, the
machine's busy CPU seconds (`/proc/stat`: user, nice, system, irq, softirq and steal, which a
hypervisor takes for other guests) minus the CPU seconds of this process and of the children it
has reaped (`getrusage`, which includes their own reaped descendants, such as a vLLM engine
process), divided by the wall seconds: how many cores something else kept busy on average.

A window with more than `--max-foreign-cores` (default `MAX_FOREIGN_CORES`) is *busy*: its
figures are marked so, `summarise` steps leave it out, and `bench/report.py` quotes no busy
result. Kernel threads working for us (page reclaim, say) count as foreign: the check can only
call a run busy that was quiet, never the other way.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["MAX_FOREIGN_CORES", "LoadWindow", "machine_busy_s", "own_cpu_s"]

MAX_FOREIGN_CORES = 0.25
"""Cores' worth of other work above which a measurement is busy: a quarter core is about what
one more Python process polling in a loop takes, enough to move a 2-core result measurably."""

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
    _start: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0), repr=False)

    def __enter__(self) -> LoadWindow:
        self.loadavg_before = os.getloadavg()
        self._start = (time.monotonic(), machine_busy_s(), own_cpu_s())
        return self

    def __exit__(self, *exc: object) -> None:
        wall0, busy0, own0 = self._start
        self.wall_s = time.monotonic() - wall0
        foreign = (machine_busy_s() - busy0) - (own_cpu_s() - own0)
        self.foreign_cores = max(0.0, foreign) / max(self.wall_s, 1e-9)
        self.loadavg_after = os.getloadavg()

    @property
    def busy(self) -> bool:
        """More foreign work than the threshold: the window's figures are not quotable."""
        return self.foreign_cores > self.max_foreign_cores

    def as_dict(self) -> dict[str, object]:
        """What a results file keeps of the window."""
        return {
            "loadavg_before": list(self.loadavg_before),
            "loadavg_after": list(self.loadavg_after),
            "foreign_cores": round(self.foreign_cores, 3),
            "max_foreign_cores": self.max_foreign_cores,
            "clean": not self.busy,
        }
