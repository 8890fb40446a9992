"""What a bf16 reference costs in accuracy and saves in time (`model.reference_dtype`).

    .venv/bin/python bench/reference_dtype.py [--quick]

The batch: expert episodes of Calculator-v0 and Search-v0 (multi-turn, tool calls and results,
recorded token by token as the warm start records them), packed as the trainer packs a step. The
embedded SmolLM2-135M-Instruct scores the batch's model tokens twice through the trainer's own
path (`wrap_reference` + `update.batch_logprobs`, shared prefix on): held in fp32, and held in
bf16. The gap `bf16 - fp32` per model token is the error the bf16 reference adds to pi_ref. At
the first GRPO step the policy equals the reference, so the true KL is 0 and the k3 estimate
over the gap (`exp(d) - 1 - d`, d = ref - pi) is the bias the bf16 reference adds to the KL
penalty; both are reported. Times are the best of `--repeats` passes of each; the expert tokens
are off-policy for the base model (lower logprobs than its own samples), which if anything
makes the gap larger. Each dtype runs in this process one after the other, at `--threads`.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch
from record import add_common_flags, bench_run, console, print_table, set_threads

ENVS = ("agent_grpo/Calculator-v0", "agent_grpo/Search-v0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Sizes: episodes per env and timing repeats."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_flags(p)
    p.set_defaults(threads=2)  # as the trainer runs
    p.add_argument("--episodes", type=int, default=8, help="expert episodes per env")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per dtype (best kept)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.episodes, args.repeats = 1, 1
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both references over one packed batch: the gap per token, and each pass's time."""
    import copy

    from agent_grpo.config.jobs import AlgoConfig
    from agent_grpo.envs.text_env import train_seeds
    from agent_grpo.models.loading import load_model, load_tokenizer
    from agent_grpo.trainer.batch import pack_records
    from agent_grpo.trainer.parallel import DistContext, wrap_reference
    from agent_grpo.trainer.update import batch_logprobs
    from agent_grpo.trainer.warm_start import expert_record

    tokenizer, model = load_tokenizer("smollm2-135m-instruct"), load_model("smollm2-135m-instruct")
    rng = random.Random(args.seed)
    records = [expert_record(tokenizer, env_id, s) for env_id in ENVS
               for s in train_seeds(args.episodes, rng)]  # fmt: skip
    batch = pack_records(records, tokenizer.pad_token_id)
    algo, ctx = AlgoConfig(), DistContext()
    out: dict[str, Any] = {"rows": batch.input_ids.shape[0],
                           "tokens": int(batch.attention_mask.sum()),
                           "model_tokens": int(batch.loss_mask.sum())}  # fmt: skip
    values = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        reference = wrap_reference(copy.deepcopy(model), "none", ctx, dtype)
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            values[name] = batch_logprobs(reference, batch, 1.0, algo, ctx)  # [B, T]
            times.append(time.perf_counter() - started)
        out[f"{name}_s"] = min(times)
        out[f"{name}_weights_mb"] = sum(p.numel() * p.element_size()
                                        for p in reference.parameters()) / 2**20  # fmt: skip
        del reference
    scored = batch.loss_mask
    gap = (values["bf16"] - values["fp32"])[scored].double()  # [N]: ref_bf16 - ref_fp32
    k3 = gap.exp() - 1 - gap  # [N]: the k3 estimate of KL at pi == pi_ref (fp32)
    abs_gap = gap.abs()
    out.update(
        gap_mean=float(gap.mean()),
        abs_gap_mean=float(abs_gap.mean()),
        abs_gap_p50=float(abs_gap.quantile(0.5)),
        abs_gap_p99=float(abs_gap.quantile(0.99)),
        abs_gap_max=float(abs_gap.max()),
        k3_bias_mean=float(k3.mean()),
        fp32_logprob_mean=float(values["fp32"][scored].mean()),
        speedup=out["fp32_s"] / out["bf16_s"],
    )
    return out


def main(argv: list[str] | None = None) -> None:
    """Measure and record."""
    args = parse_args(argv)
    set_threads(args.threads)
    torch.manual_seed(args.seed)
    with bench_run("reference_dtype", args) as run:
        r = run.results["measured"] = measure(args)
        print_table(
            f"reference pass over {r['rows']} rows, {r['tokens']} tokens "
            f"({r['model_tokens']} scored)",
            ["reference", "seconds", "weights MiB"],
            [["fp32", r["fp32_s"], r["fp32_weights_mb"]],
             ["bf16", r["bf16_s"], r["bf16_weights_mb"]]],
        )  # fmt: skip
        print_table(
            "bf16 - fp32 logprob per model token",
            ["mean", "|mean|", "|p50|", "|p99|", "|max|", "k3 KL bias", "fp32 logprob mean"],
            [[r["gap_mean"], r["abs_gap_mean"], r["abs_gap_p50"], r["abs_gap_p99"],
              r["abs_gap_max"], r["k3_bias_mean"], r["fp32_logprob_mean"]]],
        )  # fmt: skip
        console.print(f"bf16 reference: {r['speedup']:.2f}x the fp32 pass")


if __name__ == "__main__":
    main()
