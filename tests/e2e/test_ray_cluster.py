"""Rollout workers on a real Ray cluster: a head and two worker nodes on this machine, each a
raylet of its own started with `ray start` on 127.0.0.1, the worker nodes alone holding the
custom resource `rollout_node`. The actors land on the worker nodes by `resources`, the weights
are broadcast to them, and a training run joined with `rollout.workers.address` equals the run
in one process. `ray_cluster` kills every node's processes when the module ends, passed or not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import agent_grpo
from agent_grpo.rollout.backends.hf import HFBackend
from agent_grpo.testing.cli_runs import deterministic, metrics
from agent_grpo.testing.ray_cluster import RayCluster, interface_bytes, ray_cluster
from agent_grpo.testing.reward_rules import reward_override
from agent_grpo.testing.tiny_model import build_tiny_model

# Three raylets and their actors: beside another worker's vLLM engines, Ray's memory monitor
# killed the actors (seen with `pytest -n 2`).
pytestmark = pytest.mark.serial

PACKAGE_ROOT = Path(agent_grpo.__file__).resolve().parents[1]
"""Where the nodes' workers import agent_grpo from: the tree under test."""
RESOURCE = {"rollout_node": 1.0}


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[RayCluster, set[str]]]:
    """The cluster, joined by this process; and the ids of its two worker nodes."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'agent-grpo[ray]')")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_ROOT), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    mode = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # as the nodes run (`ray_cluster`)
    with ray_cluster(workers=2, worker_resources=RESOURCE, env=env) as running:
        # Ray rewrites 127.0.0.1 in an address to this machine's address, which Linux still
        # routes over the loopback device; this process's own node address stays 127.0.0.1.
        ray.init(address=running.address, _node_ip_address="127.0.0.1", log_to_driver=False)
        try:
            deadline = time.monotonic() + 120
            while len(alive := [n for n in ray.nodes() if n["Alive"]]) < 3:
                came_up = f"{len(alive)} of 3 Ray nodes came up\n{running.log_tails()}"
                assert time.monotonic() < deadline, came_up
                time.sleep(1)
            assert len({n["NodeManagerAddress"] for n in alive}) == 1  # one machine
            workers = {n["NodeID"] for n in alive if n["Resources"].get("rollout_node")}
            assert len(workers) == 2
            yield running, workers
        finally:
            ray.shutdown()
            os.environ.pop("RAY_AUTH_MODE")
            if mode is not None:
                os.environ["RAY_AUTH_MODE"] = mode


@pytest.mark.slow
def test_actors_sit_on_the_worker_nodes_and_receive_the_weights(
    cluster: tuple[RayCluster, set[str]], tiny_model_dir: Path, tokenizer: Any
) -> None:
    from agent_grpo.rollout.ray_pool import RayRolloutPool

    _, worker_nodes = cluster
    with RayRolloutPool(2, str(tiny_model_dir), resources=RESOURCE,
                        weight_sync="broadcast") as pool:  # fmt: skip
        assert sorted(pool.nodes()) == sorted(worker_nodes)  # one actor on each, none on the head
        model, _ = build_tiny_model(tokenizer, seed=1)
        pool.update_weights(model.state_dict(), version=1)
        generator = torch.Generator().manual_seed(0)
        sequences = torch.randint(3, 49152, (2, 24), generator=generator).tolist()
        targets = [[t >= 8 for t in range(24)]] * 2
        want = HFBackend(model, tokenizer).score(sequences, targets, 1.0)
        for version, scores in pool.score(sequences, targets):
            assert version == 1
            for row, want_row in zip(scores, want, strict=True):
                # the same model and kernels in another process: equal to fp32 rounding
                assert row == pytest.approx(want_row, abs=1e-6)


def train_tiny(root: Path, model_dir: Path, name: str, *settings: str) -> Path:
    """2 GRPO steps of calculator-tiny in this process, with a warm start (its push matters)."""
    from agent_grpo.config.base import load_config
    from agent_grpo.config.jobs import TrainConfig
    from agent_grpo.trainer.loop import train

    overrides = [f"model.name_or_path={model_dir}", f"run.root={root}", f"run.name={name}",
                 "eval=null", "run.tensorboard=false", reward_override("even", "even_tokens"),
                 *settings]  # fmt: skip
    return train(load_config(TrainConfig, PACKAGE_ROOT / "configs/calculator-tiny.yaml",
                             overrides))  # fmt: skip


@pytest.mark.slow
def test_training_on_the_cluster_is_the_local_run(
    cluster: tuple[RayCluster, set[str]], tiny_model_dir: Path, tmp_path: Path, tokenizer: Any
) -> None:
    from agent_grpo.run_dir.writer import RunWriter

    running, _ = cluster
    workers = (f"rollout.workers={{type: ray, num_workers: 2, address: '{running.address}', "
               "resources: {rollout_node: 1}, weight_sync: broadcast}")  # fmt: skip
    local = train_tiny(tmp_path, tiny_model_dir, "local")
    before = interface_bytes()
    remote = train_tiny(tmp_path, tiny_model_dir, "cluster", workers)
    moved = {name: n - before[name] for name, n in interface_bytes().items()}
    # 3 pushes (the warm start's, then one per step) of the tiny model's fp32 weights, each
    # broadcast to 2 actors, all over the loopback device; other interfaces see less than one
    params = sum(p.numel() for p in build_tiny_model(tokenizer, seed=0)[0].parameters())
    assert moved.pop("lo") > 3 * 2 * 4 * params
    assert sum(moved.values()) < 4 * params, moved
    for step in (0, 1):
        a, b = (RunWriter.open(run).read_trajectories(step) for run in (local, remote))
        assert [(r.uid, r.token_ids, r.reward) for r in a] == [
            (r.uid, r.token_ids, r.reward) for r in b
        ]
        assert {r.policy_version for r in b} == {step}  # the pushed version sampled each step
    for got, want in zip(metrics(remote), metrics(local), strict=True):
        assert deterministic(got) == pytest.approx(deterministic(want), rel=1e-5, abs=1e-6)
