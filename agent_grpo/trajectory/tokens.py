"""Token provenance: a multi-turn episode as one token sequence, every token tagged with its origin.

Canonical tokenization of a conversation
----------------------------------------
The chat template renders a conversation to text, which `segments.py` cuts at each message's
content (rendering it again with every content replaced by a slot marker) into segments, in
order:

- template segments: the text between two contents (end of turn, role headers, a default system
  prompt, the generation prompt). Tokenized with special tokens recognized: `<|im_end|>` is one id.
- content segments of prompt and observation messages: tokenized as plain text
  (`split_special_tokens=True`), so a tool output containing `<|im_start|>assistant` becomes
  ordinary text tokens and can never forge a turn.
- model segments: an assistant turn is never tokenized; its ids are the sampled ids, and its
  message content (and `TurnRecord.model_text`) is their decode minus a trailing turn end, with
  lone surrogates replaced (`trajectory.record.valid_text`). The turn end (`turn_end_ids`) is
  the id the chat template writes right after an assistant message's content (ChatML:
  `<|im_end|>`), whatever the tokenizer's EOS is; it is the only id treated as end of turn, and
  backends stop on it. When the sampled ids end with it, the template segment after them starts
  with that same id, dropped there, not repeated. A sampled EOS that is not the turn end is
  content: the template's full closing follows it.

The canonical sequence is the concatenation of every segment tokenized on its own. Where we depart
from common practice: `apply_chat_template(tokenize=True)` tokenizes the whole rendered text in
one go, so BPE may merge across a segment boundary (with SmolLM2, `"user\\n"` followed by content
`"\\n\\nhello"` gives `"\\n\\n" "\\n" "hello"` in one go but `"\\n" | "\\n" "\\n" "hello"` per
segment). We never merge across a boundary: a segment's tokens never depend on what comes after
it, which is what keeps the sequence append-only (the context the engine saw at turn k is exactly
a prefix of the final sequence) and forgery-proof. For ordinary content both agree.

Templates that rewrite history
------------------------------
A Qwen3-style template renders an earlier assistant turn otherwise than it was sampled (it drops
the reasoning, or normalises it); a gpt-oss or DeepSeek V3 template renders a turn from the
structured fields its tool format reads from it (`structured.py`), which may or may not give back
the sampled text. `segment_conversation(rewrites=True)` finds what the template rendered for such
a turn; `render_branch` tokenizes it as plain text with `context` provenance (it is context now,
never trained: the turn was trained where it was sampled), with the template's own markup between
a structured turn's fields as template text, while turns rendered verbatim keep their sampled
ids. A turn whose sampled ids end with the turn end, where the template closes it otherwise
(gpt-oss samples `<|return|>` and writes `<|end|>` in the history), is rendered as the template
writes it too. Tool and user content must still be rendered verbatim (or as `tojson` writes it),
so a rewrite can never forge a control token. How an episode forks into branches when its next
context is no extension of the last is in `tree.py`.

`agent_grpo.trajectory.tree.TokenBuilder` builds an episode turn by turn; `render_branch` of a
branch's own conversation, from scratch, must give that branch's ids (checked in tests and by
`check_branch_renders`). `agent_grpo.trajectory.invariants.check_invariants` checks a finished
`TrajectoryRecord`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from agent_grpo.trajectory.record import Lengths, Message, Provenance, valid_text
from agent_grpo.trajectory.segments import (
    ChatTemplateError,
    Segment,
    segment_conversation,
)

__all__ = [
    "ChatTemplateError",
    "Piece",
    "Segment",
    "TurnEnd",
    "count_lengths",
    "encode_plain",
    "encode_template",
    "env_action",
    "render_branch",
    "segment_conversation",
    "special_ids",
    "turn_end_ids",
    "turn_text",
]


def encode_template(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Tokenize chat-template text, special tokens recognized."""
    return tokenizer.encode(text, add_special_tokens=False)


def encode_plain(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Tokenize content as plain text: special-token text becomes ordinary tokens."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


@dataclass(frozen=True)
class TurnEnd:
    """The ids that end an assistant turn, read off a tokenizer and its chat template."""

    id: int
    """The id the chat template writes right after an assistant message's content (ChatML:
    `<|im_end|>`). A sampled turn ending with it has ended: it is left out of the turn's content
    and the template's own copy is not repeated."""
    stop_ids: tuple[int, ...]
    """Ids a backend stops sampling on, sorted: `id` and the tokenizer's EOS (which a model may
    sample too; when it is not `id` it stays in the turn's content)."""


# A shape every common chat template accepts. The assistant message is last because some templates
# drop the content of earlier ones (reasoning, history).
_PROBE = (Message(role="user", content="hi"), Message(role="assistant", content="ok"))


def special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids of the tokenizer's special tokens, added ones included."""
    added = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return added | set(tokenizer.all_special_ids)


def _closing_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """First id of the template text right after the probe's assistant content, if any."""
    if tokenizer.chat_template is None:
        return None
    segments = segment_conversation(tokenizer, _PROBE, generation_prompt=False)
    after = next(i for i, s in enumerate(segments) if s.message == 1) + 1
    if after == len(segments) or segments[after].message is not None:
        return None
    return next(iter(encode_template(tokenizer, segments[after].text)), None)


def turn_end_ids(tokenizer: PreTrainedTokenizerBase) -> TurnEnd:
    """Where an assistant turn ends: the first id the chat template writes after an assistant
    message's content when that is a special token, else (or without a template) the EOS.

    The one source of truth for the token builder, every backend's stop ids and the warm start's
    expert turns: a tokenizer's EOS need not be the turn end (base-model EOS `<|endoftext|>` with
    a ChatML template, Llama 3's `<|end_of_text|>` and `<|eot_id|>`).
    """
    closing = _closing_id(tokenizer)
    eos = tokenizer.eos_token_id
    if closing is not None and closing in special_ids(tokenizer):
        end = closing
    elif isinstance(eos, int):
        end = eos
    else:
        raise ChatTemplateError(
            f"chat template of {tokenizer.name_or_path!r} closes an assistant turn with no special "
            "token and the tokenizer has no single EOS id: no id can end a turn"
        )
    return TurnEnd(end, tuple(sorted({end} | ({eos} if isinstance(eos, int) else set()))))


def turn_text(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], turn_end: int | None = None
) -> str:
    """A model turn's text: decode of its sampled ids minus a trailing turn end (`turn_end`, by
    default `turn_end_ids(tokenizer).id`), specials kept, lone surrogates (a decoder that passes
    bytes through) replaced by U+FFFD so the text can be stored."""
    end = turn_end_ids(tokenizer).id if turn_end is None else turn_end
    ids = list(ids[:-1]) if list(ids[-1:]) == [end] else list(ids)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert isinstance(text, str)
    return valid_text(text)


def env_action(tokenizer: PreTrainedTokenizerBase, content: str) -> str:
    """A recorded turn's content as the env acted on it (`TokenBuilder.actions`): without the
    text of a stop id that is not the turn end (an EOS such as `<|endoftext|>`) at its end."""
    turn_end = turn_end_ids(tokenizer)
    for stop in set(turn_end.stop_ids) - {turn_end.id}:
        text = tokenizer.decode([stop], skip_special_tokens=False)
        if isinstance(text, str) and text and content.endswith(text):
            return content[: -len(text)]
    return content


def _drop_turn_end(ids: list[int], turn_end: int, template: str) -> list[int]:
    # The turn end is read off a probe conversation; a template may close other turns otherwise.
    if not ids or ids[0] != turn_end:
        raise ChatTemplateError(
            f"the model turn ended with turn-end id {turn_end} but chat template {template!r} "
            f"closes this assistant turn with ids {ids[:4]}"
        )
    return ids[1:]


def _fits(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], turn_end: int, rest: Sequence[Segment]
) -> bool:
    """Whether a turn's sampled ids can stand where the template renders it: they do not end
    with the turn end, or the template text after them starts with it (dropped there, not
    repeated). gpt-oss samples `<|return|>` and closes the same turn with `<|end|>` in history."""
    if list(ids[-1:]) != [turn_end]:
        return True
    after = rest[0] if rest else None
    return (
        after is not None
        and after.message is None
        and encode_template(tokenizer, after.text)[:1] == [turn_end]
    )


@dataclass(frozen=True)
class Piece:
    """A run of ids of one provenance in a rendered branch: one segment, tokenized."""

    ids: list[int]
    """The ids."""
    provenance: Provenance
    """Their origin (one for the whole piece)."""
    message: int | None
    """The message whose content this is; None for template text."""
    rewritten: bool = False
    """An earlier turn the template rendered otherwise than it was sampled."""


def render_branch(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    message_turns: Sequence[int | None],
    sampled: Sequence[Sequence[int]],
    trained: Collection[int],
    *,
    prompt_messages_count: int,
    turn_end: int,
    template: str = "",
) -> list[Piece]:
    """The canonical ids of one branch's conversation, rendered from scratch, as pieces.

    `message_turns[i]` names the turn whose sampled ids (`sampled[turn]`) message i holds, or None.
    A turn the template renders verbatim keeps its sampled ids: `model` when it is in `trained`
    (this branch trains it), else `context`; a turn the template rewrites (or closes otherwise
    than it ended) is its rendered text as plain text, `context`, with the template's markup
    between a structured turn's fields as template text. Prompt content is `prompt`, other
    content `observation`, template text `prompt` before the first turn and `template` after.
    Ending on a non-assistant message, the rendering ends with the generation prompt; ending on a
    turn, it is the rendering of the conversation before that turn (the context it was sampled
    in) followed by its sampled ids.
    """
    ends_on_turn = len(messages) > prompt_messages_count and messages[-1].role == "assistant"
    if ends_on_turn:  # the context that turn was sampled in, then its sampled ids
        head = render_branch(
            tokenizer,
            messages[:-1],
            message_turns[:-1],
            sampled,
            trained,
            prompt_messages_count=prompt_messages_count,
            turn_end=turn_end,
            template=template,
        )
        turn = message_turns[-1]
        if turn is None:
            raise ChatTemplateError("a branch ends on an assistant message that was not sampled")
        kind = Provenance.MODEL if turn in trained else Provenance.CONTEXT
        return [*head, Piece(list(sampled[turn]), kind, len(messages) - 1)]
    segments = segment_conversation(
        tokenizer, messages, generation_prompt=True, template=template, rewrites=True
    )
    pieces: list[Piece] = []
    seen_turn, drop = False, False
    work = list(segments)
    while work:
        seg = work.pop(0)
        i = seg.message
        if i is None:
            ids = encode_template(tokenizer, seg.text)
            kind = Provenance.TEMPLATE if seen_turn else Provenance.PROMPT
            pieces.append(Piece(ids[1:] if drop else ids, kind, None))  # `_fits` saw the end
            drop = False
        elif i < prompt_messages_count:
            if seg.parts:  # a structured message of the prompt: its markup and fields
                work[:0] = seg.parts
            else:
                pieces.append(Piece(encode_plain(tokenizer, seg.text), Provenance.PROMPT, i))
        elif messages[i].role == "assistant":
            seen_turn = True
            turn = message_turns[i]
            if (
                turn is not None
                and not seg.rewritten
                and _fits(tokenizer, sampled[turn], turn_end, work)
            ):
                ids = list(sampled[turn])
                kind = Provenance.MODEL if turn in trained else Provenance.CONTEXT
                pieces.append(Piece(ids, kind, i))
                drop = ids[-1:] == [turn_end]
            elif seg.parts:  # the template's text of the turn: its markup and its fields
                work[:0] = seg.parts
            else:
                ids = encode_plain(tokenizer, seg.text)
                rewritten = seg.rewritten or turn is not None
                pieces.append(Piece(ids, Provenance.CONTEXT, i, rewritten=rewritten))
        else:
            pieces.append(Piece(encode_plain(tokenizer, seg.text), Provenance.OBSERVATION, i))
    return pieces


def count_lengths(provenance: Sequence[Provenance], turns: int, branches: int = 1) -> Lengths:
    """Token counts by provenance (over every branch's tokens), turns and branches."""
    return Lengths(
        prompt=provenance.count(Provenance.PROMPT),
        model=provenance.count(Provenance.MODEL),
        template=provenance.count(Provenance.TEMPLATE),
        observation=provenance.count(Provenance.OBSERVATION),
        context=provenance.count(Provenance.CONTEXT),
        total=len(provenance),
        turns=turns,
        branches=branches,
    )
