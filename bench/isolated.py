"""Run one measurement in a fresh Python process and read its peak resident memory.

Memory is measured as resident set size (RSS), the memory the process really holds, from
`/proc/self/status`:
- `VmHWM` is the RSS high-water mark. Writing `5` to `/proc/self/clear_refs` resets it to the
  current RSS (Linux >= 4.0), so a measured section's peak excludes model loading before it.
- The whole child's peak comes from `os.wait4`'s `ru_maxrss` (a fresh process per measurement, so
  allocator caches from an earlier measurement never hide or inflate a later one).
Children get `MALLOC_MMAP_THRESHOLD_=65536`: with glibc's default dynamic threshold, a freed large
block can stay in the heap and be reused without raising RSS, which would make a later peak look
smaller than the tensors it held. RSS also counts torch's own code and caches, so we report both
the absolute peak and the peak minus the RSS at the start of the section.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from load import MAX_FOREIGN_CORES, LoadWindow, process_tree_cpu_s

__all__ = [
    "ChildResult",
    "PeakWindow",
    "child_env",
    "current_rss_mb",
    "exit_on_sigterm",
    "peak_rss_mb",
    "process_peak_rss_mb",
    "reset_peak_rss",
    "run_isolated",
    "write_child_result",
]

_MB = 1024.0  # /proc and ru_maxrss report KiB


def _status_kib(field: str) -> float:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return float(match.group(1)) if match else float("nan")


def current_rss_mb() -> float:
    """This process's resident memory now, in MiB."""
    return _status_kib("VmRSS") / _MB


def peak_rss_mb() -> float:
    """This process's RSS high-water mark since start or the last `reset_peak_rss`, in MiB."""
    return _status_kib("VmHWM") / _MB


_peak_before_resets_mb = 0.0
"""The highest RSS high-water mark any `reset_peak_rss` has wiped (see `process_peak_rss_mb`)."""


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark to the current RSS; False where the kernel cannot."""
    global _peak_before_resets_mb
    _peak_before_resets_mb = max(_peak_before_resets_mb, peak_rss_mb())
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def process_peak_rss_mb() -> float:
    """This process's peak RSS since it started, in MiB, resets included. The reset also lowers
    what `ru_maxrss` reports at exit, so a child that used `PeakWindow` reports this instead."""
    return max(_peak_before_resets_mb, peak_rss_mb())


class PeakWindow:
    """Peak RSS of a section of code: `with PeakWindow() as w: ...`, then `w.as_dict()`."""

    def __enter__(self) -> PeakWindow:
        self.exact = reset_peak_rss()
        self.start_mb = current_rss_mb()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.started
        self.peak_mb = peak_rss_mb()

    def as_dict(self) -> dict[str, float | bool]:
        """Start RSS, peak RSS, their difference (MiB), seconds, and whether the reset worked."""
        return {
            "rss_start_mb": round(self.start_mb, 1),
            "rss_peak_mb": round(self.peak_mb, 1),
            "rss_growth_mb": round(self.peak_mb - self.start_mb, 1),
            "seconds": round(self.seconds, 3),
            "peak_reset_exact": self.exact,
        }


def child_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a measurement child: thread counts pinned, no dynamic mmap threshold."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        MALLOC_MMAP_THRESHOLD_="65536",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


@dataclass
class ChildResult:
    """What a measurement child returned and what it cost."""

    ok: bool
    """The child exited 0 and wrote its result."""
    result: dict[str, Any]
    """The JSON object the child wrote (empty on failure)."""
    max_rss_mb: float
    """Peak RSS of the whole child process (`ru_maxrss`), MiB."""
    wall_s: float
    """Seconds from start to exit."""
    error: str | None
    """Why it failed: exit status or timeout, and the tail of its output."""
    load: dict[str, Any]
    """The machine's load around the child (`load.LoadWindow.as_dict`): foreign cores, load
    averages before and after, and whether it was `clean`."""


def exit_on_sigterm() -> None:
    """Called in the child: turn SIGTERM into SystemExit, so `finally` blocks stop servers."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def write_child_result(path: str | Path, result: dict[str, Any]) -> None:
    """Called in the child: hand `result` back to `run_isolated`."""
    Path(path).write_text(json.dumps(result))


def _wait(pid: int, deadline: float, window: LoadWindow | None = None) -> tuple[int | None, float]:
    """Exit status and ru_maxrss (MiB) of `pid`, or (None, nan) past the deadline; samples
    `window`'s bursts meanwhile."""
    while time.monotonic() < deadline:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), usage.ru_maxrss / _MB
        if window is not None:
            window.sample(lambda: process_tree_cpu_s(pid))
        time.sleep(0.2)
    return None, float("nan")


def _stop_group(pid: int) -> None:
    """SIGTERM the child's session (it may stop servers it started), then SIGKILL what is left."""
    os.killpg(pid, signal.SIGTERM)
    code, _ = _wait(pid, time.monotonic() + 30.0)
    if code is None:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def run_isolated(
    script: Path,
    args: list[str],
    *,
    env: dict[str, str],
    timeout_s: float,
    max_foreign_cores: float = MAX_FOREIGN_CORES,
) -> ChildResult:
    """Run `python script args... --result FILE` in a new session; never raises on its failure.
    The CPU other processes used meanwhile is measured (`load.LoadWindow`)."""
    with tempfile.TemporaryDirectory(prefix="agent-grpo-bench-") as tmp:
        result_path, log_path = Path(tmp) / "result.json", Path(tmp) / "child.log"
        argv = [sys.executable, str(script), *args, "--result", str(result_path)]
        started = time.monotonic()
        with LoadWindow(max_foreign_cores) as window:
            with log_path.open("wb") as log:
                proc = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            code, max_rss = _wait(proc.pid, started + timeout_s, window)
            proc.returncode = code  # reaped by wait4 already; keep Popen from waiting again
            if code is None:
                _stop_group(proc.pid)
        wall = time.monotonic() - started
        tail = log_path.read_text(errors="replace")[-3000:]
        if code == 0 and result_path.exists():
            result = json.loads(result_path.read_text())
            return ChildResult(True, result, max_rss, wall, None, window.as_dict())
        reason = f"timed out after {timeout_s:.0f}s" if code is None else f"exit status {code}"
        error = f"{reason}; output tail:\n{tail}"
        return ChildResult(False, {}, max_rss, wall, error, window.as_dict())
