"""`agent-grpo train` under torchrun takes the steps one process takes and writes the same run.

The CLI runs as a subprocess on the tiny model, once in one process and then under
`torchrun --nproc_per_node 2` (gloo, CPU, 127.0.0.1) in DDP and in FSDP2 mode; every metric of
every step and the final checkpoint (weights and AdamW state) must agree. The config makes each
torchrun code path run: 3 groups on 2 ranks (so the ranks hold different token counts), a warm
start on rank 0 alone (its weights must reach rank 1 before FSDP2 shards them), `epochs=2` so
pi_old is a separate sharded pass, `beta > 0` so pi_ref is one too, evaluation on rank 0 and a
checkpoint every step. Both learning rates are 1e-3, so the warm start moves parameters by
~4e-3 and a rank that missed it would take a visibly different first GRPO step.

What is compared, and why: the first step's metrics (loss, gradient norm, clip fractions, KLs)
are functions of the same weights and batch, computed with a different reduction order, so they
agree to fp32 precision. Weights after AdamW are not compared: Adam's first update is about
`lr * sign(g)`, so a gradient component near 0 whose sign differs by 1e-9 moves a weight by
2 * lr (the suite once failed on Intel Xeon with 2.1e-5 against 2e-5 that way). The later step
and the optimizer's first moment (linear in the gradients) are compared with a tolerance that
allows for that: relative, at 1e-3 of each tensor's scale.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import agent_grpo
from agent_grpo.config.base import ConfigError
from agent_grpo.config.jobs import DistributedConfig, TrainConfig
from agent_grpo.testing.cli_runs import RULE, RULE_REWARD, deterministic, metrics
from agent_grpo.testing.torchrun import run_torchrun
from agent_grpo.trainer.setup import start_distributed

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = Path(agent_grpo.__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs/calculator-tiny.yaml")
SETTINGS = [
    "rollout.tasks_per_step=3",
    "algo.epochs=2",
    "algo.beta=0.04",
    "algo.lr=1.0e-3",
    "warm_start.lr=1.0e-3",
    # One forward per micro-batch of rows in every mode: the shared-prefix pass splits rows into
    # passes by length (`length_buckets`) over the rows a rank holds, so one process and two
    # ranks would round differently, and after Adam's sign-like first step a flipped sample at
    # step 1 (seen) is a different run, not a distributed bug. FSDP2 runs without it anyway.
    "algo.speed.shared_prefix=false",
    RULE_REWARD,
]
FIRST_STEP_REL = 1e-4
"""First-step metrics: fp32 sums of a few hundred terms in another order (measured < 1e-6)."""
LATER_REL = 1e-3
"""Later figures, after AdamW steps (see the module docstring)."""


def train(root: Path, model_dir: Path, name: str, *args: str, mode: str = "none") -> Path:
    """`agent-grpo train` with the test settings: one process for mode none, else 2 ranks."""
    (root / "e2e_rules.py").write_text(RULE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as users run it
    # the rules beside the runs, and the agent_grpo under test (for Ray's workers too)
    path = os.pathsep.join([str(root), str(PACKAGE_ROOT)])
    env |= {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = ["-m", "agent_grpo.cli", "train", CONFIG, f"model.name_or_path={model_dir}"]
    command += [f"run.root={root}", f"run.name={name}", f"distributed.mode={mode}", *SETTINGS]
    command += list(args)
    if mode == "none":
        done = subprocess.run(
            [sys.executable, *command], env=env, cwd=root, capture_output=True, text=True,
            timeout=600, check=False,
        )  # fmt: skip
    else:
        done = run_torchrun(command, env, timeout=600, cwd=root)
    assert done.returncode == 0, f"{name}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    # Every rank prints the one directory rank 0 wrote, alone on a line (two ranks' prints may
    # share one); a log line naming the directory says more than the path.
    path = re.escape(str(root / name)) + r"(?:-\d{8}-\d{6})?"
    lines = [line for line in done.stdout.splitlines() if re.fullmatch(f"(?:{path})+", line)]
    printed = {p for line in lines for p in re.findall(path, line)}
    assert len(printed) == 1, printed
    return Path(printed.pop())


def final_checkpoint(run: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Weights and optimizer state of the run's last checkpoint."""
    path = sorted((run / "checkpoints").iterdir())[-1]
    weights = load_file(path / "model" / "model.safetensors")
    return weights, torch.load(path / "trainer.pt", weights_only=False)["optimizer"]


def max_diff(a: dict[Any, torch.Tensor], b: dict[Any, torch.Tensor]) -> float:
    """Largest absolute difference over tensors with the same keys."""
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def sampled(run: Path, step: int) -> list[tuple[list[int], float]]:
    """(token ids, reward) of every trajectory of a step."""
    lines = (run / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()
    return [(r["token_ids"], r["reward"]) for r in map(json.loads, lines)]


def assert_same_metrics(got: dict[str, float], want: dict[str, float], rel: float) -> None:
    """Every deterministic metric (all but timings) agrees within `rel`."""
    got, want = deterministic(got), deterministic(want)
    assert got.keys() == want.keys()
    assert got == pytest.approx(want, rel=rel, abs=rel * 0.1)


def max_rel_diff(a: dict[Any, torch.Tensor], b: dict[Any, torch.Tensor]) -> float:
    """Largest absolute difference of each tensor pair divided by the larger tensor's scale."""
    assert a.keys() == b.keys()
    out = 0.0
    for k in a:
        scale = max(float(a[k].float().abs().max()), float(b[k].float().abs().max()), 1e-12)
        out = max(out, float((a[k].float() - b[k].float()).abs().max()) / scale)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    """The same 2-step job in one process, under DDP and under FSDP2."""
    root = tmp_path_factory.mktemp("dist-runs")
    return {mode: train(root, tiny_model_dir, mode, mode=mode) for mode in ("none", "ddp", "fsdp")}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torchrun_takes_the_one_process_steps(
    runs: dict[str, Path], tiny_model_dir: Path, mode: str
) -> None:
    single, sharded = metrics(runs["none"]), metrics(runs[mode])
    # one row per step, then the final eval (as step 2): a second writing rank would double them
    assert [r["step"] for r in sharded] == [0, 1, 2]
    assert "eval_success_rate" in sharded[-1]
    assert_same_metrics(sharded[0], single[0], FIRST_STEP_REL)
    for got, want in zip(sharded[1:], single[1:], strict=True):
        assert_same_metrics(got, want, LATER_REL)
    assert single[1]["approx_kl_old"] > 1e-5 and single[1]["kl_ref"] > 1e-6  # both passes used
    assert sampled(runs[mode], 1) == sampled(runs["none"], 1)  # rank 0 sampled the same after
    _, optimizer = final_checkpoint(runs[mode])
    want_weights, want_optimizer = final_checkpoint(runs["none"])
    assert optimizer["param_groups"] == want_optimizer["param_groups"]
    for index, state in want_optimizer["state"].items():
        assert state["step"] == optimizer["state"][index]["step"]
        first = {"m": optimizer["state"][index]["exp_avg"]}
        assert max_rel_diff(first, {"m": state["exp_avg"]}) < LATER_REL
    base = load_file(tiny_model_dir / "model.safetensors")
    assert max_diff(want_weights, base) > 1e-3  # training moved the weights


@pytest.fixture(scope="module")
def ray_runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    """The job with 2 Ray rollout workers (a local Ray instance that rank 0 starts and drives)
    in one process and under DDP."""
    root = tmp_path_factory.mktemp("ray-runs")
    workers = "rollout.workers={type: ray, num_workers: 2}"
    return {mode: train(root, tiny_model_dir, f"ray-{mode}", workers, mode=mode)
            for mode in ("none", "ddp")}  # fmt: skip


@pytest.mark.slow
def test_ray_workers_under_torchrun_take_the_one_process_steps(ray_runs: dict[str, Path]) -> None:
    single, ddp = metrics(ray_runs["none"]), metrics(ray_runs["ddp"])
    assert [r["step"] for r in ddp] == [0, 1, 2]  # rank 0 alone wrote; the final eval is step 2
    assert_same_metrics(ddp[0], single[0], FIRST_STEP_REL)
    for got, want in zip(ddp[1:], single[1:], strict=True):
        assert_same_metrics(got, want, LATER_REL)
    for step in (0, 1):  # the actors got each step's weights from rank 0 and sampled the same
        assert sampled(ray_runs["ddp"], step) == sampled(ray_runs["none"], step)
        lines = (ray_runs["ddp"] / "trajectories" / f"step_{step:06d}.jsonl").read_text()
        assert {json.loads(x)["policy_version"] for x in lines.splitlines()} == {step}


@pytest.mark.slow
def test_fsdp_resumes_its_own_checkpoint(
    runs: dict[str, Path], tmp_path: Path, tiny_model_dir: Path
) -> None:
    """1 step, then `--resume` to 2 under FSDP2: step 1 and the weights match the 2-step run."""
    train(tmp_path, tiny_model_dir, "resumed", "steps=1", "eval=null", mode="fsdp")
    run = train(tmp_path, tiny_model_dir, "resumed", "eval=null", "--resume", mode="fsdp")
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0.0, 1.0]
    assert_same_metrics(rows[1], metrics(runs["none"])[1], LATER_REL)
    _, optimizer = final_checkpoint(run)
    _, want = final_checkpoint(runs["none"])
    for index, state in want["state"].items():
        first = {"m": optimizer["state"][index]["exp_avg"]}
        assert max_rel_diff(first, {"m": state["exp_avg"]}) < LATER_REL


@pytest.mark.slow
def test_every_rank_names_the_directory_rank_0_wrote(runs: dict[str, Path], tiny_model_dir):
    root = runs["ddp"].parent
    again = train(root, tiny_model_dir, "ddp", "steps=1", "eval=null", mode="ddp")
    assert again != runs["ddp"] and again.parent == root  # the name was taken: a fresh one
    assert (again / "config.yaml").is_file()


def test_a_launch_that_does_not_fit_the_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node"):
        start_distributed(TrainConfig(distributed=DistributedConfig(mode="ddp")))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="2 separate models"):
        start_distributed(TrainConfig())
