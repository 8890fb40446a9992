"""RunWriter: append-only writes, torn-line recovery after kill -9, index seeks, export."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agent_grpo.run_dir import writer as store
from agent_grpo.run_dir.writer import RunDirWriteError, RunWriter, record_hash
from agent_grpo.testing.records import calculator_record
from agent_grpo.trajectory.record import (
    TrajectoryRecord,
)


@pytest.fixture
def warnings_log(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> pytest.LogCaptureFixture:
    """Capture agent_grpo warnings even when setup_logging() turned propagation off."""
    monkeypatch.setattr(logging.getLogger("agent_grpo"), "propagate", True)
    caplog.set_level(logging.WARNING)
    return caplog


def _group(step: int, group_id: str, rewards: list[float]) -> list[TrajectoryRecord]:
    return [
        calculator_record(step=step, group_id=group_id, index=i, reward=r, success=r > 0.5)
        for i, r in enumerate(rewards)
    ]


def test_create_write_read_roundtrip(tmp_path: Path) -> None:
    run = RunWriter.create(
        tmp_path, run_id="r1", config_text="model: {name_or_path: x}\n", fsync=True
    )
    records = _group(1, "a", [1.0, 0.0])
    run.write_trajectories(1, records)
    run.write_trajectories(3, _group(3, "b", [0.0]))
    run.write_metrics(1, {"step": 1.0, "reward/mean": 0.5, "loss": float("nan"), "kl": None})
    reopened = RunWriter.open(tmp_path / "r1")
    assert reopened.config_text == "model: {name_or_path: x}\n"
    assert reopened.steps() == [1, 3]
    assert reopened.read_trajectories(1) == records
    # The step argument wins over a float "step" metric; NaN and None become JSON null.
    assert reopened.read_metrics() == [{"step": 1, "reward/mean": 0.5, "loss": None, "kl": None}]
    assert isinstance(reopened.read_metrics()[0]["step"], int)
    assert (tmp_path / "r1/trajectories/step_000001.jsonl").exists()
    with pytest.raises(FileExistsError):
        RunWriter.create(tmp_path, run_id="r1")


def test_open_rejects_non_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        RunWriter.open(tmp_path)


def test_index_offsets_point_at_lines_and_find_filters(tmp_path: Path) -> None:
    run = RunWriter.create(tmp_path, run_id="r")
    run.write_trajectories(0, _group(0, "a", [1.0, 0.0, 0.25]))
    errs = [calculator_record(step=0, group_id="b", index=0, success=False, tool_error=True)]
    errs.append(
        calculator_record(step=0, group_id="b", index=1, success=False, termination="truncated")
    )
    run.write_trajectories(0, errs)
    run.write_trajectories(1, _group(1, "c", [0.5]))
    data = run.trajectory_file(0).read_bytes()
    for entry in run.index():
        if entry.step == 0:
            line = data[entry.offset : entry.offset + entry.length]
            assert json.loads(line)["index_in_group"] == entry.index_in_group
            assert line.endswith(b"\n")
    uids = lambda recs: [r.uid for r in recs]  # noqa: E731
    assert uids(run.find(step=0, group="a")) == ["a/0", "a/1", "a/2"]
    assert uids(run.find(step=0, group=1)) == ["b/0", "b/1"]  # the second group of step 0
    assert uids(run.find(group=0)) == ["a/0", "a/1", "a/2", "c/0"]  # first group of each step
    assert uids(run.find(step=0, group="a", sample=2)) == ["a/2"]
    assert uids(run.find(failed=True)) == ["a/1", "a/2", "b/0", "b/1", "c/0"]
    assert uids(run.find(truncated=True)) == ["b/1"]
    assert uids(run.find(errors=True)) == ["b/0"]
    assert uids(run.find(reward_min=0.25, reward_max=0.5)) == ["a/2", "c/0"]


def test_find_seeks_without_parsing_other_lines(tmp_path: Path) -> None:
    run = RunWriter.create(tmp_path, run_id="r")
    run.write_trajectories(0, _group(0, "a", [1.0, 0.0]))
    path = run.trajectory_file(0)
    data = bytearray(path.read_bytes())
    first = run.index()[0]
    # Junk over the first record (same length): only a reader that parses every line notices.
    data[first.offset : first.offset + first.length - 1] = b"x" * (first.length - 1)
    path.write_bytes(bytes(data))
    assert [r.uid for r in run.find(step=0, sample=1)] == ["a/1"]


def test_latest_checkpoint_skips_temp_and_empty_dirs(tmp_path: Path) -> None:
    run = RunWriter.create(tmp_path, run_id="r")
    assert run.latest_checkpoint() is None
    for step in (5, 10):
        run.checkpoint_dir(step).mkdir()
        (run.checkpoint_dir(step) / "state.json").write_text("{}")
    crashed = run.checkpoint_dir(20)  # a save that died before its rename
    crashed.with_name(crashed.name + ".tmp").mkdir()
    (crashed.with_name(crashed.name + ".tmp") / "state.json").write_text("{}")
    run.checkpoint_dir(30).mkdir()  # created but never written
    assert not run.checkpoint_dir(40).exists()  # a path, not a directory, until saved into
    assert run.latest_checkpoint() == tmp_path / "r/checkpoints/step_000010"


_TORN_WRITER = """
import os, sys, time
from agent_grpo.run_dir.writer import RunWriter
from agent_grpo.trajectory.record import TrajectoryRecord
run = RunWriter.open(sys.argv[1])
template = TrajectoryRecord.from_json_line(open(sys.argv[2]).read())
for i in range(3):
    run.write_trajectories(0, [template.model_copy(update={"index_in_group": i})])
line = (template.model_copy(update={"index_in_group": 3}).to_json_line() + "\\n").encode()
fd = os.open(run.trajectory_file(0), os.O_WRONLY | os.O_APPEND)
# Two writes force a torn record; the real writer issues one, which a kill can still cut short.
os.write(fd, line[: len(line) // 2])
open(sys.argv[3], "w").close()
time.sleep(60)
os.write(fd, line[len(line) // 2 :])
"""


def _big_record_file(tmp_path: Path, size: int) -> Path:
    """A calculator record with a `size`-character verifier log, as one JSON line in a file."""
    path = tmp_path / "record.json"
    path.write_text(
        calculator_record().model_copy(update={"verifier": {"log": "y" * size}}).to_json_line()
    )
    return path


def _start(script: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args])


def _wait_for(predicate, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "writer subprocess did not get there in time"
        time.sleep(0.02)


def test_kill_9_mid_record_skips_exactly_the_torn_one(
    tmp_path: Path, warnings_log: pytest.LogCaptureFixture
) -> None:
    run = RunWriter.create(tmp_path, run_id="r")
    template = _big_record_file(tmp_path, 200_000)
    marker = tmp_path / "half-written"
    writer = _start(_TORN_WRITER, str(run.path), str(template), str(marker))
    _wait_for(marker.exists)
    os.kill(writer.pid, signal.SIGKILL)
    assert writer.wait() == -signal.SIGKILL
    torn_at = sum(e.length for e in run.index())
    assert run.trajectory_file(0).stat().st_size > torn_at  # the half line is on disk

    warnings_log.clear()
    assert [r.index_in_group for r in run.read_trajectories(0)] == [0, 1, 2]
    [message] = [r.getMessage() for r in warnings_log.records]
    assert "step_000000.jsonl" in message and f"byte {torn_at}" in message

    # A resumed writer terminates the fragment, so its own record is not lost with it.
    run.write_trajectories(0, [calculator_record(index=4)])
    assert [r.index_in_group for r in run.read_trajectories(0)] == [0, 1, 2, 4]
    assert [r.index_in_group for r in run.find(step=0)] == [0, 1, 2, 4]
    assert run.rebuild_index() == 4


_LOOP_WRITER = """
import sys
from agent_grpo.run_dir.writer import RunWriter
from agent_grpo.trajectory.record import TrajectoryRecord
run = RunWriter.open(sys.argv[1])
template = TrajectoryRecord.from_json_line(open(sys.argv[2]).read())
i = 0
while True:
    run.write_trajectories(0, [template.model_copy(update={"index_in_group": i})])
    i += 1
"""


def test_kill_9_real_writer_loop_leaves_readable_prefix(
    tmp_path: Path, warnings_log: pytest.LogCaptureFixture
) -> None:
    run = RunWriter.create(tmp_path, run_id="r")
    template = _big_record_file(tmp_path, 1_000_000)
    writer = _start(_LOOP_WRITER, str(run.path), str(template))
    path = run.trajectory_file(0)
    _wait_for(lambda: path.exists() and path.stat().st_size > 5_000_000)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    data = path.read_bytes()
    complete = data.count(b"\n")
    records = run.read_trajectories(0)
    # Whether the kill tore the last line is luck; what the reader returns must not be.
    assert [r.index_in_group for r in records] == list(range(complete))
    assert len(warnings_log.records) == (0 if data.endswith(b"\n") else 1)
    assert [r.index_in_group for r in run.find(step=0)] == list(range(len(run.index())))


def test_torn_metrics_and_index_lines_are_skipped(
    tmp_path: Path, warnings_log: pytest.LogCaptureFixture
) -> None:
    run = RunWriter.create(tmp_path, run_id="r")
    run.write_metrics(0, {"a": 1.0})
    with open(run.path / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 1, "a": 2.')
    assert run.read_metrics() == [{"step": 0, "a": 1.0}]
    run.write_metrics(2, {"a": 3.0})
    assert run.read_metrics() == [{"step": 0, "a": 1.0}, {"step": 2, "a": 3.0}]
    assert any("invalid JSON line at byte" in r.getMessage() for r in warnings_log.records)


def test_export_parquet_roundtrip(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    run = RunWriter.create(tmp_path, run_id="r")
    run.write_trajectories(0, _group(0, "a", [1.0, 0.0]))
    run.write_trajectories(
        2, [calculator_record(step=2, group_id="b", tool_error=True, reward=0.0)]
    )
    out = tmp_path / "run.parquet"
    assert run.export_parquet(out) == 3
    table = pq.read_table(out).to_pylist()
    assert [row["uid"] for row in table] == ["a/0", "a/1", "b/0"]
    assert [row["reward"] for row in table] == [1.0, 0.0, 0.0]
    assert [row["tool_errors"] for row in table] == [0, 0, 1]
    first = calculator_record(step=0, group_id="a")
    assert table[0]["token_ids"] == first.token_ids
    assert table[0]["sampler_logprobs"] == first.sampler_logprobs  # None stays None
    assert json.loads(table[0]["messages_json"])[0]["content"] == "What is 2+2?"


# Content hashes and the scan `replay --verify` reads


def test_written_records_carry_the_hash_of_their_stored_content(tmp_path: Path) -> None:
    run = RunWriter.create(tmp_path, run_id="r")
    records = _group(0, "a", [1.0, 0.0])
    run.write_trajectories(0, records)
    lines = run.trajectory_file(0).read_bytes().splitlines()
    for record, line in zip(records, lines, strict=True):
        fields = json.loads(line)
        assert fields["content_hash"] == record.content_hash == record_hash(fields)
        assert len(record.content_hash) == 64
    assert run.read_trajectories(0) == records  # the writer set the hash on the caller's copy
    fields = json.loads(lines[0])
    # The hash is of the content: key order and the hash field itself do not enter it...
    assert record_hash(dict(reversed(fields.items()))) == record_hash(fields)
    assert record_hash({**fields, "content_hash": "x"}) == record_hash(fields)
    # ...every value does, however small the change.
    flipped = [fields["token_ids"][0] + 1, *fields["token_ids"][1:]]
    assert record_hash({**fields, "token_ids": flipped}) != record_hash(fields)
    assert record_hash({**fields, "reward": 1.0000001}) != record_hash(fields)


def test_scan_step_reports_each_bad_line_at_its_offset(tmp_path: Path) -> None:
    run = RunWriter.create(tmp_path, run_id="r")
    run.write_trajectories(0, _group(0, "a", [1.0]))
    path = run.trajectory_file(0)
    good = path.read_bytes()
    bad = [b'{"group_id": "a", "index_in', b"[1, 2]", b'{"group_id": "a"}']
    path.write_bytes(good + b"\n".join(bad) + b"\n" + good + b'{"torn')
    scanned = run.scan_step(0)
    offsets = [0, len(good)]
    for line in bad:
        offsets.append(offsets[-1] + len(line) + 1)
    offsets.append(offsets[-1] + len(good))
    assert [s.offset for s in scanned] == offsets
    assert [s.record is not None for s in scanned] == [True, False, False, False, True, False]
    assert [s.hash_matches for s in scanned] == [True, None, None, None, True, None]
    problems = [s.problem or "" for s in scanned]
    assert problems[1].startswith("torn or invalid line: not JSON")
    assert problems[2].startswith("not a valid record") and problems[3].startswith("not a valid")
    assert problems[5] == "torn line: 6 bytes and no newline at the end of the file"
    assert scanned[4].entry is not None and scanned[4].entry.offset == offsets[4]


# A full disk (ENOSPC)


def _disk_full_after(monkeypatch: pytest.MonkeyPatch, room: int) -> None:
    """Make the store's writes fail with ENOSPC once `room` more bytes are written; the write
    that crosses the limit writes what fits first, as a real short write on a full disk does."""
    left = [room]
    real = store._write_all

    def write_all(fd: int, data: bytes) -> int:
        if len(data) > left[0]:
            os.write(fd, data[: left[0]])
            left[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        left[0] -= len(data)
        return real(fd, data)

    monkeypatch.setattr(store, "_write_all", write_all)


def _files(run: RunWriter) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in [run.trajectory_file(0), run.path / "index.jsonl"]}


@pytest.mark.parametrize("where", ["records", "index"])
def test_disk_full_mid_write_cuts_the_step_back_and_raises_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    run = RunWriter.create(tmp_path, run_id="r")
    run.write_trajectories(0, _group(0, "a", [1.0, 0.0]))
    before = _files(run)
    more = _group(0, "b", [1.0, 0.5, 0.0])
    scratch = RunWriter.create(tmp_path, run_id="scratch")
    scratch.write_trajectories(0, more)
    lines_size = scratch.trajectory_file(0).stat().st_size
    # Full in the middle of the second record, or in the middle of the index entries.
    room = lines_size // 2 if where == "records" else lines_size + 100
    _disk_full_after(monkeypatch, room)
    with pytest.raises(RunDirWriteError) as failed:
        run.write_trajectories(0, more)
    file = "step_000000.jsonl" if where == "records" else "index.jsonl"
    message = str(failed.value)
    assert file in message and "disk full (ENOSPC)" in message and "\n" not in message
    assert failed.value.errno == errno.ENOSPC
    assert _files(run) == before  # no partial line, no record without its index entry
    monkeypatch.undo()  # space freed: the run goes on where it stood
    run.write_trajectories(0, more)
    uids = ["a/0", "a/1", "b/0", "b/1", "b/2"]
    assert [r.uid for r in run.read_trajectories(0)] == uids
    assert [r.uid for r in run.find(step=0)] == uids
    assert all(s.problem is None and s.hash_matches for s in run.scan_step(0))


def test_disk_full_on_a_new_step_leaves_no_step_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = RunWriter.create(tmp_path, run_id="r")
    run.write_trajectories(0, _group(0, "a", [1.0]))
    _disk_full_after(monkeypatch, 100)
    with pytest.raises(RunDirWriteError):
        run.write_trajectories(1, _group(1, "b", [1.0]))
    assert run.steps() == [0] and [e.uid for e in run.index()] == ["a/0"]


def test_disk_full_in_metrics_leaves_them_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warnings_log: pytest.LogCaptureFixture
) -> None:
    run = RunWriter.create(tmp_path, run_id="r")
    run.write_metrics(0, {"reward": 0.5})
    _disk_full_after(monkeypatch, 5)
    with pytest.raises(RunDirWriteError, match=r"metrics\.jsonl: disk full"):
        run.write_metrics(1, {"reward": 0.75})
    monkeypatch.undo()
    run.write_metrics(1, {"reward": 0.75})
    assert run.read_metrics() == [{"step": 0, "reward": 0.5}, {"step": 1, "reward": 0.75}]
    assert not warnings_log.records  # no torn line was left to skip


def test_cli_reports_a_full_disk_as_one_line_and_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    cli_logging: None,
) -> None:
    from agent_grpo import cli

    run = RunWriter.create(tmp_path, run_id="r")

    def full_disk_command(args: object) -> int:
        run.write_metrics(0, {"reward": 0.5})
        return 0

    _disk_full_after(monkeypatch, 0)
    monkeypatch.setattr(cli, "_cmd_envs", full_disk_command)
    assert cli.main(["envs"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot write ") and "metrics.jsonl: disk full (ENOSPC)" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_rollback_drops_metrics_rows_whose_step_is_not_a_number(tmp_path: Path) -> None:
    run = RunWriter.create(tmp_path, run_id="r")
    run.write_metrics(0, {"reward_mean": 0.5})
    run.write_metrics(1, {"reward_mean": 0.7})
    with open(run.path / "metrics.jsonl", "a") as f:  # edited by hand, or by a broken tool
        f.write('{"step": null, "reward_mean": 1}\n{"step": "2"}\n[1, 2]\n')
    run.rollback_to(1)  # once a TypeError
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "reward_mean": 0.5}]


def test_an_index_entry_naming_another_file_is_skipped(tmp_path: Path) -> None:
    # a run directory's author can write index.jsonl: an entry pointing outside the run (or at
    # /dev/zero) once showed that file's record, or read until memory ran out
    outside = tmp_path / "outside.jsonl"
    run = RunWriter.create(tmp_path, run_id="r")
    run.write_trajectories(0, [calculator_record(step=0, group_id="g", index=0)])
    secret = calculator_record(step=0, group_id="secret", index=0)
    outside.write_text(secret.model_dump_json() + "\n")
    (entry,) = run.index()
    for file in ("../outside.jsonl", "/dev/zero"):
        forged = entry.model_copy(update={"file": file, "uid": secret.uid, "offset": 0})
        with open(run.path / "index.jsonl", "a") as f:
            f.write(forged.model_dump_json() + "\n")
    assert [e.uid for e in run.index()] == [entry.uid]
    assert [r.group_id for r in run.find()] == ["g"]


def test_json_nested_deeper_than_the_parser_goes_is_a_bad_line_not_a_crash(
    tmp_path: Path,
) -> None:
    run = RunWriter.create(tmp_path, run_id="r")
    run.write_metrics(0, {"reward_mean": 0.5})
    run.write_trajectories(0, [calculator_record(step=0, group_id="g", index=0)])
    deep = "[" * 100_000 + "\n"
    for name in ("metrics.jsonl", "index.jsonl", "trajectories/step_000000.jsonl"):
        with open(run.path / name, "a") as f:
            f.write(deep)
    assert run.read_metrics() == [{"step": 0, "reward_mean": 0.5}]
    assert len(run.index()) == 1
    lines = list(run.scan_step(0))
    assert [line.problem for line in lines][1].startswith("torn or invalid line")


def test_a_rollback_entry_sealed_before_kept_existed_still_verifies() -> None:
    # rollbacks of older runs were sealed without `kept`: re-dumping them must give the same
    # bytes, or every resumed older run fails its own `replay --verify`
    from agent_grpo.run_dir.manifest import ManifestEntry, digest_of

    old = {"piece": {"kind": "rollback", "step": 3}, "prev": "genesis", "seq": 5}
    body = json.dumps(old, sort_keys=True, separators=(",", ":")).encode("ascii")
    entry = ManifestEntry.model_validate({**old, "digest": digest_of(body, None)})
    assert digest_of(entry.body(), None) == entry.digest
    kept = {**old, "piece": {"kind": "rollback", "step": 3, "kept": ["ab"]}}
    entry = ManifestEntry.model_validate({**kept, "digest": "x"})
    assert b'"kept":["ab"]' in entry.body()  # a rollback that kept rows says so in its digest
