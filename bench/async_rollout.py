"""Synchronous, asynchronous and partial-rollout GRPO on Ray rollout workers, side by side.

    .venv/bin/python bench/async_rollout.py [--quick] [--backend vllm|hf] [--steps 10]

One job, eight ways: 2 Ray rollout workers (each a vLLM engine, or the `hf` engine with `--backend
hf`), `algo.max_staleness` k = 0 (synchronous), 1 and 2, each with partial rollouts off and on
(`rollout.partial={over_sample: 4}`), and at k = 1 and 2 with actors that keep sampling while the
trainer updates (`keep_sampling: true` beside `over_sample`). The workload is long-tailed and
tool-bound (`agent_grpo.testing.envs.LongTailEnv`): one task in 4 takes 6 turns, the others 1 or 2,
and every turn but the last waits `--latency` seconds for a tool reply. The model is the tiny test
Llama (head dim 32, which vLLM's CPU attention runs), so what the modes can hide is the tool latency
and the update, not sampling. Reported per mode: trained tokens per second over the steps after the
first (start-up excluded), the trainer's idle fraction (time waiting for rollouts over step time),
and the staleness of the trained tokens. The issue's goal: partial rollouts at least 1.3x the
trained tokens/s of non-partial async at the same k.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from load import TreeCpu
from record import add_common_flags, bench_run, print_table, set_threads

from agent_grpo.testing.reward_rules import reward_override

PARTIAL = ("", "partial", "keep")
"""Partial rollouts off, on (turns run inside each step's call), and on with actors that keep
sampling between calls (`rollout.partial.keep_sampling`, which needs k >= 1)."""
MODES = [(k, partial) for k in (0, 1, 2) for partial in PARTIAL if k or partial != "keep"]


def mode_name(k: int, partial: str) -> str:
    """`k1`, `k1-partial` or `k1-keep`."""
    return f"k{k}" + (f"-{partial}" if partial else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Sizes and the engine."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_flags(p)
    p.add_argument("--backend", choices=("vllm", "hf"), default="vllm", help="the actors' engine")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--latency", type=float, default=0.5, help="seconds per tool call")
    p.add_argument("--epochs", type=int, default=2, help="update passes (its cost vs rollout)")
    p.add_argument("--over-sample", type=int, default=4, help="partial: groups beyond a step's")
    p.add_argument("--modes", nargs="*", help="only these modes (k0, k1-partial, k2-keep, ...)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 3
    return args


def run_mode(root: Path, model_dir: str, k: int, partial: str,
             args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """Train `args.steps` steps in one mode; the figures of steps 1..N."""
    from agent_grpo.config.base import load_config
    from agent_grpo.config.jobs import TrainConfig
    from agent_grpo.trainer.loop import train

    overrides = [
        f"model.name_or_path={model_dir}", f"run.root={root}", f"run.name={mode_name(k, partial)}",
        f"steps={args.steps}", "eval=null", "warm_start=null", "run.tensorboard=false",
        "run.checkpoint_every_s=0", "env.id=agent_grpo.testing.envs:LongTailEnv",
        f"env.kwargs={{latency_s: {args.latency}, long_every: 4, long_turns: 6}}",
        "rollout.tasks_per_step=4", "rollout.group_size=4", "rollout.sampling.max_tokens=24",
        # a random model writes "e" within a few tokens: turns end by stop, and the env answers
        "rollout.sampling.stop=[e]", "rollout.workers={type: ray, num_workers: 2}",
        f"rollout.backend={{type: {args.backend}}}", f"algo.max_staleness={k}",
        f"algo.epochs={args.epochs}", reward_override("even", "even_tokens"),
    ]  # fmt: skip
    if args.backend == "vllm":  # no CUDA graphs on CPU
        overrides.append("rollout.backend.engine_kwargs={enforce_eager: true}")
    if partial:
        keep = "true" if partial == "keep" else "false"
        over = args.over_sample
        overrides.append(f"rollout.partial={{over_sample: {over}, keep_sampling: {keep}}}")
    if k:
        overrides.append("algo.tis_cap=2.0")  # as an async user would run it
    config_path = Path(__file__).resolve().parent.parent / "configs/calculator-tiny.yaml"
    started = time.perf_counter()
    run = train(load_config(TrainConfig, config_path, overrides))
    wall = time.perf_counter() - started
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][1:]
    seconds = sum(r["step_time_s"] for r in rows)
    hist: dict[str, int] = {}
    for r in rows:
        for key, n in r.items():
            if key.startswith("staleness/"):
                hist[key.split("/")[1]] = hist.get(key.split("/")[1], 0) + n
    return {
        "trained_tokens_per_s": sum(r["trained_tokens"] for r in rows) / seconds,
        "idle_fraction": sum(r["rollout_wait_time_s"] for r in rows) / seconds,
        "step_s": seconds / len(rows),
        "stale_masked_tokens": sum(r.get("stale_masked_tokens", 0) for r in rows),
        "staleness": hist,
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    """The six modes on one local Ray instance; print and record the table."""
    args = parse_args(argv)
    set_threads(args.threads)
    import ray

    from agent_grpo.models.loading import DEFAULT_MODEL, load_tokenizer
    from agent_grpo.testing.tiny_model import save_tiny_llama

    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here)]
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", object_store_memory=200 * 2**20,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}})  # fmt: skip
    rows, results = [], {}
    # Ray's raylet and actors are this process's descendants: their CPU is the benchmark's own
    tree = TreeCpu(os.getpid())  # killed actors' engine processes stay counted
    try:
        with tempfile.TemporaryDirectory() as tmp, bench_run("async_rollout", args, tree) as run:
            model_dir = Path(tmp) / "tiny-llama"
            save_tiny_llama(model_dir, load_tokenizer(DEFAULT_MODEL))
            for k, partial in MODES:
                if args.modes and mode_name(k, partial) not in args.modes:
                    continue
                results[mode_name(k, partial)] = run_mode(Path(tmp), str(model_dir), k, partial,
                                                          args)  # fmt: skip
            base = results.get("k0", {}).get("trained_tokens_per_s", math.nan)
            for name, r in results.items():
                r["speedup"] = r["trained_tokens_per_s"] / base
                plain = results.get(name.split("-")[0], {}).get("trained_tokens_per_s", math.nan)
                r["x_same_k"] = r["trained_tokens_per_s"] / plain
                hist = json.dumps(r["staleness"])
                rows.append([name, r["trained_tokens_per_s"], r["speedup"], r["x_same_k"],
                             r["idle_fraction"], r["step_s"], hist])  # fmt: skip
            run.results = results
    finally:
        ray.shutdown()
    print_table(f"GRPO on 2 Ray workers ({args.backend}), long-tailed episodes, "
                f"{args.latency} s per tool call",
                ["mode", "trained tok/s", "x sync", "x same k", "trainer idle", "s/step",
                 "staleness"], rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
