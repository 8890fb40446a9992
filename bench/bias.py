"""The exact-gradient meter: each objective's bias and variance against the exact gradient.

    .venv/bin/python bench/bias.py [--quick] [--batches 20000]

On the enumerable two-turn task of `agent_grpo.testing.bias_meter` (900 trajectories, a
stochastic tool, a terminal reward), every objective the trainer offers is sampled `--batches`
times (one group per prompt, the trainer's own advantage and loss functions) and its mean
gradient compared with the exact one. Writes `bench/results/bias.json`, the table in
docs/algorithms.md (between its `bias` markers) and docs/bias.png. The numbers are statistics of
a seeded sampler: they do not depend on the machine, only on the seed and the batch count.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from record import RESULTS_DIR, add_common_flags, bench_run, print_table, set_threads

from agent_grpo.algo.config import AlgoConfig
from agent_grpo.testing.bias_meter import (
    Failures,
    Objective,
    build_task,
    exact_kl_gradient,
    initial_logits,
    kl_term_gradient,
    measure,
)

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "algorithms.md"
PLOT = ROOT / "docs" / "bias.png"
SUM_NORM = "seq-mean-token-sum-norm"
BASELINES = {
    "GRPO (mean, std-scaled)": {},
    "Dr. GRPO (mean, unscaled)": {"scale": "none"},
    "RLOO (leave-one-out, unscaled)": {"leave_one_out": True},
    "RLOO, std-scaled": {"leave_one_out": True, "scale": "group"},
}
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", SUM_NORM)
RLOO = {"leave_one_out": True, "aggregation": SUM_NORM}
CORRECTIONS = {
    "none (pi_old = trainer, no weights)": (dict(RLOO), "current"),
    "plain PPO-clip (pi_old = sampler)": (RLOO | {"old_logprobs": "sampler"}, "behaviour"),
    "decoupled, TIS cap 2": (RLOO | {"tis_cap": 2.0}, "current"),
    "decoupled, IcePop mask [0.5, 5]": (RLOO | {"mask": {}}, "current"),
    "decoupled, whole-sequence IS": (
        RLOO | {"mask": {"low": 1e-9, "high": 1e9, "level": "sequence"}},
        "current",
    ),
    "GSPO (sequence ratio, pi_old = sampler)": (
        RLOO | {"old_logprobs": "sampler", "ratio": "sequence"},
        "behaviour",
    ),
}
TURN_CREDIT = {
    "RLOO, episode advantage only": dict(RLOO),
    "RLOO + turn credit (leave-one-out steps), omega 1": RLOO | {"turn_credit": {"weight": 1.0}},
    "GiGPO (mean baselines, unscaled), omega 1": {"scale": "none", "aggregation": SUM_NORM,
                                                   "turn_credit": {"weight": 1.0}},
    "GiGPO (mean baselines, std-scaled), omega 1": {"aggregation": SUM_NORM,
                                                     "turn_credit": {"weight": 1.0}},
}  # fmt: skip
"""Turn-level credit against the episode advantage alone (on-policy)."""
FAILURE_RATE = 0.2
"""Chance an episode fails, in the failure models below."""


def failure_models(task: Any) -> dict[str, Any]:
    """Independent failures, failures of wrong answers only (twice the rate: an outcome-linked
    failure, as when failing episodes are the ones that time out), of long episodes only."""
    n = len(task.reward)
    return {
        "independent": torch.full((n,), FAILURE_RATE, dtype=torch.float64),
        "wrong answers": torch.where(task.reward == 0, 2 * FAILURE_RATE, 0.0).double(),
        "long episodes": torch.where(task.mask.sum(-1) >= 5, 2 * FAILURE_RATE, 0.0).double(),
    }


COLUMNS = ["objective", "cos", "coef", "rel. error", "s.e.", "rel. std", "length push",
           "push s.e."]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Batches per objective and the seed."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_flags(p)
    p.add_argument("--batches", type=int, default=20000, help="sampled batches per objective")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _row(name: str, bias: Any) -> dict[str, Any]:
    return {
        "objective": name,
        "cos": bias.cosine,
        "coef": bias.coefficient,
        "rel_error": bias.rel_error,
        "standard_error": bias.standard_error,
        "rel_std": bias.rel_std,
        "length_push": bias.length_push,
        "length_push_se": bias.length_push_se,
        "prompt_coefficients": list(bias.prompt_coefficients),
    }


def run_meter(batches: int, seed: int) -> dict[str, Any]:
    """Every section of the table."""
    task = build_task()
    logits = initial_logits(task)
    on_policy = []
    for baseline, settings in BASELINES.items():
        for aggregation in AGGREGATIONS:
            algo = AlgoConfig(**settings, aggregation=aggregation)
            name = f"{baseline}, {aggregation}"
            on_policy.append(_row(name, measure(Objective(name, algo), task, logits,
                                                batches=batches, seed=seed)))  # fmt: skip
    groups = []
    for baseline in ("GRPO (mean, std-scaled)", "Dr. GRPO (mean, unscaled)"):
        algo = AlgoConfig(**BASELINES[baseline], aggregation=SUM_NORM)
        got = measure(Objective(baseline, algo), task, logits, batches=max(batches // 4, 100),
                      group_size=16, seed=seed)  # fmt: skip
        groups.append(_row(f"{baseline}, groups of 16", got))
    stale = []
    for staleness in range(4):
        for name, (settings, old) in CORRECTIONS.items():
            objective = Objective(name, AlgoConfig(**settings), staleness=staleness, old=old)  # type: ignore[arg-type]
            got = measure(objective, task, logits, batches=max(batches // 2, 100), seed=seed)
            stale.append({**_row(name, got), "staleness": staleness})
    failed = []
    for model, probability in failure_models(task).items():
        for mode in ("exclude", "drop_group"):
            for baseline in ("RLOO (leave-one-out, unscaled)", "GRPO (mean, std-scaled)"):
                algo = AlgoConfig(**BASELINES[baseline], aggregation=SUM_NORM)
                name = f"{model}, {mode}, {baseline}"
                objective = Objective(name, algo, failures=Failures(probability, mode))  # type: ignore[arg-type]
                got = measure(objective, task, logits, batches=max(batches // 2, 100), seed=seed)
                failed.append(_row(name, got))
    credit = []
    for name, settings in TURN_CREDIT.items():
        got = measure(Objective(name, AlgoConfig(**settings)), task, logits,  # type: ignore[arg-type]
                      batches=max(batches // 2, 100), seed=seed)  # fmt: skip
        credit.append(_row(name, got))
    ref = initial_logits(task, seed=1)
    exact = exact_kl_gradient(logits, ref, task)
    kl = []
    for kind in ("k1", "k2", "k3"):
        grad = kl_term_gradient(logits, ref, task, kind)
        norm = float(grad.norm())
        kl.append({
            "estimator": kind,
            "cos": float((grad * exact).sum()) / (norm * float(exact.norm())) if norm > 1e-12
            else None,
            "coef": float((grad * exact).sum() / exact.norm() ** 2),
            "norm_ratio": norm / float(exact.norm()),
        })  # fmt: skip
    return {"on_policy": on_policy, "groups_of_16": groups, "staleness": stale,
            "failures": failed, "turn_credit": credit, "kl": kl}  # fmt: skip


def _cells(row: dict[str, Any]) -> list[Any]:
    return [row["objective"], row["cos"], row["coef"], row["rel_error"], row["standard_error"],
            row["rel_std"], row["length_push"], row["length_push_se"]]  # fmt: skip


def _md_table(columns: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(payload: dict[str, Any]) -> str:
    """The generated section of docs/algorithms.md."""
    r = payload["results"]
    settings = payload["settings"]
    head = (
        f"Measured {payload['started_at'][:10]} with `bench/bias.py --batches "
        f"{settings['batches']}` (seed {settings['seed']}; the figures depend on the seed and "
        "batch count, not the machine: `bench/results/bias.json` records the run's machine and "
        "time). Groups of 4, one group per prompt per batch."
    )
    on_policy = _md_table(COLUMNS, [_cells(row) for row in r["on_policy"]])
    groups = _md_table(["objective", "prompt 0 coef", "prompt 1 coef", "s.e."],
                       [[row["objective"], *row["prompt_coefficients"], row["standard_error"]]
                        for row in r["groups_of_16"]])  # fmt: skip
    stale = _md_table(["staleness", *COLUMNS[:6]],
                      [[row["staleness"], *_cells(row)[:6]] for row in r["staleness"]])  # fmt: skip
    failed = _md_table(COLUMNS, [_cells(row) for row in r.get("failures", [])])
    credit = _md_table(COLUMNS[:6], [_cells(row)[:6] for row in r.get("turn_credit", [])])
    kl = _md_table(["per-token KL as a loss", "cos", "coef", "norm / exact"],
                   [[row["estimator"], row["cos"], row["coef"], row["norm_ratio"]]
                    for row in r["kl"]])  # fmt: skip
    return "\n\n".join([
        head,
        "**On-policy: baseline x aggregation** (rel. error and s.e. with `coef`'s nominal "
        "normaliser; length push > 0 is the Dr. GRPO paper's length bias)",
        on_policy,
        "**Std scaling reweights prompts** (groups of 16; prompt 1's rewards vary less)",
        groups,
        "**Stale samples** (RLOO, seq-mean-token-sum-norm; sampler `staleness` versions back)",
        stale,
        f"**Partial groups after failures** (each episode fails with the chance its model "
        f"gives, {FAILURE_RATE:.0%} or twice that; `rollout.on_failure`; seq-mean-token-sum-norm)",
        failed,
        "**Turn-level credit** (on-policy, seq-mean-token-sum-norm; `coef` and the errors with "
        "the nominal normaliser divided by 1 + omega: 1 is the policy gradient, once per "
        "estimate the advantage sums)",
        credit,
        "**KL estimators** against the gradient of the episode's KL(pi || pi_ref) (exact sums, "
        "no sampling)",
        kl,
        "![bias](bias.png)",
    ])  # fmt: skip


def write_doc(payload: dict[str, Any]) -> None:
    """Replace the text between the `bias` markers of docs/algorithms.md."""
    text = DOC.read_text()
    pattern = re.compile(r"(<!-- bias:begin -->\n).*?(\n<!-- bias:end -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{DOC} has no <!-- bias:begin --> / <!-- bias:end --> markers")
    DOC.write_text(pattern.sub(lambda m: m.group(1) + markdown(payload) + m.group(2), text))


def plot(payload: dict[str, Any]) -> None:
    """Left: on-policy relative error per objective; right: error against staleness."""
    r = payload["results"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    rows = r["on_policy"]
    left.barh([row["objective"] for row in rows], [row["rel_error"] for row in rows],
              xerr=[row["standard_error"] for row in rows], color="tab:blue")  # fmt: skip
    left.set_xlabel("|E[g] - grad J| / |grad J| (nominal scale)")
    left.invert_yaxis()
    left.tick_params(axis="y", labelsize=7)
    for name in CORRECTIONS:
        points = [row for row in r["staleness"] if row["objective"] == name]
        right.errorbar(
            [p["staleness"] for p in points],
            [p["rel_error"] for p in points],
            yerr=[p["standard_error"] for p in points],
            label=name,
            marker="o",
        )
    right.set_xlabel("staleness (policy versions)")
    right.set_ylabel("relative error")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=90)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(1)  # the meter's tensors are tiny: one thread is fastest
    batches = 200 if args.quick else args.batches
    with bench_run("bias", args) as run:
        run.results.update(run_meter(batches, args.seed))
    out = args.out or RESULTS_DIR / ("bias.quick.json" if args.quick else "bias.json")
    payload = json.loads(out.read_text())
    r = payload["results"]
    print_table("on-policy", COLUMNS, [_cells(row) for row in r["on_policy"]])
    print_table("stale", ["k", *COLUMNS[:6]],
                [[row["staleness"], *_cells(row)[:6]] for row in r["staleness"]])  # fmt: skip
    if not args.quick:
        write_doc(payload)
        plot(payload)


if __name__ == "__main__":
    main()
