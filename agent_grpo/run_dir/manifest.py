"""The run's manifest: an append-only hash chain over every piece `RunWriter` writes.

`manifest.jsonl` holds one `ManifestEntry` per piece, written right after the piece itself:
the config, each call's block of trajectory lines (offset, length, record count, sha256 of the
bytes), each metrics row (sha256 of its line), each checkpoint (sha256 of every file), a
checkpoint's removal by pruning, and a resume's rollback. Each entry carries the digest of the one
before it (`prev`) and its own (`digest`), so deleting, adding, reordering or editing a piece, or
an entry, breaks the chain unless every later entry is rewritten too.

Without a key the digest is a plain sha256: anyone who can write the directory can recompute the
whole chain, so it proves only that the files are what the chain says, not who wrote them. With
`AGENT_GRPO_RUN_KEY` set the digest is an HMAC-SHA256 under that key: a signature only whoever
holds the key can forge. Neither detects the loss of a tail (the last pieces deleted along with
their entries): the chain has no end mark, since a run can always be resumed.

Everything here is a pure function of the entries and file bytes; `RunWriter` appends, and
`agent_grpo.inspect.verify_run` checks the directory against `replay_state`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "GENESIS",
    "KEY_ENV",
    "MANIFEST",
    "CheckpointPiece",
    "CheckpointRemoved",
    "ConfigPiece",
    "ManifestEntry",
    "ManifestLine",
    "MetricsPiece",
    "Piece",
    "RollbackPiece",
    "RunState",
    "TrajectoryPiece",
    "checkpoint_files",
    "digest_of",
    "parse_manifest",
    "replay_state",
    "run_key",
    "seal",
    "sha256_bytes",
]

MANIFEST = "manifest.jsonl"
"""The manifest's file name in the run directory."""
KEY_ENV = "AGENT_GRPO_RUN_KEY"
"""Environment variable holding the HMAC key that turns the chain into a signature."""
GENESIS = "genesis"
"""`prev` of the first entry."""


class _Piece(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class ConfigPiece(_Piece):
    """`config.yaml` as the run was created with it."""

    kind: Literal["config"] = "config"
    """Piece kind."""
    sha256: str
    """sha256 (hex) of the file's bytes."""


class TrajectoryPiece(_Piece):
    """The lines one `write_trajectories` call appended to a step's file."""

    kind: Literal["trajectories"] = "trajectories"
    """Piece kind."""
    step: int
    """Step whose file got the lines."""
    offset: int
    """Byte offset of the first line: where the file ended before the call."""
    length: int
    """Bytes appended, every newline included."""
    records: int
    """Number of lines (records) appended."""
    sha256: str
    """sha256 (hex) of the appended bytes."""


class MetricsPiece(_Piece):
    """One row of `metrics.jsonl`."""

    kind: Literal["metrics"] = "metrics"
    """Piece kind."""
    step: int
    """The row's step."""
    sha256: str
    """sha256 (hex) of the line's bytes, without its newline."""


class CheckpointPiece(_Piece):
    """A whole checkpoint directory as renamed into place."""

    kind: Literal["checkpoint"] = "checkpoint"
    """Piece kind."""
    step: int
    """Steps completed when it was taken (its directory is `checkpoints/step_N`)."""
    files: dict[str, str]
    """Every file's path inside the directory -> sha256 (hex) of its bytes."""


class CheckpointRemoved(_Piece):
    """A checkpoint deleted on purpose (pruned to `run.keep_checkpoints`)."""

    kind: Literal["checkpoint_removed"] = "checkpoint_removed"
    """Piece kind."""
    step: int
    """Step of the deleted checkpoint."""


class RollbackPiece(_Piece):
    """A resume's rollback: trajectories and metrics rows of steps >= `step` were dropped."""

    kind: Literal["rollback"] = "rollback"
    """Piece kind."""
    step: int
    """First step forgotten."""
    kept: list[str] = []
    """sha256 of the metrics rows of steps >= `step` the rollback kept: evaluations of the
    policy the checkpoint holds (a finished run's final one, when it goes on to train more)."""


Piece = Annotated[
    ConfigPiece
    | TrajectoryPiece
    | MetricsPiece
    | CheckpointPiece
    | CheckpointRemoved
    | RollbackPiece,
    Field(discriminator="kind"),
]


class ManifestEntry(BaseModel):
    """One line of `manifest.jsonl`: a piece, chained to the entry before it."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    seq: int
    """Position in the chain, from 0."""
    piece: Piece
    """What was written."""
    prev: str
    """`digest` of the entry before (`genesis` for the first)."""
    digest: str
    """`sha256:HEX` or `hmac-sha256:HEX` of the entry's canonical JSON without this field."""

    def body(self) -> bytes:
        """The bytes the digest covers: the entry without `digest`, canonical JSON."""
        fields = self.model_dump(mode="json", exclude={"digest"})
        if fields["piece"].get("kept") == []:  # as rollbacks were sealed before `kept` existed
            del fields["piece"]["kept"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("ascii")


def sha256_bytes(data: bytes) -> str:
    """sha256 (hex) of `data`."""
    return hashlib.sha256(data).hexdigest()


def digest_of(body: bytes, key: bytes | None) -> str:
    """An entry's digest: HMAC-SHA256 under `key`, else a plain sha256 (not a signature)."""
    if key is None:
        return "sha256:" + sha256_bytes(body)
    return "hmac-sha256:" + hmac.new(key, body, hashlib.sha256).hexdigest()


def seal(seq: int, prev: str, piece: Piece, key: bytes | None) -> ManifestEntry:
    """The entry for `piece` after the entry whose digest is `prev`."""
    entry = ManifestEntry(seq=seq, piece=piece, prev=prev, digest="")
    entry.digest = digest_of(entry.body(), key)
    return entry


def run_key() -> bytes | None:
    """The HMAC key from `AGENT_GRPO_RUN_KEY`, or None when it is unset or empty."""
    value = os.environ.get(KEY_ENV, "")
    return value.encode() if value else None


@dataclass(frozen=True)
class ManifestLine:
    """One line of the manifest file: its entry, or why it has none."""

    offset: int
    """Byte offset of the line."""
    entry: ManifestEntry | None
    """The parsed entry; None when the line is torn or invalid."""
    problem: str | None = None
    """Why there is no entry."""


def parse_manifest(data: bytes) -> list[ManifestLine]:
    """Every line of the manifest's bytes, parsed; a bad line is reported, never skipped."""
    lines = []
    offset = 0
    while offset < len(data):
        end = data.find(b"\n", offset)
        whole = end >= 0
        raw = data[offset : end if whole else len(data)]
        if not whole:
            lines.append(ManifestLine(offset, None, "torn line (no newline at the end)"))
            break
        try:
            lines.append(ManifestLine(offset, ManifestEntry.model_validate_json(raw)))
        except ValidationError as error:
            problem = f"not a manifest entry ({error.error_count()} errors)"
            lines.append(ManifestLine(offset, None, problem))
        offset = end + 1
    return lines


@dataclass
class RunState:
    """What the run directory must hold, by the manifest: the result of replaying its entries."""

    config: ConfigPiece | None = None
    """The config's piece; None if never recorded."""
    metrics: list[MetricsPiece] = field(default_factory=list)
    """The rows `metrics.jsonl` must hold, in order."""
    trajectories: dict[int, list[TrajectoryPiece]] = field(default_factory=dict)
    """Per step: the blocks its file must be, end to end."""
    checkpoints: dict[int, CheckpointPiece] = field(default_factory=dict)
    """Per step: the checkpoint directory that must exist, file by file."""


def replay_state(pieces: Sequence[Piece]) -> RunState:
    """Apply the pieces in order: what the directory holds after they were all written."""
    state = RunState()
    for piece in pieces:
        if isinstance(piece, ConfigPiece):
            state.config = piece
        elif isinstance(piece, MetricsPiece):
            state.metrics.append(piece)
        elif isinstance(piece, TrajectoryPiece):
            state.trajectories.setdefault(piece.step, []).append(piece)
        elif isinstance(piece, CheckpointPiece):
            state.checkpoints[piece.step] = piece
        elif isinstance(piece, CheckpointRemoved):
            state.checkpoints.pop(piece.step, None)
        else:  # a rollback forgets what `RunWriter.rollback_to` deleted; checkpoints stay
            state.metrics = [
                m for m in state.metrics if m.step < piece.step or m.sha256 in piece.kept
            ]
            state.trajectories = {s: v for s, v in state.trajectories.items() if s < piece.step}
    return state


def _files_below(root: Path) -> Iterator[Path]:
    return (p for p in sorted(root.rglob("*")) if p.is_file())


def checkpoint_files(root: Path) -> dict[str, str]:
    """sha256 of every file below a checkpoint directory, by its path relative to it."""
    out = {}
    for path in _files_below(root):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):  # weights can be gigabytes
                digest.update(chunk)
        out[path.relative_to(root).as_posix()] = digest.hexdigest()
    return out
