"""Replay stored trajectories in the terminal: turns, tool calls, rewards, and every token.

The token view colours each token by provenance and shows, for model tokens, the sampler, old
(trainer) and reference logprobs. Its `ratio` is `exp(old - sampler)`: the trainer's probability
of the sampled token over the engine's. It is 1 when engine and trainer agree, so it measures
engine/trainer mismatch, not the PPO ratio of one update (that is always 1 at the first
minibatch). A token is flagged `clipped` when `|ratio - 1| > clip_eps`: engine and trainer disagree
on it by more than the whole PPO clip range, so any importance weight or clipping computed against
the sampler's logprobs is dominated by the mismatch, not by the policy update.

Piped, the view is `PIPED_WIDTH` columns wide unless COLUMNS says otherwise; without colour
(piped, or NO_COLOR) it marks provenance with `PLAIN_MARKS`. `--no-prompt` leaves the prompt
out. Each group's caption is the baseline its advantages used (`agent_grpo.inspect.baseline`),
over the whole group even when a filter shows only some of its members.

Every recorded text (messages, tool calls and results, tokens, reasons) is printed through
`agent_grpo.inspect.visible`: control characters in tool output are shown as escapes, never obeyed
by the terminal, piped or not.

`--verify` checks each record itself (torn lines, content hash, token invariants, duplicates,
complete groups), then replays the environment from the record's seed with the recorded assistant
texts and checks that it reproduces every observation and the reward (`agent_grpo.inspect.verify`),
and checks the run as a whole: its files against `manifest.jsonl`, its records against its config
(`agent_grpo.inspect.verify_run`);
`--recompute-logprobs` scores the record's tokens with a checkpoint and reports how far those
logprobs drift from the recorded ones (`agent_grpo.inspect.curves`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from agent_grpo.inspect.baseline import AdvantageNorm, GroupBaseline, group_baseline
from agent_grpo.inspect.curves import add_inspect_parser
from agent_grpo.inspect.drift import drift_table, logprob_drift, recompute_logprobs
from agent_grpo.inspect.verify import print_report, verify_lines
from agent_grpo.inspect.verify_run import check_run
from agent_grpo.inspect.visible import visible, visible_text
from agent_grpo.run_dir.manifest import run_key
from agent_grpo.run_dir.writer import (
    IndexEntry,
    RecordFilter,
    RunWriter,
    StoredLine,
    select_entries,
)
from agent_grpo.trajectory.record import Provenance, TrajectoryRecord

__all__ = [
    "PIPED_WIDTH",
    "PLAIN_MARKS",
    "PROVENANCE_STYLES",
    "TokenRow",
    "add_inspect_parser",
    "add_replay_parser",
    "cmd_replay",
    "load_run_tokenizer",
    "render_group",
    "render_trajectory",
    "token_rows",
    "top_disagreements",
]

PROVENANCE_STYLES = {
    Provenance.PROMPT: "grey62",
    Provenance.MODEL: "green",
    Provenance.TEMPLATE: "magenta",
    Provenance.OBSERVATION: "cyan",
    Provenance.PADDING: "grey30",
}
"""Colour of each provenance in the token view (the HTML view uses the same names)."""

CLIPPED_STYLE = "bold white on red"
DEFAULT_CLIP_EPS = 0.2

PLAIN_MARKS = {p: f"\u27e6{p.value}\u27e7" for p in Provenance}
"""Without colour (output piped, or NO_COLOR), each run of tokens of one provenance starts with
its mark, e.g. `\u27e6model\u27e7`: brackets a chat template or a tool's JSON does not write."""
CLIPPED_MARKS = ("\u27ea", "\u27eb")
"""Without colour, a clipped token is written between these."""
PIPED_WIDTH = 120
"""Columns when output is not a terminal and COLUMNS is unset (rich's 80 squeezes the token
tables until their numbers wrap)."""


@dataclass(frozen=True)
class TokenRow:
    """One token of a record with the values the token view shows."""

    index: int
    """Position in `token_ids`."""
    token_id: int
    """The token id."""
    text: str
    """The token decoded on its own (a split multi-byte character shows as U+FFFD)."""
    provenance: Provenance
    """Where the token came from."""
    sampler: float | None
    """Sampler (engine) logprob; None off model tokens."""
    old: float | None
    """Trainer logprob under the sampling policy; None when not recorded."""
    ref: float | None
    """Reference-model logprob; None when not recorded."""
    ratio: float | None
    """exp(old - sampler); None unless both exist."""
    advantage: float | None
    """The record's advantage on model tokens, None elsewhere."""
    clipped: bool
    """|ratio - 1| > clip_eps."""


def _at(values: Sequence[float | None] | None, i: int) -> float | None:
    return None if values is None else values[i]


def token_rows(
    record: TrajectoryRecord, tokenizer: Any, clip_eps: float = DEFAULT_CLIP_EPS, branch: int = 0
) -> list[TokenRow]:
    """Every token of one branch of `record` (0: its own arrays) with its text, logprobs, ratio,
    advantage and clip flag."""
    row = record.rows()[branch]
    texts = tokenizer.batch_decode([[t] for t in row.token_ids])
    rows = []
    for i, (tid, prov) in enumerate(zip(row.token_ids, row.provenance, strict=True)):
        sampler, old = row.sampler_logprobs[i], _at(row.old_logprobs, i)
        ratio = math.exp(old - sampler) if old is not None and sampler is not None else None
        model = prov is Provenance.MODEL
        rows.append(
            TokenRow(
                index=i,
                token_id=tid,
                text=texts[i],
                provenance=prov,
                sampler=sampler,
                old=old,
                ref=_at(row.ref_logprobs, i),
                ratio=ratio,
                advantage=record.advantage if model else None,
                clipped=ratio is not None and abs(ratio - 1.0) > clip_eps,
            )
        )
    return rows


def top_disagreements(rows: Sequence[TokenRow], k: int) -> list[TokenRow]:
    """The k tokens where sampler and trainer logprobs differ most (and at all), largest first."""
    scored = [r for r in rows if r.ratio is not None and _gap(r) != 0.0]
    return sorted(scored, key=lambda r: -abs(_gap(r)))[:k]


def _gap(row: TokenRow) -> float:
    assert row.old is not None and row.sampler is not None
    return row.old - row.sampler


def _num(value: float | None, fmt: str = ".4f") -> str:
    return "-" if value is None else format(value, fmt)


# Terminal rendering


def _header(record: TrajectoryRecord) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_row(
        "uid",
        visible_text(record.uid),
        "step",
        str(record.step),
        "task",
        visible_text(record.task_id),
    )
    table.add_row(
        "reward",
        _num(record.reward),
        "advantage",
        _num(record.advantage, "+.4f"),
        "success",
        str(record.success),
    )
    term = record.termination
    table.add_row(
        "termination",
        visible_text(f"{term.kind} ({term.reason})"),
        "env",
        visible_text(record.env_id),
        "seed",
        str(record.seed),
    )
    return table


def _branches_table(record: TrajectoryRecord) -> Table:
    """Where a forked episode's token tree branched, and why (one row per branch)."""
    table = Table(title="token branches (one training row each)", show_lines=False)
    for name in ("branch", "from", "fork at token", "tokens", "turns trained", "why"):
        table.add_column(name)
    rows = record.rows()
    for row in rows:
        fork = record.forks[row.branch - 1] if row.branch else None
        turns = ", ".join(str(t.index) for t in record.turns if t.branch == row.branch) or "-"
        table.add_row(
            f"branch {row.branch}",
            "-" if fork is None else f"branch {fork.parent}",
            "-" if fork is None else str(fork.fork_at),
            str(len(row.token_ids)),
            turns,
            "the episode's start" if fork is None else visible_text(fork.reason),
        )
    return table


def _tool_calls_table(record: TrajectoryRecord, turn_index: int) -> Table | None:
    turns = [t for t in record.turns if t.index == turn_index]
    calls = turns[0].tool_calls if turns else []
    if not calls:
        return None
    table = Table("tool", "arguments", "result / error", show_lines=True, expand=True)
    for call in calls:
        args = call.raw if call.arguments is None else json.dumps(call.arguments)
        outcome = (
            visible_text(call.result or "")
            if call.error is None
            else visible_text(f"[{call.error_kind}] {call.error}", style="red")
        )
        table.add_row(visible_text(call.name), visible_text(args), outcome)
    return table


def _conversation(record: TrajectoryRecord, prompt: bool = True) -> list[RenderableType]:
    """Prompt messages (or one line saying they are hidden), then each turn and observation."""
    parts: list[RenderableType] = []
    if not prompt and record.prompt_messages_count:
        parts.append(
            Text(f"prompt: {record.prompt_messages_count} message(s) hidden (--no-prompt)")
        )
    turn = 0
    for i, message in enumerate(record.messages):
        if i < record.prompt_messages_count:
            if prompt:
                title = visible_text(f"prompt: {message.role}")
                parts.append(Panel(visible_text(message.content), title=title, style="grey62"))
        elif message.role == "assistant":
            detail = [t for t in record.turns if t.index == turn]
            finish = f", finish={detail[0].finish_reason}" if detail else ""
            body: list[RenderableType] = [visible_text(message.content, style="green")]
            calls = _tool_calls_table(record, turn)
            body += [calls] if calls is not None else []
            title = visible_text(f"turn {turn}: assistant{finish}")
            parts.append(Panel(Group(*body), title=title))
            turn += 1
        else:
            name = f" ({message.name})" if message.name else ""
            title = visible_text(f"{message.role}{name}")
            parts.append(Panel(visible_text(message.content, style="cyan"), title=title))
    return parts


def _outcome(record: TrajectoryRecord) -> Panel:
    lines = [
        f"reward {record.reward:.4f}  components {json.dumps(record.reward_components)}",
        f"verifier {json.dumps(record.verifier)}",
        f"termination {record.termination.kind}: {record.termination.reason}",
        f"lengths {record.lengths.model_dump_json()}",
        f"malformed tool calls {record.malformed_tool_calls}",
    ]
    return Panel(visible_text("\n".join(lines)), title="outcome")


def _legend(plain: bool = False) -> Text:
    legend = Text("tokens: ")
    if plain:
        marks = " ".join(PLAIN_MARKS.values())
        return legend.append(
            f"{marks} start a run of that provenance; clipped: {'token'.join(CLIPPED_MARKS)}"
        )
    for prov, style in PROVENANCE_STYLES.items():
        legend.append(f" {prov.value} ", style=style)
    return legend.append(" clipped ", style=CLIPPED_STYLE)


def _inline_tokens(rows: Sequence[TokenRow], plain: bool = False) -> Text:
    """The tokens as one text, coloured by provenance, or with `PLAIN_MARKS` when `plain`."""
    text = Text()
    previous: Provenance | None = None
    for row in rows:
        if plain:
            if row.provenance is not previous:
                text.append(PLAIN_MARKS[row.provenance])
            shown = visible(row.text)
            text.append(shown.join(CLIPPED_MARKS) if row.clipped else shown)
        else:
            style = CLIPPED_STYLE if row.clipped else PROVENANCE_STYLES[row.provenance]
            text.append(visible(row.text), style=style)
        previous = row.provenance
    return text


def _shown_tokens(rows: Sequence[TokenRow], prompt: bool, plain: bool) -> Text:
    """`_inline_tokens` of the rows, the prompt's replaced by a count when `prompt` is False."""
    if prompt:
        return _inline_tokens(rows, plain)
    hidden = sum(r.provenance is Provenance.PROMPT for r in rows)
    text = Text(f"({hidden} prompt tokens hidden)")
    return text.append(
        _inline_tokens([r for r in rows if r.provenance is not Provenance.PROMPT], plain)
    )


def _token_table(rows: Sequence[TokenRow], title: str) -> Table:
    table = Table("#", "id", "token", "sampler", "old", "ref", "ratio", "adv", "clip", title=title)
    for r in rows:
        table.add_row(
            str(r.index),
            str(r.token_id),
            visible_text(repr(r.text)[1:-1], style=PROVENANCE_STYLES[r.provenance]),
            _num(r.sampler),
            _num(r.old),
            _num(r.ref),
            _num(r.ratio),
            _num(r.advantage, "+.3f"),
            Text("CLIP", style=CLIPPED_STYLE) if r.clipped else "",
        )
    return table


def _mismatch_summary(rows: Sequence[TokenRow], clip_eps: float) -> Text:
    gaps = [abs(_gap(r)) for r in rows if r.ratio is not None]
    if not gaps:
        return Text("no trainer logprobs recorded: ratio and clipping unavailable")
    clipped = sum(r.clipped for r in rows)
    return Text(
        f"|old - sampler|: mean {statistics.fmean(gaps):.4f} max {max(gaps):.4f}; "
        f"clipped (|ratio-1| > {clip_eps}) {clipped}/{len(gaps)}"
    )


def render_trajectory(
    record: TrajectoryRecord,
    tokenizer: Any = None,
    *,
    tokens: bool = False,
    clip_eps: float = DEFAULT_CLIP_EPS,
    top_k: int = 10,
    plain: bool = False,
    prompt: bool = True,
) -> RenderableType:
    """One record: header, each turn with its tool calls, the outcome, and optionally tokens.

    `plain` marks provenance with `PLAIN_MARKS` instead of colour (for output without colour);
    `prompt=False` leaves the prompt's messages and tokens out."""
    conversation = _conversation(record, prompt)
    parts: list[RenderableType] = [_header(record), *conversation, _outcome(record)]
    if record.forks:
        parts.append(_branches_table(record))
    if tokens:
        rows = token_rows(record, tokenizer, clip_eps)
        model_rows = [r for r in rows if r.provenance is Provenance.MODEL]
        parts += [_legend(plain), Panel(_shown_tokens(rows, prompt, plain), title="tokens")]
        for branch in range(1, len(record.forks) + 1):
            shown = _shown_tokens(token_rows(record, tokenizer, clip_eps, branch), prompt, plain)
            parts.append(Panel(shown, title=f"tokens of branch {branch}"))
        parts += [_token_table(model_rows, "model tokens"), _mismatch_summary(rows, clip_eps)]
        top = top_disagreements(rows, top_k)
        if top:
            parts.append(_token_table(top, f"top {len(top)} sampler/trainer disagreements"))
    title = visible_text(f"trajectory {record.uid} (step {record.step})")
    return Panel(Group(*parts), title=title)


def render_group(
    records: Sequence[TrajectoryRecord], baseline: GroupBaseline | None = None
) -> Table:
    """A group's samples side by side: reward, advantage, success, termination, lengths. The
    caption is `baseline`: by default that of `records` under GRPO's default norm."""
    baseline = baseline or group_baseline(records)
    title = visible_text(
        f"group {records[0].group_id} (step {records[0].step})" if records else "group"
    )
    table = Table(
        "sample",
        "reward",
        "advantage",
        "success",
        "termination",
        "turns",
        "model tok",
        "tool calls",
        "tool errors",
        "excluded",
        title=title,
        caption=baseline.caption(),
    )
    for r in sorted(records, key=lambda r: r.index_in_group):
        calls = [c for t in r.turns for c in t.tool_calls]
        table.add_row(
            str(r.index_in_group),
            _num(r.reward),
            _num(r.advantage, "+.4f"),
            str(r.success),
            r.termination.kind,
            str(len(r.turns)),
            str(sum(r.loss_mask)),
            str(len(calls)),
            str(sum(c.error is not None for c in calls)),
            visible_text(r.excluded or ""),
        )
    return table


# The `replay` subcommand


def _run_config(run: RunWriter) -> dict[str, Any]:
    import yaml

    config = yaml.safe_load(run.config_text)
    return config if isinstance(config, dict) else {}


def load_run_tokenizer(run: RunWriter) -> Any:
    """The tokenizer named by the run's `config.yaml` (`model: {name_or_path: ...}`)."""
    from agent_grpo.models.loading import load_tokenizer

    name = (_run_config(run).get("model") or {}).get("name_or_path")
    if not name:
        raise SystemExit(f"{run.path}/config.yaml has no model.name_or_path: no tokenizer")
    return load_tokenizer(name)


def run_env_factory(run: RunWriter, trust_code: bool = False) -> Callable[[str], Any]:
    """`make_env` with the run's `env.kwargs` (records keep the env id, not its kwargs). Only
    ids installed code registered, unless `trust_code`: a record's env id or the run's config
    can name any `module:attr`, which making the env would import and call."""
    from agent_grpo.envs.registry import is_registered, make_env

    env = _run_config(run).get("env") or {}
    kwargs = env.get("kwargs") or {}

    def build(env_id: str) -> Any:
        if not trust_code and not is_registered(env_id):
            raise PermissionError(
                f"{env_id!r} is no registered env id: building it would import and run the "
                "code it names; pass --trust-code for a run you trust"
            )
        given = kwargs if env_id == env.get("id") else {}
        if not trust_code and (named := _names_code(given)):
            raise PermissionError(
                f"the run's env.kwargs name code to run ({named}): building the env would run "
                "it; pass --trust-code for a run you trust"
            )
        return make_env(env_id, **given)

    return build


def _names_code(value: Any, key: str = "") -> str | None:
    """Where `value` (a run's env kwargs) names code a built-in env would run, if anywhere: a
    `module:attr` (custom tools, a verifiers taskset) or a server's `command`."""
    if key in ("command", "mcp_server"):
        return key
    if isinstance(value, str) and ":" in value and "://" not in value:
        return repr(value[:80])
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        return None
    for inner_key, inner in items:
        if found := _names_code(inner, str(inner_key)):
            return found
    return None


def _group_arg(text: str) -> str | int:
    return int(text) if text.isdigit() else text


def add_replay_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `replay RUN ...` on an argparse subparsers object."""
    p = subparsers.add_parser("replay", help="show stored trajectories, token by token")
    p.add_argument("run", type=Path, help="run directory")
    p.add_argument(
        "--step",
        type=int,
        help=(
            "step to show (default: the latest); --html: the page holds every step and opens on "
            "this one"
        ),
    )
    p.add_argument("--group", type=_group_arg, help="group id, or g: the g-th group of the step")
    p.add_argument("--sample", type=int, help="index of the sample within its group")
    p.add_argument("--tokens", action="store_true", help="show every token with its logprobs")
    p.add_argument(
        "--no-prompt", action="store_true", help="leave the prompt (its messages and tokens) out"
    )
    p.add_argument("--failed", action="store_true", help="only records not judged solved")
    p.add_argument("--truncated", action="store_true", help="only records ended by a limit")
    p.add_argument("--errors", action="store_true", help="only records with a failed tool call")
    p.add_argument("--reward-min", type=float, help="only records with reward >= X")
    p.add_argument("--reward-max", type=float, help="only records with reward <= X")
    p.add_argument("--clip-eps", type=float, default=DEFAULT_CLIP_EPS, help="|ratio-1| flagged")
    p.add_argument("--html", type=Path, help="write a self-contained HTML page here instead")
    p.add_argument(
        "--trust-code",
        action="store_true",
        help=(
            "--verify: also re-run envs given as `module:Class` paths (a run's records and "
            "config name them; re-running one imports and runs that code)"
        ),
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help=(
            "check the records (every step unless --step: torn lines, content hashes, token "
            "invariants, duplicates, whole groups), re-run the env and compare, check the run "
            "against its manifest.jsonl and the records against config.yaml; exit 1 on any problem"
        ),
    )
    p.add_argument(
        "--recompute-logprobs",
        type=Path,
        metavar="CHECKPOINT",
        help=(
            "score the tokens with this checkpoint (an HF model dir, or a run's "
            "checkpoints/step_N) and report the drift"
        ),
    )
    p.set_defaults(func=cmd_replay)
    return p


def _record_filter(args: argparse.Namespace) -> RecordFilter:
    return RecordFilter(
        failed=args.failed,
        truncated=args.truncated,
        errors=args.errors,
        reward_min=args.reward_min,
        reward_max=args.reward_max,
    )


def _show(
    console: Console, records: list[TrajectoryRecord], args: argparse.Namespace, run: RunWriter
) -> None:
    detailed = args.group is not None or args.sample is not None or args.tokens
    detailed = detailed or _record_filter(args) != RecordFilter()
    tokenizer = load_run_tokenizer(run) if args.tokens else None
    plain = console.no_color or console.color_system is None
    baselines = group_baselines(run, records)
    for key, members in _by_group(records).items():
        console.print(render_group(members, baselines[key]))
        for r in members if detailed else []:
            console.print(
                render_trajectory(
                    r,
                    tokenizer,
                    tokens=args.tokens,
                    clip_eps=args.clip_eps,
                    plain=plain,
                    prompt=not args.no_prompt,
                )
            )


def _by_group(records: Sequence[TrajectoryRecord]) -> dict[tuple[int, str], list[TrajectoryRecord]]:
    groups: dict[tuple[int, str], list[TrajectoryRecord]] = {}
    for r in records:
        groups.setdefault((r.step, r.group_id), []).append(r)
    return groups


def group_baselines(
    run: RunWriter, records: Sequence[TrajectoryRecord]
) -> dict[tuple[int, str], GroupBaseline]:
    """Each shown group's baseline, under the run's `algo` config, over the *whole* group: a
    filter (--failed, --sample) shows some members, but the advantages used them all."""
    norm = AdvantageNorm.from_config(_run_config(run))
    groups = _by_group(records)
    # the index read once for every group shown in part, not once per group (quadratic)
    partial = {key for key, members in groups.items() if len(members) < members[0].group_size}
    entries: dict[tuple[int, str], list[IndexEntry]] = {key: [] for key in partial}
    for entry in run.index() if partial else []:
        entries.get((entry.step, entry.group_id), []).append(entry)
    return {
        key: group_baseline(run.records_of(entries[key]) if key in partial else members, norm)
        for key, members in groups.items()
    }


def _console() -> Console:
    """Rich's console, `PIPED_WIDTH` wide when not a terminal and COLUMNS is unset."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPED_WIDTH
    return console


def _verify(console: Console, run: RunWriter, args: argparse.Namespace) -> int:
    """Scan the chosen steps' files (not the index: a changed line shifts its offsets), check
    the lines --group/--sample/filters choose, print the report; 1 on any problem."""
    steps = run.steps() if args.step is None else [args.step]
    lines = [line for step in steps for line in run.scan_step(step)]
    if not lines:
        console.print("no records match")
        return 1
    entries = [line.entry for line in lines if line.entry is not None]
    picked = select_entries(entries, None, args.group, args.sample, _record_filter(args))
    keys = {(e.file, e.offset) for e in picked}

    def chosen(line: StoredLine) -> bool:
        return (line.file, line.offset) in keys

    envs = run_env_factory(run, args.trust_code)
    report = verify_lines(lines, load_run_tokenizer(run), envs, chosen)
    whole = args.step is None and args.group is None and args.sample is None
    whole = whole and _record_filter(args) == RecordFilter()
    by_step = {
        step: [line for line in lines if line.file == _step_file(run, step)] for step in steps
    }
    checked = check_run(run.path, by_step, run_key(), whole, chosen)
    print_report(console, report, checked.lines())
    return 1 if report.failed or checked.failed else 0


def _step_file(run: RunWriter, step: int) -> str:
    return str(run.trajectory_file(step).relative_to(run.path))


def _write_html(args: argparse.Namespace, run: RunWriter, records: list[TrajectoryRecord]) -> None:
    from agent_grpo.inspect.html import write_html
    from agent_grpo.inspect.pass_at_curves import run_pass_at_curves

    write_html(
        args.html,
        records,
        load_run_tokenizer(run),
        clip_eps=args.clip_eps,
        title=run.run_id,
        open_step=args.step,
        baselines=group_baselines(run, records),
        pass_at=run_pass_at_curves(run),
    )


def _recompute(console: Console, records: list[TrajectoryRecord], checkpoint: Path) -> None:
    from agent_grpo.models.loading import load_model

    # A trainer checkpoint keeps the HF model in `model/` beside its optimizer state.
    nested = checkpoint / "model"
    model = load_model(nested if (nested / "config.json").exists() else checkpoint)
    for r in records:
        console.print(drift_table(r, logprob_drift(r, recompute_logprobs(model, r))))


def cmd_replay(args: argparse.Namespace) -> int:
    """Handler of `replay`: verify the run, or select records, then show, rescore or write
    HTML."""
    run = RunWriter.open(args.run)
    console = _console()
    if args.verify:
        return _verify(console, run, args)
    step = args.step
    if step is None and args.html is None:
        steps = run.steps()
        step = steps[-1] if steps else None
    # The page holds every step (its picker opens on --step); the terminal shows one.
    chosen = None if args.html is not None else step
    records = run.find(chosen, args.group, args.sample, **_record_filter(args).model_dump())
    if not records or (step is not None and all(r.step != step for r in records)):
        console.print("no records match")
        return 1
    if args.html is not None:
        _write_html(args, run, records)
        console.print(f"wrote {args.html}")
        records = [r for r in records if step is None or r.step == step]
    if args.recompute_logprobs is not None:
        _recompute(console, records, args.recompute_logprobs)
    if args.html is None and args.recompute_logprobs is None:
        _show(console, records, args, run)
    return 0
