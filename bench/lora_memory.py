"""Peak memory of a GRPO step with LoRA against full fine-tuning, same model and batch.

    .venv/bin/python bench/lora_memory.py [--quick] [--model embedded|tiny] [--rows 8 --tokens 256]

Each side runs in a fresh process (`isolated.py`): load the model (full: as is; LoRA: under a
rank-16 adapter on every linear layer of the decoder), then 2 steps of the real update
(`train.update.minibatch_update`, AdamW) over one batch of `rows` sequences of `length` tokens,
half of them model tokens. Reported: the child's whole peak RSS (weights, gradients, AdamW state,
activations), the growth over the two steps, and the trainable parameter count. Full fine-tuning
holds a gradient and two AdamW moments for every weight (3 x 4 bytes x 135M = 1.6 GB); LoRA holds
them for the adapter alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from isolated import (
    PeakWindow,
    child_env,
    exit_on_sigterm,
    process_peak_rss_mb,
    run_isolated,
    write_child_result,
)
from record import add_common_flags, bench_run, print_table, set_threads

SIDES = ("full", "lora")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Sizes; `--worker` is internal."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_flags(p)
    p.add_argument("--model", choices=["tiny", "embedded"], default="embedded")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.rows, args.tokens = "tiny", 4, 64
    return args


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One side: model, batch, 2 update steps under a peak-RSS window."""
    from agent_grpo.config.jobs import AlgoConfig, LoraSettings, SpeedConfig
    from agent_grpo.models.loading import load_model
    from agent_grpo.testing.tiny_model import build_tiny_model
    from agent_grpo.trainer.batch import PackedBatch
    from agent_grpo.trainer.lora import wrap_lora
    from agent_grpo.trainer.parallel import DistContext, wrap_policy
    from agent_grpo.trainer.update import minibatch_update

    set_threads(args.threads)
    model = build_tiny_model()[0] if args.model == "tiny" else load_model("smollm2-135m-instruct")
    if args.worker == "lora":
        model = wrap_lora(model, LoraSettings())
    policy = wrap_policy(model, "none", DistContext())
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 49152, (args.rows, args.tokens), generator=g)
    model_tokens = torch.arange(args.tokens)[None].expand(args.rows, -1) >= args.tokens // 2
    advantages = torch.randn(args.rows, generator=g)[:, None].repeat(1, args.tokens)  # [B, T]
    batch = PackedBatch(ids, torch.ones_like(ids), model_tokens.clone(),
                        torch.full(ids.shape, -1.0), advantages, torch.arange(args.rows),
                        torch.arange(args.rows))  # fmt: skip
    started = time.perf_counter()
    with PeakWindow() as window:
        for _ in range(2):
            minibatch_update(policy, optimizer, batch, None, None,
                             AlgoConfig(speed=SpeedConfig(shared_prefix=False)), 1.0,
                             args.tokens)  # fmt: skip
    return {**window.as_dict(), "step_s": (time.perf_counter() - started) / 2,
            "trainable_params": sum(p.numel() for p in trainable),
            "process_peak_rss_mb": process_peak_rss_mb()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Both sides, one fresh process each; print and record the table."""
    args = parse_args(argv)
    if args.worker:
        exit_on_sigterm()
        write_child_result(args.result, worker(args))
        return 0
    rows = []
    with bench_run("lora_memory", args) as run:
        for side in SIDES:
            flags = ["--worker", side, "--model", args.model, "--rows", str(args.rows),
                     "--tokens", str(args.tokens), "--threads", str(args.threads)]  # fmt: skip
            child = run_isolated(Path(__file__), flags, env=child_env(args.threads),
                                 timeout_s=1800)  # fmt: skip
            if not child.ok:
                print(child.error, file=sys.stderr)
                return 1
            r = child.result
            # the window's reset also lowers ru_maxrss: the child's own figure covers both
            peak = max(r.pop("process_peak_rss_mb"), child.max_rss_mb)
            run.results[side] = {**r, "process_peak_rss_mb": round(peak, 1)}
            rows.append([side, r["trainable_params"], round(peak),
                         r["rss_growth_mb"], r["step_s"]])  # fmt: skip
    print_table(f"GRPO step, {args.model} model, {args.rows} x {args.tokens} tokens",
                ["side", "trainable params", "peak RSS MiB", "growth over 2 steps MiB",
                 "s/step"], rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
