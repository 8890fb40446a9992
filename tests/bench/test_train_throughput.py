"""`bench/train_throughput.py` still runs our side through the real loop: it wraps the loop's
phase functions where the loop looks them up, so a refactor that moves one breaks the bench
(it did: the engine builder moved to `trainer/setup.py`). A `--quick` run of the `hf` side
checks that every phase was seen and that the results file records the machine's load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Not `serial`: it checks what the results file records, not that the machine was quiet, so it
# runs beside other tests (its run is then recorded as busy), which keeps `make test` shorter.


@pytest.mark.slow
def test_a_quick_run_of_our_side_sees_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "train_throughput.json"
    command = [sys.executable, str(ROOT / "bench" / "train_throughput.py"), "--quick",
               "--sides", "hf", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result) >= {"clean", "foreign_cores", "loadavg_start", "loadavg_end"}
    (run,) = result["results"]["raw"]["hf"]
    assert run["ok"], run.get("error")
    assert set(run["load"]) >= {"foreign_cores", "loadavg_before", "loadavg_after", "clean"}
    assert {"rollout", "pi_ref", "update"} <= set(run["peaks"])
    assert run["parts"]["engine (weights, KV cache, runtime)"] >= 0
    hf = result["results"]["sides"]["hf"]
    assert hf["ok"] and hf["step_s"] > 0 and hf["update_tokens"] > 0


def test_the_update_ceiling_counts_the_tokens_the_pass_computes() -> None:
    """3 groups x 2 rows: a 200-token head every prompt starts with, a 10-token task, 5 model
    tokens. The pass computes each prompt once but the head once in all ((3 - 1) x 200 > 128):
    3 x 210 - 2 x 200 + 6 x 5 = 260 tokens."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from train_throughput import computed_tokens

    from agent_grpo.trainer.batch import PackedBatch

    head = list(range(10, 210))
    ids = torch.tensor([[*head, *range(1000 + 10 * g, 1010 + 10 * g), *[2000 + r] * 5]
                        for g in range(3) for r in range(2)])  # fmt: skip
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, 210:] = True
    nan = torch.full(ids.shape, float("nan"))
    batch = PackedBatch(ids, torch.ones_like(ids), loss_mask, nan, torch.ones(ids.shape),
                        torch.tensor([0, 0, 1, 1, 2, 2]), torch.arange(6))  # fmt: skip
    assert computed_tokens(batch) == 260
    assert computed_tokens(batch.select([0, 1])) == 220  # one group: 210 + 2 x 5


def test_every_side_of_ours_is_a_valid_train_config() -> None:
    """Each of our sides' configs validates (the lean sides once named knobs that had moved to
    `algo.speed`, and a full `make bench` then reported them as not run)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import train_throughput

    from agent_grpo.config.jobs import TrainConfig

    args = train_throughput.parse_args([])
    for side in train_throughput.SIDES:
        config = TrainConfig.model_validate(train_throughput.our_config(args, side, "/tmp/x"))
        if "lean" in side:
            assert config.algo.speed.recompute_mlp and config.algo.speed.optimizer_in_backward


def test_the_ceiling_is_the_best_each_rate_reached_in_any_round() -> None:
    """Two rounds, each faster at something: the ceiling takes the higher FLOP/s and bandwidth
    and the shorter decode matmul of each, not one round's figures."""
    sys.path.insert(0, str(ROOT / "bench"))
    from train_throughput import best_ceiling

    def round_(forward: float, backward: float, bandwidth: float, onednn: float) -> dict:
        kernels = {"fp32": {"F.linear": 0.05, "oneDNN": onednn}}
        rates = {"layers forward": forward, "layers backward": backward}
        return {"ok": True, "tokens": 876, "params": 7, "fp32": rates,
                "bandwidth_gb_s": bandwidth, "decode_matmul_by_kernel": kernels}  # fmt: skip

    best = best_ceiling([round_(115e9, 190e9, 70.0, 0.03), round_(190e9, 110e9, 40.0, 0.02)])
    assert best["fp32"] == {"layers forward": 190e9, "layers backward": 190e9}
    assert best["bandwidth_gb_s"] == 70.0 and best["tokens"] == 876 and best["params"] == 7
    assert best["decode_matmul_by_kernel"] == {"fp32": {"F.linear": 0.05, "oneDNN": 0.02}}
