"""Token provenance: a multi-turn episode as one token sequence, every token tagged with its origin.

Canonical tokenization of a conversation
----------------------------------------
The chat template renders a conversation to text. We render it a second time with each message's
content replaced by a unique slot marker; splitting that text at the markers cuts the rendering
into segments, in order:

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
the reasoning, or normalises it). `segment_conversation(rewrites=True)` finds such a turn's
rendered text between the template text around its slot; `render_branch` tokenizes it as plain
text with `context` provenance (it is context now, never trained: the turn was trained where it
was sampled), while turns rendered verbatim keep their sampled ids. Tool and user content must
still be rendered verbatim, so a rewrite can never forge a control token. How an episode forks
into branches when its next context is no extension of the last is in `tree.py`.

`agent_grpo.trajectory.tree.TokenBuilder` builds an episode turn by turn; `render_branch` of a
branch's own conversation, from scratch, must give that branch's ids (checked in tests and by
`check_branch_renders`). `agent_grpo.trajectory.invariants.check_invariants` checks a finished
`TrajectoryRecord`.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from agent_grpo.trajectory.record import Lengths, Message, Provenance, valid_text

__all__ = [
    "ChatTemplateError",
    "Piece",
    "Segment",
    "TurnEnd",
    "count_lengths",
    "encode_plain",
    "encode_template",
    "render_branch",
    "segment_conversation",
    "turn_end_ids",
    "turn_text",
]

_SLOT_END = "\ue001"
_SNIPPET = 30


def _snippet(text: str, position: int) -> str:
    return text[max(0, position - _SNIPPET) : position + _SNIPPET]


class ChatTemplateError(ValueError):
    """The chat template renders content in a way the provenance builder cannot segment."""


@dataclass(frozen=True)
class Segment:
    """One piece of a rendered conversation: template text, or one message's content."""

    text: str
    """The rendered text of this piece."""
    message: int | None
    """Index of the message whose content this is; None for template text."""
    rewritten: bool = False
    """True for an assistant message the template rendered otherwise than its content (then
    `text` is what it rendered)."""


def encode_template(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Tokenize chat-template text, special tokens recognized."""
    return tokenizer.encode(text, add_special_tokens=False)


def encode_plain(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Tokenize content as plain text: special-token text becomes ordinary tokens."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], generation_prompt: bool
) -> str:
    try:
        text = tokenizer.apply_chat_template(
            [m.to_template() for m in messages],
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )
    except Exception as error:  # jinja raises anything from TemplateError to TypeError
        name = getattr(tokenizer, "name_or_path", "?")
        raise ChatTemplateError(
            f"the chat template of {name!r} fails to render {len(messages)} messages "
            f"({', '.join(m.role for m in messages)}): {type(error).__name__}: {error}"
        ) from error
    if not isinstance(text, str):
        raise ChatTemplateError(f"the chat template rendered {type(text).__name__}, not text")
    return text


def _first_difference(a: Sequence[object], b: Sequence[object]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _slot_marker(messages: Sequence[Message]) -> str:
    # Grown until no content contains it, so a marker can only come from our own substitution.
    marker = "\ue000slot"
    while any(marker in m.content for m in messages):
        marker += "\ue000"
    return marker


def _split_slots(text: str, marker: str) -> list[str]:
    """`text` cut at slot markers: [between, index, between, index, ..., between]."""
    return re.split(re.escape(marker) + r"(\d+)" + _SLOT_END, text)


def _slotted(messages: Sequence[Message], marker: str, which: Sequence[int]) -> list[Message]:
    keep = set(which)
    return [
        m.model_copy(update={"content": f"{marker}{i}{_SLOT_END}"}) if i in keep else m
        for i, m in enumerate(messages)
    ]


def segment_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    generation_prompt: bool,
    template: str = "",
    rewrites: bool = False,
) -> list[Segment]:
    """Cut the rendered conversation into template and content segments (see module docstring).

    With `rewrites`, an assistant message the template renders differently from its content (a
    Qwen3-style template dropping old reasoning) is a segment of its rendered text, marked
    `rewritten`; every other message's content must still be rendered verbatim.
    """
    marker = _slot_marker(messages)
    everyone = range(len(messages))
    pieces = _split_slots(
        _render(tokenizer, _slotted(messages, marker, everyone), generation_prompt), marker
    )
    order = [int(p) for p in pieces[1::2]]
    real = _render(tokenizer, messages, generation_prompt)
    if order == list(everyone):
        segments: list[Segment] = []
        for i, between in enumerate(pieces[0::2]):
            if between:
                segments.append(Segment(between, None))
            if i < len(messages):
                segments.append(Segment(messages[i].content, i))
        rebuilt = "".join(s.text for s in segments)
        if rebuilt == real:
            return segments
        if not rewrites:
            pos = _first_difference(rebuilt, real)
            raise ChatTemplateError(
                f"chat template {template!r} does not render content verbatim (it depends on or "
                f"rewrites the content) at character {pos}: {_snippet(real, pos)!r}"
            )
    dropped = set(everyone) - set(order)
    if (
        not rewrites
        or order != sorted(set(order))
        or any(messages[i].role != "assistant" for i in dropped)
    ):
        raise ChatTemplateError(
            f"chat template {template!r} does not render each message's content exactly once, "
            f"in order (got message order {pieces[1::2]})"
        )
    return _segment_rewritten(tokenizer, messages, generation_prompt, template, pieces, real)


def _segment_rewritten(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    generation_prompt: bool,
    template: str,
    slot_pieces: Sequence[str],
    real: str,
) -> list[Segment]:
    """Segments of a rendering that rewrites (or drops) assistant content.

    Rendered again with only the other messages slotted, the text between two of their slots is
    template text with the (rewritten) assistant content inside. The all-slotted rendering
    (`slot_pieces`) says where in it each assistant slot sits: between the same template text.
    """
    marker = _slot_marker(messages)
    others = [i for i, m in enumerate(messages) if m.role != "assistant"]
    parts = _split_slots(
        _render(tokenizer, _slotted(messages, marker, others), generation_prompt), marker
    )
    rebuilt = "".join(
        part if k % 2 == 0 else messages[int(part)].content for k, part in enumerate(parts)
    )
    if [int(p) for p in parts[1::2]] != others or rebuilt != real:
        pos = _first_difference(rebuilt, real)
        raise ChatTemplateError(
            f"chat template {template!r} does not render non-assistant content verbatim at "
            f"character {pos}: {_snippet(real, pos)!r}"
        )
    regions = _slot_regions(slot_pieces, others, len(messages))
    segments: list[Segment] = []
    bounds = [-1, *others, len(messages)]
    for k, (left, right) in enumerate(itertools.pairwise(bounds)):
        inside = range(left + 1, right)
        segments.extend(_locate_assistants(parts[2 * k], messages, inside, regions[k], template))
        if right < len(messages):
            segments.append(Segment(messages[right].content, right))
    return segments


def _slot_regions(
    slot_pieces: Sequence[str], others: Sequence[int], count: int
) -> list[list[str | int]]:
    """The all-slotted rendering between consecutive non-assistant slots: template texts and the
    indices of the assistant slots it holds, in order."""
    regions: list[list[str | int]] = [[]]
    for k, piece in enumerate(slot_pieces):
        if k % 2 == 0:
            regions[-1].append(piece)
        elif int(piece) in others:
            regions.append([])
        else:
            regions[-1].append(int(piece))
    assert len(regions) == len(others) + 1 and count >= len(others)
    return regions


def _locate_assistants(
    text: str,
    messages: Sequence[Message],
    inside: range,
    region: Sequence[str | int],
    template: str,
) -> list[Segment]:
    """Split `text`, template text holding the assistant messages `inside`, into segments.

    An assistant message the template drops entirely becomes an empty rewritten segment at the
    start of the region (where exactly its text went is not knowable, and nothing of it is left).
    """
    shown = [item for item in region if isinstance(item, int)]
    out = [Segment("", i, rewritten=True) for i in inside if i not in shown]
    verbatim = "".join(item if isinstance(item, str) else messages[item].content for item in region)
    if text == verbatim:
        for item in region:
            out.append(
                Segment(item, None)
                if isinstance(item, str)
                else Segment(messages[item].content, item)
            )
        return [seg for seg in out if seg.text or seg.message is not None]
    if len(shown) != 1:
        raise ChatTemplateError(
            f"chat template {template!r} rewrites assistant messages {list(inside)} in a way "
            "that cannot be located in its rendering"
        )
    cut = region.index(shown[0])
    before = "".join(str(item) for item in region[:cut])
    after = "".join(str(item) for item in region[cut + 1 :])
    if (
        not text.startswith(before)
        or not text.endswith(after)
        or len(before) + len(after) > len(text)
    ):
        raise ChatTemplateError(
            f"chat template {template!r} rewrites assistant message {shown[0]} in a way that "
            "cannot be located in its rendering"
        )
    body = text[len(before) : len(text) - len(after)]
    out += [
        Segment(before, None),
        Segment(body, shown[0], rewritten=body != messages[shown[0]].content),
        Segment(after, None),
    ]
    return [seg for seg in out if seg.text or seg.message is not None]


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


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
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
    if closing is not None and closing in _special_ids(tokenizer):
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


def _drop_turn_end(ids: list[int], turn_end: int, template: str) -> list[int]:
    # The turn end is read off a probe conversation; a template may close other turns otherwise.
    if not ids or ids[0] != turn_end:
        raise ChatTemplateError(
            f"the model turn ended with turn-end id {turn_end} but chat template {template!r} "
            f"closes this assistant turn with ids {ids[:4]}"
        )
    return ids[1:]


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
    (this branch trains it), else `context`; a turn the template rewrites is its rendered text as
    plain text, `context`. Prompt content is `prompt`, other content `observation`, template text
    `prompt` before the first turn and `template` after. Ending on a non-assistant message, the
    rendering ends with the generation prompt; ending on a turn, it is the rendering of the
    conversation before that turn (the context it was sampled in) followed by its sampled ids.
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
    for seg in segments:
        i = seg.message
        if i is None:
            ids = encode_template(tokenizer, seg.text)
            ids = _drop_turn_end(ids, turn_end, template) if drop else ids
            kind = Provenance.TEMPLATE if seen_turn else Provenance.PROMPT
            pieces.append(Piece(ids, kind, None))
            drop = False
            continue
        if drop:
            raise ChatTemplateError(f"chat template {template!r} has no end of turn")
        if i < prompt_messages_count:
            pieces.append(Piece(encode_plain(tokenizer, seg.text), Provenance.PROMPT, i))
        elif messages[i].role == "assistant":
            seen_turn = True
            turn = message_turns[i]
            if turn is None or seg.rewritten:
                ids = encode_plain(tokenizer, seg.text)
                pieces.append(Piece(ids, Provenance.CONTEXT, i, rewritten=seg.rewritten))
            else:
                ids = list(sampled[turn])
                kind = Provenance.MODEL if turn in trained else Provenance.CONTEXT
                pieces.append(Piece(ids, kind, i))
                drop = ids[-1:] == [turn_end]
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
