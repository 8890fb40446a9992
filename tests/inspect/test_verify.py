"""`replay --verify` on a stored run with each kind of corruption: token id flipped, observation
changed, line torn, line grown, record duplicated, record missing, hash absent."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from agent_grpo.envs.registry import make_env
from agent_grpo.inspect.verify import verify_record
from agent_grpo.rollout.collector import CollectOptions
from agent_grpo.run_dir.writer import RunWriter
from agent_grpo.testing.backends import ScriptedBackend
from agent_grpo.testing.cli_runs import inspect_cli
from agent_grpo.testing.records import expert_record
from agent_grpo.trajectory.invariants import check_invariants
from agent_grpo.trajectory.record import Provenance, TrajectoryRecord

ENV_ID = "agent_grpo/Calculator-v0"
FILE = "trajectories/step_000000.jsonl"
CLEAN = "ok 4, diverged 0, corrupt 0, duplicated 0, unverifiable 0; incomplete groups 0"


@pytest.fixture
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rich consoles the CLI creates print 220 columns, so report lines are not cut."""
    monkeypatch.setenv("COLUMNS", "220")


@pytest.fixture(scope="module")
def collected(tokenizer: Any) -> list[TrajectoryRecord]:
    """Two groups of two (seeds 3 and 4) as the collector makes them, with the expert's texts
    for seed 3 (seed 4's group answers wrong, which replays just as exactly)."""
    from agent_grpo.rollout.collector import Task, collect_groups
    from agent_grpo.rollout.config import RolloutConfig

    expert = expert_record(ENV_ID, seed=3)
    texts = [m.content for m in expert.messages if m.role == "assistant"]
    config = CollectOptions.from_config(RolloutConfig(group_size=2, max_context_tokens=600))
    tasks = [Task(env_id=ENV_ID, seed=3), Task(env_id=ENV_ID, seed=4)]
    return collect_groups(
        tasks, ScriptedBackend(tokenizer, texts, eos=False, logprob=-1.0), tokenizer, config
    ).records


@pytest.fixture
def run(tmp_path: Path, embedded_model_dir: Path, collected: list[TrajectoryRecord]) -> RunWriter:
    """A run directory holding the four records as step 0."""
    config = f"model: {{name_or_path: {embedded_model_dir}}}\nenv: {{id: {ENV_ID}}}\n"
    run = RunWriter.create(tmp_path, run_id="r", config_text=config)
    run.write_trajectories(0, [r.model_copy(deep=True) for r in collected])
    return run


def _verify(run: RunWriter, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = inspect_cli(["replay", str(run.path), "--verify", *args])
    return code, capsys.readouterr().out


def _lines(run: RunWriter) -> list[bytes]:
    return run.trajectory_file(0).read_bytes().splitlines(keepends=True)


def _rewrite(run: RunWriter, index: int, record: TrajectoryRecord) -> tuple[bytes, bytes]:
    """Replace line `index` with `record` as the writer would serialize it (its stored hash
    kept: a change made after writing); return the old and the new line."""
    lines = _lines(run)
    old, lines[index] = lines[index], record.to_json_line().encode() + b"\n"
    run.trajectory_file(0).write_bytes(b"".join(lines))
    return old, lines[index]


def _with_token(record: TrajectoryRecord, position: int, token_id: int) -> TrajectoryRecord:
    ids = list(record.token_ids)
    ids[position] = token_id
    return record.model_copy(update={"token_ids": ids})


def _same_width_neighbour(token_id: int) -> int:
    """Another id with as many digits (79 -> 80), so the line keeps its length."""
    up = token_id + 1
    return up if len(str(up)) == len(str(token_id)) else token_id - 1


def test_a_clean_run_is_ok_and_the_report_ends_with_counts(
    run: RunWriter, capsys: pytest.CaptureFixture[str], wide: None
) -> None:
    code, out = _verify(run, capsys)
    lines = out.splitlines()
    assert code == 0
    assert lines[:4] == [f"verify s0-t{g}/{i}: ok" for g in (0, 1) for i in (0, 1)]
    assert lines[-1] == f"verified 4 records: {CLEAN}"


def test_a_flipped_model_token_id_is_corrupt(
    run: RunWriter, capsys: pytest.CaptureFixture[str], wide: None
) -> None:
    record = run.read_trajectories(0)[0]
    position = record.provenance.index(Provenance.MODEL)
    flipped = record.token_ids[position]
    old, new = _rewrite(run, 0, _with_token(record, position, _same_width_neighbour(flipped)))
    assert len(old) == len(new)  # in place: the index still points at every line
    code, out = _verify(run, capsys)
    assert code == 1
    assert f"verify s0-t0/0: CORRUPT at {FILE} byte 0" in out
    assert "content hash mismatch" in out and "the record changed after it was written" in out
    assert "token invariant broken" in out and "is not the decode of its span" in out
    assert out.splitlines()[-1].startswith("verified 4 records: ok 3, diverged 0, corrupt 1,")


def test_a_flipped_token_id_that_keeps_the_invariants_is_caught_by_the_hash(
    run: RunWriter, tokenizer: Any, capsys: pytest.CaptureFixture[str], wide: None
) -> None:
    record = run.read_trajectories(0)[1]
    position = record.provenance.index(Provenance.PROMPT) + 3
    tampered = _with_token(record, position, _same_width_neighbour(record.token_ids[position]))
    check_invariants(tampered, tokenizer)  # no invariant decodes prompt tokens
    assert verify_record(tampered, make_env) is None  # nor does the env see token ids
    _rewrite(run, 1, tampered)
    code, out = _verify(run, capsys)
    assert code == 1
    assert f"verify s0-t0/1: CORRUPT at {FILE} byte {len(_lines(run)[0])}" in out
    assert "content hash mismatch" in out and "token invariant" not in out
    # and rendering the conversation from scratch gives other ids at that position
    assert f"at token {position}: differs from the from-scratch rendering" in out


def test_a_changed_observation_is_corrupt_and_the_env_diverges(
    run: RunWriter, capsys: pytest.CaptureFixture[str], wide: None
) -> None:
    record = run.read_trajectories(0)[2].model_copy(deep=True)
    tool = next(m for m in record.messages if m.role == "tool")
    tool.content = tool.content + " (edited)"
    _rewrite(run, 2, record)
    code, out = _verify(run, capsys)
    assert code == 1
    assert "verify s0-t1/0: CORRUPT at" in out and "content hash mismatch" in out
    assert "and the env diverges at turn 0 (observation)" in out and "(edited)" in out


def test_a_changed_observation_without_a_hash_is_caught_by_its_rendering(
    run: RunWriter, capsys: pytest.CaptureFixture[str], wide: None
) -> None:
    record = run.read_trajectories(0)[2].model_copy(deep=True)
    next(m for m in record.messages if m.role == "tool").content = "999"
    _rewrite(run, 2, record.model_copy(update={"content_hash": None}))
    code, out = _verify(run, capsys)
    assert code == 1
    # without a hash, the ids no longer render from the edited messages, and the env diverges
    assert "verify s0-t1/0: CORRUPT at" in out and "tokens and messages disagree" in out
    assert "and the env diverges at turn 0 (observation)" in out
    assert "verified 4 records: ok 3, diverged 0, corrupt 1," in out


def test_a_torn_last_line_is_corrupt_at_its_offset_and_the_rest_is_ok(
    run: RunWriter, capsys: pytest.CaptureFixture[str], wide: None
) -> None:
    lines = _lines(run)
    torn_at = sum(map(len, lines[:3]))
    run.trajectory_file(0).write_bytes(b"".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    code, out = _verify(run, capsys)
    assert code == 1
    assert f"verify {FILE} byte {torn_at}: CORRUPT\n  torn line:" in out
    assert "no newline at the end of the file" in out
    assert [f"verify s0-t{g}/{i}: ok" for g, i in ((0, 0), (0, 1), (1, 0))] == [
        line for line in out.splitlines() if line.endswith(": ok")
    ]
    assert f"verify group s0-t1 in {FILE}: INCOMPLETE: samples [0] of 2, missing [1]" in out
    assert "ok 3, diverged 0, corrupt 1, duplicated 0, unverifiable 0; incomplete groups 1" in out


def test_a_torn_line_mid_file_after_a_resumed_writer(
    run: RunWriter,
    collected: list[TrajectoryRecord],
    capsys: pytest.CaptureFixture[str],
    wide: None,
) -> None:
    lines = _lines(run)
    # A writer killed mid-line (before the index entries), then a resumed one writing the last
    # two records again.
    run.trajectory_file(0).write_bytes(b"".join(lines[:2]) + lines[2][:100])
    index = run.path / "index.jsonl"
    index.write_bytes(b"".join(index.read_bytes().splitlines(keepends=True)[:2]))
    run.write_trajectories(0, [r.model_copy(deep=True) for r in collected[2:]])
    torn_at = len(lines[0]) + len(lines[1])
    code, out = _verify(run, capsys)
    assert code == 1
    assert f"verify {FILE} byte {torn_at}: CORRUPT\n  torn or invalid line: not JSON" in out
    assert "verified 5 records: ok 4, diverged 0, corrupt 1, duplicated 0" in out
    assert [r.uid for r in run.find(step=0)] == [r.uid for r in collected]


def test_a_grown_line_is_corrupt_and_hides_no_other_record(
    run: RunWriter, tokenizer: Any, capsys: pytest.CaptureFixture[str], wide: None
) -> None:
    record = run.read_trajectories(0)[0]
    position = next(i for i, t in enumerate(record.token_ids) if t < len(tokenizer) // 1000)
    grown = int(f"{record.token_ids[position]}000")  # 3 more bytes, still in the vocabulary
    old, new = _rewrite(run, 0, _with_token(record, position, grown))
    assert len(new) == len(old) + 3  # every later offset in the index is now 3 bytes off
    code, out = _verify(run, capsys)
    assert code == 1
    assert f"verify s0-t0/0: CORRUPT at {FILE} byte 0" in out
    assert "content hash mismatch" in out
    assert "torn" not in out
    assert "verified 4 records: ok 3, diverged 0, corrupt 1," in out
    # Reading through the index falls back to scanning the lines the offsets no longer hit.
    assert [r.uid for r in run.find(step=0)] == ["s0-t0/0", "s0-t0/1", "s0-t1/0", "s0-t1/1"]
    assert inspect_cli(["replay", str(run.path), "--step", "0"]) == 0


def test_a_duplicated_record_is_reported_with_both_offsets(
    run: RunWriter, capsys: pytest.CaptureFixture[str], wide: None
) -> None:
    lines = _lines(run)
    run.trajectory_file(0).write_bytes(b"".join(lines) + lines[1])
    code, out = _verify(run, capsys)
    assert code == 1
    copy_at, first_at = sum(map(len, lines)), len(lines[0])
    assert f"verify s0-t0/1: DUPLICATED at {FILE} byte {copy_at}" in out
    assert f"a second copy of the record at byte {first_at}" in out
    assert "ok 4, diverged 0, corrupt 0, duplicated 1, unverifiable 0; incomplete groups 0" in out


def test_a_missing_record_leaves_its_group_incomplete(
    run: RunWriter, capsys: pytest.CaptureFixture[str], wide: None
) -> None:
    lines = _lines(run)
    run.trajectory_file(0).write_bytes(b"".join(lines[:1] + lines[2:]))
    code, out = _verify(run, capsys)
    assert code == 1
    assert f"verify group s0-t0 in {FILE}: INCOMPLETE: samples [0] of 2, missing [1]" in out
    assert "verified 3 records: ok 3," in out and "incomplete groups 1" in out


def test_records_without_a_hash_are_unverifiable_not_ok(
    run: RunWriter, capsys: pytest.CaptureFixture[str], wide: None
) -> None:
    old_format = []
    for line in _lines(run):
        fields = json.loads(line)
        del fields["content_hash"]  # as written before records carried one
        old_format.append(json.dumps(fields).encode() + b"\n")
    run.trajectory_file(0).write_bytes(b"".join(old_format))
    (run.path / "manifest.jsonl").unlink()  # a run that old has no manifest either
    code, out = _verify(run, capsys)
    assert code == 0  # nothing is known to be wrong, but nothing is proven right either
    assert "verify s0-t0/0: UNVERIFIABLE at" in out and "no content hash" in out
    assert out.splitlines()[-1] == (
        "verified 4 records: ok 0, diverged 0, corrupt 0, duplicated 0, unverifiable 4; "
        "incomplete groups 0"
    )


def test_group_selects_what_is_checked(
    run: RunWriter, capsys: pytest.CaptureFixture[str], wide: None
) -> None:
    record = run.read_trajectories(0)[0]
    position = record.provenance.index(Provenance.MODEL)
    flipped = _same_width_neighbour(record.token_ids[position])
    _rewrite(run, 0, _with_token(record, position, flipped))
    code, out = _verify(run, capsys, "--group", "1")  # the second group: untouched
    assert code == 0 and "verified 2 records: ok 2," in out and "s0-t0" not in out
    code, out = _verify(run, capsys, "--step", "0", "--group", "s0-t0", "--sample", "0")
    assert code == 1 and "verified 1 records: ok 0, diverged 0, corrupt 1," in out


def test_an_environment_that_cannot_be_built_is_said_once_not_as_divergences(
    tmp_path: Path,
    tokenizer: Any,
    embedded_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    wide: None,
) -> None:
    from agent_grpo.rollout.collector import Task, collect_groups
    from agent_grpo.rollout.config import RolloutConfig

    # The run's env lives in a module of the user's that this shell cannot import any more.
    (tmp_path / "gone_envs.py").write_text(
        "from agent_grpo.envs.calculator import CalculatorEnv\n\n\n"
        "class MyCalculator(CalculatorEnv):\n    pass\n"
    )
    env_id = "gone_envs:MyCalculator"
    with monkeypatch.context() as importable:
        importable.syspath_prepend(str(tmp_path))
        config = CollectOptions.from_config(RolloutConfig(group_size=2, max_context_tokens=600))
        backend = ScriptedBackend(tokenizer, ["Answer: 3"], eos=False, logprob=-1.0)
        tasks = [Task(env_id=env_id, seed=3), Task(env_id=env_id, seed=4)]
        records = collect_groups(tasks, backend, tokenizer, config).records
    monkeypatch.delitem(sys.modules, "gone_envs")
    text = f"model: {{name_or_path: {embedded_model_dir}}}\nenv: {{id: {env_id}}}\n"
    run = RunWriter.create(tmp_path / "runs", run_id="r", config_text=text)
    run.write_trajectories(0, records)

    # a `module:Class` id is imported only when asked: a run's records and config are not code
    code, out = _verify(run, capsys)
    assert code == 1 and "DIVERGES" not in out
    assert [line for line in out.splitlines() if "cannot build" in line] == [
        "verify: cannot build environment gone_envs:MyCalculator (PermissionError: "
        "'gone_envs:MyCalculator' is no registered env id: building it would import and run the "
        "code it names; pass --trust-code for a run you trust): its 4 records were checked but "
        "not re-run"
    ]
    code, out = _verify(run, capsys, "--trust-code")
    assert code == 1
    assert "DIVERGES" not in out
    lines = [line for line in out.splitlines() if "cannot build" in line]
    assert lines == [
        "verify: cannot build environment gone_envs:MyCalculator (ModuleNotFoundError: No module "
        "named 'gone_envs'): its 4 records were checked but not re-run"
    ]
    assert out.strip().splitlines()[-1] == (
        "verified 4 records: ok 0, diverged 0, corrupt 0, duplicated 0, unverifiable 0, "
        "not re-run 4; incomplete groups 0"
    )


@pytest.mark.parametrize(
    "kwargs",
    [{"mcp_server": {"command": ["sh", "-c", "touch {marker}"]}}, {"tools": ["os:system"]}],
    ids=["server-command", "module-attr"],
)
def test_a_registered_env_whose_run_kwargs_name_code_needs_trust_code(
    tmp_path: Path, kwargs: dict[str, Any]
) -> None:
    # a built-in env builds what its kwargs name: a run's config could start any command
    import yaml

    from agent_grpo.inspect.replay import run_env_factory

    marker = tmp_path / "ran"
    given = json.loads(json.dumps(kwargs).replace("{marker}", str(marker)))
    config = {"env": {"id": "agent_grpo/Dataset-v0", "kwargs": given}}
    run = RunWriter.create(tmp_path / "runs", run_id="r", config_text=yaml.safe_dump(config))
    with pytest.raises(PermissionError, match=r"the run's env.kwargs name code to run \("):
        run_env_factory(run)("agent_grpo/Dataset-v0")
    assert not marker.exists()
    # and a registered env with plain kwargs builds as before
    plain = RunWriter.create(tmp_path / "runs", run_id="p", config_text=yaml.safe_dump(
        {"env": {"id": "agent_grpo/Calculator-v0", "kwargs": {"max_turns": 2}}}))  # fmt: skip
    assert run_env_factory(plain)("agent_grpo/Calculator-v0").unwrapped.max_turns == 2
