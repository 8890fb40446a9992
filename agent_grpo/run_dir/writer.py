"""The run directory: config, metrics, trajectories and checkpoints of one training or eval run.

Layout of `RunWriter.path`:

    config.yaml                     the resolved config text
    metrics.jsonl                   one `{"step": n, ...floats}` object per line
    trajectories/step_000007.jsonl  one `TrajectoryRecord` JSON per line
    index.jsonl                     one `IndexEntry` per record: where its line lies, and what
                                    replay filters on (reward, success, termination, errors)
    checkpoints/step_000007/        whatever the trainer saves (renamed into place when whole)

Every file is append-only. Each line is written with one `os.write` on an `O_APPEND` descriptor,
so readers never see two lines interleaved. What this does *not* guarantee: that a line is whole.
A `kill -9` in the middle of a large write, a full disk, or a power cut before the page cache is
flushed (fsync is off by default: it costs a disk round trip per step) can leave a torn last line.
So readers treat a line without its trailing newline, or one that does not parse, as torn: they
log a warning naming the file and byte offset and skip exactly that record. A writer that reopens
a file ending in a torn line first terminates it with a newline, so the next record is not glued
onto the fragment. Index entries are written after the records they point to, so an entry never
points at bytes not yet written; a crash can lose the entries of the records of its last call,
which `rebuild_index` recovers from the trajectory files.

Each record carries `content_hash`, the sha256 of its canonical JSON without that field
(`record_hash`), set when it is written; `scan_step` reads a step's file line by line without
the index and recomputes it, so `replay --verify` catches a changed byte even where the token
invariants still hold, and a line that grew or shrank (shifting the index's offsets) hides no
other record. A write that fails (a full disk: ENOSPC) cuts its file back to the size it had
before the call and raises `RunDirWriteError`; a failed `write_trajectories` also cuts back the
records it wrote before its index entries failed, so each call lands whole or not at all.

Where we depart from common practice: no database and no Parquet as the primary format. JSON
lines append safely from one process and can be inspected with `tail`, and a byte-offset index is
enough to seek to one group. `export_parquet` converts a finished run for analysis.

`manifest.jsonl` (`agent_grpo.run_dir.manifest`) chains a hash of every piece written: each is
appended right after its piece, inside the same all-or-nothing block, so a failed entry cuts its
piece back. A kill between a piece and its entry leaves a piece the manifest lacks; the resume's
`rollback_to` deletes it (it belongs to a step after the checkpoint) or, for a checkpoint, adopts
it, and cuts off a torn last entry. A run written before the manifest existed gets none.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticSerializationError

from agent_grpo.config.base import ConfigError
from agent_grpo.faults import crash_point
from agent_grpo.logs import get_logger
from agent_grpo.run_dir.manifest import (
    GENESIS,
    MANIFEST,
    CheckpointPiece,
    CheckpointRemoved,
    ConfigPiece,
    MetricsPiece,
    Piece,
    RollbackPiece,
    TrajectoryPiece,
    checkpoint_files,
    parse_manifest,
    replay_state,
    run_key,
    seal,
    sha256_bytes,
)
from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = [
    "DamagedCheckpointError",
    "IndexEntry",
    "NotARunDirectory",
    "RecordFilter",
    "RunDirWriteError",
    "RunWriter",
    "StoredLine",
    "read_jsonl",
    "record_hash",
    "select_entries",
]

log = get_logger(__name__)

_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")
_CHECKPOINT_DIR = re.compile(r"^step_(\d+)$")


class IndexEntry(BaseModel):
    """Where one stored record lies, and the fields replay filters on without reading it."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    step: int
    """Training step (or eval round) of the record."""
    uid: str
    """`{group_id}/{index_in_group}`."""
    group_id: str
    """Group the record belongs to."""
    task_id: str
    """Prompt id `{env_id}:{seed}`."""
    index_in_group: int
    """Position within the group."""
    reward: float
    """Total scalar reward."""
    success: bool
    """Whether the verifier judged the task solved."""
    termination: str
    """Termination kind: terminated, truncated or error."""
    tool_errors: int = 0
    """Tool calls that failed (parse, unknown tool, bad arguments, exception, timeout)."""
    file: str
    """Trajectory file, relative to the run directory."""
    offset: int
    """Byte offset of the record's line in `file`."""
    length: int
    """Length in bytes of the line, its newline included."""


class RecordFilter(BaseModel):
    """Which records replay shows; every condition set must hold."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    failed: bool = False
    """Only records the verifier did not judge solved."""
    truncated: bool = False
    """Only records ended by a limit (max turns, max tokens, context)."""
    errors: bool = False
    """Only records with a failed tool call or an `error` termination."""
    reward_min: float | None = None
    """Only records with reward >= this."""
    reward_max: float | None = None
    """Only records with reward <= this."""

    def matches(self, entry: IndexEntry) -> bool:
        """Whether `entry` passes every condition."""
        return not (
            (self.failed and entry.success)
            or (self.truncated and entry.termination != "truncated")
            or (self.errors and entry.tool_errors == 0 and entry.termination != "error")
            or (self.reward_min is not None and entry.reward < self.reward_min)
            or (self.reward_max is not None and entry.reward > self.reward_max)
        )


class NotARunDirectory(FileNotFoundError):
    """A path given as a run directory holds no run (no `trajectories/`, no metrics)."""


class DamagedCheckpointError(ValueError):
    """The newest checkpoint lacks files its manifest entry lists (not a prune's doing)."""


class RunDirWriteError(OSError):
    """A write to the run directory failed (most often a full disk). The file was cut back to its
    size before the write, so the run directory stays readable and can be resumed."""


def _write_error(path: Path, error: OSError) -> RunDirWriteError:
    full = error.errno in (errno.ENOSPC, errno.EDQUOT)
    cause = "disk full" if full else error.strerror or str(error)
    code = errno.errorcode.get(error.errno or 0, "")
    failed = RunDirWriteError(
        f"cannot write {path}: {cause}{f' ({code})' if code else ''}; the run directory keeps "
        "everything written before this call: free space, then resume the run"
    )
    failed.errno = error.errno
    return failed


@dataclass(frozen=True)
class StoredLine:
    """One line of a trajectory file as a scan finds it (not through the index): the record it
    holds, or why it holds none."""

    file: str
    """Trajectory file, relative to the run directory."""
    offset: int
    """Byte offset of the line in `file`."""
    record: TrajectoryRecord | None
    """The record; None when the line is torn or does not parse as one."""
    problem: str | None
    """Why the line holds no record (torn, invalid JSON, not a valid record); None if it does."""
    computed_hash: str | None
    """`record_hash` of the line's fields, to compare with `record.content_hash`."""
    entry: IndexEntry | None
    """The index entry the line would have (None without a record): for selecting lines."""

    @property
    def hash_matches(self) -> bool | None:
        """Whether the stored content hash is the line's own; None when there is none to check."""
        if self.record is None or self.record.content_hash is None:
            return None
        return self.record.content_hash == self.computed_hash


def _tool_errors(record: TrajectoryRecord) -> int:
    return sum(call.error is not None for turn in record.turns for call in turn.tool_calls)


def _step_name(step: int) -> str:
    return f"step_{step:06d}"


def _split_lines(data: bytes) -> Iterator[tuple[int, bytes, bool]]:
    """Yield `(offset, line, whole)` per line; only a last line without its newline is not whole."""
    offset = 0
    while offset < len(data):
        end = data.find(b"\n", offset)
        if end < 0:
            yield offset, data[offset:], False
            return
        yield offset, data[offset:end], True
        offset = end + 1


def _parse_lines(data: bytes, path: Path) -> Iterator[tuple[int, bytes]]:
    """Yield `(offset, line)` for each complete line; warn about a torn last line."""
    for offset, line, whole in _split_lines(data):
        if whole:
            yield offset, line
        else:
            log.warning("%s: torn last line at byte %d (no newline), skipped", path, offset)


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield `(offset, object)` for each valid JSON-object line; warn about and skip torn ones."""
    if not path.exists():
        return
    for offset, line in _parse_lines(path.read_bytes(), path):
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # nested deeper than the parser goes: not ours
            log.warning("%s: invalid JSON line at byte %d, skipped", path, offset)
            continue
        if isinstance(obj, dict):
            yield offset, obj
        else:
            log.warning("%s: line at byte %d is not a JSON object, skipped", path, offset)


def _parse_record(line: bytes, path: Path, offset: int) -> TrajectoryRecord | None:
    try:
        return TrajectoryRecord.model_validate_json(line)
    except ValidationError:
        log.warning("%s: torn or invalid record at byte %d, skipped", path, offset)
        return None


def record_hash(fields: Mapping[str, Any]) -> str:
    """sha256 (hex) of a record's JSON fields without `content_hash`, in canonical form.

    Canonical: keys sorted, no whitespace, ASCII escapes. It hashes the parsed values, not the
    line's bytes, so the hash names the content: it survives re-serialization (how a float is
    spelled), and a field added to `TrajectoryRecord` later leaves old records' hashes valid.
    """
    content = {k: v for k, v in fields.items() if k != "content_hash"}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _stored_line(step: int, file: str, offset: int, line: bytes, whole: bool) -> StoredLine:
    """What one line of a trajectory file holds; never raises, whatever the bytes are."""

    def bad(problem: str) -> StoredLine:
        return StoredLine(file, offset, None, problem, None, None)

    if not whole:
        return bad(f"torn line: {len(line)} bytes and no newline at the end of the file")
    try:
        fields = json.loads(line)
    except ValueError as error:  # UnicodeDecodeError included
        return bad(f"torn or invalid line: not JSON ({error})")
    except RecursionError:
        return bad("torn or invalid line: JSON nested deeper than a record is")
    try:
        record = TrajectoryRecord.model_validate(fields)
    except RecursionError:
        return bad("not a valid record: nested deeper than a record is")
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(map(str, first["loc"])) or "the line"
        return bad(f"not a valid record: {where}: {first['msg']} ({error.error_count()} errors)")
    entry = _index_entry(record, step, file, offset, len(line) + 1)
    return StoredLine(file, offset, record, None, record_hash(fields), entry)


def _record_line(record: TrajectoryRecord) -> str | None:
    """The record's JSON line with its content hash, or None (logged) when it cannot be
    serialized: a lost log line must not end a training run. The hash is also set on `record`,
    so the caller's copy equals the one read back."""
    try:
        record.content_hash = None
        fields = json.loads(record.to_json_line())
        record.content_hash = record_hash(fields)
        return record.to_json_line()
    except (PydanticSerializationError, ValidationError) as error:
        log.error("record %s cannot be serialized, not stored: %s", record.uid, error)
        return None


def _write_all(fd: int, data: bytes) -> int:
    """Write `data` with one `os.write` (more only if the kernel writes short); return the end."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    return os.lseek(fd, 0, os.SEEK_CUR)


@contextmanager
def _appending(path: Path, fsync: bool) -> Iterator[Callable[[str], tuple[int, int]]]:
    """Open `path` for appending; yield `append(line) -> (offset, length)`, one write a line.

    All or nothing against write failures: if a write or the fsync fails (a full disk), the file
    is cut back to its size before the block and `RunDirWriteError` is raised. A partial line
    left behind would end up mid-file, under the next call's records.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as error:
        raise _write_error(path, error) from error
    try:
        size = os.fstat(fd).st_size
        try:
            if size and os.pread(fd, 1, size - 1) != b"\n":
                # Without this the next line would be glued onto the fragment and lost with it.
                log.warning("%s: ends in a torn line (size %d); terminating it", path, size)
                _write_all(fd, b"\n")

            def append(line: str) -> tuple[int, int]:
                data = line.encode() + b"\n"
                return _write_all(fd, data) - len(data), len(data)

            yield append
            if fsync:
                os.fsync(fd)
        except OSError as error:  # RunDirWriteError included: an inner file's failure
            _cut_back(fd, path, size)
            if isinstance(error, RunDirWriteError):
                raise
            raise _write_error(path, error) from error
    finally:
        os.close(fd)


def _cut_back(fd: int, path: Path, size: int) -> None:
    """Truncate `fd` to `size` after a failed write (shrinking a file needs no free space)."""
    try:
        os.ftruncate(fd, size)
    except OSError as error:
        log.error("%s: cannot cut a failed write back to %d bytes: %s", path, size, error)


def _replace_lines(path: Path, lines: list[str]) -> None:
    """Atomically replace `path` with `lines` (a temp file, fsynced, renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        out.write("".join(line + "\n" for line in lines))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def _new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


class RunWriter:
    """One run's directory: append-only metrics and trajectories, an index, checkpoint paths."""

    def __init__(self, path: str | Path, *, fsync: bool = False) -> None:
        self.path = Path(path)
        # fsync after each write call survives power loss, at a disk round trip per call.
        self.fsync = fsync
        self._manifest = self.path / MANIFEST
        # A run from before manifests gets none: a chain of only its later pieces would
        # flag every earlier one as unrecorded.
        self._chained = self._manifest.exists()
        self._key = run_key()
        self._tail: tuple[int, str, int] | None = None  # next seq, last digest, manifest size

    @property
    def run_id(self) -> str:
        """The run's id: its directory name."""
        return self.path.name

    @classmethod
    def create(
        cls,
        root: str | Path,
        run_id: str | None = None,
        config_text: str = "",
        *,
        fsync: bool = False,
    ) -> RunWriter:
        """Make a new run directory `root/run_id` (a timestamped id by default)."""
        path = Path(root) / (run_id or _new_run_id())
        path.mkdir(parents=True, exist_ok=False)
        (path / "trajectories").mkdir()
        (path / "checkpoints").mkdir()
        (path / "config.yaml").write_text(config_text)
        run = cls(path, fsync=fsync)
        run._chained = True
        run._record(ConfigPiece(sha256=sha256_bytes((path / "config.yaml").read_bytes())))
        return run

    @classmethod
    def create_fresh(
        cls, root: str | Path, name: str, config_text: Callable[[str], str], *, fsync: bool = False
    ) -> RunWriter:
        """A new run directory `root/name`, or where that exists `root/name-<time>` (then
        `-2`, `-3`, ...): never one another run holds. `config_text(taken)` is the config it
        stores, which names the directory taken (so the run resumes by that name)."""
        root = Path(root)
        if root.exists() and not root.is_dir():
            raise ConfigError(f"run.root {root} is not a directory")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        candidates = [name, f"{name}-{stamp}", *(f"{name}-{stamp}-{n}" for n in range(2, 100))]
        for taken in candidates:
            if (root / taken).exists():
                continue
            try:
                return cls.create(root, taken, config_text(taken), fsync=fsync)
            except FileExistsError:  # another process took it since: the next one
                continue
        raise ConfigError(f"no free run directory for run.name {name!r} under {root}")

    @classmethod
    def open(cls, path: str | Path, *, fsync: bool = False) -> RunWriter:
        """Open an existing run directory."""
        path = Path(path)
        if not (path / "trajectories").is_dir() and not (path / "metrics.jsonl").is_file():
            raise NotARunDirectory(f"{path} is not a run directory (no trajectories/ or metrics)")
        return cls(path, fsync=fsync)

    @property
    def config_text(self) -> str:
        """The resolved config this run was started with ('' if none was stored)."""
        config = self.path / "config.yaml"
        return config.read_text() if config.exists() else ""

    def trajectory_file(self, step: int) -> Path:
        """The JSON-lines file holding step `step`'s records."""
        return self.path / "trajectories" / f"{_step_name(step)}.jsonl"

    # Writing

    def write_metrics(self, step: int, metrics: Mapping[str, float | None]) -> None:
        """Append one step's metrics as `{"step": step, **metrics}`."""
        values = {k: _jsonable(v) for k, v in metrics.items() if k != "step"}
        line = json.dumps({"step": step, **values})
        with _appending(self.path / "metrics.jsonl", self.fsync) as append:
            append(line)
            self._record(MetricsPiece(step=step, sha256=sha256_bytes(line.encode())))

    def write_trajectories(self, step: int, records: Iterable[TrajectoryRecord]) -> None:
        """Append records to step `step`'s file, then their index entries."""
        path = self.trajectory_file(step)
        path.parent.mkdir(exist_ok=True)
        relative = str(path.relative_to(self.path))
        # Every line is made before the first is written, so a record that fails to serialize
        # cannot leave the step half written.
        lines = [(record, line) for record in records if (line := _record_line(record))]
        entries = []
        size = path.stat().st_size if path.exists() else None
        try:
            with _appending(path, self.fsync) as append:
                for record, line in lines:
                    offset, length = append(line)
                    entries.append(_index_entry(record, step, relative, offset, length))
                    crash_point("trajectories", step)  # crash tests: mid-step, records half written
            # Only after the records: an index entry never points at bytes not yet written.
            with _appending(self.path / "index.jsonl", self.fsync) as append:
                for entry in entries:
                    append(entry.model_dump_json())
                self._record(_trajectory_piece(step, path, entries, [line for _, line in lines]))
        except RunDirWriteError:
            # All or nothing: records the index lacks would be missed by `find`, seen by a scan;
            # an empty step file would count as a step.
            if size is None:
                path.unlink(missing_ok=True)
            else:
                os.truncate(path, size)
            raise

    # Reading

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every step's metrics, in file order (torn lines skipped with a warning)."""
        return [obj for _, obj in read_jsonl(self.path / "metrics.jsonl")]

    def read_trajectories(self, step: int) -> list[TrajectoryRecord]:
        """Every complete record of step `step`, in write order (torn ones skipped)."""
        return list(_records_in(self.trajectory_file(step)))

    def scan_step(self, step: int) -> list[StoredLine]:
        """Every line of step `step`'s file, read in order without the index (what `replay
        --verify` checks): a bad line is reported with its offset, never skipped, and never
        hides the lines after it."""
        path = self.trajectory_file(step)
        relative = str(path.relative_to(self.path))
        data = path.read_bytes() if path.exists() else b""
        return [_stored_line(step, relative, *parts) for parts in _split_lines(data)]

    def steps(self) -> list[int]:
        """Steps with a trajectory file, ascending."""
        folder = self.path / "trajectories"
        found = (_STEP_FILE.match(p.name) for p in folder.iterdir()) if folder.is_dir() else ()
        return sorted(int(m.group(1)) for m in found if m)

    def index(self) -> list[IndexEntry]:
        """Every index entry, in write order (torn lines skipped with a warning)."""
        path = self.path / "index.jsonl"
        entries = []
        for offset, obj in read_jsonl(path):
            try:
                entry = IndexEntry.model_validate(obj)
            except ValidationError:
                log.warning("%s: invalid index entry at byte %d, skipped", path, offset)
                continue
            # an entry points into its own step's file, nowhere else (`../`, `/dev/zero`)
            if entry.file != self._relative_step_file(entry.step):
                log.warning("%s: the index entry at byte %d names file %r, not its step's: "
                            "skipped", path, offset, entry.file)  # fmt: skip
                continue
            entries.append(entry)
        return entries

    def _relative_step_file(self, step: int) -> str:
        return str(self.trajectory_file(step).relative_to(self.path))

    def find_entries(
        self,
        step: int | None = None,
        group: str | int | None = None,
        sample: int | None = None,
        record_filter: RecordFilter | None = None,
    ) -> list[IndexEntry]:
        """Index entries by step, group (a group id, or an int: the g-th group of its step),
        sample (index in group) and filter, without reading any trajectory file."""
        return select_entries(self.index(), step, group, sample, record_filter)

    def _seek(self, entry: IndexEntry) -> TrajectoryRecord | None:
        """The record at the entry's offset, if the bytes there are still that record."""
        path = self.path / entry.file
        if not path.exists():
            return None
        with open(path, "rb") as f:
            f.seek(entry.offset)
            data = f.read(entry.length)
        if len(data) != entry.length or not data.endswith(b"\n"):
            return None
        try:
            record = TrajectoryRecord.model_validate_json(data[:-1])
        except ValidationError:
            return None
        return record if record.uid == entry.uid else None

    def _scan_for(
        self, entry: IndexEntry, scanned: dict[str, dict[str, TrajectoryRecord]]
    ) -> TrajectoryRecord | None:
        """The entry's record found by uid in its file's lines (`scanned` caches each file)."""
        path = self.path / entry.file
        if entry.file not in scanned:
            log.warning(
                "%s: the index entry of %s (byte %d) does not match the file; scanning its lines",
                path,
                entry.uid,
                entry.offset,
            )
            by_uid: dict[str, TrajectoryRecord] = {}
            for found in _records_in(path):
                by_uid.setdefault(found.uid, found)
            scanned[entry.file] = by_uid
        record = scanned[entry.file].get(entry.uid)
        if record is None:
            log.warning("%s: record %s is torn or missing, skipped", path, entry.uid)
        return record

    def find(
        self,
        step: int | None = None,
        group: str | int | None = None,
        sample: int | None = None,
        **filters: Any,
    ) -> list[TrajectoryRecord]:
        """Records matching step/group/sample and `RecordFilter` keywords (failed, truncated,
        errors, reward_min, reward_max), each read by seeking to its line."""
        return self.records_of(self.find_entries(step, group, sample, RecordFilter(**filters)))

    def records_of(self, entries: Iterable[IndexEntry]) -> list[TrajectoryRecord]:
        """The records `entries` point at, each read by seeking to its line."""
        # One scan per file whose lines moved under the index, however many entries point there.
        scanned: dict[str, dict[str, TrajectoryRecord]] = {}
        records = (self._seek(e) or self._scan_for(e, scanned) for e in entries)
        return [r for r in records if r is not None]

    def rebuild_index(self) -> int:
        """Rewrite `index.jsonl` from the trajectory files (after a crash lost entries); return
        the number of entries."""
        entries = [e for step in self.steps() for e in self._scan_step(step)]
        tmp = self.path / "index.jsonl.tmp"
        tmp.write_text("".join(e.model_dump_json() + "\n" for e in entries))
        os.replace(tmp, self.path / "index.jsonl")
        return len(entries)

    def rollback_to(self, step: int, keep: Callable[[dict[str, Any]], bool] | None = None) -> None:
        """Forget everything from step `step` on: the state a checkpoint taken after `step`
        completed steps describes. Resuming calls it first, so a step that ran after the last
        checkpoint (wholly or in part) is recorded exactly once, when it runs again.

        Metrics rows of steps >= `step` (the final evaluation's row included, unless `keep`
        says to keep the row) and the index entries pointing there are dropped by an atomic
        rewrite; their trajectory files are deleted. Each file is rewritten to a temp name and
        renamed, so a crash during the rollback leaves either the old or the new file, and the
        rollback can simply run again.
        """
        self._reconcile_checkpoints()
        metrics = self.path / "metrics.jsonl"
        later_kept: list[str] = []
        if metrics.exists():
            # The kept rows' bytes unchanged: the manifest holds the hash of each line.
            kept = []
            for _, line, whole in _split_lines(metrics.read_bytes()):
                if not whole:
                    continue
                if _row_step(line, step) < step:
                    kept.append(line)
                elif keep is not None and keep(_row(line)):
                    kept.append(line)
                    later_kept.append(sha256_bytes(line))
            _replace_lines(metrics, [line.decode() for line in kept])
        index = self.path / "index.jsonl"
        if index.exists():
            entries = [e for e in self.index() if e.step < step]
            _replace_lines(index, [e.model_dump_json() for e in entries])
        for later in (s for s in self.steps() if s >= step):
            self.trajectory_file(later).unlink()
        self._record(RollbackPiece(step=step, kept=later_kept))

    # The manifest

    def record_checkpoint(self, path: Path) -> None:
        """Chain the checkpoint directory `path` (just renamed into place), file by file."""
        if self._chained and (m := _CHECKPOINT_DIR.match(path.name)):
            self._record(CheckpointPiece(step=int(m.group(1)), files=checkpoint_files(path)))

    def record_checkpoint_removed(self, path: Path) -> None:
        """Chain the deletion of checkpoint `path` (pruned); temp dirs were never chained."""
        if self._chained and (m := _CHECKPOINT_DIR.match(path.name)):
            self._record(CheckpointRemoved(step=int(m.group(1))))

    def _record(self, piece: Piece) -> None:
        """Append `piece`'s entry to the chain (nothing in a run from before manifests)."""
        if not self._chained:
            return
        seq, prev = self._chain_tail()
        entry = seal(seq, prev, piece, self._key)
        with _appending(self._manifest, self.fsync) as append:
            append(entry.model_dump_json())
        self._tail = (seq + 1, entry.digest, self._manifest.stat().st_size)

    def _chain_tail(self) -> tuple[int, str]:
        """The next entry's seq and prev; cuts off a torn last entry (a kill mid-append)."""
        size = self._manifest.stat().st_size if self._manifest.exists() else 0
        if self._tail is not None and self._tail[2] == size:
            return self._tail[0], self._tail[1]
        lines = parse_manifest(self._manifest.read_bytes() if size else b"")
        if lines and lines[-1].entry is None:
            log.warning(
                "%s: cutting off a torn last entry at byte %d: its piece is unrecorded",
                self._manifest,
                lines[-1].offset,
            )
            os.truncate(self._manifest, lines[-1].offset)
        entries = [line.entry for line in lines if line.entry is not None]
        return (entries[-1].seq + 1, entries[-1].digest) if entries else (0, GENESIS)

    def _reconcile_checkpoints(self) -> None:
        """Make the chain's checkpoints those on disk after a kill between a checkpoint's
        rename (or a prune's delete) and its entry: adopt whole ones, finish half-pruned ones."""
        if not self._chained:
            return
        self._chain_tail()  # a torn last entry goes first
        lines = parse_manifest(self._manifest.read_bytes())
        state = replay_state([line.entry.piece for line in lines if line.entry is not None])
        newest = max(state.checkpoints, default=None)
        for step, piece in state.checkpoints.items():
            folder = self.checkpoint_dir(step)
            missing = [name for name in piece.files if not (folder / name).is_file()]
            if missing and step == newest and folder.is_dir():
                # a prune never touches the newest: files went missing some other way, and
                # what is left is the user's to decide on, not ours to delete
                raise DamagedCheckpointError(
                    f"the newest checkpoint {folder} is missing {', '.join(missing[:3])}"
                    f"{' ...' if len(missing) > 3 else ''}: put them back, or move the folder "
                    "away to resume from the checkpoint before it"
                )
            if missing:
                log.warning("%s: half deleted by a prune; deleting the rest", folder)
                shutil.rmtree(folder, ignore_errors=True)
                self._record(CheckpointRemoved(step=step))
        for folder in sorted((self.path / "checkpoints").glob("step_*")):
            m = _CHECKPOINT_DIR.match(folder.name)
            if m and int(m.group(1)) not in state.checkpoints and (folder / "state.json").is_file():
                log.warning("%s: not in the manifest (a kill before its entry); adding it", folder)
                self.record_checkpoint(folder)

    def _scan_step(self, step: int) -> Iterator[IndexEntry]:
        path = self.trajectory_file(step)
        relative = str(path.relative_to(self.path))
        for offset, line in _parse_lines(path.read_bytes(), path):
            record = _parse_record(line, path, offset)
            if record is not None:
                yield _index_entry(record, step, relative, offset, len(line) + 1)

    # Checkpoints

    def checkpoint_dir(self, step: int) -> Path:
        """Where step `step`'s checkpoint goes. Not created: the saver writes a temp dir and
        renames it here (as `agent_grpo.trainer.checkpoint.save_checkpoint` does), so this path
        exists only once the checkpoint is whole."""
        folder = self.path / "checkpoints"
        folder.mkdir(exist_ok=True)
        return folder / _step_name(step)

    def latest_checkpoint(self) -> Path | None:
        """The highest-step whole checkpoint directory: temp dirs of a crashed save never count,
        nor a directory without its `state.json` (written last)."""
        folder = self.path / "checkpoints"
        found = sorted(
            (int(m.group(1)), p)
            for p in (folder.iterdir() if folder.is_dir() else ())
            if (m := _CHECKPOINT_DIR.match(p.name)) and (p / "state.json").is_file()
        )
        return found[-1][1] if found else None

    # Export

    def export_parquet(self, path: str | Path) -> int:
        """Write every stored record to one Parquet file (needs pyarrow); return the row count."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema(list(_parquet_columns().items()))
        rows = 0
        # One row group per step, so memory holds one step's records at a time.
        with pq.ParquetWriter(str(path), schema) as writer:
            for step in self.steps():
                table = [_parquet_row(r) for r in self.read_trajectories(step)]
                writer.write_table(pa.Table.from_pylist(table, schema=schema))
                rows += len(table)
        return rows


def _parquet_columns() -> dict[str, Any]:
    import pyarrow as pa

    scalars = {
        "run_id": pa.string(),
        "step": pa.int64(),
        "uid": pa.string(),
        "group_id": pa.string(),
        "task_id": pa.string(),
        "index_in_group": pa.int64(),
        "group_size": pa.int64(),
        "env_id": pa.string(),
        "seed": pa.int64(),
        "reward": pa.float64(),
        "success": pa.bool_(),
        "advantage": pa.float64(),
        "termination_kind": pa.string(),
        "termination_reason": pa.string(),
        "sampling_temperature": pa.float64(),
        "num_tokens": pa.int64(),
        "num_model_tokens": pa.int64(),
        "num_turns": pa.int64(),
        "tool_errors": pa.int64(),
        "malformed_tool_calls": pa.int64(),
    }
    arrays = {
        "token_ids": pa.list_(pa.int64()),
        "provenance": pa.list_(pa.string()),
        "sampler_logprobs": pa.list_(pa.float64()),
        "old_logprobs": pa.list_(pa.float64()),
        "ref_logprobs": pa.list_(pa.float64()),
    }
    # Free-form nested fields stay JSON text: their keys differ between envs and records.
    nested = dict.fromkeys(["messages", "turns", "verifier", "reward_components"], pa.string())
    return {**scalars, **arrays, **{f"{k}_json": v for k, v in nested.items()}}


def _parquet_row(r: TrajectoryRecord) -> dict[str, Any]:
    data = r.model_dump(mode="json")
    row = {k: data[k] for k in _PARQUET_SCALARS_FROM_RECORD}
    row |= {k: data[k] for k in _PARQUET_ARRAYS}
    row |= {f"{k}_json": json.dumps(data[k]) for k in _PARQUET_NESTED}
    return row | {
        "uid": r.uid,
        "termination_kind": r.termination.kind,
        "termination_reason": r.termination.reason,
        "num_tokens": len(r.token_ids),
        "num_model_tokens": sum(r.loss_mask),
        "num_turns": len(r.turns),
        "tool_errors": _tool_errors(r),
    }


_PARQUET_SCALARS_FROM_RECORD = (
    "run_id",
    "step",
    "group_id",
    "task_id",
    "index_in_group",
    "group_size",
    "env_id",
    "seed",
    "reward",
    "success",
    "advantage",
    "sampling_temperature",
    "malformed_tool_calls",
)
_PARQUET_ARRAYS = ("token_ids", "provenance", "sampler_logprobs", "old_logprobs", "ref_logprobs")
_PARQUET_NESTED = ("messages", "turns", "verifier", "reward_components")


def _jsonable(value: Any) -> Any:
    """Metric values as JSON numbers; None and non-finite floats become null (JSON has no NaN)."""
    if value is None or isinstance(value, bool | int):
        return value
    number = float(value)
    return number if number == number and abs(number) != float("inf") else None


_INDEXED_FIELDS = {"group_id", "task_id", "index_in_group", "reward", "success"}


def _index_entry(
    record: TrajectoryRecord, step: int, file: str, offset: int, length: int
) -> IndexEntry:
    fields = record.model_dump(include=_INDEXED_FIELDS)
    termination, errors = record.termination.kind, _tool_errors(record)
    return IndexEntry(
        **fields,
        step=step,
        uid=record.uid,
        termination=termination,
        tool_errors=errors,
        file=file,
        offset=offset,
        length=length,
    )


def _trajectory_piece(
    step: int, path: Path, entries: Sequence[IndexEntry], lines: Sequence[str]
) -> TrajectoryPiece:
    """The manifest piece of the lines one `write_trajectories` call appended to `path`."""
    data = b"".join(line.encode() + b"\n" for line in lines)
    offset = entries[0].offset if entries else path.stat().st_size
    return TrajectoryPiece(
        step=step, offset=offset, length=len(data), records=len(lines), sha256=sha256_bytes(data)
    )


def _row(line: bytes) -> dict[str, Any]:
    """A metrics line's row; {} when it is not a JSON object."""
    try:
        obj = json.loads(line)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _row_step(line: bytes, default: int) -> int:
    """A metrics line's step; `default` (dropped by a rollback to it) when it does not parse."""
    try:
        obj = json.loads(line)
    except ValueError:
        return default
    step = obj.get("step", 0) if isinstance(obj, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else default


def _records_in(path: Path) -> Iterator[TrajectoryRecord]:
    """Every valid record of a trajectory file, in order (bad lines skipped with a warning)."""
    if not path.exists():
        return
    for offset, line in _parse_lines(path.read_bytes(), path):
        record = _parse_record(line, path, offset)
        if record is not None:
            yield record


def select_entries(
    entries: Sequence[IndexEntry],
    step: int | None = None,
    group: str | int | None = None,
    sample: int | None = None,
    record_filter: RecordFilter | None = None,
) -> list[IndexEntry]:
    """The entries matching step, group (a group id, or an int: the g-th group of its step),
    sample (index in group) and filter, in their order."""
    chosen = [e for e in entries if step is None or e.step == step]
    if isinstance(group, int):
        chosen = _nth_group(chosen, group)
    elif group is not None:
        chosen = [e for e in chosen if e.group_id == group]
    record_filter = record_filter or RecordFilter()
    return [
        e
        for e in chosen
        if (sample is None or e.index_in_group == sample) and record_filter.matches(e)
    ]


def _nth_group(entries: list[IndexEntry], n: int) -> list[IndexEntry]:
    """Entries of the n-th group (in order of first appearance) of each step."""
    order: dict[int, list[str]] = {}
    for e in entries:
        groups = order.setdefault(e.step, [])
        if e.group_id not in groups:
            groups.append(e.group_id)
    chosen = {(s, g[n]) for s, g in order.items() if 0 <= n < len(g)}
    return [e for e in entries if (e.step, e.group_id) in chosen]
