"""Invariants checked on every trajectory record, cheap enough to leave on during training.

Each failure names the record (`uid`) and the token position: array lengths agree; the loss mask is
exactly the model tokens; every model token, and no other, has a finite sampler logprob; each turn's
span decodes to its recorded text; and, given the contexts the engine was actually conditioned on,
the record's tokens start with each of them (the prefix property).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from agent_grpo.trajectory.record import Provenance, TrajectoryRecord
from agent_grpo.trajectory.tokens import _first_difference, count_lengths, turn_end_ids, turn_text

__all__ = ["TrajectoryInvariantError", "check_invariants"]


class TrajectoryInvariantError(ValueError):
    """A trajectory record breaks a token-accounting invariant."""

    def __init__(self, uid: str, position: int | None, message: str) -> None:
        self.uid = uid
        self.position = position
        where = "" if position is None else f" at token {position}"
        super().__init__(f"trajectory {uid}{where}: {message}")


def check_invariants(
    record: TrajectoryRecord,
    tokenizer: PreTrainedTokenizerBase,
    *,
    contexts: Sequence[Sequence[int]] | None = None,
) -> None:
    """Raise TrajectoryInvariantError (uid, position) if the record's token accounting is off."""
    _check_array_lengths(record)
    _check_provenance(record, len(tokenizer))
    _check_logprobs(record)
    _check_turns(record, tokenizer)
    if contexts is not None:
        _check_contexts(record, contexts)
    _check_lengths(record)


def _check_array_lengths(record: TrajectoryRecord) -> None:
    n = len(record.token_ids)
    arrays: dict[str, Sequence[object] | None] = {
        "provenance": record.provenance,
        "sampler_logprobs": record.sampler_logprobs,
        "old_logprobs": record.old_logprobs,
        "ref_logprobs": record.ref_logprobs,
    }
    for name, values in arrays.items():
        if values is not None and len(values) != n:
            raise TrajectoryInvariantError(
                record.uid, min(n, len(values)), f"{name} has {len(values)} entries, token_ids {n}"
            )


def _check_provenance(record: TrajectoryRecord, vocab_size: int) -> None:
    uid, prompt_over = record.uid, False
    for i, (tid, prov, mask) in enumerate(
        zip(record.token_ids, record.provenance, record.loss_mask, strict=True)
    ):
        if not 0 <= tid < vocab_size:
            raise TrajectoryInvariantError(
                uid, i, f"token id {tid} outside the vocabulary ({vocab_size})"
            )
        if prov is Provenance.PADDING:
            raise TrajectoryInvariantError(uid, i, "padding inside a stored trajectory")
        if prov is Provenance.PROMPT and prompt_over:
            raise TrajectoryInvariantError(uid, i, "prompt token after the first non-prompt token")
        prompt_over = prompt_over or prov is not Provenance.PROMPT
        if mask != (prov is Provenance.MODEL):
            raise TrajectoryInvariantError(uid, i, f"loss mask {mask} on a {prov.value} token")


def _check_logprobs(record: TrajectoryRecord) -> None:
    uid = record.uid
    for i, (prov, lp) in enumerate(zip(record.provenance, record.sampler_logprobs, strict=True)):
        if prov is Provenance.MODEL and (lp is None or not math.isfinite(lp)):
            raise TrajectoryInvariantError(uid, i, f"model token has sampler logprob {lp}")
        if prov is not Provenance.MODEL and lp is not None:
            raise TrajectoryInvariantError(uid, i, f"{prov.value} token has sampler logprob {lp}")
    for name in ("old_logprobs", "ref_logprobs"):
        for i, value in enumerate(getattr(record, name) or []):
            if value is not None and not math.isfinite(value):
                raise TrajectoryInvariantError(uid, i, f"{name} holds {value}")


def _check_turns(record: TrajectoryRecord, tokenizer: PreTrainedTokenizerBase) -> None:
    uid, covered = record.uid, 0
    turn_end = turn_end_ids(tokenizer).id
    for k, turn in enumerate(record.turns):
        start, end = turn.token_start, turn.token_end
        if turn.index != k or not covered <= start <= end <= len(record.token_ids):
            raise TrajectoryInvariantError(
                uid, start, f"turn {k} span [{start}, {end}) out of order"
            )
        bad = next(
            (i for i in range(start, end) if record.provenance[i] is not Provenance.MODEL), None
        )
        if bad is not None:
            raise TrajectoryInvariantError(uid, bad, f"turn {k} span holds a non-model token")
        if turn_text(tokenizer, record.token_ids[start:end], turn_end) != turn.model_text:
            raise TrajectoryInvariantError(
                uid, start, f"turn {k} model_text is not the decode of its span (minus turn end)"
            )
        covered = end
    in_span = {i for t in record.turns for i in range(t.token_start, t.token_end)}
    stray = next(
        (i for i, p in enumerate(record.provenance) if p is Provenance.MODEL and i not in in_span),
        None,
    )
    if stray is not None:
        raise TrajectoryInvariantError(uid, stray, "model token outside every turn span")


def _check_contexts(record: TrajectoryRecord, contexts: Sequence[Sequence[int]]) -> None:
    if len(contexts) != len(record.turns):
        raise TrajectoryInvariantError(
            record.uid, None, f"{len(contexts)} contexts for {len(record.turns)} turns"
        )
    for k, (context, turn) in enumerate(zip(contexts, record.turns, strict=True)):
        expected = record.token_ids[: turn.token_start]
        if list(context) != expected:
            raise TrajectoryInvariantError(
                record.uid,
                _first_difference(context, expected),
                f"turn {k} context ({len(context)} ids) is not token_ids[:{turn.token_start}]",
            )


def _check_lengths(record: TrajectoryRecord) -> None:
    for name, value in count_lengths(record.provenance, len(record.turns)):
        if getattr(record.lengths, name) != value:
            raise TrajectoryInvariantError(
                record.uid,
                None,
                f"lengths.{name} is {getattr(record.lengths, name)}, tokens say {value}",
            )
