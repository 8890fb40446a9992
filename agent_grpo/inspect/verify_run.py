"""`replay --verify` over the whole run: the manifest's chain, the files against it, and the
records against the config, their file and each other.

Two kinds of check, each a pure function returning one message per problem:

- `manifest_problems`: the chain of `manifest.jsonl` (seq, prev, digest; an HMAC under
  `AGENT_GRPO_RUN_KEY` when one was used), then `config.yaml`, `metrics.jsonl` row by row, each
  step's trajectory file block by block and each checkpoint file by file against the state the
  chain describes (`replay_state`). A piece deleted, added, reordered or edited is named.
- `record_problems`: what a record says that the run contradicts. `reward` must be the verifier
  component plus the weighted other components (`agent_grpo.rewards.apply_rewards`, weights from
  `config.yaml`'s `rewards`); `success` the verifier's; `step` its file's; `run_id` the run's
  `run.name`; `policy_version` in 0..step and equal across the group; `group_size` the config's
  `rollout.group_size`; `advantage` the trainer's own recompute (`advantages_of`) from the
  group's stored rewards under the config's `algo`.

A run without a manifest (written before it existed) is "unverifiable as a whole": a warning, and
its records are still checked.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from agent_grpo.algo.config import AlgoConfig, TurnCreditConfig
from agent_grpo.run_dir.manifest import (
    GENESIS,
    KEY_ENV,
    MANIFEST,
    ManifestEntry,
    RunState,
    TrajectoryPiece,
    checkpoint_files,
    digest_of,
    parse_manifest,
    replay_state,
    sha256_bytes,
)
from agent_grpo.run_dir.writer import StoredLine
from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = ["RunCheck", "RunFacts", "check_run", "manifest_problems", "record_problems"]

# The trainer stores advantages as float32 of an fp64 computation (`group_advantages`): a
# recompute may differ by that rounding, one float32 ulp, and nothing else.
_ADVANTAGE_TOL = 2.0**-22
# A reward is a short fp64 sum (`apply_rewards`): a few fp64 ulps.
_REWARD_TOL = 1e-12


class _View(BaseModel):
    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)


class _RunSection(_View):
    name: str | None = None
    """`run.name`: every record's `run_id`."""


class _RolloutSection(_View):
    group_size: int | None = None
    """Samples per group."""


class _RewardSection(_View):
    name: str
    """Component name."""
    weight: float = 1.0
    """Its multiplier in the total reward."""


class _AlgoSection(_View):
    scale: Literal["group", "none"] | None = None
    """Advantage scale (None: resolved by `AlgoConfig`)."""
    leave_one_out: bool = False
    """RLOO baseline."""
    turn_credit: TurnCreditConfig | None = None
    """Turn-level credit, if the run used it."""
    max_staleness: int = 0
    """Most policy versions a trained token may lag the trainer by."""


class _ConfigView(_View):
    run: _RunSection = _RunSection()
    """The `run` section."""
    rollout: _RolloutSection | None = None
    """The `rollout` section; None in an eval run's config."""
    rewards: list[_RewardSection] = []
    """Extra reward sources."""
    algo: _AlgoSection = _AlgoSection()
    """The `algo` section."""


class _VerdictView(_View):
    success: bool | None = None
    """The verifier's verdict, when it gave one (`envs.text_env.Verdict.success`)."""


@dataclass(frozen=True)
class RunFacts:
    """What `config.yaml` says the records must agree with."""

    run_name: str | None
    """Every record's `run_id` (None: not stated)."""
    group_size: int | None
    """Every group's size (None: not a training config)."""
    weights: Mapping[str, float]
    """Reward component name -> weight, for the components besides `verifier`."""
    algo: AlgoConfig
    """The advantage settings the trainer used."""
    trained: bool
    """A training run (its records' run_id is always set)."""

    @classmethod
    def from_config_text(cls, text: str) -> RunFacts:
        """The facts of a `config.yaml`; defaults for anything it lacks or cannot parse."""
        try:
            loaded = yaml.safe_load(text) or {}
            view = _ConfigView.model_validate(loaded if isinstance(loaded, dict) else {})
        except (yaml.YAMLError, ValidationError):
            view = _ConfigView()
        algo = AlgoConfig(scale=view.algo.scale, leave_one_out=view.algo.leave_one_out,
                          turn_credit=view.algo.turn_credit,
                          max_staleness=view.algo.max_staleness)  # fmt: skip
        return cls(
            run_name=view.run.name,
            group_size=view.rollout.group_size if view.rollout else None,
            weights={r.name: r.weight for r in view.rewards},
            algo=algo,
            trained=view.rollout is not None,
        )


# Records against the run


def _where(line: StoredLine, record: TrajectoryRecord) -> str:
    return f"{line.file} byte {line.offset} ({record.uid})"


def _reward_problem(record: TrajectoryRecord, weights: Mapping[str, float]) -> str | None:
    parts = record.reward_components
    if "verifier" not in parts or not math.isfinite(record.reward):
        return None  # not scored by `apply_rewards`, or excluded from the statistics anyway
    # The same sum in the same order as `apply_rewards`.
    want = parts["verifier"] + sum(weights[k] * v for k, v in parts.items() if k in weights)
    if math.isclose(record.reward, want, rel_tol=_REWARD_TOL, abs_tol=_REWARD_TOL):
        return None
    return f"reward {record.reward!r} is not its weighted components' sum {want!r} ({parts})"


def _record_facts(record: TrajectoryRecord, step: int, facts: RunFacts) -> Iterator[str]:
    if record.step != step:
        yield f"says step {record.step} but lies in the file of step {step}"
    # An eval run's records may carry no run_id; a training run's always carry run.name.
    named = facts.run_name is not None and (facts.trained or record.run_id != "")
    if named and record.run_id != facts.run_name:
        yield f"run_id {record.run_id!r} is not this run's ({facts.run_name!r})"
    if not 0 <= record.policy_version <= step:
        yield f"policy_version {record.policy_version} is impossible at step {step} (0..{step})"
    yield from _turn_version_problems(record, step, facts.algo.max_staleness)
    if facts.group_size is not None and record.group_size != facts.group_size:
        yield f"group_size {record.group_size}, but rollout.group_size is {facts.group_size}"
    verdict = _VerdictView.model_validate(record.verifier).success
    if verdict is not None and verdict != record.success:
        yield f"success {record.success} but the verifier said {verdict}"
    if (reward := _reward_problem(record, facts.weights)) is not None:
        yield reward


def _turn_version_problems(record: TrajectoryRecord, step: int, bound: int) -> Iterator[str]:
    """Partial rollouts' per-turn versions: they run up from the record's `policy_version` to at
    most `step`, and a turn more than `bound` versions old has no trainer logprob (it was not
    trained)."""
    versions = [t.policy_version for t in record.turns if t.policy_version is not None]
    if not versions:
        return
    if versions != sorted(versions) or versions[0] != record.policy_version or versions[-1] > step:
        yield (f"turn policy versions {versions} do not run up from policy_version "
               f"{record.policy_version} to at most step {step}")  # fmt: skip
    rows = {row.branch: row for row in record.rows()}
    for turn in record.turns:
        old = rows[turn.branch].old_logprobs or []
        age = step - (record.policy_version if turn.policy_version is None else turn.policy_version)
        if age > bound and any(v is not None for v in old[turn.token_start : turn.token_end]):
            yield (f"turn {turn.index} was sampled {age} versions before step {step} (bound "
                   f"{bound}) but was trained")  # fmt: skip


def _advantage_problems(
    lines: Sequence[StoredLine], facts: RunFacts
) -> Iterator[tuple[StoredLine, str]]:
    """Each stored advantage (and, under turn credit, each turn's) against the trainer's
    recompute over its step's records."""
    from agent_grpo.algo.groups import advantages_of, turn_advantages_of  # torch: when needed

    records = [(line, line.record) for line in lines if line.record is not None]
    if not records or any(r.advantage is None for _, r in records):
        return  # not trained on (an eval run): nothing to recompute
    episode = advantages_of([r for _, r in records], facts.algo)
    algo = f"algo scale {facts.algo.advantage_scale}, leave_one_out {facts.algo.leave_one_out}"
    for (line, record), a in zip(records, episode.tolist(), strict=True):
        assert record.advantage is not None
        if not _close(record.advantage, a):
            yield line, (f"{_where(line, record)}: advantage {record.advantage!r}, but the "
                         f"group's rewards give {a!r} ({algo})")  # fmt: skip
    if facts.algo.turn_credit is None:
        return
    per_turn = turn_advantages_of([r for _, r in records], facts.algo, episode)
    for (line, record), want in zip(records, per_turn, strict=True):
        for turn, a in zip(record.turns, want, strict=True):
            if turn.advantage is None or not _close(turn.advantage, a):
                stored = turn.advantage
                yield line, (f"{_where(line, record)}: turn {turn.index}'s advantage "
                             f"{stored!r}, but turn credit gives {a!r} ({algo})")  # fmt: skip


def _close(stored: float, recomputed: float) -> bool:
    return math.isclose(stored, recomputed, rel_tol=_ADVANTAGE_TOL, abs_tol=_ADVANTAGE_TOL)


def _group_problems(lines: Sequence[StoredLine]) -> Iterator[str]:
    versions: dict[str, set[int]] = {}
    for line in lines:
        if line.record is not None:
            versions.setdefault(line.record.group_id, set()).add(line.record.policy_version)
    for group_id, seen in versions.items():
        if len(seen) > 1:
            yield f"group {group_id} in {lines[0].file}: members sampled by policies {sorted(seen)}"


def record_problems(
    steps: Mapping[int, Sequence[StoredLine]],
    facts: RunFacts,
    chosen: Callable[[StoredLine], bool] = lambda line: True,
) -> list[str]:
    """What the chosen records of each step's lines (first copies only) say that the run
    contradicts."""
    problems = []
    for step, all_lines in sorted(steps.items()):
        lines = _first_copies(all_lines)
        for line in lines:
            if line.record is not None and chosen(line):
                where = _where(line, line.record)
                problems += [f"{where}: {p}" for p in _record_facts(line.record, step, facts)]
        problems += list(_group_problems([line for line in lines if chosen(line)]))
        # Recomputed over the whole step (a group's advantages use every member), reported for
        # the chosen lines.
        problems += [p for line, p in _advantage_problems(lines, facts) if chosen(line)]
    return problems


def _first_copies(lines: Sequence[StoredLine]) -> list[StoredLine]:
    seen: set[str] = set()
    out = []
    for line in lines:
        if line.record is not None and line.record.uid not in seen:
            seen.add(line.record.uid)
            out.append(line)
    return out


# The directory against its manifest


def _chain_problems(entries: Sequence[tuple[int, ManifestEntry]], key: bytes | None) -> list[str]:
    problems, prev = [], GENESIS
    for seq, (offset, entry) in enumerate(entries):
        what = f"{MANIFEST} byte {offset} ({entry.piece.kind} entry {entry.seq})"
        signed = entry.digest.startswith("hmac-sha256:")
        if entry.seq != seq or entry.prev != prev:
            problems.append(
                f"{what}: does not follow entry {seq - 1}: an entry was deleted, added or moved"
            )
        if key is not None and not signed:
            problems.append(f"{what}: not signed, but {KEY_ENV} is set: written without the key")
        elif (key is not None or not signed) and digest_of(entry.body(), key) != entry.digest:
            problems.append(f"{what}: its digest does not match: the entry was edited")
        prev = entry.digest
    return problems


def _metrics_problems(run: Path, state: RunState) -> list[str]:
    path = run / "metrics.jsonl"
    data = path.read_bytes() if path.exists() else b""
    rows = data.split(b"\n")
    torn = rows.pop()  # b"" when the file ends in a newline
    for i, piece in enumerate(state.metrics):
        if i >= len(rows):
            return [f"metrics.jsonl: the row of step {piece.step} (row {i}) is missing"]
        if sha256_bytes(rows[i]) != piece.sha256:
            return [
                f"metrics.jsonl row {i}: not the row of step {piece.step} as written "
                "(edited, deleted or moved)"
            ]
    extra = len(rows) - len(state.metrics) + (1 if torn else 0)
    return [f"metrics.jsonl: {extra} row(s) after the last recorded one"] if extra else []


def _step_file_problems(file: str, data: bytes, pieces: Sequence[TrajectoryPiece]) -> list[str]:
    """The file must be its pieces' bytes end to end, and nothing else."""
    position = 0
    for piece in pieces:
        if piece.offset != position:
            return [f"{file}: bytes {position}..{piece.offset} are not the manifest's"]
        block = data[piece.offset : piece.offset + piece.length]
        if sha256_bytes(block) != piece.sha256:
            return [
                f"{file}: the {piece.records} records at byte {piece.offset} are not the bytes "
                "written (edited, reordered, cut or replaced)"
            ]
        position = piece.offset + piece.length
    if position != len(data):
        return [
            f"{file}: {len(data) - position} bytes after byte {position} are not in the manifest"
        ]
    return []


def _trajectory_problems(run: Path, state: RunState) -> list[str]:
    folder = run / "trajectories"
    found = {
        int(m.group(1))
        for p in folder.glob("step_*.jsonl")
        if (m := re.fullmatch(r"step_(\d+)\.jsonl", p.name))
    }
    problems = []
    for step in sorted(found | set(state.trajectories)):
        file = f"trajectories/step_{step:06d}.jsonl"
        pieces = state.trajectories.get(step)
        if pieces is None:
            problems.append(f"{file}: not in the manifest (added)")
        elif step not in found:
            records = sum(p.records for p in pieces)
            problems.append(f"{file}: missing; the manifest has {records} records there (deleted)")
        else:
            problems += _step_file_problems(file, (run / file).read_bytes(), pieces)
    return problems


def _checkpoint_problems(run: Path, state: RunState) -> list[str]:
    folder = run / "checkpoints"
    found = {
        int(m.group(1)): p
        for p in (folder.iterdir() if folder.is_dir() else ())
        if (m := re.fullmatch(r"step_(\d+)", p.name))
    }
    problems = []
    for step in sorted(set(found) | set(state.checkpoints)):
        name, piece = f"checkpoints/step_{step:06d}", state.checkpoints.get(step)
        if piece is None:
            problems.append(f"{name}: not in the manifest (added)")
            continue
        if step not in found:
            problems.append(f"{name}: missing (deleted)")
            continue
        files = checkpoint_files(found[step])
        for file in sorted(set(files) | set(piece.files)):
            if files.get(file) != piece.files.get(file):
                change = (
                    "missing"
                    if file not in files
                    else "added"
                    if file not in piece.files
                    else "changed"
                )
                problems.append(f"{name}/{file}: {change} since the checkpoint was written")
    return problems


def manifest_problems(run: Path, key: bytes | None) -> tuple[list[str], list[str], int]:
    """(problems, warnings, entries) of the run directory against its manifest's chain."""
    lines = parse_manifest((run / MANIFEST).read_bytes())
    problems = [
        f"{MANIFEST} byte {line.offset}: {line.problem}" for line in lines if line.entry is None
    ]
    entries = [(line.offset, line.entry) for line in lines if line.entry is not None]
    warnings = []
    if key is None and any(e.digest.startswith("hmac-sha256:") for _, e in entries):
        warnings.append(f"the manifest is signed: set {KEY_ENV} to check its signature")
    problems += _chain_problems(entries, key)
    state = replay_state([entry.piece for _, entry in entries])
    config = run / "config.yaml"
    if state.config is None or not config.exists():
        problems.append("config.yaml: missing, or not in the manifest")
    elif sha256_bytes(config.read_bytes()) != state.config.sha256:
        problems.append("config.yaml: changed since the run was created")
    problems += _metrics_problems(run, state)
    problems += _trajectory_problems(run, state)
    problems += _checkpoint_problems(run, state)
    return problems, warnings, len(entries)


@dataclass
class RunCheck:
    """The run-level findings of `replay --verify`, printed before its counts."""

    problems: list[str] = field(default_factory=list)
    """One message per problem, the first failure first."""
    warnings: list[str] = field(default_factory=list)
    """What could not be checked."""
    passed: str | None = None
    """What was proven, when nothing failed."""

    @property
    def failed(self) -> bool:
        """Whether any problem was found."""
        return bool(self.problems)

    def lines(self) -> list[str]:
        """One line per problem and warning (or the one line saying what passed)."""
        out = [f"verify run: FAILED: {p}" for p in self.problems]
        out += [f"verify run: WARNING: {w}" for w in self.warnings]
        return out + ([f"verify run: ok: {self.passed}"] if self.passed and not out else [])


def check_run(
    run: Path,
    steps: Mapping[int, Sequence[StoredLine]],
    key: bytes | None,
    whole: bool,
    chosen: Callable[[StoredLine], bool] = lambda line: True,
) -> RunCheck:
    """The manifest checks (only when `whole`: the run is what is verified), then the records'
    cross-checks against `config.yaml`."""
    config = run / "config.yaml"
    facts = RunFacts.from_config_text(config.read_text() if config.exists() else "")
    check, passed = RunCheck(), "records agree with config.yaml"
    if not whole:
        check.warnings.append(
            "--step, --group, --sample or a filter is set: the run as a whole "
            "(its manifest) is not checked"
        )
    elif not (run / MANIFEST).exists():
        check.warnings.append(
            f"no {MANIFEST} (written before runs carried one): unverifiable as "
            "a whole; its records are checked one by one"
        )
    else:
        check.problems, check.warnings, entries = manifest_problems(run, key)
        how = "signed with the key" if key else "sha256, not a signature"
        passed = (
            f"the manifest's {entries} entries chain ({how}) and every piece matches; " + passed
        )
    check.problems += record_problems(steps, facts, chosen)
    check.passed = passed
    return check
