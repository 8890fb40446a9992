"""`bench/load.py` counts other processes' CPU as foreign and never the benchmark's own, so a
busy machine cannot pass for a quiet one; `bench/report.py` quotes no busy result."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from load import LoadWindow  # noqa: E402
from report import document  # noqa: E402

# It measures other processes' load: a test beside it on another worker would be that load.
pytestmark = pytest.mark.serial

BURN = [sys.executable, "-c", "import time\nend = time.time() + 30\nwhile time.time() < end: pass"]


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_process_the_bench_does_not_own_is_foreign() -> None:
    # started before the window and reaped after it: none of its CPU is ours
    burner = subprocess.Popen(BURN)
    try:
        time.sleep(0.3)
        with LoadWindow(max_foreign_cores=0.25) as window:
            time.sleep(1.5)
    finally:
        burner.kill()
        burner.wait()
    assert window.foreign_cores > 0.5  # one core spinning, measured in 10 ms ticks
    assert window.busy and window.as_dict()["clean"] is False


def test_the_bench_own_work_and_its_reaped_children_are_not_foreign() -> None:
    with LoadWindow() as idle:  # whatever else runs on this machine now, for comparison
        time.sleep(1.4)
    with LoadWindow() as window:
        _spin(0.7)  # this process: a whole core
        child = subprocess.run([*BURN[:2], "import time\nend = time.time() + 0.7\n"
                                "while time.time() < end: pass"], check=True)  # fmt: skip
    assert child.returncode == 0
    # 1.4 s of our CPU in about 1.5 s of wall: counted as foreign it would add ~0.9 cores
    assert window.foreign_cores < idle.foreign_cores + 0.45
    assert window.loadavg_before and window.loadavg_after


def test_a_running_descendant_is_the_bench_s_own_when_the_window_counts_the_tree() -> None:
    # a helper that outlives the window (as Ray's raylet and actors do): foreign by default,
    # the bench's own with `own_cpu` counting the process tree
    from load import process_tree_cpu_s

    helper = subprocess.Popen(BURN)
    try:
        time.sleep(0.3)
        with LoadWindow() as plain:
            time.sleep(1.5)
        with LoadWindow(own_cpu=lambda: process_tree_cpu_s(os.getpid())) as tree:
            time.sleep(1.5)
    finally:
        helper.kill()
        helper.wait()
    assert plain.foreign_cores > 0.5  # the helper's core
    assert tree.foreign_cores < plain.foreign_cores - 0.45


ORPHANING = [sys.executable, "-c", "import subprocess, sys, time\n"
             "subprocess.Popen([sys.executable, '-c', 'import time\\nend = time.time() + 1.5\\n"
             "while time.time() < end: pass'])\ntime.sleep(30)"]  # fmt: skip
"""A parent that starts a 1.5 s burner and sleeps: killed, it leaves the burner re-parented,
as a killed Ray actor leaves its vLLM engine process."""


def test_a_descendant_orphaned_by_a_kill_stays_the_bench_s_own() -> None:
    from load import TreeCpu, process_tree_cpu_s

    tree = TreeCpu(os.getpid(), every_s=0.1)
    before_tree, before_plain = tree(), process_tree_cpu_s(os.getpid())
    parent = subprocess.Popen(ORPHANING)
    time.sleep(1.0)  # the burner has burnt about 1 s by now, seen by the polling thread
    parent.kill()
    parent.wait()
    time.sleep(1.0)  # the burner runs out, no longer below this process
    gained_tree = tree() - before_tree
    gained_plain = process_tree_cpu_s(os.getpid()) - before_plain
    tree.close()
    assert gained_plain < 0.5  # the orphan's CPU left the tree with it
    assert gained_tree > 0.6  # kept: seen before the kill


def _busy_train_result() -> dict[str, object]:
    machine = {"cpu_model": "AMD EPYC", "cpu_count": 2, "usable_cores": 2, "memory_gb": 23.5,
               "torch_threads": 2, "torch": "2.13.0+cpu", "transformers": "5.19.0",
               "python": "3.11.7", "platform": "Linux"}  # fmt: skip
    return {
        "benchmark": "train_throughput", "quick": False, "clean": False, "foreign_cores": 0.9,
        "busy_parts": ["trl: no clean run"], "started_at": "2026-12-03T23:00:00+00:00",
        "wall_s": 100.0, "loadavg_start": [0.1, 0.1, 0.1], "loadavg_end": [2.0, 1.0, 0.5],
        "machine": machine, "settings": {"max_foreign_cores": 0.25},
        "results": {"sides": {"trl": {"ok": True, "step_s": 1.0}}},
    }  # fmt: skip


@pytest.mark.parametrize("name", ["train_throughput", "train_throughput-notes"])
def test_a_busy_result_is_refused_not_quoted(name: str) -> None:
    page = document({name: _busy_train_result()}, "benchmarks.png")
    assert f"## {name}\n\nThe latest run" in page and "is not quoted" in page
    assert "trl: no clean run" in page and "busy: not quoted" in page
    assert "| trl |" not in page and "x TRL" not in page


def test_a_burst_the_mean_would_hide_makes_a_sampled_window_busy() -> None:
    # one core of someone else's work (not our child: started before, reaped after) for the
    # first ~5 s of a 15 s window: the mean is about a third of a core, a burst a whole one
    from load import BURST_S, MAX_BURST_CORES, process_tree_cpu_s

    burner = subprocess.Popen(BURN)
    try:
        with LoadWindow(max_foreign_cores=0.9) as window:
            stop_at = time.monotonic() + BURST_S + 0.5
            end = time.monotonic() + 3 * BURST_S
            while time.monotonic() < end:
                if burner.poll() is None and time.monotonic() > stop_at:
                    os.kill(burner.pid, signal.SIGSTOP)  # quiet from here on
                window.sample()
                time.sleep(0.2)
    finally:
        burner.kill()
        burner.wait()
    assert window.foreign_cores < 0.9 < window.burst_cores  # the mean alone would pass it
    assert window.burst_cores > MAX_BURST_CORES and window.busy
    assert process_tree_cpu_s(os.getpid()) > 0  # this process's own CPU, read from /proc
