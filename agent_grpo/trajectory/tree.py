"""An episode's token tree, built turn by turn: sampled ids kept exactly, forks where history
changes.

Most chat templates only append: the context of turn k+1 is the context of turn k, its sampled
ids, and the tokens of what came back. Then the episode is one row, as before. When the next
context is not an extension of the tokens held (a Qwen3-style template rewrites an earlier turn's
reasoning, a gpt-oss template renders a call from its `tool_calls` otherwise than it was sampled,
a context policy drops or compacts old observations), a new branch starts: the
from-scratch rendering of the new conversation (`tokens.render_branch`), sharing its longest
common prefix with the branch it leaves (`fork_at`). Each branch is one training row.

Every sampled id is trained exactly once: with `model` provenance in the branch it was sampled
in, and as `context` in every later branch (its sampled ids where the template renders them
unchanged, the template's rewrite otherwise). All branches share the episode's reward and
advantage; group statistics count the episode once. Departure from TRL's default drift handling,
which keeps one row and masks the rewritten turns out of the loss: there every rewritten turn
loses its gradient, here every turn keeps it, in the exact context it was sampled in.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from agent_grpo.trajectory.record import (
    Lengths,
    Message,
    Provenance,
    TokenBranch,
    TokenRow,
    TrajectoryRecord,
    TurnRecord,
)
from agent_grpo.trajectory.segments import first_difference
from agent_grpo.trajectory.tokens import (
    ChatTemplateError,
    Piece,
    count_lengths,
    render_branch,
    turn_end_ids,
    turn_text,
)

__all__ = ["TokenBuilder", "TurnSpan"]


@dataclass(frozen=True)
class TurnSpan:
    """Where one assistant turn's sampled tokens lie: in which branch, and where in it."""

    index: int
    """0-based turn number."""
    start: int
    """Index (in its branch) of the turn's first model token."""
    end: int
    """Index one past the turn's last model token."""
    model_text: str
    """Decode of the sampled ids minus a trailing turn end: the assistant message content, and
    what `TurnRecord.model_text` must hold."""
    ended_turn: bool
    """Whether the last sampled id is the turn end (`TurnEnd.id`), which the template then does
    not repeat."""
    branch: int = 0
    """The branch the turn was sampled in (and is trained in)."""

    def record(self, finish_reason: str = "stop", index: int | None = None) -> TurnRecord:
        """The turn's record: where its tokens lie, its text, and why sampling stopped (a
        scripted turn stops by itself). `index` overrides the span's turn number."""
        return TurnRecord(
            index=self.index if index is None else index,
            model_text=self.model_text,
            token_start=self.start,
            token_end=self.end,
            finish_reason=finish_reason,
            branch=self.branch,
        )


@dataclass
class _Branch:
    """One row of the tree while it grows."""

    parent: int
    fork_at: int
    reason: str
    messages: list[Message]
    message_turns: list[int | None]
    ids: list[int] = field(default_factory=list)
    provenance: list[Provenance] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    trained: set[int] = field(default_factory=set)
    closed: bool = False

    def extend(self, pieces: Sequence[Piece]) -> None:
        for piece in pieces:
            self.ids.extend(piece.ids)
            self.provenance.extend([piece.provenance] * len(piece.ids))
            self.logprobs.extend([None] * len(piece.ids))


def _flat(pieces: Sequence[Piece]) -> list[int]:
    return [i for piece in pieces for i in piece.ids]


class TokenBuilder:
    """An episode's token tree with provenance, built turn by turn by a rollout engine."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_messages: Sequence[Message],
        *,
        template_name: str | None = None,
    ) -> None:
        if not prompt_messages:
            raise ValueError("the prompt needs at least one message")
        self._tok = tokenizer
        self._template = template_name or str(tokenizer.name_or_path)
        self.turn_end = turn_end_ids(tokenizer)
        """The ids that end a turn: a sampled `turn_end.id` closes it; a backend stops on
        `turn_end.stop_ids`."""
        self.prompt_messages_count = len(prompt_messages)
        """How many leading messages are the prompt."""
        self._log: list[Message] = list(prompt_messages)
        self._sampled: list[list[int]] = []
        self._spans: list[TurnSpan] = []
        root = _Branch(-1, 0, "", list(prompt_messages), [None] * len(prompt_messages))
        root.extend(self._render(root.messages, root.message_turns, set()))
        self._branches = [root]

    def _render(
        self, messages: Sequence[Message], turns: Sequence[int | None], trained: set[int]
    ) -> list[Piece]:
        return render_branch(
            self._tok,
            messages,
            turns,
            self._sampled,
            trained,
            prompt_messages_count=self.prompt_messages_count,
            turn_end=self.turn_end.id,
            template=self._template,
        )

    @property
    def _current(self) -> _Branch:
        return self._branches[-1]

    @property
    def _awaiting_model(self) -> bool:
        return self._current.messages[-1].role != "assistant" or len(self._log) == (
            self.prompt_messages_count
        )

    def add_model_turn(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> TurnSpan:
        """Append one turn's exact sampled ids (turn end or not) and their sampler logprobs."""
        if not self._awaiting_model:
            raise ValueError("two model turns in a row: add the observations in between first")
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} sampled ids but {len(logprobs)} logprobs")
        for i, lp in enumerate(logprobs):
            if not math.isfinite(lp):
                raise ValueError(f"sampled token {i} of turn {len(self._spans)} has logprob {lp}")
        ids = list(token_ids)
        branch, turn = self._current, len(self._spans)
        ended = bool(ids) and ids[-1] == self.turn_end.id
        content = turn_text(self._tok, ids, self.turn_end.id)
        span = TurnSpan(
            turn,
            len(branch.ids),
            len(branch.ids) + len(ids),
            content,
            ended,
            len(self._branches) - 1,
        )
        branch.ids.extend(ids)
        branch.provenance.extend([Provenance.MODEL] * len(ids))
        branch.logprobs.extend(float(lp) for lp in logprobs)
        message = Message(role="assistant", content=content)
        branch.messages.append(message)
        branch.message_turns.append(turn)
        branch.trained.add(turn)
        self._log.append(message)
        self._sampled.append(ids)
        self._spans.append(span)
        return span

    def action(self, turn: int) -> str:
        """Sampled turn `turn`'s text as an env acts on it: its content without the stop id it
        ended on when that is not the turn end (a tokenizer's EOS, `<|endoftext|>` under a
        ChatML template, Gemma's `<eos>`). The content keeps that id's text: the history renders
        it back to the ids sampled; a verifier comparing answers must not see it."""
        ids = self._sampled[turn]
        if ids and ids[-1] in set(self.turn_end.stop_ids) - {self.turn_end.id}:
            return turn_text(self._tok, ids[:-1], self.turn_end.id)
        return self._spans[turn].model_text

    @property
    def actions(self) -> list[str]:
        """`action` of every sampled turn, in order."""
        return [self.action(turn) for turn in range(len(self._sampled))]

    def add_observations(self, messages: Sequence[Message]) -> None:
        """Append the messages that came back after a model turn (tool results, the user)."""
        if self._awaiting_model:
            raise ValueError("observations must follow a model turn")
        if not messages or any(m.role == "assistant" for m in messages):
            raise ValueError("observations are one or more non-assistant messages")
        branch = self._current
        self._log.extend(messages)
        self._advance(
            [*branch.messages, *messages],
            [*branch.message_turns, *([None] * len(messages))],
            reason=None,
        )

    def replace_messages(self, replacements: Mapping[int, Message | None], reason: str) -> None:
        """Rewrite the current context (`context_messages`) before the next turn: message i
        becomes `replacements[i]` (a summary, a truncated observation) or is dropped (None). Only
        observations after the prompt can be rewritten: turns are sampled ids. The record's
        `messages` keep what really happened; a new branch starts unless nothing changed."""
        messages, turns = self._replaced(replacements)
        self._advance(messages, turns, reason=f"context: {reason}")

    def preview_length(self, replacements: Mapping[int, Message | None]) -> int:
        """The context length `replace_messages(replacements)` would give; nothing changes."""
        messages, turns = self._replaced(replacements)
        return len(_flat(self._render(messages, turns, set())))

    def _replaced(
        self, replacements: Mapping[int, Message | None]
    ) -> tuple[list[Message], list[int | None]]:
        branch = self._current
        if not self._awaiting_model:
            raise ValueError("the context can only be rewritten before a model turn")
        for i, new in replacements.items():
            if not self.prompt_messages_count <= i < len(branch.messages):
                raise ValueError(
                    f"message {i} is not within the {len(branch.messages)} after the "
                    f"{self.prompt_messages_count} prompt messages"
                )
            if branch.messages[i].role == "assistant" or (
                new is not None and new.role == "assistant"
            ):
                raise ValueError(f"message {i}: turns are sampled ids and are never rewritten")
        pairs = zip(branch.messages, branch.message_turns, strict=True)
        kept = [(replacements.get(i, m), turn) for i, (m, turn) in enumerate(pairs)]
        messages = [m for m, _ in kept if m is not None]
        turns = [turn for m, turn in kept if m is not None]
        if messages[-1].role == "assistant":
            raise ValueError("the context must still end with a message for the model")
        return messages, turns

    def _advance(
        self, messages: list[Message], turns: list[int | None], reason: str | None
    ) -> None:
        """Make `messages` the next context: extend the current branch, or fork a new one."""
        branch = self._current
        pieces = self._render(messages, turns, branch.trained)
        ids = _flat(pieces)
        if ids[: len(branch.ids)] == branch.ids:
            held, rest = len(branch.ids), _after(pieces, len(branch.ids))
            if any(p.provenance is Provenance.MODEL for p in rest):
                raise ChatTemplateError(f"chat template {self._template!r} moved a sampled turn")
            branch.extend(rest)
            assert len(branch.ids) == len(ids) and held <= len(ids)
            branch.messages, branch.message_turns = messages, turns
            return
        why_messages = branch.messages
        if not branch.trained:  # it trains nothing (two forks in a row): the new one replaces it
            self._branches.pop()
        else:  # it ends where its last turn does: what follows was never trained on there
            self._close(branch)
        parent = self._branches[branch.parent] if not branch.trained else branch
        pieces = self._render(messages, turns, set())
        fork = _Branch(self._branches.index(parent), 0, "", messages, turns)
        fork.extend(pieces)
        fork.fork_at = first_difference(parent.ids, fork.ids)
        fork.reason = reason or _why(pieces, fork.fork_at, why_messages, messages, turns)
        self._branches.append(fork)

    def _close(self, branch: _Branch) -> None:
        """Cut a branch that is left behind after its last trained turn (ids and messages)."""
        last = max(branch.trained)
        end = self._spans[last].end
        del branch.ids[end:], branch.provenance[end:], branch.logprobs[end:]
        branch.closed = True
        keep = branch.message_turns.index(last) + 1
        branch.messages, branch.message_turns = branch.messages[:keep], branch.message_turns[:keep]

    # ---- what the engine and the record read -------------------------------------------------

    @property
    def token_ids(self) -> list[int]:
        """The current branch's ids: the exact context the engine must be conditioned on next."""
        return list(self._current.ids)

    @property
    def provenance(self) -> list[Provenance]:
        """Origin of each token of the current branch."""
        return list(self._current.provenance)

    @property
    def sampler_logprobs(self) -> list[float | None]:
        """Sampler logprob of each model token of the current branch; None for every other."""
        return list(self._current.logprobs)

    @property
    def messages(self) -> list[Message]:
        """The conversation as it happened: every prompt message, turn (the decode of its
        sampled ids) and observation, whatever the context policy later did to the context."""
        return list(self._log)

    @property
    def context_messages(self) -> list[Message]:
        """The conversation the current branch renders (the context of the next turn)."""
        return list(self._current.messages)

    @property
    def turn_spans(self) -> list[TurnSpan]:
        """Per-turn model spans, in order, each in its branch."""
        return list(self._spans)

    @property
    def context_length(self) -> int:
        """Length of the context the engine is conditioned on next (all of `token_ids`)."""
        return len(self._current.ids)

    @property
    def branch_count(self) -> int:
        """Branches (training rows) so far."""
        return len(self._branches)

    def finish(self) -> None:
        """End the episode: a last branch that never got a turn (the context of a fork the
        episode ended before sampling in) trains nothing and is dropped. Call before building
        its record; nothing may be added after."""
        if len(self._branches) > 1 and not self._branches[-1].trained:
            self._branches.pop()

    @property
    def root_messages_count(self) -> int | None:
        """How many messages branch 0 renders once the episode forked; None until then (all)."""
        root = self._branches[0]
        return len(root.messages) if len(self._branches) > 1 or root.closed else None

    def root(self) -> TokenRow:
        """Branch 0: the record's own arrays."""
        b = self._branches[0]
        return TokenRow(0, list(b.ids), list(b.provenance), list(b.logprobs), None, None)

    def forks(self) -> list[TokenBranch]:
        """Every later branch, as the record stores it."""
        return [
            TokenBranch(
                parent=b.parent,
                fork_at=b.fork_at,
                reason=b.reason,
                messages=b.messages,
                message_turns=b.message_turns,
                token_ids=b.ids,
                provenance=b.provenance,
                sampler_logprobs=b.logprobs,
            )
            for b in self._branches[1:]
        ]

    def lengths(self) -> Lengths:
        """Token counts by provenance over every branch, turns taken and branches."""
        every = [p for b in self._branches for p in b.provenance]
        return count_lengths(every, len(self._spans), len(self._branches))

    def to_record(self, **episode: Any) -> TrajectoryRecord:
        """The finished episode (this calls `finish`) as a record: what the builder holds (the
        messages, branch 0's arrays, the forks, the lengths, and the turns unless `episode`
        gives them, scripted ones stopping by themselves) and the caller's `episode` fields
        (its ids, reward, termination, ...)."""
        self.finish()
        root = self.root()
        held: dict[str, Any] = {
            "messages": self.messages,
            "prompt_messages_count": self.prompt_messages_count,
            "token_ids": root.token_ids,
            "provenance": root.provenance,
            "sampler_logprobs": root.sampler_logprobs,
            "root_messages_count": self.root_messages_count,
            "forks": self.forks(),
            "lengths": self.lengths(),
            "turns": [s.record() for s in self._spans],
        }
        return TrajectoryRecord(**(held | episode))


def _after(pieces: Sequence[Piece], held: int) -> list[Piece]:
    """The pieces past the first `held` ids (a piece that straddles it is cut)."""
    out: list[Piece] = []
    seen = 0
    for piece in pieces:
        if seen + len(piece.ids) > held:
            cut = max(0, held - seen)
            out.append(Piece(piece.ids[cut:], piece.provenance, piece.message, piece.rewritten))
        seen += len(piece.ids)
    return out


def _why(
    pieces: Sequence[Piece],
    position: int,
    before: Sequence[Message],
    after: Sequence[Message],
    turns: Sequence[int | None],
) -> str:
    """Why the rendering of the next context first differs from the branch held at `position`:
    a turn the template rewrote (in the template text around the difference), a message that
    changed, or template text."""
    ends = list(itertools.accumulate(len(p.ids) for p in pieces))
    at = next((k for k, end in enumerate(ends) if end > position), len(pieces) - 1)
    i = pieces[at].message
    if i is not None and not pieces[at].rewritten and (i >= len(before) or before[i] != after[i]):
        return f"message {i} changed"
    # the run of template text and turns around the difference, up to the nearest other content
    lo, hi = at, at
    while lo > 0 and _in_run(pieces[lo - 1], turns):
        lo -= 1
    while hi < len(pieces) - 1 and _in_run(pieces[hi + 1], turns):
        hi += 1
    rewritten = [p.message for p in pieces[lo : hi + 1] if p.rewritten and p.message is not None]
    if rewritten:
        return f"template rewrote turn {turns[rewritten[0]]}"
    return f"template text changed at token {position}"


def _in_run(piece: Piece, turns: Sequence[int | None]) -> bool:
    return piece.message is None or turns[piece.message] is not None
