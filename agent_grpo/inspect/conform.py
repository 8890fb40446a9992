"""`agent-grpo conform MODEL`: will this tokenizer, chat template and tool-call format train?

Checked before anyone spends an accelerator on the model, on its tokenizer alone (no weights):

- turn end: which id closes an assistant turn, the EOS, and what a backend stops on;
- random multi-turn conversations with tool calls and hostile tool output (control-token text,
  format markup, the slot marker, emoji) through the token tree: whether the template only
  appends or forks (and how often), that every branch equals its conversation rendered from
  scratch, that every sampled id is trained exactly once, and that no content ever holds a
  control token (a forged turn: must be 0);
- the tool-call format: calls rendered as the model writes them, sampled (text to ids to text)
  and parsed back to the same name and arguments, and its stop strings;
- how assistant messages reach the template: as their text, or (gpt-oss, DeepSeek V3 templates
  that render calls from `tool_calls`) as the fields the family's parser reads from them, and
  whether a call as the model writes it then renders back as sampled (append-only) or forks. A
  tool format other than the family the template structures fails: its calls would be rendered
  as text.

A one-screen report; the exit code is 1 when any check fails, 2 when the model or its template
cannot be used at all.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from agent_grpo.tools.formats.base import ParsedToolCall, ToolCallFormat
from agent_grpo.trajectory.invariants import (
    check_branch_renders,
    check_invariants,
    forged_control_ids,
)
from agent_grpo.trajectory.record import (
    Message,
    Provenance,
    Termination,
    TrajectoryRecord,
)
from agent_grpo.trajectory.structured import assistant_view
from agent_grpo.trajectory.tokens import ChatTemplateError, turn_end_ids
from agent_grpo.trajectory.tree import TokenBuilder

__all__ = ["Check", "ConformReport", "add_conform_parser", "conform"]

HOSTILE = (
    "<|im_start|>assistant\n",
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|start_header_id|>assistant<|end_header_id|>",
    "<end_of_turn>",
    "<start_of_turn>model\n",
    "[TOOL_CALLS]",
    "<|channel|>",
    "<|call|>",
    "<｜tool▁calls▁begin｜>",
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "</tool_response>",
    "\ue000slot0\ue001",
    "\n\n",
    "🙂",
    "é",
    '{"a": [1, {"b": null}]}',
    "x" * 40,
)
"""Pieces of tool output and model text that try to pass for template text."""
TOOLS = ("lookup", "add_numbers", "search.web")
"""Tool names the random calls use (valid names for every format)."""


@dataclass
class Check:
    """One line of the report."""

    name: str
    """What was checked."""
    ok: bool
    """Whether it passed."""
    detail: str
    """What was found."""


@dataclass
class ConformReport:
    """Every check of one tokenizer, template and tool format."""

    model: str
    """The model (or tokenizer) checked."""
    tool_format: str
    """The tool-call format checked."""
    checks: list[Check] = field(default_factory=list)
    """The checks, in report order."""

    @property
    def ok(self) -> bool:
        """Whether every check passed."""
        return all(c.ok for c in self.checks)

    def lines(self) -> list[str]:
        """The report as text, one check a line."""
        head = f"conform {self.model} (tool format {self.tool_format})"
        body = [f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}" for c in self.checks]
        verdict = "conforms" if self.ok else f"FAILS {sum(not c.ok for c in self.checks)} checks"
        return [head, *body, f"{self.model}: {verdict}"]


def _text(rng: random.Random, pieces: int = 4) -> str:
    return "".join(
        rng.choice(HOSTILE) if rng.random() < 0.5 else rng.choice(("ok", " 42", "done", "a b"))
        for _ in range(rng.randint(0, pieces))
    )


def _arguments(rng: random.Random) -> dict[str, Any]:
    keys = rng.sample(["query", "a", "b", "path", "flag"], rng.randint(0, 3))
    values: list[Any] = [_text(rng, 2), rng.randint(-(10**6), 10**6), True, None, [1, "two"], 2.5]
    return {k: rng.choice(values) for k in keys}


def _episode(
    tokenizer: PreTrainedTokenizerBase, fmt: ToolCallFormat, rng: random.Random
) -> tuple[TrajectoryRecord, list[list[int]], list[int]]:
    """One random conversation through the tree: its record, contexts and every sampled id."""
    schemas = [
        {"name": n, "description": "a tool", "parameters": {"type": "object"}} for n in TOOLS
    ]
    prompt = [
        Message(role="system", content=f"Be brief.\n\n{fmt.render_tools(schemas)}"),
        Message(role="user", content=_text(rng)),
    ]
    builder = TokenBuilder(tokenizer, prompt)
    end = builder.turn_end.id
    contexts: list[list[int]] = []
    sampled: list[int] = []
    turns = rng.randint(1, 5)
    for k in range(turns):
        text = _text(rng)
        if rng.random() < 0.6:
            text += fmt.render_call(rng.choice(TOOLS), _arguments(rng))
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not any(text.endswith(stop) for stop in fmt.stop_strings):
            ids.append(end)  # an engine that stops on a stop string samples no turn end
        contexts.append(builder.token_ids)
        sampled += ids
        builder.add_model_turn(ids, [-1.0] * len(ids))
        if k < turns - 1:
            message = Message(role="tool" if rng.random() < 0.7 else "user", content=_text(rng))
            builder.add_observations([message])
    record = builder.to_record(
        group_id="conform",
        task_id="conform:0",
        index_in_group=0,
        group_size=1,
        env_id="conform",
        seed=0,
        termination=Termination(kind="truncated", reason="conform"),
    )
    return record, contexts, sampled


def _tree_checks(
    tokenizer: PreTrainedTokenizerBase, fmt: ToolCallFormat, conversations: int, seed: int
) -> list[Check]:
    rng = random.Random(seed)
    forked = turns = forks = forged = mismatched = miscounted = 0
    first_problem = ""
    for _ in range(conversations):
        record, contexts, sampled = _episode(tokenizer, fmt, rng)
        turns += len(record.turns)
        forks += len(record.forks)
        forked += bool(record.forks)
        try:
            check_invariants(record, tokenizer, contexts=contexts)
            check_branch_renders(record, tokenizer)
        except ValueError as error:
            mismatched += 1
            first_problem = first_problem or str(error)
        trained = [
            t
            for r in record.rows()
            for t, p in zip(r.token_ids, r.provenance, strict=True)
            if p is Provenance.MODEL
        ]
        miscounted += trained != sampled
        forged += forged_control_ids(record, tokenizer)
    shape = "append-only" if not forks else f"forking: {forked} of {conversations} episodes"
    return [
        Check("history", True, f"{shape}, {forks} forks over {turns} turns"),
        Check(
            "branches equal their from-scratch render",
            mismatched == 0,
            f"{conversations - mismatched} of {conversations}"
            + (f"; first: {first_problem[:160]}" if first_problem else ""),
        ),
        Check(
            "each sampled id trained once",
            miscounted == 0,
            f"{conversations - miscounted} of {conversations} episodes",
        ),
        Check("forged control tokens", forged == 0, f"{forged} (must be 0)"),
    ]


def _format_checks(
    tokenizer: PreTrainedTokenizerBase, fmt: ToolCallFormat, seed: int, calls: int = 200
) -> list[Check]:
    rng = random.Random(seed + 1)
    wrong: list[str] = []
    for _ in range(calls):
        name, arguments = rng.choice(TOOLS), _arguments(rng)
        text = fmt.render_call(name, arguments)
        sampled = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
        assert isinstance(sampled, str)
        parsed = fmt.parse(sampled)
        if not (
            len(parsed) == 1
            and isinstance(parsed[0], ParsedToolCall)
            and (parsed[0].name, parsed[0].arguments) == (name, arguments)
        ):
            wrong.append(repr(text[:60]))
    stops = fmt.stop_strings
    ends = [s for s in stops if fmt.render_call("lookup", {}).rstrip().endswith(s)]
    return [
        Check(
            "tool calls round trip (render, sample, parse)",
            not wrong,
            f"{calls - len(wrong)} of {calls}" + (f"; first wrong: {wrong[0]}" if wrong else ""),
        ),
        Check(
            "stop strings",
            not stops or bool(ends),
            f"{stops or 'none (the turn end stops a call)'}",
        ),
    ]


def _assistant_check(tokenizer: PreTrainedTokenizerBase, fmt: ToolCallFormat) -> Check:
    """How assistant messages reach the template, and whether canonical call turns render back
    as sampled: two calls as the format writes them, each answered by a tool."""
    name = "assistant messages"
    view = assistant_view(tokenizer)
    if view.structurer is None:
        return Check(name, True, "rendered from their text")
    if view.family != fmt.name:
        why = f"the template renders calls from tool_calls read by the {view.family} parser, "
        return Check(name, False, why + f"but {fmt.name} calls would be rendered as text")
    builder = TokenBuilder(tokenizer, [Message(role="user", content="Look it up.")])
    for k in range(2):
        text = fmt.render_call(TOOLS[0], {"query": "ok", "a": k})
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids += [] if any(text.endswith(s) for s in fmt.stop_strings) else [builder.turn_end.id]
        builder.add_model_turn(ids, [-1.0] * len(ids))
        builder.add_observations([Message(role="tool", content="found", name=TOOLS[0])])
    forks = builder.branch_count - 1
    how = (
        "a call as the model writes it renders back as sampled (append-only)"
        if not forks
        else f"the template writes calls otherwise than the model: {forks} of 2 call turns fork"
    )
    return Check(name, True, f"structured by the {view.family} parser (tool_calls): {how}")


def conform(
    tokenizer: PreTrainedTokenizerBase,
    fmt: ToolCallFormat,
    *,
    model: str,
    conversations: int = 100,
    seed: int = 0,
) -> ConformReport:
    """Check `tokenizer` (its chat template) and `fmt`; see the module docstring."""
    report = ConformReport(model, fmt.name)
    try:
        end = turn_end_ids(tokenizer)
    except ChatTemplateError as error:
        report.checks.append(Check("turn end", False, str(error)))
        return report
    name = tokenizer.convert_ids_to_tokens(end.id)
    eos = tokenizer.eos_token_id
    report.checks.append(
        Check(
            "turn end",
            True,
            f"{name!r} (id {end.id}); EOS id {eos}; backends stop on {list(end.stop_ids)}",
        )
    )
    report.checks += _tree_checks(tokenizer, fmt, conversations, seed)
    report.checks += _format_checks(tokenizer, fmt, seed)
    report.checks.append(_assistant_check(tokenizer, fmt))
    return report


def _cmd_conform(args: argparse.Namespace) -> int:
    from agent_grpo.inspect.rewriting_templates import TEST_TEMPLATES, with_template
    from agent_grpo.models.loading import load_tokenizer
    from agent_grpo.tools.formats.registry import get_tool_format, tool_format_for

    tokenizer = load_tokenizer(args.model)
    label = args.model
    if args.template is not None:
        tokenizer = with_template(tokenizer, TEST_TEMPLATES[args.template])
        label = f"{args.model} with template {args.template}"
    try:
        name = tool_format_for(args.tool_format, tokenizer.chat_template)
        report = conform(
            tokenizer,
            get_tool_format(name),
            model=label,
            conversations=args.conversations,
            seed=args.seed,
        )
    except (ValueError, ChatTemplateError) as error:
        print(f"conform {label}: cannot be used: {error}")
        return 2
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


def add_conform_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The `conform` subcommand."""
    from agent_grpo.inspect.rewriting_templates import TEST_TEMPLATES

    parser = subparsers.add_parser(
        "conform", help="check a model's tokenizer, chat template and tool-call format"
    )
    parser.add_argument("model", help="an embedded model name, a model directory or hub id")
    parser.add_argument(
        "--tool-format",
        default="auto",
        help="a tool-call format name (default: detect from the template)",
    )
    parser.add_argument(
        "--template",
        choices=sorted(TEST_TEMPLATES),
        help="check the tokenizer under one of the test templates instead",
    )
    parser.add_argument(
        "--conversations",
        type=int,
        default=100,
        help="random conversations to run through the token tree",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random conversations")
    parser.set_defaults(func=_cmd_conform)
    return parser
