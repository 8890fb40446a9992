"""`replay --verify`: check each stored record itself, then re-run its environment.

The lines of the chosen steps' trajectory files are read by scanning (`RunWriter.scan_step`), never
through the index, whose byte offsets a grown or shrunk line shifts. Each line gets one outcome,
the first that applies:

- corrupt: torn or unparsable (reported with its byte offset); or its content hash is not the
  hash of its content; or it breaks a token invariant (`check_invariants`: lengths agree, the
  provenance spans, sampler logprobs on model tokens only, each turn's tokens decode to its text);
- duplicated: a later line of the same file with a uid already seen (the first copy is checked);
- diverged: the environment, re-run from the seed with the recorded assistant texts, gives a
  different prompt, observation, termination or reward (`verify_record`);
- not re-run: sound, but its environment cannot be built here (its module does not import, say):
  said once per environment, not as a divergence of each record;
- unverifiable: sound and reproducible, but written without a content hash (an older run), so a
  changed token id that keeps the invariants would pass unseen;
- ok.

Every group with a checked record must also be complete: one readable line for each sample
0..group_size-1. The report ends with the counts; a corrupt, duplicated, diverged or not re-run
record, or an incomplete group, makes the exit status 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rich.console import Console

from agent_grpo.inspect.visible import visible
from agent_grpo.run_dir.writer import StoredLine
from agent_grpo.trajectory.invariants import check_branch_renders, check_invariants
from agent_grpo.trajectory.record import TrajectoryRecord
from agent_grpo.trajectory.tokens import env_action

__all__ = [
    "Divergence",
    "Outcome",
    "Verdict",
    "VerifyReport",
    "incomplete_groups",
    "print_report",
    "record_problems",
    "verify_lines",
    "verify_record",
]

EnvFactory = Callable[[str], Any]


@dataclass(frozen=True)
class Divergence:
    """The first place a re-run environment disagrees with the record."""

    turn: int | None
    """Assistant turn after which it diverged; None for the initial prompt."""
    what: str
    """prompt, observation, reward or error."""
    expected: Any
    """What the record holds."""
    got: Any
    """What the re-run environment produced."""


def _plain(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as `{"role", "content", "name"?}` dicts, whatever type the env returned."""
    out = []
    for m in messages:
        m = m if isinstance(m, dict) else m.model_dump()
        out.append({k: m[k] for k in ("role", "content", "name") if m.get(k) is not None})
    return out


def _recorded_turns(
    record: TrajectoryRecord, tokenizer: Any = None
) -> list[tuple[str, list[dict[str, Any]]]]:
    """(assistant text as the env acted on it, the messages that follow it) for each recorded
    turn; without a tokenizer, the content as recorded."""
    turns: list[tuple[str, list[dict[str, Any]]]] = []
    for message in record.messages[record.prompt_messages_count :]:
        if message.role == "assistant":
            action = (
                message.content if tokenizer is None else env_action(tokenizer, message.content)
            )
            turns.append((action, []))
        elif turns:
            turns[-1][1].append(message.to_template())
    return turns


def _step(env: Any, turn: int, action: str) -> tuple[Any, float, bool] | Divergence:
    """One env step as (observation, reward, ended), or the error as a divergence."""
    try:
        observation, reward, terminated, truncated, _ = env.step(action)
    except Exception as error:  # any env failure is the divergence we report
        return Divergence(turn, "error", "a step", f"{type(error).__name__}: {error}")
    return observation, float(reward), bool(terminated or truncated)


def _replay_turns(env: Any, record: TrajectoryRecord, tokenizer: Any = None) -> Divergence | None:
    turns = _recorded_turns(record, tokenizer)
    for turn, (action, expected) in enumerate(turns):
        result = _step(env, turn, action)
        if isinstance(result, Divergence):
            return result
        observation, reward, ended = result
        last = turn == len(turns) - 1
        if ended and not last:
            return Divergence(turn, "termination", "episode goes on", "env ended the episode")
        # The collector keeps no observation from a final step (or never stepped a cut turn).
        if not (last and not expected) and _plain(observation) != expected:
            return Divergence(turn, "observation", expected, _plain(observation))
        if last and ended:
            expected_reward = record.reward_components.get("verifier", record.reward)
            if not math.isclose(reward, expected_reward, rel_tol=1e-6, abs_tol=1e-9):
                return Divergence(turn, "reward", expected_reward, reward)
        if last and not ended and record.termination.kind == "terminated":
            return Divergence(turn, "termination", "env ends the episode", "episode goes on")
    return None


def verify_record(
    record: TrajectoryRecord, make_env: Callable[[str], Any], tokenizer: Any = None
) -> Divergence | None:
    """Re-run the env from the record's seed with its assistant texts; the first divergence.

    Checks the prompt, every observation, that the env ends exactly after the last turn when the
    record says it did, and the env's final reward against the record's `verifier` component
    (the env's own reward; other sources are added outside the env).
    """
    env = make_env(record.env_id)
    try:
        messages, _ = env.reset(seed=record.seed)
        prompt = [m.to_template() for m in record.messages[: record.prompt_messages_count]]
        if _plain(messages) != prompt:
            return Divergence(None, "prompt", prompt, _plain(messages))
        return _replay_turns(env, record, tokenizer)
    finally:
        env.close()


class Outcome(StrEnum):
    """What verify concluded about one line, worst first."""

    CORRUPT = "corrupt"
    DUPLICATED = "duplicated"
    DIVERGED = "diverged"
    NOT_RERUN = "not re-run"
    UNVERIFIABLE = "unverifiable"
    OK = "ok"


FAILING = frozenset({Outcome.CORRUPT, Outcome.DUPLICATED, Outcome.DIVERGED, Outcome.NOT_RERUN})
"""Outcomes that make `replay --verify` exit 1."""


@dataclass(frozen=True)
class Verdict:
    """What verify found for one line of a trajectory file."""

    line: StoredLine
    """The line checked."""
    outcome: Outcome
    """The worst outcome that applies."""
    problems: tuple[str, ...] = ()
    """One message per problem found; empty when ok."""
    divergence: Divergence | None = None
    """The first difference of the re-run environment, if any."""

    @property
    def where(self) -> str:
        """`{file} byte {offset}`: where the line lies."""
        return f"{self.line.file} byte {self.line.offset}"


@dataclass
class VerifyReport:
    """Every line's verdict, and the groups missing samples."""

    verdicts: list[Verdict] = field(default_factory=list)
    """One per line checked, in file order."""
    incomplete: list[str] = field(default_factory=list)
    """One message per incomplete group."""
    unbuildable: dict[str, str] = field(default_factory=dict)
    """Each environment id of a checked record that cannot be built here: why."""

    def counts(self) -> dict[Outcome, int]:
        """How many lines got each outcome."""
        return {o: sum(v.outcome is o for v in self.verdicts) for o in Outcome}

    @property
    def failed(self) -> bool:
        """Whether any line is corrupt, duplicated, diverged or not re-run, or any group is
        incomplete."""
        return bool(self.incomplete) or any(v.outcome in FAILING for v in self.verdicts)

    def summary(self) -> str:
        """The report's last line: the counts."""
        n = self.counts()
        not_rerun = f", not re-run {n[Outcome.NOT_RERUN]}" if n[Outcome.NOT_RERUN] else ""
        return (
            f"verified {len(self.verdicts)} records: ok {n[Outcome.OK]}, "
            f"diverged {n[Outcome.DIVERGED]}, corrupt {n[Outcome.CORRUPT]}, "
            f"duplicated {n[Outcome.DUPLICATED]}, unverifiable {n[Outcome.UNVERIFIABLE]}"
            f"{not_rerun}; incomplete groups {len(self.incomplete)}"
        )

    def unbuildable_lines(self) -> list[str]:
        """One line per environment that cannot be built, with its records' count."""
        ids = [v.line.record.env_id for v in self.verdicts if v.line.record is not None]
        return [
            f"verify: cannot build environment {env_id} ({why}): its {ids.count(env_id)} "
            "records were checked but not re-run"
            for env_id, why in self.unbuildable.items()
        ]


def _short(digest: str | None) -> str:
    return f"{digest[:16]}..." if digest else "-"


def record_problems(line: StoredLine, tokenizer: Any) -> list[str]:
    """What is wrong with a parsed record itself: its content hash, its token invariants."""
    record = line.record
    assert record is not None
    problems = []
    if line.hash_matches is False:
        problems.append(
            f"content hash mismatch: stored {_short(record.content_hash)}, content hashes to "
            f"{_short(line.computed_hash)}: the record changed after it was written"
        )
    try:
        check_invariants(record, tokenizer)
    except Exception as error:  # a corrupted record can trip any check; it must not stop the rest
        problems.append(f"token invariant broken: {error}")
        return problems
    try:  # every branch, rendered from its messages: edited ids or text disagree
        check_branch_renders(record, tokenizer)
    except Exception as error:
        problems.append(f"tokens and messages disagree: {error}")
    return problems


def _rerun(record: TrajectoryRecord, make_env: EnvFactory, tokenizer: Any) -> Divergence | None:
    try:
        return verify_record(record, make_env, tokenizer)
    except Exception as error:  # env construction or reset failing on a record's env id or seed
        return Divergence(None, "error", "the env to reset", f"{type(error).__name__}: {error}")


def _unbuildable(env_ids: Iterable[str], make_env: EnvFactory) -> dict[str, str]:
    """Each of `env_ids` that `make_env` cannot build, with the error it raised."""
    found = {}
    for env_id in env_ids:
        try:
            make_env(env_id).close()
        except Exception as error:  # an import, a constructor: the same for every record
            found[env_id] = " ".join(f"{type(error).__name__}: {error}".split())
    return found


def _verdict(
    line: StoredLine, tokenizer: Any, make_env: EnvFactory, unbuildable: Container[str] = ()
) -> Verdict:
    if line.record is None:
        return Verdict(line, Outcome.CORRUPT, (line.problem or "unreadable",))
    problems = tuple(record_problems(line, tokenizer))
    rerun = line.record.env_id not in unbuildable
    divergence = _rerun(line.record, make_env, tokenizer) if rerun else None
    if problems:
        outcome = Outcome.CORRUPT
    elif divergence is not None:
        outcome = Outcome.DIVERGED
    elif not rerun:
        outcome = Outcome.NOT_RERUN
    elif line.hash_matches is None:
        outcome = Outcome.UNVERIFIABLE
        problems = ("no content hash (written before records carried one): token ids unchecked",)
    else:
        outcome = Outcome.OK
    return Verdict(line, outcome, problems, divergence)


def _first_copies(lines: Sequence[StoredLine]) -> dict[tuple[str, int], StoredLine]:
    """For each later copy of a uid in the same file, keyed (file, offset): its first copy."""
    first: dict[tuple[str, str], StoredLine] = {}
    copies = {}
    for line in lines:
        if line.record is None:
            continue
        key = (line.file, line.record.uid)
        if key in first:
            copies[(line.file, line.offset)] = first[key]
        else:
            first[key] = line
    return copies


def incomplete_groups(lines: Sequence[StoredLine], groups: set[tuple[str, str]]) -> list[str]:
    """A message for each of `groups` ((file, group id)) without one readable line per sample."""
    members: dict[tuple[str, str], list[TrajectoryRecord]] = {g: [] for g in groups}
    for line in lines:
        if line.record is not None and (line.file, line.record.group_id) in members:
            members[(line.file, line.record.group_id)].append(line.record)
    messages = []
    for (file, group_id), records in sorted(members.items()):
        size = max(r.group_size for r in records)
        indices = sorted({r.index_in_group for r in records})
        missing = sorted(set(range(size)) - set(indices))
        extra = [i for i in indices if not 0 <= i < size]
        if missing or extra:
            beyond = f", outside 0..{size - 1}: {extra}" if extra else ""
            messages.append(
                f"group {group_id} in {file}: INCOMPLETE: samples {indices} of {size}, "
                f"missing {missing}{beyond}"
            )
    return messages


def verify_lines(
    lines: Sequence[StoredLine],
    tokenizer: Any,
    make_env: EnvFactory,
    chosen: Callable[[StoredLine], bool] = lambda line: True,
) -> VerifyReport:
    """Check every chosen line (and every unreadable one: its group is unknown) of `lines`."""
    copies = _first_copies(lines)
    report = VerifyReport()
    env_ids = {line.record.env_id for line in lines if line.record is not None and chosen(line)}
    report.unbuildable = _unbuildable(sorted(env_ids), make_env)
    groups = set()
    for line in lines:
        if line.record is not None and not chosen(line):
            continue
        first = copies.get((line.file, line.offset))
        if first is not None:
            problem = f"a second copy of the record at byte {first.offset}"
            report.verdicts.append(Verdict(line, Outcome.DUPLICATED, (problem,)))
            continue
        report.verdicts.append(_verdict(line, tokenizer, make_env, report.unbuildable))
        if line.record is not None:
            groups.add((line.file, line.record.group_id))
    report.incomplete = incomplete_groups(lines, groups)
    return report


def _verdict_lines(verdict: Verdict) -> list[str]:
    record, found = verdict.line.record, verdict.divergence
    if record is None:
        head = f"verify {verdict.where}: CORRUPT"
    elif verdict.outcome is Outcome.OK:
        return [f"verify {record.uid}: ok"]
    elif verdict.outcome is Outcome.NOT_RERUN:
        return []  # said once for its environment (`VerifyReport.unbuildable_lines`)
    elif verdict.outcome is Outcome.DIVERGED and found is not None:
        head = f"verify {record.uid}: DIVERGES at turn {found.turn} ({found.what})"
    else:
        head = f"verify {record.uid}: {verdict.outcome.value.upper()} at {verdict.where}"
    out = [head, *(f"  {problem}" for problem in verdict.problems)]
    if found is not None:
        if verdict.outcome is not Outcome.DIVERGED:
            out.append(f"  and the env diverges at turn {found.turn} ({found.what})")
        out += [f"  expected: {found.expected!r}", f"  got:      {found.got!r}"]
    return out


def print_report(console: Console, report: VerifyReport, run_lines: Sequence[str] = ()) -> None:
    """Each verdict (problems indented under it), each incomplete group, the run-level lines
    (`agent_grpo.inspect.verify_run`), then the counts."""
    lines = [text for v in report.verdicts for text in _verdict_lines(v)]
    incomplete = [f"verify {m}" for m in report.incomplete]
    for text in [*lines, *report.unbuildable_lines(), *incomplete, *run_lines, report.summary()]:
        # No markup: recorded text is full of brackets that rich would read as style tags; and
        # its control characters are shown, not obeyed (agent_grpo.inspect.visible).
        console.print(visible(text), markup=False, highlight=False, soft_wrap=True)
