"""`replay --verify` checks the run as a whole: one real 3-step run of the tiny model, copied and
corrupted once per case (a piece deleted, added, reordered or edited; a record edited with its
content hash recomputed), must fail naming the corruption; the untouched run passes."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent_grpo.inspect.replay import add_replay_parser
from agent_grpo.inspect.verify_run import RunFacts, manifest_problems, record_problems
from agent_grpo.run_dir.manifest import KEY_ENV, MANIFEST, parse_manifest, seal, sha256_bytes
from agent_grpo.run_dir.writer import RunWriter, record_hash

ROOT = Path(__file__).resolve().parents[2]
EVEN = "agent_grpo.testing.reward_rules:even_tokens"
# A weight other than 1 so the reward check must read it from config.yaml.
SETTINGS = ["steps=3", "eval.tasks=1", "warm_start.demos=2", "run.tensorboard=false",
            f"rewards=[{{type: rule, name: even, weight: 0.5, function: '{EVEN}'}}]"]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A real 3-step run of calculator-tiny (checkpoints 2 and 3 kept, 0 and 1 pruned).

    Training it takes seconds, so every test on it is marked slow: `make test` runs them, `make
    test-fast` runs only the key tests at the end, which need no run."""
    root = tmp_path_factory.mktemp("verify-run")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop(KEY_ENV, None)
    command = [sys.executable, "-m", "agent_grpo.cli", "train",
               str(ROOT / "configs/calculator-tiny.yaml"), f"model.name_or_path={tiny_model_dir}",
               f"run.root={root}", "run.name=base", *SETTINGS]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "base"


@pytest.fixture
def run(trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh copy of the trained run, verified without a key, 220 columns wide."""
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setenv("COLUMNS", "220")
    return Path(shutil.copytree(trained, tmp_path / "base"))


def _verify(run: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """`replay RUN --verify` in-process: its exit code and the run-level lines."""
    parser = argparse.ArgumentParser()
    add_replay_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["replay", str(run), "--verify"])
    capsys.readouterr()
    code = int(args.func(args))
    out = capsys.readouterr().out.splitlines()
    return code, [line for line in out if line.startswith("verify run:")]


def _step_file(run: Path, step: int) -> Path:
    return run / "trajectories" / f"step_{step:06d}.jsonl"


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _edit_record(run: Path, step: int, index: int, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit line `index` of a step's file and recompute its content hash through the public
    `record_hash`, as someone covering their tracks would."""
    lines = _lines(_step_file(run, step))
    fields = json.loads(lines[index])
    edit(fields)
    fields["content_hash"] = record_hash(fields)
    lines[index] = json.dumps(fields).encode() + b"\n"
    _step_file(run, step).write_bytes(b"".join(lines))


def _first_of(provenance: list[str], kind: str) -> int:
    return provenance.index(kind)


def _delete_group(run: Path) -> None:
    lines = _lines(_step_file(run, 1))
    _step_file(run, 1).write_bytes(b"".join(lines[2:]))


def _append_step0_group(run: Path) -> None:
    with open(_step_file(run, 2), "ab") as f:
        f.write(b"".join(_lines(_step_file(run, 0))[:2]))


def _swap_lines(run: Path) -> None:
    lines = _lines(_step_file(run, 1))
    lines[0], lines[1] = lines[1], lines[0]
    _step_file(run, 1).write_bytes(b"".join(lines))


def _edit_every_metric(run: Path) -> None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    edited = [
        {k: (v if k == "step" or v is None else v + 1) for k, v in row.items()} for row in rows
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in edited))


def _delete_metrics_row(run: Path) -> None:
    rows = _lines(run / "metrics.jsonl")
    (run / "metrics.jsonl").write_bytes(b"".join(rows[:1] + rows[2:]))


def _change_lr(run: Path) -> None:
    text = (run / "config.yaml").read_text()
    assert "lr: 1.0e-05" in text
    (run / "config.yaml").write_text(text.replace("lr: 1.0e-05", "lr: 1.0e-03"))


def _flip_weight_byte(run: Path) -> None:
    weights = run / "checkpoints/step_000003/model/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0x01
    weights.write_bytes(bytes(data))


def _prompt_token(fields: dict[str, Any]) -> None:
    fields["token_ids"][_first_of(fields["provenance"], "prompt") + 3] += 1


def _sampler_logprob(fields: dict[str, Any]) -> None:
    fields["sampler_logprobs"][_first_of(fields["provenance"], "model")] -= 0.5


def _old_logprob(fields: dict[str, Any]) -> None:
    fields["old_logprobs"][_first_of(fields["provenance"], "model")] -= 0.5


def _shrink_group(run: Path) -> None:
    lines = _lines(_step_file(run, 1))
    _step_file(run, 1).write_bytes(b"".join(lines[:1] + lines[2:]))

    def alone(fields: dict[str, Any]) -> None:
        fields["group_size"] = 1
        fields["group_member_ids"] = fields["group_member_ids"][:1]

    _edit_record(run, 1, 0, alone)


def _raise_reward(fields: dict[str, Any]) -> None:
    assert fields["reward_components"]["verifier"] == 0.0
    fields["reward"] += 1.0


def _edit(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda run: _edit_record(run, 1, 0, change)


def _set(key: str, value: object) -> Callable[[Path], None]:
    return _edit(lambda fields: fields.__setitem__(key, value))


def _shift(key: str, by: float) -> Callable[[Path], None]:
    return _edit(lambda fields: fields.__setitem__(key, fields[key] + by))


STEP1 = "trajectories/step_000001.jsonl"
# Caught by the manifest: (corruption, what the first failure line says).
MANIFEST_CASES = {
    "group deleted": (_delete_group, f"{STEP1}: the 4 records at byte 0 are not the bytes"),
    "last step file deleted": (lambda r: _step_file(r, 2).unlink(),
                               "step_000002.jsonl: missing; the manifest has 4 records"),
    "middle step file deleted": (lambda r: _step_file(r, 1).unlink(), f"{STEP1}: missing"),
    "step 0 group appended to the last step": (_append_step0_group,
                                               "step_000002.jsonl: "),  # then the size
    "two lines swapped": (_swap_lines, f"{STEP1}: the 4 records at byte 0 are not the bytes"),
    "every metric edited": (_edit_every_metric, "metrics.jsonl row 0: not the row of step 0"),
    "metrics row deleted": (_delete_metrics_row, "metrics.jsonl row 1: not the row of step 1"),
    "lr changed": (_change_lr, "config.yaml: changed since the run was created"),
    "weight byte flipped": (_flip_weight_byte,
                            "checkpoints/step_000003/model/model.safetensors: changed"),
    "prompt token, hash recomputed": (_edit(_prompt_token), f"{STEP1}: the 4 records at byte 0"),
    "sampler logprob, hash recomputed": (_edit(_sampler_logprob), f"{STEP1}: the 4 records"),
    "old logprob, hash recomputed": (_edit(_old_logprob), f"{STEP1}: the 4 records"),
    "advantage, hash recomputed": (_shift("advantage", 0.25), f"{STEP1}: the 4 records"),
    "success, hash recomputed": (_set("success", True), f"{STEP1}: the 4 records"),
    "step, hash recomputed": (_set("step", 2), f"{STEP1}: the 4 records"),
    "run_id, hash recomputed": (_set("run_id", "other"), f"{STEP1}: the 4 records"),
    "policy_version, hash recomputed": (_set("policy_version", 0), f"{STEP1}: the 4 records"),
    "group shrunk to one, hash recomputed": (_shrink_group, f"{STEP1}: the 4 records"),
    "reward raised by 1, hash recomputed": (_edit(_raise_reward), f"{STEP1}: the 4 records"),
}  # fmt: skip
# Caught inside the records even without a manifest (a run from before it).
RECORD_CASES = {
    "advantage": (_shift("advantage", 0.25), f"{STEP1} byte 0 (s1-t0/0): advantage"),
    "step": (_set("step", 2), "says step 2 but lies in the file of step 1"),
    "run_id": (_set("run_id", "other"), "run_id 'other' is not this run's ('base')"),
    "policy_version": (_set("policy_version", 7), "policy_version 7 is impossible at step 1"),
    "group shrunk to one": (_shrink_group, "group_size 1, but rollout.group_size is 2"),
    "reward raised by 1": (_edit(_raise_reward), "is not its weighted components' sum"),
}


@pytest.mark.slow
def test_the_untouched_run_verifies(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = _verify(run, capsys)
    assert code == 0
    assert len(lines) == 1 and lines[0].startswith("verify run: ok: the manifest's ")
    assert "(sha256, not a signature) and every piece matches" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MANIFEST_CASES))
def test_a_corrupted_run_fails_naming_the_corruption(
    run: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    corrupt, named = MANIFEST_CASES[case]
    corrupt(run)
    code, lines = _verify(run, capsys)
    assert code == 1
    assert lines[0].startswith("verify run: FAILED: ") and named in lines[0], lines


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RECORD_CASES))
def test_records_are_cross_checked_without_a_manifest(
    run: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    corrupt, named = RECORD_CASES[case]
    corrupt(run)
    (run / MANIFEST).unlink()
    code, lines = _verify(run, capsys)
    assert code == 1
    failed = [line for line in lines if line.startswith("verify run: FAILED: ")]
    assert failed and named in failed[0], lines


@pytest.mark.slow
def test_a_run_without_a_manifest_is_unverifiable_as_a_whole(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run / MANIFEST).unlink()
    code, lines = _verify(run, capsys)
    assert code == 0
    assert lines == [
        "verify run: WARNING: no manifest.jsonl (written before runs carried one): unverifiable "
        "as a whole; its records are checked one by one"
    ]


@pytest.mark.slow
def test_success_is_checked_against_the_verifier(run: Path) -> None:
    step = RunWriter.open(run).scan_step(1)
    record = step[0].record
    assert record is not None
    record.verifier, record.success = {"success": False, "expected": "4"}, True
    facts = RunFacts.from_config_text((run / "config.yaml").read_text())
    problems = record_problems({1: step}, facts)
    assert problems == [f"{STEP1} byte 0 (s1-t0/0): success True but the verifier said False"]


# Crash safety: a kill between a piece and its entry, then a resume's rollback


@pytest.mark.slow
def test_a_resume_rolls_the_manifest_back_with_the_run(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Killed after step 3's lines, their entry torn half way: the same state as a kill right
    # before the entry, plus a torn line. The newest checkpoint is step 3's.
    _step_file(run, 3).write_bytes(b"".join(_lines(_step_file(run, 2))))
    with open(run / MANIFEST, "ab") as f:
        f.write(b'{"seq": 14, "piece": {"kind": "traj')
    assert _verify(run, capsys)[0] == 1
    RunWriter.open(run).rollback_to(3)
    code, lines = _verify(run, capsys)
    assert code == 0, lines
    assert not _step_file(run, 3).exists()
    # The final eval's row (step 3) went too, and the manifest says so.
    assert [json.loads(r)["step"] for r in _lines(run / "metrics.jsonl")] == [0, 1, 2]


@pytest.mark.slow
def test_a_checkpoint_renamed_before_its_entry_is_adopted_on_resume(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(run / "checkpoints/step_000003", run / "checkpoints/step_000004")
    assert "checkpoints/step_000004: not in the manifest" in _verify(run, capsys)[1][0]
    RunWriter.open(run).rollback_to(4)
    code, lines = _verify(run, capsys)
    assert code == 0, lines


@pytest.mark.slow
def test_a_prune_killed_half_way_is_finished_on_resume(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run / "checkpoints/step_000002/model/model.safetensors").unlink()  # rmtree cut short
    assert "step_000002/model/model.safetensors: missing" in _verify(run, capsys)[1][0]
    RunWriter.open(run).rollback_to(3)
    assert _verify(run, capsys)[0] == 0
    assert not (run / "checkpoints/step_000002").exists()


@pytest.mark.slow
def test_a_resume_never_deletes_the_newest_checkpoint_that_lost_a_file(
    run: Path, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, cli_logging: None
) -> None:
    # a prune never touches the newest checkpoint: a file gone from it went some other way (a
    # user saving disk space), and the rest is left for the user; the resume refuses in one line
    from agent_grpo.cli import main
    from agent_grpo.run_dir.writer import DamagedCheckpointError

    newest = run / "checkpoints/step_000003"
    (newest / "trainer.pt").unlink()
    before = sorted(p.relative_to(run) for p in newest.rglob("*"))
    with pytest.raises(DamagedCheckpointError, match=r"step_000003 is missing trainer.pt: put "):
        RunWriter.open(run).rollback_to(3)
    assert sorted(p.relative_to(run) for p in newest.rglob("*")) == before
    assert (run / "checkpoints/step_000002").is_dir()
    code = main(["train", str(ROOT / "configs/calculator-tiny.yaml"), f"run.root={run.parent}",
                 f"model.name_or_path={tiny_model_dir}", "run.name=base", *SETTINGS,
                 "--resume", "--accept-config-change"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is missing trainer.pt" in err[0], err


@pytest.mark.slow
def test_training_a_finished_run_further_keeps_its_final_evaluation(
    run: Path, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, cli_logging: None
) -> None:
    # the evaluation of the 3-step policy is a record of that policy: a resume that trains on
    # to 4 steps keeps it (it once dropped it with the rows after the checkpoint), the manifest
    # knows it kept it, and the new final evaluation comes after
    from agent_grpo.cli import main
    from agent_grpo.run_dir.reader import load_run

    def evaluations() -> list[tuple[int, int]]:
        rows = [json.loads(line) for line in _lines(run / "metrics.jsonl")]
        return [(r["step"], r["eval_after_steps"]) for r in rows if "eval_after_steps" in r]

    assert evaluations() == [(3, 3)]
    code = main(["train", str(ROOT / "configs/calculator-tiny.yaml"), f"run.root={run.parent}",
                 f"model.name_or_path={tiny_model_dir}", "run.name=base",
                 *[s if s != "steps=3" else "steps=4" for s in SETTINGS], "--resume",
                 "--accept-config-change"])  # fmt: skip
    assert code == 0
    assert evaluations() == [(3, 3), (4, 4)]
    final = load_run(run).final_eval()
    assert final is not None and final["after_steps"] == 4
    assert _verify(run, capsys)[0] == 0


# The key


def _signed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str) -> RunWriter:
    monkeypatch.setenv(KEY_ENV, key)
    writer = RunWriter.create(tmp_path, run_id="signed", config_text="seed: 0\n")
    writer.write_metrics(0, {"reward_mean": 0.5})
    return writer


def test_a_key_signs_the_chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = _signed_run(tmp_path, monkeypatch, "secret")
    assert manifest_problems(writer.path, b"secret") == ([], [], 2)
    problems, _, _ = manifest_problems(writer.path, b"wrong")
    assert problems[0].endswith("its digest does not match: the entry was edited")
    assert manifest_problems(writer.path, None) == (
        [],
        [f"the manifest is signed: set {KEY_ENV} to check its signature"],
        2,
    )


def test_a_chain_rewritten_without_the_key_fails_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = _signed_run(tmp_path, monkeypatch, "secret")
    (writer.path / "config.yaml").write_text("seed: 1\n")
    # Whoever edits the config and recomputes the whole chain, but has no key.
    entries = [line.entry for line in parse_manifest((writer.path / MANIFEST).read_bytes())]
    prev, out = "genesis", []
    for entry in entries:
        assert entry is not None
        piece = entry.piece
        if piece.kind == "config":
            piece = piece.model_copy(update={"sha256": sha256_bytes(b"seed: 1\n")})
        resealed = seal(entry.seq, prev, piece, None)
        out.append(resealed.model_dump_json() + "\n")
        prev = resealed.digest
    (writer.path / MANIFEST).write_text("".join(out))
    assert manifest_problems(writer.path, None)[0] == []  # unsigned: it passes, as documented
    problems, _, _ = manifest_problems(writer.path, b"secret")
    assert problems[0].endswith(f"not signed, but {KEY_ENV} is set: written without the key")
