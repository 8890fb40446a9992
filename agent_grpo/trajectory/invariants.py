"""Invariants checked on every trajectory record, cheap enough to leave on during training.

Each failure names the record (`uid`), the branch when it is not the record's own arrays, and the
token position. On every row (branch 0 and each fork): array lengths agree; the loss mask is
exactly the model tokens; every model token, and no other, has a finite sampler logprob. Each turn
lies in one branch, its span decodes to its recorded text, and no model token lies outside every
span, so a sampled token is trained exactly once. A fork shares its first `fork_at` ids with its
parent. Given the contexts the engine was actually conditioned on, each turn's branch starts with
its context (the prefix property). `check_branch_renders` (on in a run with
`rollout.check_renders`) renders every branch's conversation from scratch and compares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from agent_grpo.trajectory.record import Provenance, TokenRow, TrajectoryRecord
from agent_grpo.trajectory.segments import first_difference
from agent_grpo.trajectory.tokens import (
    Piece,
    count_lengths,
    render_branch,
    special_ids,
    turn_end_ids,
    turn_text,
)

__all__ = [
    "TrajectoryInvariantError",
    "branch_pieces",
    "check_branch_renders",
    "check_invariants",
    "forged_control_ids",
]


class TrajectoryInvariantError(ValueError):
    """A trajectory record breaks a token-accounting invariant."""

    def __init__(self, uid: str, position: int | None, message: str, branch: int = 0) -> None:
        self.uid = uid
        self.position = position
        self.branch = branch
        where = "" if position is None else f" at token {position}"
        row = f" branch {branch}" if branch else ""
        super().__init__(f"trajectory {uid}{row}{where}: {message}")


def check_invariants(
    record: TrajectoryRecord,
    tokenizer: PreTrainedTokenizerBase,
    *,
    contexts: Sequence[Sequence[int]] | None = None,
) -> None:
    """Raise TrajectoryInvariantError (uid, branch, position) if the token accounting is off."""
    rows = record.rows()
    for row in rows:
        _check_array_lengths(record.uid, row)
        _check_provenance(record.uid, row, len(tokenizer))
        _check_logprobs(record.uid, row)
    _check_forks(record, rows)
    _check_turns(record, rows, tokenizer)
    if contexts is not None:
        _check_contexts(record, rows, contexts)
    _check_lengths(record, rows)


def _check_array_lengths(uid: str, row: TokenRow) -> None:
    n = len(row.token_ids)
    arrays: dict[str, Sequence[object] | None] = {
        "provenance": row.provenance,
        "sampler_logprobs": row.sampler_logprobs,
        "old_logprobs": row.old_logprobs,
        "ref_logprobs": row.ref_logprobs,
    }
    for name, values in arrays.items():
        if values is not None and len(values) != n:
            raise TrajectoryInvariantError(
                uid,
                min(n, len(values)),
                f"{name} has {len(values)} entries, token_ids {n}",
                row.branch,
            )


def _check_provenance(uid: str, row: TokenRow, vocab_size: int) -> None:
    prompt_over = False
    for i, (tid, prov) in enumerate(zip(row.token_ids, row.provenance, strict=True)):
        if not 0 <= tid < vocab_size:
            raise TrajectoryInvariantError(
                uid, i, f"token id {tid} outside the vocabulary ({vocab_size})", row.branch
            )
        if prov is Provenance.PADDING:
            raise TrajectoryInvariantError(uid, i, "padding inside a stored trajectory", row.branch)
        if prov is Provenance.CONTEXT and row.branch == 0:
            raise TrajectoryInvariantError(uid, i, "a context token in branch 0", row.branch)
        if prov is Provenance.PROMPT and prompt_over:
            raise TrajectoryInvariantError(
                uid, i, "prompt token after the first non-prompt token", row.branch
            )
        prompt_over = prompt_over or prov is not Provenance.PROMPT


def _check_logprobs(uid: str, row: TokenRow) -> None:
    for i, (prov, lp) in enumerate(zip(row.provenance, row.sampler_logprobs, strict=True)):
        if prov is Provenance.MODEL and (lp is None or not math.isfinite(lp)):
            raise TrajectoryInvariantError(
                uid, i, f"model token has sampler logprob {lp}", row.branch
            )
        if prov is not Provenance.MODEL and lp is not None:
            raise TrajectoryInvariantError(
                uid, i, f"{prov.value} token has sampler logprob {lp}", row.branch
            )
    for name, values in (("old_logprobs", row.old_logprobs), ("ref_logprobs", row.ref_logprobs)):
        for i, value in enumerate(values or []):
            if value is not None and not math.isfinite(value):
                raise TrajectoryInvariantError(uid, i, f"{name} holds {value}", row.branch)


def _check_forks(record: TrajectoryRecord, rows: Sequence[TokenRow]) -> None:
    for k, fork in enumerate(record.forks, start=1):
        if not 0 <= fork.parent < k:
            raise TrajectoryInvariantError(
                record.uid, None, f"parent {fork.parent} is not an earlier branch", k
            )
        parent = rows[fork.parent].token_ids
        if not 0 <= fork.fork_at <= min(len(parent), len(fork.token_ids)):
            raise TrajectoryInvariantError(
                record.uid, None, f"fork_at {fork.fork_at} is out of range", k
            )
        if fork.token_ids[: fork.fork_at] != parent[: fork.fork_at]:
            at = first_difference(fork.token_ids, parent)
            raise TrajectoryInvariantError(
                record.uid,
                at,
                f"differs from parent {fork.parent} before fork_at {fork.fork_at}",
                k,
            )
        if len(fork.message_turns) != len(fork.messages):
            raise TrajectoryInvariantError(
                record.uid,
                None,
                f"{len(fork.message_turns)} message_turns for {len(fork.messages)} messages",
                k,
            )
    if record.forks and record.root_messages_count is None:
        raise TrajectoryInvariantError(record.uid, None, "forked, but root_messages_count is unset")


def _check_turns(
    record: TrajectoryRecord, rows: Sequence[TokenRow], tokenizer: PreTrainedTokenizerBase
) -> None:
    uid = record.uid
    turn_end = turn_end_ids(tokenizer).id
    covered = [0] * len(rows)
    for k, turn in enumerate(record.turns):
        b = turn.branch
        if not 0 <= b < len(rows):
            raise TrajectoryInvariantError(
                uid, None, f"turn {k} is in branch {b}, which does not exist"
            )
        ids, prov = rows[b].token_ids, rows[b].provenance
        start, end = turn.token_start, turn.token_end
        if turn.index != k or not covered[b] <= start <= end <= len(ids):
            raise TrajectoryInvariantError(
                uid, start, f"turn {k} span [{start}, {end}) out of order", b
            )
        bad = next((i for i in range(start, end) if prov[i] is not Provenance.MODEL), None)
        if bad is not None:
            raise TrajectoryInvariantError(uid, bad, f"turn {k} span holds a non-model token", b)
        if turn_text(tokenizer, ids[start:end], turn_end) != turn.model_text:
            raise TrajectoryInvariantError(
                uid, start, f"turn {k} model_text is not the decode of its span (minus turn end)", b
            )
        covered[b] = end
    for row in rows:
        in_span = {
            i
            for t in record.turns
            if t.branch == row.branch
            for i in range(t.token_start, t.token_end)
        }
        stray = next(
            (i for i, p in enumerate(row.provenance) if p is Provenance.MODEL and i not in in_span),
            None,
        )
        if stray is not None:
            raise TrajectoryInvariantError(
                uid, stray, "model token outside every turn span", row.branch
            )


def _check_contexts(
    record: TrajectoryRecord, rows: Sequence[TokenRow], contexts: Sequence[Sequence[int]]
) -> None:
    if len(contexts) != len(record.turns):
        raise TrajectoryInvariantError(
            record.uid, None, f"{len(contexts)} contexts for {len(record.turns)} turns"
        )
    for k, (context, turn) in enumerate(zip(contexts, record.turns, strict=True)):
        expected = rows[turn.branch].token_ids[: turn.token_start]
        if list(context) != expected:
            raise TrajectoryInvariantError(
                record.uid,
                first_difference(context, expected),
                f"turn {k} context ({len(context)} ids) is not token_ids[:{turn.token_start}]",
                turn.branch,
            )


def _check_lengths(record: TrajectoryRecord, rows: Sequence[TokenRow]) -> None:
    every = [p for row in rows for p in row.provenance]
    for name, value in count_lengths(every, len(record.turns), len(rows)):
        if getattr(record.lengths, name) != value:
            raise TrajectoryInvariantError(
                record.uid,
                None,
                f"lengths.{name} is {getattr(record.lengths, name)}, tokens say {value}",
            )


def branch_pieces(
    record: TrajectoryRecord, tokenizer: PreTrainedTokenizerBase
) -> list[list[Piece]]:
    """Every branch's own conversation rendered from scratch (`tokens.render_branch`), as pieces,
    in branch order."""
    rows = record.rows()
    sampled = [rows[t.branch].token_ids[t.token_start : t.token_end] for t in record.turns]
    root = record.messages[: record.root_messages_count or len(record.messages)]
    turns = iter(range(len(record.turns)))
    root_turns = [
        next(turns, None) if i >= record.prompt_messages_count and m.role == "assistant" else None
        for i, m in enumerate(root)
    ]
    conversations = [(root, root_turns)] + [(f.messages, f.message_turns) for f in record.forks]
    turn_end = turn_end_ids(tokenizer).id
    return [
        render_branch(
            tokenizer,
            messages,
            message_turns,
            sampled,
            {t.index for t in record.turns if t.branch == row.branch},
            prompt_messages_count=record.prompt_messages_count,
            turn_end=turn_end,
        )
        for row, (messages, message_turns) in zip(rows, conversations, strict=True)
    ]


def check_branch_renders(record: TrajectoryRecord, tokenizer: PreTrainedTokenizerBase) -> None:
    """Raise TrajectoryInvariantError unless every branch's ids and provenance equal the
    from-scratch rendering of its own conversation (`tokens.render_branch`)."""
    for row, pieces in zip(record.rows(), branch_pieces(record, tokenizer), strict=True):
        ids = [i for p in pieces for i in p.ids]
        provenance = [p.provenance for p in pieces for _ in p.ids]
        if ids != row.token_ids or provenance != row.provenance:
            at = min(
                first_difference(ids, row.token_ids), first_difference(provenance, row.provenance)
            )
            raise TrajectoryInvariantError(
                record.uid,
                at,
                "differs from the from-scratch rendering of its conversation",
                row.branch,
            )


def forged_control_ids(record: TrajectoryRecord, tokenizer: PreTrainedTokenizerBase) -> int:
    """Special-token ids inside content over every branch: prompt and observation content, and
    what a template rendered of a rewritten turn (its text, a structured turn's fields). Must
    be 0: only template text and sampled ids may hold a control token."""
    special = special_ids(tokenizer)
    return sum(
        sum(i in special for i in piece.ids)
        for pieces in branch_pieces(record, tokenizer)
        for piece in pieces
        if piece.message is not None
        and (piece.provenance in (Provenance.PROMPT, Provenance.OBSERVATION) or piece.rewritten)
    )
