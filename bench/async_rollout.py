"""Synchronous against asynchronous GRPO on Ray rollout workers, in one run on this machine.

    .venv/bin/python bench/async_rollout.py [--quick] [--steps 6] [--latency 0.3]

The same job three times: 2 Ray rollout workers, `algo.max_staleness` 0 (synchronous), 1 and
2. The environment (`SlowToolEnv`, below) answers every turn with a tool message after
`--latency` seconds, as a real tool (a search API, a web request) would, for 3 turns; the model
is the tiny test model, so sampling is cheap and what the overlap can hide is the tool latency
and the update. Reported per mode: trained tokens per second over the steps after the first
(start-up excluded), the trainer's idle fraction (time waiting for rollouts / step time), and
the staleness histogram of the trained records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from record import add_common_flags, bench_run, print_table, set_threads

from agent_grpo.envs.text_env import TextEnv, TurnOutcome
from agent_grpo.testing.reward_rules import reward_override

MODES = (0, 1, 2)


class SlowToolEnv(TextEnv[int]):
    """Every turn gets a tool reply after `latency_s` seconds, for `max_turns` turns."""

    def __init__(self, latency_s: float = 0.3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.latency_s = latency_s

    def generate_task(self, rng: Any) -> int:
        return int(rng.integers(1000))

    def user_prompt(self, task: int) -> str:
        return f"Look up record {task} and summarise it."

    def respond(self, action: str) -> TurnOutcome:
        time.sleep(self.latency_s)
        reply = {"role": "tool", "name": "lookup", "content": f"record: {len(action)} bytes"}
        return TurnOutcome(observations=[reply])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Sizes."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_flags(p)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--latency", type=float, default=1.0, help="seconds per tool call")
    p.add_argument("--epochs", type=int, default=4, help="update passes (its cost vs rollout)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 3
    return args


def run_mode(root: Path, model_dir: str, k: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train `args.steps` steps with `max_staleness = k`; the figures of steps 1..N."""
    from agent_grpo.config.base import load_config
    from agent_grpo.config.jobs import TrainConfig
    from agent_grpo.trainer.loop import train

    rule = reward_override("even", "even_tokens")
    overrides = [
        f"model.name_or_path={model_dir}", f"run.root={root}", f"run.name=k{k}",
        f"steps={args.steps}", "eval=null", "warm_start=null", "run.tensorboard=false",
        "run.checkpoint_every_s=0", "env.id=async_rollout:SlowToolEnv",
        f"env.kwargs={{latency_s: {args.latency}, max_turns: 3}}",
        "rollout.tasks_per_step=4", "rollout.group_size=4", "rollout.sampling.max_tokens=24",
        # a random model writes "e" within a few tokens: turns end by stop, and the env answers
        "rollout.sampling.stop=[e]", "rollout.workers={type: ray, num_workers: 2}",
        f"algo.max_staleness={k}", f"algo.epochs={args.epochs}", rule,
    ]  # fmt: skip
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
        "staleness": hist,
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    """The three modes on one local Ray instance; print and record the table."""
    args = parse_args(argv)
    set_threads(args.threads)
    import ray

    from agent_grpo.testing.tiny_model import save_tiny_model

    here, tests = Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent / "tests"
    sys.path[:0] = [str(here), str(tests)]
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", object_store_memory=200 * 2**20,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                                       "PYTHONPATH": f"{here}:{tests}"}})  # fmt: skip
    rows, results = [], {}
    try:
        with tempfile.TemporaryDirectory() as tmp, bench_run("async_rollout", args) as run:
            model_dir = str(save_tiny_model(Path(tmp) / "tiny"))
            for k in MODES:
                results[k] = run_mode(Path(tmp), model_dir, k, args)
            base = results[0]["trained_tokens_per_s"]
            for k, r in results.items():
                r["speedup"] = r["trained_tokens_per_s"] / base
                hist = json.dumps(r["staleness"])
                rows.append([f"max_staleness {k}", r["trained_tokens_per_s"], r["speedup"],
                             r["idle_fraction"], r["step_s"], hist])  # fmt: skip
            run.results = {f"k{k}": r for k, r in results.items()}
    finally:
        ray.shutdown()
    print_table(f"async GRPO, 2 Ray workers, {args.latency} s per tool call, 3 turns",
                ["mode", "trained tok/s", "x sync", "trainer idle", "s/step", "staleness"],
                rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
