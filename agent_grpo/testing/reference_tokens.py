"""The reference of the token builder: a finished conversation's ids and provenance,
rendered from scratch in one go (what `TokenBuilder` must equal, built turn by turn)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from agent_grpo.trajectory.record import Message, Provenance
from agent_grpo.trajectory.tokens import (
    _drop_turn_end,
    encode_plain,
    encode_template,
    segment_conversation,
    turn_end_ids,
)


def render_reference(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    model_token_ids_per_turn: Sequence[Sequence[int]],
    *,
    prompt_messages_count: int,
) -> tuple[list[int], list[Provenance]]:
    """Canonical ids and provenance of a finished conversation, rendered from scratch in one go."""
    turn_end = turn_end_ids(tokenizer).id
    ends_on_model = len(messages) > prompt_messages_count and messages[-1].role == "assistant"
    segments = segment_conversation(tokenizer, messages, generation_prompt=not ends_on_model)
    if ends_on_model:  # the closing of the last turn has not been appended yet
        segments = segments[
            : next(i for i, s in enumerate(segments) if s.message == len(messages) - 1) + 1
        ]
    turns = iter(model_token_ids_per_turn)
    ids: list[int] = []
    provenance: list[Provenance] = []
    seen_model, drop = False, False
    for seg in segments:
        if seg.message is None:
            piece = encode_template(tokenizer, seg.text)
            piece = _drop_turn_end(piece, turn_end, "") if drop else piece
            kind = Provenance.TEMPLATE if seen_model else Provenance.PROMPT
        elif seg.message < prompt_messages_count:
            piece, kind = encode_plain(tokenizer, seg.text), Provenance.PROMPT
        elif messages[seg.message].role == "assistant":
            piece, kind = list(next(turns)), Provenance.MODEL
            seen_model = True
        else:
            piece, kind = encode_plain(tokenizer, seg.text), Provenance.OBSERVATION
        drop = kind is Provenance.MODEL and piece[-1:] == [turn_end]
        ids.extend(piece)
        provenance.extend([kind] * len(piece))
    if next(turns, None) is not None:
        raise ValueError("more model turns than assistant messages after the prompt")
    return ids, provenance
