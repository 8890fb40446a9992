"""What the weight canary costs per check, on the embedded model, for the hf and vllm engines.

    .venv/bin/python bench/canary_cost.py [--quick] [--sequences 2] [--length 256]

One check (`rollout.canary`, agent_grpo/trainer/canary.py) is the trainer scoring the canary
with its own weights plus each engine scoring it with what it holds. Here: `--sequences` random
sequences of `--length` tokens, half of each a model turn; each side timed over `--repeats`
checks after one warm-up, and the engine-trainer gap reported (the hf engine samples from the
trainer's weights, so its gap is 0; vLLM runs its own kernels).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from record import add_common_flags, bench_run, print_table, set_threads

from agent_grpo.models.embedded import DEFAULT_MODEL
from agent_grpo.models.loading import load_model, load_tokenizer, resolve_model_path
from agent_grpo.rollout.backends.hf import HFBackend
from agent_grpo.rollout.sources import EngineScore
from agent_grpo.trainer.canary import Canary, check_engines, trainer_scores


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Canary size and repeats."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_flags(p)
    p.add_argument("--sequences", type=int, default=2)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-vllm", action="store_true", help="time the hf engine only")
    return p.parse_args(argv)


def _timed(fn: Any, repeats: int) -> tuple[float, Any]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    n, length, repeats = (1, 32, 1) if args.quick else (args.sequences, args.length, args.repeats)
    path = resolve_model_path(DEFAULT_MODEL)
    model, tokenizer = load_model(path), load_tokenizer(path)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tokenizer), (n, length), generator=g).tolist()
    targets = [[t >= length // 2 for t in range(length)] for _ in range(n)]
    canary = Canary(ids, targets)
    rows = []
    with bench_run("canary_cost", args) as run:
        trainer_s, trainer = _timed(lambda: trainer_scores(model, canary), repeats)
        engines: list[tuple[str, Any]] = [("hf", HFBackend(model, tokenizer))]
        if not args.no_vllm:
            from agent_grpo.rollout.backends.vllm import VLLMBackend

            engines.append(("vllm", VLLMBackend(path, max_model_len=max(length + 8, 512),
                                                kv_cache_memory_bytes=2**30,
                                                enforce_eager=True)))  # fmt: skip
        for name, engine in engines:
            engine_s, scored = _timed(lambda e=engine: e.score(ids, targets, 1.0), repeats)
            gap = check_engines([EngineScore(name, None, scored)], Canary(ids, targets),
                                trainer, 1, 10.0)  # fmt: skip
            run.results[name] = {"trainer_s": trainer_s, "engine_s": engine_s,
                                 "check_s": trainer_s + engine_s, "gap_mean": gap.mean,
                                 "gap_max": gap.max}  # fmt: skip
            rows.append([name, trainer_s, engine_s, trainer_s + engine_s, gap.mean, gap.max])
            engine.close()
        run.results["canary"] = {"sequences": n, "length": length, "model_tokens": n * length // 2}
    print_table(
        f"one canary check: {n} sequences of {length} tokens, embedded model",
        ["engine", "trainer s", "engine s", "check s", "gap mean", "gap max"],
        rows,
    )


if __name__ == "__main__":
    main()
