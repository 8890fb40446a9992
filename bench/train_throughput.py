"""One GRPO step, ours vs TRL's `GRPOTrainer`: time and peak memory of generation and of the update.

    .venv/bin/python bench/train_throughput.py [--quick] [--tasks 2 --group-size 4 ...]

Matched single-turn workload: the same Calculator-v0 prompts (system prompt with the tool schema
plus the question), the same model (the embedded SmolLM2-135M-Instruct, fp32), `tasks x group`
completions of exactly `completion-length` tokens each (EOS disabled on our side, `min_new_tokens`
on TRL's, so both train on the same number of tokens), temperature 1, top-p 1, top-k off, the
same KL weight `beta`, clip 0.2, token-mean loss (TRL's `dapo`), AdamW with the same lr, grad
clip 1.0, one optimizer step, on-policy (TRL `num_iterations=1`, ours `epochs=1`), and seeded
random rewards (the reward values do not change the compute). Each side runs in a fresh process,
`--repeats` times, alternating sides; tables show medians (the load of a shared machine drifts).

Phases (wall seconds and peak RSS, see `isolated.py` for how memory is measured):
- generate: ours `collect_groups` with the `hf` backend; TRL `_generate_and_score_completions`
  (generation, rewards, advantages and, when beta > 0, the reference logprobs).
- update: the rest of the step: ours `minibatch_update` (plus the reference logprobs when
  beta > 0); TRL from the end of generation to `on_step_end` (logprob forward, loss, backward,
  clip, optimizer step). Tokens/s counts every real token in the batch (prompt + completion)
  per update second; "trained tok/s" counts completion tokens only.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from isolated import PeakWindow, child_env, exit_on_sigterm, run_isolated, write_child_result
from record import add_common_flags, bench_run, console, print_table, set_threads

ENV_ID = "agent_grpo/Calculator-v0"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Sizes and settings; `--worker` is internal."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_flags(p)
    p.add_argument("--tasks", type=int, default=2, help="distinct prompts")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--completion-length", type=int, default=64)
    p.add_argument("--beta", type=float, default=0.0, help="KL weight (0: no reference model)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sides", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    p.add_argument("--repeats", type=int, default=3, help="runs per side, alternating sides")
    p.add_argument("--worker-timeout", type=float, default=1800.0)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.tasks, args.group_size, args.completion_length, args.repeats = 1, 2, 16, 1
    return args


def prompts(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    """The chat prompts of the first `tasks` Calculator-v0 training seeds."""
    from agent_grpo.env import train_seeds
    from agent_grpo.registry import make_env

    env = make_env(ENV_ID)
    seeds = train_seeds(args.tasks, random.Random(args.seed))
    out = [env.reset(seed=s)[0] for s in seeds]
    env.close()
    return out


def random_rewards(n: int, seed: int) -> list[float]:
    """Seeded rewards in [0, 1): realistic non-zero advantages at no cost."""
    rng = random.Random(seed)
    return [rng.random() for _ in range(n)]


def worker_ours(args: argparse.Namespace) -> dict[str, Any]:
    """Our step: `collect_groups` (hf backend) then `minibatch_update`."""
    from agent_grpo.algo.grpo import group_advantages
    from agent_grpo.models import load_model, load_tokenizer
    from agent_grpo.rollout.backend import SamplingConfig
    from agent_grpo.rollout.collector import Task, collect_groups
    from agent_grpo.rollout.config import RolloutConfig
    from agent_grpo.rollout.hf_backend import HFBackend
    from agent_grpo.train.batch import pack_records
    from agent_grpo.train.config import AlgoConfig
    from agent_grpo.train.update import batch_logprobs, minibatch_update

    tokenizer, policy = load_tokenizer("smollm2-135m-instruct"), load_model("smollm2-135m-instruct")
    reference = copy.deepcopy(policy).requires_grad_(False) if args.beta > 0 else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    algo = AlgoConfig(beta=args.beta, lr=args.lr, clip_low=0.2, clip_high=0.2)
    backend = HFBackend(policy, tokenizer, eos_token_ids=[])  # every completion full length
    backend.generate([[1, 2, 3, 4]], SamplingConfig(max_tokens=4), [0])  # untimed warm-up
    backend.prefix_cache.clear()
    from agent_grpo.env import train_seeds

    seeds = train_seeds(args.tasks, random.Random(args.seed))
    tasks = [Task(env_id=ENV_ID, seed=s, env_kwargs={"max_turns": 1}) for s in seeds]
    sampling = SamplingConfig(temperature=1.0, max_tokens=args.completion_length, seed=args.seed)
    config = RolloutConfig(group_size=args.group_size, sampling=sampling, progress=False)
    with PeakWindow() as generate:
        records = collect_groups(tasks, backend, tokenizer, config).records
        rewards = torch.tensor(random_rewards(len(records), args.seed))  # [B]
        advantages = group_advantages(rewards, [r.group_id for r in records])  # [B]
        batch = pack_records(records, tokenizer.pad_token_id, advantages.tolist())
    with PeakWindow() as update:
        ref = None
        if reference is not None:
            ref = batch_logprobs(reference, batch, 1.0, algo)  # [B, T]
        metrics, _ = minibatch_update(policy, optimizer, batch, None, ref, algo, 1.0)
    return {
        "prompt_tokens": int(batch.attention_mask.sum()) - batch.num_model_tokens,
        "completion_tokens": batch.num_model_tokens,
        "rows": int(batch.input_ids.shape[0]),
        "generate": generate.as_dict(),
        "update": update.as_dict(),
        "loss": metrics["loss"],
        "algo": algo.model_dump(),
    }


def worker_trl(args: argparse.Namespace) -> dict[str, Any]:
    """TRL's step: `GRPOTrainer.train()` for one step, phases timed by a wrapper and a callback."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agent_grpo.models import load_model, load_tokenizer

    tokenizer, model = load_tokenizer("smollm2-135m-instruct"), load_model("smollm2-135m-instruct")
    rows = args.tasks * args.group_size
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), use_cpu=True, bf16=False,
        per_device_train_batch_size=rows, gradient_accumulation_steps=1,
        num_generations=args.group_size, max_completion_length=args.completion_length,
        generation_kwargs={"min_new_tokens": args.completion_length},
        temperature=1.0, top_p=1.0, top_k=0, beta=args.beta, epsilon=0.2, loss_type="dapo",
        learning_rate=args.lr, weight_decay=0.0, max_grad_norm=1.0, num_iterations=1,
        max_steps=1, logging_steps=1, report_to=[], save_strategy="no", seed=args.seed,
        dataloader_num_workers=0, log_completions=False,
    )  # fmt: skip
    reward_values = iter(random_rewards(rows, args.seed))

    def reward(completions: list[Any], **_: Any) -> list[float | None]:
        return [next(reward_values) for _ in completions]

    dataset = Dataset.from_list([{"prompt": p} for p in prompts(args)])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer)  # fmt: skip
    windows: dict[str, Any] = {}
    generate_inner = trainer._generate_and_score_completions

    def timed_generate(batch: Any) -> Any:
        with PeakWindow() as window:
            out = generate_inner(batch)
        windows["generate"] = window
        windows["tokens"] = (int(out["prompt_mask"].sum()), int(out["completion_mask"].sum()))
        windows["update"] = PeakWindow().__enter__()  # the update starts now
        return out

    class StepEnd(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            windows["update"].__exit__(None, None, None)

    trainer._generate_and_score_completions = timed_generate  # type: ignore[method-assign,assignment]
    trainer.add_callback(StepEnd())
    trainer.train()
    prompt_tokens, completion_tokens = windows["tokens"]
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "rows": rows,
        "generate": windows["generate"].as_dict(),
        "update": windows["update"].as_dict(),
        "loss": float(trainer.state.log_history[0].get("loss", float("nan"))),
    }


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """Throughput of the update: all real tokens and trained tokens per update second."""
    seconds = result["update"]["seconds"]
    tokens = result["prompt_tokens"] + result["completion_tokens"]
    return {
        "update_tokens_per_s": tokens / seconds,
        "update_trained_tokens_per_s": result["completion_tokens"] / seconds,
        "step_s": seconds + result["generate"]["seconds"],
    }


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One side in a fresh process."""
    console.print(f"[bold]{side}[/bold] ...")
    flags = ["--worker", side, "--threads", str(args.threads), "--tasks", str(args.tasks),
             "--group-size", str(args.group_size), "--completion-length",
             str(args.completion_length), "--beta", str(args.beta), "--lr", str(args.lr),
             "--seed", str(args.seed)]  # fmt: skip
    child = run_isolated(
        Path(__file__), flags, env=child_env(args.threads), timeout_s=args.worker_timeout
    )
    if not child.ok:
        console.print(f"[red]{side} did not run:[/red] {(child.error or '')[-1500:]}")
        return {"ok": False, "error": child.error}
    return {"ok": True, "process_peak_rss_mb": child.max_rss_mb, **child.result}


def _median_phase(runs: list[dict[str, Any]], phase: str) -> dict[str, float]:
    keys = ("seconds", "rss_start_mb", "rss_peak_mb", "rss_growth_mb")
    return {k: statistics.median(r[phase][k] for r in runs) for k in keys}


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's repeats as medians (load on a shared machine drifts between runs)."""
    ok = [r for r in runs if r["ok"]]
    if not ok:
        return {"ok": False, "error": runs[0]["error"], "runs": runs}
    median = {
        **ok[0],
        "generate": _median_phase(ok, "generate"),
        "update": _median_phase(ok, "update"),
        "process_peak_rss_mb": statistics.median(r["process_peak_rss_mb"] for r in ok),
        "repeats": len(ok),
        "update_s_all": [r["update"]["seconds"] for r in ok],
        "generate_s_all": [r["generate"]["seconds"] for r in ok],
        "runs": runs,
    }
    return {**median, **summarise(median)}


def print_results(sides: dict[str, dict[str, Any]]) -> None:
    """The comparison table."""
    rows = []
    for name, r in sides.items():
        if not r["ok"]:
            rows.append([name, "did not run"] + [None] * 8)
            continue
        rows.append([name, r["prompt_tokens"], r["completion_tokens"], r["generate"]["seconds"],
                     r["update"]["seconds"], r["update_tokens_per_s"],
                     r["update_trained_tokens_per_s"], r["generate"]["rss_growth_mb"],
                     r["update"]["rss_growth_mb"], r["process_peak_rss_mb"]])  # fmt: skip
    columns = ["impl", "prompt tok", "completion tok", "generate s", "update s", "update tok/s",
               "trained tok/s", "gen +RSS MiB", "update +RSS MiB", "process peak MiB"]  # fmt: skip
    print_table("one GRPO step (medians over repeats)", columns, rows)


def main(argv: list[str] | None = None) -> None:
    """Measure each side in its own process and write the results."""
    args = parse_args(argv)
    set_threads(args.threads)
    if args.worker:
        exit_on_sigterm()
        torch.manual_seed(args.seed)
        worker = worker_ours if args.worker == "ours" else worker_trl
        write_child_result(args.result, worker(args))
        return
    with bench_run("train_throughput", args) as run:
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in args.sides}
        for _ in range(args.repeats):
            for side in args.sides:
                runs[side].append(measure(side, args))
        sides = run.results["sides"] = {side: combine(r) for side, r in runs.items()}
        if all(sides.get(s, {}).get("ok") for s in ("ours", "trl")):
            run.results["ours_over_trl_update_speed"] = (
                sides["ours"]["update_tokens_per_s"] / sides["trl"]["update_tokens_per_s"]
            )
        print_results(sides)


if __name__ == "__main__":
    main()
