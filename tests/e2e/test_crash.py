"""Crash safety: SIGKILL the trainer at several points, `--resume`, and get the uninterrupted run.

The trainer is `agent-grpo train` in a subprocess on the tiny model; `AGENT_GRPO_CRASH_AT`
(agent_grpo/faults.py) makes it SIGKILL itself at a named point of a chosen step: half way
through writing a step's trajectories, after a step is recorded but before its checkpoint, and
half way through writing a checkpoint. After `--resume`, every step must appear exactly once in
`metrics.jsonl`, the trajectory files and the index, with the records, the metrics and the
final weights of the uninterrupted run (on CPU the run is deterministic), and the resume must
not repeat the base evaluation or the warm start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agent_grpo.run_dir.writer import RunWriter
from agent_grpo.testing.cli_runs import deterministic
from agent_grpo.testing.reward_rules import reward_override

ROOT = Path(__file__).resolve().parents[2]
EVEN = reward_override("even", "even_tokens")
SETTINGS = ["steps=3", "run.checkpoint_every=2", "run.checkpoint_every_s=0", "eval.tasks=2",
            "warm_start.demos=2", "run.tensorboard=false", EVEN]  # fmt: skip

pytestmark = pytest.mark.slow


def train(root: Path, model_dir: Path, name: str, *extra: str, crash: str | None = None):
    """`agent-grpo train` on calculator-tiny; returns the finished process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("AGENT_GRPO_CRASH_AT", None)
    if crash is not None:
        env["AGENT_GRPO_CRASH_AT"] = crash
    config = str(ROOT / "configs/calculator-tiny.yaml")
    command = [sys.executable, "-m", "agent_grpo.cli", "train", config,
               f"model.name_or_path={model_dir}", f"run.root={root}", f"run.name={name}",
               *SETTINGS, *extra]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def snapshot(run: Path) -> dict[str, object]:
    """Everything a run recorded, without wall-clock figures."""
    rows = [deterministic(json.loads(x)) for x in (run / "metrics.jsonl").read_text().splitlines()]
    store = RunWriter.open(run)
    records = {
        step: [
            (r.uid, r.token_ids, r.reward, r.old_logprobs) for r in store.read_trajectories(step)
        ]
        for step in store.steps()
    }
    index = [(e.step, e.uid) for e in store.index()]
    last = store.latest_checkpoint()
    assert last is not None
    weights = load_file(last / "model" / "model.safetensors")
    return {"rows": rows, "records": records, "index": index, "weights": weights}


# Partial rollouts: half the tasks take 6 turns, so groups are in flight at every checkpoint;
# a resume must continue them (their token trees, turns and envs) where the killed run had them.
PARTIAL = ["env.id=agent_grpo.testing.envs:LongTailEnv", "env.kwargs={long_every: 2}",
           "rollout.partial={over_sample: 2}", "rollout.sampling.stop=[e]", "warm_start=null",
           "algo.max_staleness=1"]  # fmt: skip


def _uninterrupted(root: Path, model_dir: Path, *extra: str) -> dict[str, object]:
    done = train(root, model_dir, "whole", *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    whole = snapshot(root / "whole")
    # A comparison on dead groups (zero advantages) could not see a wrong update: every step
    # here must carry a signal, or the test proves nothing.
    steps = [row for row in whole["rows"] if "dead_group_fraction" in row]  # type: ignore[attr-defined]
    assert len(steps) == 3 and all(row["dead_group_fraction"] < 1.0 for row in steps)
    return whole


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    return _uninterrupted(tmp_path_factory.mktemp("crash"), tiny_model_dir)


@pytest.fixture(scope="module")
def uninterrupted_partial(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    whole = _uninterrupted(tmp_path_factory.mktemp("crash-partial"), tiny_model_dir, *PARTIAL)
    assert all(row.get("in_flight_groups", 2) == 2 for row in whole["rows"])  # type: ignore[attr-defined]
    return whole


# Every point between a step's records, its metrics row, its checkpoint and the pruning of the
# oldest checkpoint (checkpoints after steps 0, 2 and 3; the save after step 3 prunes step 0's).
@pytest.mark.parametrize("point", ["trajectories:0", "trajectories:2", "metrics:2", "after_step:2",
                                   "checkpoint:2", "prune:3"])  # fmt: skip
def test_a_killed_run_resumes_to_the_uninterrupted_run(
    tmp_path: Path, tiny_model_dir: Path, uninterrupted: dict[str, object], point: str
) -> None:
    _kill_and_resume(tmp_path, tiny_model_dir, uninterrupted, point)


# Points where groups are in flight between the last checkpoint and the kill.
@pytest.mark.parametrize("point", ["trajectories:2", "after_step:2", "checkpoint:2"])
def test_a_killed_partial_run_resumes_its_groups_in_flight(
    tmp_path: Path, tiny_model_dir: Path, uninterrupted_partial: dict[str, object], point: str
) -> None:
    _kill_and_resume(tmp_path, tiny_model_dir, uninterrupted_partial, point, *PARTIAL)


def test_a_killed_partial_run_on_ray_workers_trains_every_group_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The actors' groups in flight are not in the checkpoint (their token trees live on the
    actors), but their tasks are: a resumed run starts them over, so none is lost and none
    trains twice, whether it was in flight, finished and not yet trained, or admitted ahead for
    a step the killed run never took."""
    # Checkpointed after step 0, which trained a task of step 1 (s1-t0) while one of step 0's
    # (s0-t0) was in flight: the kill after step 1 loses both from the actors.
    ray = [*PARTIAL, "rollout.workers={type: ray, num_workers: 2}", "steps=4", "eval=null",
           "run.checkpoint_every=1"]  # fmt: skip
    killed = train(tmp_path, tiny_model_dir, "run", *ray, crash="after_step:1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = train(tmp_path, tiny_model_dir, "run", *ray, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    store = RunWriter.open(tmp_path / "run")
    assert store.steps() == [0, 1, 2, 3]
    trained = [sorted({r.group_id for r in store.read_trajectories(s)}) for s in store.steps()]
    assert trained[0] == ["s0-t1", "s1-t0"]  # the case above (the run is deterministic)
    groups = [g for step in trained for g in step]
    assert all(len(step) == 2 for step in trained)  # tasks_per_step groups each step
    assert len(groups) == len(set(groups)), trained  # none trained twice
    assert "s0-t0" in groups, trained  # started over, not lost with the killed run's actors


def _kill_and_resume(
    tmp_path: Path, tiny_model_dir: Path, uninterrupted: dict[str, object], point: str,
    *extra: str,
) -> None:  # fmt: skip
    killed = train(tmp_path, tiny_model_dir, "run", *extra, crash=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = train(tmp_path, tiny_model_dir, "run", *extra, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # the fresh run's base eval and warm start are in the step-0 checkpoint: never repeated
    log = resumed.stdout + resumed.stderr  # the rich log handler writes to stdout
    assert "resumed from" in log  # the log is where this looks
    assert "warm start:" not in log and "eval base" not in log
    got = snapshot(tmp_path / "run")
    steps = [r["step"] for r in got["rows"]]  # type: ignore[index]
    assert steps == [0, 1, 2, 3]  # 3 steps, then the final eval, each exactly once
    index = got["index"]
    assert len(index) == len(set(index)) == 3 * 4  # type: ignore[arg-type]
    assert got["records"] == uninterrupted["records"]
    # Sampler logprobs (and so the sampler/trainer mismatch) depend in the last bits on what the
    # engine's prefix cache held: a restarted engine recomputes prefixes the old one reused.
    # Everything else is bit for bit the uninterrupted run's.
    for row, want in zip(got["rows"], uninterrupted["rows"], strict=True):  # type: ignore[call-overload]
        row, want = dict(row), dict(want)
        for key in ("logprob_mismatch_mean", "logprob_mismatch_max"):
            if key in want:
                assert row.pop(key) == pytest.approx(want.pop(key), abs=1e-6)
        assert row == want
    for name, tensor in uninterrupted["weights"].items():  # type: ignore[attr-defined]
        assert torch.equal(got["weights"][name], tensor), name  # type: ignore[index]


def test_old_checkpoints_are_pruned(tmp_path: Path, tiny_model_dir: Path) -> None:
    done = train(tmp_path, tiny_model_dir, "pruned", "run.checkpoint_every=1",
                 "run.keep_checkpoints=2")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "pruned" / "checkpoints").iterdir())
    assert names == ["step_000002", "step_000003"]


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(
    tmp_path: Path, monkeypatch
) -> None:
    import errno

    from agent_grpo.run_dir.writer import RunDirWriteError
    from agent_grpo.trainer import checkpoint
    from agent_grpo.trainer.checkpoint import TrainerState, save_checkpoint

    class Model:
        """Writes its 'weights', or fails like a full disk."""

        def __init__(self, full: bool) -> None:
            self.full = full

        def save_pretrained(self, path: Path) -> None:
            path.mkdir(parents=True)
            (path / "model.safetensors").write_bytes(b"w")
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    tokenizer = type("T", (), {"save_pretrained": lambda self, path: None})()
    folder = tmp_path / "checkpoints"
    save_checkpoint(
        folder / "step_000001", Model(False), tokenizer, optimizer, TrainerState(step=1)
    )
    with pytest.raises(RunDirWriteError, match=r"cannot write checkpoint .*step_000002"):
        save_checkpoint(folder / "step_000002", Model(True), tokenizer, optimizer,
                        TrainerState(step=2))  # fmt: skip
    assert sorted(p.name for p in folder.iterdir()) == ["step_000001"]  # no half-written dir
    assert RunWriter(tmp_path).latest_checkpoint() == folder / "step_000001"
    assert checkpoint.read_state(folder / "step_000001").step == 1
