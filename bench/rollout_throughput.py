"""Multi-turn rollout throughput: our backends next to a naive loop and a model-only ceiling.

    .venv/bin/python bench/rollout_throughput.py [--quick] [--tasks 4 --group-size 8 ...]

Every method collects the same tasks (same env seeds), group size, per-turn token limit, context
limit and sampling settings, each in a fresh process (so one engine's threads, caches or memory
cannot slow the next), in one run:
- `hf`, `vllm` (in-process engine), `openai` (against a `vllm serve` this script starts);
- `naive`: one trajectory at a time, the whole conversation re-rendered and re-encoded each turn,
  `model.generate` with the same sampling (see `rollout_workers.py`);
- `ceiling`: a plain batched KV-cache decode loop on random ids replaying the best backend's
  schedule (same batch sizes, same decode steps, perfect prefix cache), with no environment.

Reported: generated tokens/s (sampled tokens / wall seconds of the collection), and the issue's
targets: best backend >= 3x naive, and within 25% of the ceiling (>= 0.75x). Engine start-up is
reported apart and not timed. Sampling is stochastic, so methods produce different trajectories
(different lengths and turn counts); tokens/s is comparable, token counts are shown next to it.
A backend that cannot run here is reported as such with its error, never estimated.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from isolated import child_env, exit_on_sigterm, run_isolated, write_child_result
from policy import policy_path
from record import add_common_flags, bench_run, console, print_table, set_threads
from rollout_workers import RolloutSpec, run_worker

ENVS = ["agent_grpo/Calculator-v0", "agent_grpo/Search-v0"]
BACKENDS = ["hf", "vllm", "openai"]
NAIVE_TARGET = 3.0
CEILING_TARGET = 0.75


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Sizes and settings; `--worker` is internal (one measurement in a child process)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_flags(p)
    p.add_argument("--envs", nargs="+", default=ENVS)
    p.add_argument("--backends", nargs="+", default=BACKENDS, choices=BACKENDS)
    p.add_argument("--tasks", type=int, default=4, help="tasks per environment")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64, help="per assistant turn")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--policy",
        choices=["warm", "base"],
        default="warm",
        help="warm: the embedded model after the demo's warm start (calls tools); "
        "base: as shipped (never calls a tool, so every episode is one turn)",
    )
    p.add_argument("--warm-demos", type=int, default=16, help="expert demos per env for warm")
    p.add_argument("--kv-cache-mb", type=int, default=512, help="vLLM KV cache")
    p.add_argument("--worker-timeout", type=float, default=1800.0, help="seconds per method")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.envs, args.tasks, args.group_size, args.max_tokens = args.envs[:1], 1, 2, 48
    return args


def measure(method: str, spec: RolloutSpec, args: argparse.Namespace) -> dict[str, Any]:
    """Run one method in a fresh process; its result, or why it could not run."""
    console.print(f"[bold]{method}[/bold] ...")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(spec.model_dump_json())
    child = run_isolated(
        Path(__file__),
        ["--worker", method, "--spec", f.name, "--threads", str(args.threads)],
        env=child_env(args.threads),
        timeout_s=args.worker_timeout,
    )
    Path(f.name).unlink()
    if not child.ok:
        console.print(f"[red]{method} did not run:[/red] {(child.error or '')[-800:]}")
        return {"ok": False, "error": child.error, "max_rss_mb": child.max_rss_mb}
    return {"ok": True, "max_rss_mb": child.max_rss_mb, "process_s": child.wall_s, **child.result}


def best_backend(methods: dict[str, dict], env_id: str, backends: list[str]) -> str | None:
    """The backend with the highest tokens/s on `env_id` among those that ran."""
    ran = [b for b in backends if methods.get(b, {}).get("ok")]
    return max(ran, key=lambda b: methods[b]["envs"][env_id]["tokens_per_s"], default=None)


def summarise(methods: dict[str, dict], env_ids: list[str], backends: list[str]) -> dict:
    """Per environment: the best backend and its ratios to naive and ceiling, targets met or not."""
    summary = {}
    for env_id in env_ids:
        best = best_backend(methods, env_id, backends)
        rate = {m: r["envs"][env_id]["tokens_per_s"] for m, r in methods.items() if r.get("ok")}
        entry: dict[str, Any] = {"best_backend": best}
        if best is not None and "naive" in rate:
            entry["best_over_naive"] = rate[best] / rate["naive"]
            entry["naive_target_met"] = entry["best_over_naive"] >= NAIVE_TARGET
        if best is not None and "ceiling" in rate:
            entry["best_over_ceiling"] = rate[best] / rate["ceiling"]
            entry["ceiling_target_met"] = entry["best_over_ceiling"] >= CEILING_TARGET
        summary[env_id] = entry
    return summary


def print_results(methods: dict[str, dict], summary: dict, env_ids: list[str]) -> None:
    """One table per environment, then the targets."""
    for env_id in env_ids:
        rows = []
        for name, result in methods.items():
            if not result.get("ok"):
                rows.append([name, "did not run", None, None, None, None, None])
                continue
            r = result["envs"][env_id]
            rows.append(
                [
                    name,
                    r.get("trajectories"),
                    r.get("turns_mean"),
                    r["generated_tokens"],
                    r["wall_s"],
                    r["tokens_per_s"],
                    result.get("startup_s"),
                ]
            )
        print_table(env_id, ["method", "trajectories", "turns", "tokens", "wall s", "tok/s",
                             "start-up s"], rows)  # fmt: skip
        s = summary[env_id]
        for key, target in (
            ("best_over_naive", NAIVE_TARGET),
            ("best_over_ceiling", CEILING_TARGET),
        ):
            if key in s:
                met = "met" if s[key] >= target else "NOT met"
                console.print(
                    f"  {s['best_backend']}: {key} = {s[key]:.2f} (target {target}: {met})"
                )


def run_child(args: argparse.Namespace) -> None:
    """Child process: one method, one spec, result to `--result`."""
    exit_on_sigterm()
    set_threads(args.threads)
    spec = RolloutSpec.model_validate_json(Path(args.spec).read_text())
    write_child_result(args.result, run_worker(args.worker, spec))


def main(argv: list[str] | None = None) -> None:
    """Measure every method, then the ceiling of the best backend, and write the results."""
    args = parse_args(argv)
    if args.worker:
        run_child(args)
        return
    set_threads(args.threads)
    with bench_run("rollout_throughput", args) as run:
        model_path, policy = policy_path(args.policy, demos_per_env=args.warm_demos)
        spec = RolloutSpec(
            env_ids=args.envs, tasks=args.tasks, group_size=args.group_size,
            max_tokens=args.max_tokens, max_context=args.max_context,
            temperature=args.temperature, top_p=args.top_p, seed=args.seed,
            model_path=model_path, kv_cache_mb=args.kv_cache_mb, server_timeout_s=600.0,
        )  # fmt: skip
        run.results["policy"] = policy
        methods = run.results["methods"] = {}
        for method in ["naive", *args.backends]:
            methods[method] = measure(method, spec, args)
        schedules = {}
        for env_id in args.envs:
            best = best_backend(methods, env_id, args.backends)
            if best is not None:
                schedules[env_id] = methods[best]["envs"][env_id]["schedule"]
        if schedules:
            ceiling = RolloutSpec.model_validate({**spec.model_dump(), "schedules": schedules})
            methods["ceiling"] = measure("ceiling", ceiling, args)
        run.results["summary"] = summarise(methods, args.envs, args.backends)
        print_results(methods, run.results["summary"], args.envs)
        json.dumps(run.results)  # fail here, not after the run, if something is not serialisable


if __name__ == "__main__":
    main()
