"""Tool-call cost: latency of the sandboxed `python` tool and of `run_sandboxed` (today's, and the
one before issue #14, side by side), calls/s under concurrency, and the in-process calculator tool
for contrast.

    .venv/bin/python bench/tool_runtime.py [--quick] [--calls 100] [--concurrency 1 2 4 8]

Methods:
- `python tool`: `run_tool_call(python, {"code": ...})`, what an environment step pays: argument
  validation, a worker thread with the tool's timeout, the sandbox, result formatting.
- `run_sandboxed`: the bubblewrap sandbox alone, running `print(1)` (namespaces, a cgroup, rlimits).
- `run_sandboxed before #14`: the hand-written namespace sandbox it replaced, running `print(1)`,
  loaded from git history (`OLD_SANDBOX_COMMIT`, its last version) rather than kept in the tree:
  it is unsafe (issue #14) and nothing else may call it. Skipped where git or the history is
  missing (a source tarball).
- `calculator tool`: `run_tool_call(calculator, ...)`: the same tool layer, but in-process.
- `calculator direct`: the decorated function called as a plain function (no thread, no timeout).
Latency is measured one call at a time (p50, p99 and max over `--calls`; with 100 calls p99 is
the second slowest). The sandboxed methods take turns call by call, so a change in the machine's
load during the run hits them alike. Throughput is `--burst` calls submitted at once to a pool of
N threads, divided by the wall time until the last finishes. Every call's output is checked.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

from record import add_common_flags, bench_run, print_table, set_threads

CODE = "import json\nprint(json.dumps({'sum': sum(range(1000))}))\n"
EXPECTED = '{"sum": 499500}'
EXPRESSION = "((347 * 29) - 1181) / 7"
OLD_SANDBOX_COMMIT = "3e5ab887990931cdb6efab6c71f245cef51e84fa"
"""The last commit holding the sandbox that bubblewrap replaced (tools/sandbox.py and
_sandbox_init.py then)."""
ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Sizes."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_flags(p)
    p.add_argument("--calls", type=int, default=100, help="sequential calls for latency")
    p.add_argument("--burst", type=int, default=32, help="calls per concurrency level")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--calculator-calls", type=int, default=2000)
    args = p.parse_args(argv)
    if args.quick:
        args.calls, args.burst, args.concurrency, args.calculator_calls = 5, 4, [1, 2], 50
    return args


def old_sandbox(directory: Path) -> ModuleType | None:
    """The pre-#14 sandbox module, written out of git history into `directory` (None: no git)."""
    for name in ("sandbox.py", "_sandbox_init.py"):
        source = f"{OLD_SANDBOX_COMMIT}:tools/{name}"
        shown = subprocess.run(["git", "-C", str(ROOT), "show", source], capture_output=True)
        if shown.returncode != 0:
            return None
        (directory / name).write_bytes(shown.stdout)
    spec = importlib.util.spec_from_file_location("old_sandbox", directory / "sandbox.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def methods(old: ModuleType | None) -> dict[str, Callable[[], bool]]:
    """Each method as a zero-argument call that returns whether its output was right."""
    from agent_grpo.sandbox.runner import run_sandboxed
    from agent_grpo.tools.calculator import calculator
    from agent_grpo.tools.python import python
    from agent_grpo.tools.tool import run_tool_call

    answer = calculator(expression=EXPRESSION)

    def python_tool() -> bool:
        record = run_tool_call(python, {"code": CODE})
        return record.error is None and EXPECTED in str(record.result)

    def sandbox() -> bool:
        result = run_sandboxed("print(1)")
        return result.exit_code == 0 and result.stdout == "1\n"

    def sandbox_before() -> bool:
        assert old is not None
        result = old.run_sandboxed("print(1)")
        return bool(result.exit_code == 0 and result.stdout == "1\n")

    def calculator_tool() -> bool:
        record = run_tool_call(calculator, {"expression": EXPRESSION})
        return record.error is None and str(record.result) == answer

    def calculator_direct() -> bool:
        return bool(calculator(expression=EXPRESSION) == answer)

    return {
        "python tool": python_tool,
        "run_sandboxed": sandbox,
        **({"run_sandboxed before #14": sandbox_before} if old else {}),
        "calculator tool": calculator_tool,
        "calculator direct": calculator_direct,
    }


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), nearest-rank: a value that was actually measured."""
    ordered = sorted(values)
    rank = max(1, round(q / 100 * len(ordered) + 0.5 - 1e-9))
    return ordered[min(rank, len(ordered)) - 1]


def latency(call: Callable[[], bool], n: int) -> dict[str, Any]:
    """p50/p99/max/mean latency (ms) of `n` sequential calls, and how many were wrong."""
    return interleaved_latency({"call": call}, n)["call"]


def interleaved_latency(calls: dict[str, Callable[[], bool]], n: int) -> dict[str, dict[str, Any]]:
    """`latency` of each call, measured in turns: call 1 of each, then call 2 of each, ..."""
    for call in calls.values():
        call()  # warm-up: imports, first process start
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    wrong = dict.fromkeys(calls, 0)
    for _ in range(n):
        for name, call in calls.items():
            started = time.perf_counter()
            wrong[name] += not call()
            seconds[name].append(time.perf_counter() - started)
    return {name: _summary(seconds[name], wrong[name]) for name in calls}


def _summary(seconds: list[float], wrong: int) -> dict[str, Any]:
    ms = [1000 * s for s in seconds]
    n = len(ms)
    return {
        "calls": n,
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms),
        "mean_ms": statistics.fmean(ms),
        "wrong": wrong,
    }


def throughput(call: Callable[[], bool], threads: int, burst: int) -> dict[str, Any]:
    """Calls per second with `threads` workers running `burst` calls."""
    with ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        results = list(pool.map(lambda _: call(), range(burst)))
        wall = time.perf_counter() - started
    return {"threads": threads, "calls": burst, "wall_s": wall, "calls_per_s": burst / wall,
            "wrong": results.count(False)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Latency, then throughput per concurrency level, per method."""
    args = parse_args(argv)
    set_threads(args.threads)
    with bench_run("tool_runtime", args) as run, tempfile.TemporaryDirectory() as old_dir:
        old = old_sandbox(Path(old_dir))
        run.results["old_sandbox_commit"] = OLD_SANDBOX_COMMIT if old else None
        calls = methods(old)
        sandboxed = {k: v for k, v in calls.items() if not k.startswith("calculator")}
        latencies = interleaved_latency(sandboxed, args.calls)
        results: dict[str, Any] = {}
        for name, call in calls.items():
            in_process = name not in sandboxed
            burst = args.calculator_calls if in_process else args.burst
            results[name] = {
                "latency": latency(call, args.calculator_calls) if in_process else latencies[name],
                "throughput": [throughput(call, t, burst) for t in args.concurrency],
            }
        run.results["methods"] = results
        print_table("latency, one call at a time (ms)",
                    ["method", "calls", "p50", "p99", "max", "wrong"],
                    [[k, v["latency"]["calls"], v["latency"]["p50_ms"], v["latency"]["p99_ms"],
                      v["latency"]["max_ms"], v["latency"]["wrong"]]
                     for k, v in results.items()])  # fmt: skip
        print_table("calls per second by worker threads",
                    ["method", *(f"{t} threads" for t in args.concurrency)],
                    [[k, *(t["calls_per_s"] for t in v["throughput"])]
                     for k, v in results.items()])  # fmt: skip


if __name__ == "__main__":
    main()
