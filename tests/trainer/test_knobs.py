"""Every knob of the update, tested: 2 real training steps on the tiny model per combination.

The combinations cover every value of every `algo` knob and most pairs of them (each row below
changes several at once), plus the steps that broke before: a batch whose groups are all dead
(so a minibatch has no trainable row) and a non-finite reward. Each run must finish, keep its
loss and weights finite and log the complete metric set. Pairs that must take the same update
(shared prefix on/off, skipping zero-advantage rows at beta 0, micro-batch sizes) are compared on
their first step, where both start from the same weights and batch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from agent_grpo.config.base import load_config
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.testing.reward_rules import reward_override
from agent_grpo.trainer.loop import train
from agent_grpo.trainer.metrics import StepMetrics

ROOT = Path(__file__).resolve().parents[2]
EVEN = reward_override("even", "even_tokens")
NAN = reward_override("nan", "nan_for_first_member")
DEAD = reward_override("dead", "constant")

MATRIX: dict[str, list[str]] = {
    "defaults": [EVEN],
    "epochs2-mb2-seqmean-k1-tis": [EVEN, "algo.epochs=2", "algo.minibatches=2",
        "algo.aggregation=seq-mean-token-mean", "algo.beta=0.04", "algo.kl=k1",
        "algo.tis_cap=2.0"],
    "epochs2-sumnorm-k2-rloo-sampler": [EVEN, "algo.epochs=2",
        "algo.aggregation=seq-mean-token-sum-norm", "algo.beta=0.04", "algo.kl=k2",
        "algo.leave_one_out=true", "algo.old_logprobs=sampler"],
    "mb2-k3-rloo-scaled-drop-dynamic": [EVEN, "algo.minibatches=2", "algo.beta=0.04",
        "algo.kl=k3", "algo.leave_one_out=true", "algo.scale=group", "algo.drop_dead_groups=true",
        "algo.dynamic_sampling=true", "algo.speed.skip_zero_advantage=false",
        "algo.speed.shared_prefix=false"],
    "sumnorm-maxtokens-none-sampler-dynamic": [EVEN, "algo.aggregation=seq-mean-token-sum-norm",
        "algo.max_tokens=64", "algo.scale=none", "algo.old_logprobs=sampler",
        "algo.dynamic_sampling=true", "algo.speed.shared_prefix=false",
        "algo.drop_dead_groups=true"],
    "seqmean-k1-noskip-drop-tis": [EVEN, "algo.aggregation=seq-mean-token-mean",
        "algo.beta=0.04", "algo.kl=k1", "algo.speed.skip_zero_advantage=false",
        "algo.drop_dead_groups=true", "algo.tis_cap=1.5"],
    "epochs2-mb2-k2-none-dynamic-sampler": [EVEN, "algo.epochs=2", "algo.minibatches=2",
        "algo.beta=0.04", "algo.scale=none", "algo.dynamic_sampling=true",
        "algo.old_logprobs=sampler", "algo.speed.micro_batch_tokens=64"],
    "all-dead-mb2": [DEAD, "algo.minibatches=2"],
    "all-dead-epochs2-k3-drop": [DEAD, "algo.epochs=2", "algo.minibatches=2", "algo.beta=0.04",
        "algo.kl=k3", "algo.drop_dead_groups=true"],
    "all-dead-dynamic": [DEAD, "algo.dynamic_sampling=true",
        "algo.dynamic_sampling_max_rounds=1"],
    "lean-bf16-epochs2-mb2-k3": [EVEN, "algo.speed.optimizer_in_backward=true",
        "algo.max_grad_norm=null", "algo.speed.recompute_mlp=true", "model.dtype=bfloat16",
        "algo.beta=0.04", "algo.kl=k3", "algo.epochs=2", "algo.minibatches=2",
        "algo.speed.micro_batch_tokens=64"],
    "bf16-reference-k3-mb2": [EVEN, "model.reference_dtype=bfloat16", "algo.beta=0.04",
        "algo.kl=k3", "algo.minibatches=2"],
    "all-dead-in-backward": [DEAD, "algo.speed.optimizer_in_backward=true",
        "algo.max_grad_norm=null"],
    "nan-reward": [NAN],
    "turn-credit-gigpo-k3": [EVEN, "algo.turn_credit={weight: 1.0, discount: 0.95}",
        "algo.beta=0.04", "algo.kl=k3"],
    "turn-credit-rloo-nan-mb2": [NAN, "algo.turn_credit={}", "algo.leave_one_out=true",
        "algo.minibatches=2"],
    "nan-reward-mb2-k2-rloo-tis-sumnorm": [NAN, "algo.minibatches=2", "algo.beta=0.04",
        "algo.leave_one_out=true", "algo.tis_cap=2.0", "algo.aggregation=seq-mean-token-sum-norm"],
    "partial-k1-tis-topk-causes-epochs2": [EVEN, "rollout.partial={over_sample: 1}",
        "algo.max_staleness=1", "algo.tis_cap=2.0", "rollout.sampling.top_k=20",
        "rollout.mismatch_causes_every=1", "algo.epochs=2"],
}  # fmt: skip

SAME_UPDATE: list[tuple[str, list[str], list[str]]] = [
    ("shared-prefix", [EVEN, "algo.speed.shared_prefix=true"],
     [EVEN, "algo.speed.shared_prefix=false"]),
    ("skip-zero-advantage", [EVEN, "algo.speed.skip_zero_advantage=true"],
     [EVEN, "algo.speed.skip_zero_advantage=false"]),
    ("micro-batch-tokens", [EVEN, "algo.beta=0.04", "algo.speed.micro_batch_tokens=4096"],
     [EVEN, "algo.beta=0.04", "algo.speed.micro_batch_tokens=48"]),
    ("optimizer-in-backward", [EVEN, "algo.max_grad_norm=null"],
     [EVEN, "algo.max_grad_norm=null", "algo.speed.optimizer_in_backward=true"]),
    ("recompute-mlp", [EVEN, "algo.beta=0.04", "algo.speed.recompute_mlp=true"],
     [EVEN, "algo.beta=0.04", "algo.speed.recompute_mlp=false"]),
]  # fmt: skip
SAME_ARITHMETIC = {"optimizer-in-backward", "recompute-mlp"}
"""Pairs that run the very same float operations (AdamW per tensor; the MLP recomputed as it
ran): their weights after step 0 agree, so step 1 is compared too."""
COMPARED = ["loss", "grad_norm", "clip_frac", "approx_kl_old", "ratio_mean", "trained_tokens"]
FIRST_STEP_ATOL = 64 * torch.finfo(torch.float32).eps
"""Step-0 figures of two paths over the same weights and batch: fp32 sums of ~100 O(1) terms in
another order, about sqrt(100) * eps apart; 64 eps is a margin of 6x."""


def source(name: str) -> str:
    """The extra reward source's name in matrix row `name`."""
    settings = " ".join(MATRIX[name])
    return next(n for n in ("even", "nan", "dead") if f"name: {n}," in settings)


def run_steps(tmp: Path, model_dir: Path, name: str, settings: list[str]) -> Path:
    """2 GRPO steps on Calculator-v0 (2 tasks x 2 samples), no eval, no warm start."""
    overrides = [f"model.name_or_path={model_dir}", f"run.root={tmp}", f"run.name={name}",
                 "eval=null", "warm_start=null", "run.tensorboard=false", *settings]  # fmt: skip
    config = load_config(TrainConfig, ROOT / "configs/calculator-tiny.yaml", overrides)
    return train(config)


def rows(run: Path) -> list[dict[str, Any]]:
    """The run's step rows of `metrics.jsonl`."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


STEP_KEYS = set(StepMetrics.model_fields) - {"rollout", "signal", "mismatch", "update", "times",
                                             "reward_means", "staleness",
                                             "mismatch_by_staleness", "heldout",
                                             "mismatch_causes"}  # fmt: skip


def metric_names() -> set[str]:
    """Every key a step row must have: the fields of `StepMetrics` and of its parts."""
    names = set(STEP_KEYS)
    for part in ("rollout", "signal", "mismatch", "update", "times"):
        names |= set(StepMetrics.model_fields[part].annotation.model_fields)  # type: ignore[union-attr]
    return names


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MATRIX))
def test_every_knob_combination_trains(tmp_path: Path, tiny_model_dir: Path, name: str) -> None:
    run = run_steps(tmp_path, tiny_model_dir, name, MATRIX[name])
    steps = rows(run)
    assert [r["step"] for r in steps] == [0, 1]
    for row in steps:
        components = {k for k in row if k.startswith("rewards/")}
        assert components == {"rewards/verifier/mean", f"rewards/{source(name)}/mean"}, row
        # synchronous, except the groups partial rollouts carry into the next step
        ages = {"0", "1"} if name.startswith("partial") and row["step"] > 0 else {"0"}
        assert {k for k in row if k.startswith("staleness/")} <= {f"staleness/{a}" for a in ages}
        assert {k for k in row if k.startswith("mismatch_staleness/")} <= {
            f"mismatch_staleness/{a}" for a in ages
        }
        causes = {k for k in row if k.startswith("mismatch_cause/")}
        wanted = {"mismatch_cause/filter", "mismatch_cause/kernels"} if "causes" in name else set()
        assert causes == wanted, causes
        named = {k for k in row if not k.startswith(("rewards/", "staleness/",
                                                      "mismatch_staleness/",
                                                      "mismatch_cause/"))}  # fmt: skip
        assert named == metric_names(), named ^ metric_names()
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]), row
        assert row["skipped_steps"] == 0
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    weights = load_file(checkpoint / "model" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    if name.startswith("all-dead"):
        assert all(r["dead_group_fraction"] == 1.0 for r in steps)
        if "beta" not in " ".join(MATRIX[name]):
            # Every advantage is 0 and there is no KL term: nothing moves the weights
            # (trained_tokens still counts the denominator's tokens, skipped or not).
            assert all(r["loss"] == 0 and r["grad_norm"] == 0 for r in steps)
    if name.startswith("partial"):
        assert all(r["in_flight_groups"] == 1 for r in steps)
    if name.startswith("nan-reward"):
        assert all(r["nonfinite_rewards"] == 2 and r["excluded_trajectories"] == 2 for r in steps)
        records = (run / "trajectories" / "step_000000.jsonl").read_text().splitlines()
        first = [json.loads(line) for line in records if json.loads(line)["index_in_group"] == 0]
        assert all(r["excluded"].startswith("non-finite reward") for r in first)
        assert all(r["advantage"] == 0.0 for r in first)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "a", "b"), SAME_UPDATE, ids=[s[0] for s in SAME_UPDATE])
def test_equivalent_settings_take_the_same_first_step(
    tmp_path: Path, tiny_model_dir: Path, name: str, a: list[str], b: list[str]
) -> None:
    runs_a = rows(run_steps(tmp_path, tiny_model_dir, f"{name}-a", a))
    runs_b = rows(run_steps(tmp_path, tiny_model_dir, f"{name}-b", b))
    first, second = runs_a[0], runs_b[0]
    assert first["trained_tokens"] > 0 and first["grad_norm"] > 0
    for key in COMPARED:
        assert first[key] == pytest.approx(second[key], rel=1e-5, abs=FIRST_STEP_ATOL), key
    if name in SAME_ARITHMETIC:  # step 0's update was the same, so step 1 samples the same
        for key in COMPARED:
            assert runs_a[1][key] == pytest.approx(runs_b[1][key], rel=1e-5, abs=FIRST_STEP_ATOL)
