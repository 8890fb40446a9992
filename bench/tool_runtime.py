"""Tool-call cost: latency of the sandboxed `python` tool and of `run_sandboxed`, calls/s under
concurrency, and the in-process calculator tool for contrast.

    .venv/bin/python bench/tool_runtime.py [--quick] [--calls 100] [--concurrency 1 2 4 8]

Methods:
- `python tool`: `run_tool_call(python, {"code": ...})`, what an environment step pays: argument
  validation, a worker thread with the tool's timeout, the sandbox, result formatting.
- `run_sandboxed`: the sandbox alone (fresh process tree, namespaces, rlimits, temp dir).
- `calculator tool`: `run_tool_call(calculator, ...)`: the same tool layer, but in-process.
- `calculator direct`: the decorated function called as a plain function (no thread, no timeout).
Latency is measured one call at a time (p50, p99 and max over `--calls`; with 100 calls p99 is
the second slowest). Throughput is `--burst` calls submitted at once to a pool of N threads,
divided by the wall time until the last finishes. Every call's output is checked.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from record import add_common_flags, bench_run, print_table, set_threads

CODE = "import json\nprint(json.dumps({'sum': sum(range(1000))}))\n"
EXPECTED = '{"sum": 499500}'
EXPRESSION = "((347 * 29) - 1181) / 7"


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


def methods() -> dict[str, Callable[[], bool]]:
    """Each method as a zero-argument call that returns whether its output was right."""
    from agent_grpo.tool import run_tool_call
    from agent_grpo.tools.calculator import calculator
    from agent_grpo.tools.python import python
    from agent_grpo.tools.sandbox import run_sandboxed

    answer = calculator(expression=EXPRESSION)

    def python_tool() -> bool:
        record = run_tool_call(python, {"code": CODE})
        return record.error is None and EXPECTED in str(record.result)

    def sandbox() -> bool:
        result = run_sandboxed(CODE)
        return result.exit_code == 0 and result.stdout.strip() == EXPECTED

    def calculator_tool() -> bool:
        record = run_tool_call(calculator, {"expression": EXPRESSION})
        return record.error is None and str(record.result) == answer

    def calculator_direct() -> bool:
        return bool(calculator(expression=EXPRESSION) == answer)

    return {
        "python tool": python_tool,
        "run_sandboxed": sandbox,
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
    call()  # warm-up: imports, first process start
    seconds, wrong = [], 0
    for _ in range(n):
        started = time.perf_counter()
        wrong += not call()
        seconds.append(time.perf_counter() - started)
    ms = [1000 * s for s in seconds]
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
    with bench_run("tool_runtime", args) as run:
        results: dict[str, Any] = {}
        for name, call in methods().items():
            in_process = name.startswith("calculator")
            n = args.calculator_calls if in_process else args.calls
            burst = args.calculator_calls if in_process else args.burst
            results[name] = {
                "latency": latency(call, n),
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
