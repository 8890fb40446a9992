"""Peak memory of the policy update as the sequence grows: chunked logprobs vs full logits.

    .venv/bin/python bench/memory_scaling.py [--quick] [--lengths 512 1024 ...] [--model tiny]

One forward + backward of `policy_loss` over per-token logprobs of one sequence (batch 1, every
token after the first trained, advantage 1), computed two ways:
- `chunked`: `agent_grpo.models.logprobs.token_logprobs` (the head applied 1024 tokens at a time,
  checkpointed; never a `[T, V]` fp32 tensor);
- `full`: `reference_token_logprobs` (the usual `log_softmax(model(x).logits)`, `[T, V]` fp32).
Each point runs in a fresh process; memory is the growth of resident memory over the section
(see `isolated.py`); parameter gradients are allocated by an untimed warm-up before it, so the
growth is activations, logits and their gradients only. The default model is the tiny test
model (SmolLM2's 49,152-token vocabulary and tied head, 2 layers of width 64): with it the
backbone costs almost nothing, so what is left is the head, which is where the two paths
differ. `--model embedded` runs the 135M model (30 layers; its activations grow linearly with
length too, and take minutes per point here).
The slope (MiB per 1k tokens, least squares) is compared with `V x 4 bytes` per token, the size of
one fp32 logits row.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from isolated import PeakWindow, child_env, exit_on_sigterm, run_isolated, write_child_result
from record import add_common_flags, bench_run, console, print_table, set_threads
from transformers import PreTrainedModel

PATHS = ("chunked", "full")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Sizes; `--worker` is internal."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_flags(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--model", choices=["tiny", "embedded"], default="tiny")
    p.add_argument("--worker-timeout", type=float, default=900.0)
    p.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.lengths = [256, 512]
    return args


def load(kind: str) -> PreTrainedModel:
    """The tiny test model (seeded) or the embedded SmolLM2-135M-Instruct, in train mode."""
    from agent_grpo.models.loading import load_model
    from agent_grpo.testing.tiny_model import build_tiny_model

    model = build_tiny_model()[0] if kind == "tiny" else load_model("smollm2-135m-instruct")
    return model.train()


def update_once(model: PreTrainedModel, path: str, length: int) -> float:
    """Forward + backward of the policy loss on one random sequence; returns the loss."""
    from agent_grpo.algo.grpo import policy_loss
    from agent_grpo.models.logprobs import reference_token_logprobs, token_logprobs

    generator = torch.Generator().manual_seed(length)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(3, vocab, (1, length), generator=generator)  # [1, T]
    attention = torch.ones_like(ids)  # [1, T]
    logprobs_fn = token_logprobs if path == "chunked" else reference_token_logprobs
    logprobs = logprobs_fn(model, ids, attention)  # [1, T]
    mask = torch.ones_like(ids, dtype=torch.bool)  # [1, T]
    mask[:, 0] = False  # the first token has no prefix
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.ones(1), mask)
    loss.backward()
    return float(loss.detach())


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One point: load, warm up on a short sequence (untimed), then measure the real length."""
    model = load(args.model)
    update_once(model, args.worker, 64)
    model.zero_grad(set_to_none=False)  # gradients exist before the window: not counted twice
    with PeakWindow() as window:
        update_once(model, args.worker, args.length)
    vocab = int(model.config.vocab_size)
    return {**window.as_dict(), "vocab": vocab}


def slope_mb_per_1k(lengths: list[int], values: list[float]) -> float:
    """Least-squares slope of `values` (MiB) against `lengths`, per 1,000 tokens."""
    n = len(lengths)
    mean_x, mean_y = sum(lengths) / n, sum(values) / n
    sxx = sum((x - mean_x) ** 2 for x in lengths)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(lengths, values, strict=True))
    return 1000 * sxy / sxx if sxx else float("nan")


def measure(path: str, length: int, args: argparse.Namespace) -> dict[str, Any]:
    """One (path, length) point in a fresh process."""
    flags = ["--worker", path, "--length", str(length), "--model", args.model,
             "--threads", str(args.threads)]  # fmt: skip
    child = run_isolated(
        Path(__file__), flags, env=child_env(args.threads), timeout_s=args.worker_timeout
    )
    if not child.ok:
        console.print(f"[red]{path} @ {length} failed:[/red] {(child.error or '')[-600:]}")
        return {"ok": False, "error": child.error, "process_peak_rss_mb": child.max_rss_mb}
    return {"ok": True, "process_peak_rss_mb": child.max_rss_mb, **child.result}


def fit(points: dict[str, list[dict[str, Any]]], lengths: list[int]) -> dict[str, float]:
    """Per path, the slope of RSS growth against length (points that ran only)."""
    slopes = {}
    for path, rows in points.items():
        ok = [(n, r["rss_growth_mb"]) for n, r in zip(lengths, rows, strict=True) if r["ok"]]
        if len(ok) >= 2:
            slopes[path] = slope_mb_per_1k([n for n, _ in ok], [g for _, g in ok])
    return slopes


def main(argv: list[str] | None = None) -> None:
    """Every (path, length) point, the slopes, and the table."""
    args = parse_args(argv)
    set_threads(args.threads)
    if args.worker:
        exit_on_sigterm()
        write_child_result(args.result, worker(args))
        return
    with bench_run("memory_scaling", args) as run:
        points: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
        for length in args.lengths:
            for path in PATHS:
                console.print(f"{path} @ {length} ...")
                points[path].append(measure(path, length, args))
        run.results.update(lengths=args.lengths, model=args.model, points=points)
        slopes = run.results["slope_mb_per_1k_tokens"] = fit(points, args.lengths)
        vocab = next((r["vocab"] for rows in points.values() for r in rows if r["ok"]), 0)
        logits_row = run.results["fp32_logits_mb_per_1k_tokens"] = vocab * 4 * 1000 / 2**20
        rows = []
        for i, length in enumerate(args.lengths):
            cells = [points[p][i].get("rss_growth_mb") for p in PATHS]
            secs = [points[p][i].get("seconds") for p in PATHS]
            rows.append([length, *cells, length * logits_row / 1000, *secs])
        print_table(f"peak RSS growth of one update, {args.model} model (MiB)",
                    ["tokens", "chunked", "full", "one [T, V] fp32", "chunked s", "full s"],
                    rows)  # fmt: skip
        for path, slope in slopes.items():
            per_token = slope / logits_row
            console.print(f"  {path}: {slope:.1f} MiB per 1k tokens, {per_token:.2f} logits rows")


if __name__ == "__main__":
    main()
