"""Held-out success per step for the main objectives, same seeds (docs/algorithms.md).

    .venv/bin/python bench/objective_curves.py [--seeds 0 1] [--every 2] [--root DIR]

Runs `configs/calculator.yaml` (the `make demo` job) once per objective and seed, changing only
the objective, with a held-out evaluation every `--every` steps (`eval.every`), each run in its
own process. A run whose directory already holds its final evaluation is read, not run again, so
an interrupted sweep continues where it stopped. Prints one row per run: held-out success before
GRPO (after the warm start), after each evaluated step, and at the end, then the mean over seeds.
About 8-9 minutes a run on 2 CPU cores; run it alone (docs/benchmarks.md, "Machines").
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "calculator.yaml"

OBJECTIVES = {
    "grpo": [],
    "rloo": ["algo.leave_one_out=true", "algo.scale=none"],
    "dr-grpo": ["algo.scale=none", "algo.aggregation=seq-mean-token-sum-norm"],
    "seq-mean-token-mean": ["algo.aggregation=seq-mean-token-mean"],
}
"""Each objective as the overrides that make it from the demo config (GRPO, its default)."""


def run_dir(root: Path, objective: str, seed: int) -> Path:
    return root / f"{objective}-seed{seed}"


def curve(run: Path) -> dict[int, float]:
    """{GRPO steps the evaluated policy had: held-out success} from a run's metrics."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # rows written before `eval_after_steps` existed: a step row's evaluation followed its update
    return {r.get("eval_after_steps", r["step"] + ("loss" in r)): r["eval_success_rate"]
            for r in rows if "eval_success_rate" in r}  # fmt: skip


def warm_start_success(run: Path) -> float:
    """Held-out success after the warm start, as the run's checkpoints keep it."""
    state = sorted(run.glob("checkpoints/step_*/state.json"))[-1]
    return float(json.loads(state.read_text())["eval_warm_start"]["summary"]["success_rate"])


def finished(run: Path, steps: int) -> bool:
    return (run / "metrics.jsonl").exists() and steps in curve(run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--every", type=int, default=2, help="held-out evaluation every N steps")
    p.add_argument("--root", type=Path, default=ROOT / "runs" / "objective-curves")
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args(argv)
    exe = Path(sys.executable).with_name("agent-grpo")
    for seed in args.seeds:
        for name, overrides in OBJECTIVES.items():
            run = run_dir(args.root, name, seed)
            if finished(run, args.steps):
                continue
            shutil.rmtree(run, ignore_errors=True)  # a run cut short starts over under its name
            started = time.perf_counter()
            command = [str(exe), "train", str(CONFIG), f"seed={seed}", f"steps={args.steps}",
                       f"eval.every={args.every}", f"run.root={args.root}",
                       f"run.name={run.name}", "run.tensorboard=false", *overrides]  # fmt: skip
            args.root.mkdir(parents=True, exist_ok=True)
            with run.with_suffix(".log").open("w") as log:  # the job's own log, beside its run
                subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
            print(f"{run.name}: {time.perf_counter() - started:.0f} s", flush=True)
    print_table(args)
    return 0


def print_table(args: argparse.Namespace) -> None:
    """A markdown table: one row per objective and seed, then each objective's mean."""
    points = sorted(curve(run_dir(args.root, "grpo", args.seeds[0])))
    print("| objective | seed | warm start | " + " | ".join(f"step {s}" for s in points) + " |")
    print("|---|---:|---:|" + "---:|" * len(points))
    for name in OBJECTIVES:
        rows = []
        for seed in args.seeds:
            run = run_dir(args.root, name, seed)
            c = curve(run)
            rows.append([warm_start_success(run), *(c[s] for s in points)])
            cells = " | ".join(f"{v:.3f}" for v in rows[-1])
            print(f"| {name} | {seed} | {cells} |")
        mean = [sum(col) / len(col) for col in zip(*rows, strict=True)]
        print(f"| {name} | mean | " + " | ".join(f"{v:.3f}" for v in mean) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
