"""Cutting a rendered conversation into template text and content: the slots.

The chat template renders a conversation to text. We render it a second time with each message's
content replaced by a unique slot marker; splitting that text at the markers cuts the rendering
into segments, in order: template text (ends of turns, role headers, a default system prompt, the
generation prompt) and each message's content. `tokens.py` says how each is tokenized: template
text with special tokens recognized, content as plain text, sampled turns as their sampled ids.

Templates that rewrite history
------------------------------
A Qwen3-style template renders an earlier assistant turn otherwise than it was sampled (it drops
the reasoning, or normalises it). With `rewrites`, such a turn's rendered text is found between
the template text around its slot (the conversation rendered again with only the other slots
marked) and is a `rewritten` segment; every other content must still be rendered verbatim, so a
rewrite can never forge a control token.

Structured assistant messages
-----------------------------
A template that renders calls from `tool_calls` (gpt-oss, DeepSeek V3: `structured.py`) gets an
assistant turn as fields read from its text, and each field has a slot of its own: the template's
markup between them (`<|call|>`, `<｜tool▁sep｜>`, a call's name) is template text, and every
field (content, reasoning, each call's arguments) is content. A field the template writes through
`tojson` (a call's arguments, gpt-oss's tool output) shows as a quoted marker; its text is then
`json.dumps` of its value, as transformers' `tojson` writes it (tokenized as plain text all the
same). A template that writes a field any other way is refused.

A sampled turn spans template text and fields: it starts where the generation prompt of its
context ends (the template text after the last slot of the conversation before it, rendered with
the generation prompt) and runs on through its fields. When the rendering from there starts with
the turn's text and that text covers every field, the turn is rendered verbatim: one segment of
its text, where its sampled ids go, with `parts`, the same text cut into template text and fields,
for when the ids cannot stand (the template closes the turn otherwise than it ended). When it
does not (the template dropped the analysis, wrote the arguments with other spacing, the call
was in another order), the turn is its fields as `rewritten` segments between template text, and
the token tree forks there (`tree.py`).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from agent_grpo.tools.formats.base import StructuredTurn
from agent_grpo.trajectory.record import Message
from agent_grpo.trajectory.structured import CONTENT, AssistantView, assistant_view

__all__ = ["ChatTemplateError", "Segment", "first_difference", "segment_conversation"]

_SLOT_END = "\ue001"
_SNIPPET = 30


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
    """True for an assistant message (or one field of it) the template rendered otherwise than
    it was sampled (then `text` is what it rendered)."""
    parts: tuple[Segment, ...] = ()
    """For a turn rendered verbatim from its structured fields: the same text as template text
    and fields (marked `rewritten`), which stand in for the sampled ids when those cannot."""


def first_difference(a: Sequence[object], b: Sequence[object]) -> int:
    """The first index where `a` and `b` differ (the shorter length when one extends the other)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _snippet(text: str, position: int) -> str:
    return text[max(0, position - _SNIPPET) : position + _SNIPPET]


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], generation_prompt: bool
) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as error:  # jinja raises anything from TemplateError to TypeError
        name = getattr(tokenizer, "name_or_path", "?")
        roles = ", ".join(str(m["role"]) for m in messages)
        raise ChatTemplateError(
            f"the chat template of {name!r} fails to render {len(messages)} messages "
            f"({roles}): {type(error).__name__}: {error}"
        ) from error
    if not isinstance(text, str):
        raise ChatTemplateError(f"the chat template rendered {type(text).__name__}, not text")
    return text


def _slot_marker(messages: Sequence[Message]) -> str:
    # Grown until no content contains it, so a marker can only come from our own substitution.
    marker = "\ue000slot"
    while any(marker in m.content for m in messages):
        marker += "\ue000"
    return marker


@dataclass(frozen=True)
class _Slot:
    """A slot marker found in a rendering: which field of which message, and whether the
    template wrote it through `tojson` (a quoted marker)."""

    message: int
    field: int
    quoted: bool

    @property
    def ref(self) -> tuple[int, int]:
        return (self.message, self.field)


_Item = str | _Slot
"""A rendering cut at its slots: template text and slots, alternating, text first and last."""
_Slotted = Callable[[int, int], bool]


def _every(message: int, field: int) -> bool:
    return True


def _none(message: int, field: int) -> bool:
    return False


@dataclass(frozen=True)
class _Conversation:
    """The messages, how their template takes assistant messages, and each one's fields."""

    messages: Sequence[Message]
    view: AssistantView
    turns: tuple[StructuredTurn | None, ...]
    """Each assistant message's structured fields; None for a message rendered from its text."""
    marker: str

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> _Conversation:
        view = assistant_view(tokenizer)
        turns = tuple(
            view.structure(m.content) if m.role == "assistant" else None for m in messages
        )
        return cls(messages, view, turns, _slot_marker(messages))

    def values(self, i: int) -> dict[int, Any]:
        """Message i's slotted values by field: its text, or its non-empty structured fields."""
        turn = self.turns[i]
        return {CONTENT: self.messages[i].content} if turn is None else self.view.fields(turn)

    def refs(self) -> list[tuple[int, int]]:
        """Every slot, in order."""
        return [(i, k) for i in range(len(self.messages)) for k in sorted(self.values(i))]

    def plain_assistant(self, i: int) -> bool:
        """An assistant message rendered from its text (whose rendering may rewrite it)."""
        return self.messages[i].role == "assistant" and self.turns[i] is None

    def dicts(self, slotted: _Slotted, count: int | None = None) -> list[dict[str, Any]]:
        """The first `count` messages as the template takes them, the `slotted` fields marked."""
        out = []
        for i, m in enumerate(self.messages[:count]):
            marks = {k: f"{self.marker}{i}.{k}{_SLOT_END}" for k in self.values(i) if slotted(i, k)}
            turn = self.turns[i]
            if turn is not None:
                out.append(self.view.message(turn, marks))
            else:
                out.append(m.to_template() | ({"content": marks[CONTENT]} if marks else {}))
        return out

    def split(self, text: str) -> list[_Item]:
        """`text` cut at its slot markers."""
        pattern = re.escape(self.marker) + r"(\d+)\.(\d+)" + re.escape(_SLOT_END)
        items: list[_Item] = []
        pos = 0
        for found in re.finditer('(")?' + pattern + '(?(1)")', text):
            items += [
                text[pos : found.start()],
                _Slot(int(found[2]), int(found[3]), bool(found[1])),
            ]
            pos = found.end()
        return [*items, text[pos:]]

    def text(self, slot: _Slot) -> str | None:
        """What the template writes for a slot's value; None for what it cannot write as text
        (an arguments object printed without `tojson`)."""
        value = self.values(slot.message).get(slot.field)
        if slot.quoted:
            return json.dumps(value, ensure_ascii=False)
        return value if isinstance(value, str) else None

    def unquoted(self, items: Sequence[_Item], real: str) -> list[_Item]:
        """`items` where a quoted slot holds text the template wrote between literal quotes
        (`"` + content + `"`, not `tojson`): that slot plain, the quotes template text. Seen
        against the rendering `real`, left to right, up to the first place they part."""
        out = list(items)
        pos = 0
        for k, item in enumerate(out):
            if isinstance(item, str):
                if not real.startswith(item, pos):
                    break
                pos += len(item)
                continue
            slot, after = item, out[k + 1]
            assert isinstance(after, str)
            if self._literal(slot, real, pos, after):
                slot = replace(slot, quoted=False)
                out[k - 1], out[k], out[k + 1] = f'{out[k - 1]}"', slot, f'"{after}'
                pos += 1
            pos += len(self.text(slot) or "")
        return out

    def _literal(self, slot: _Slot, real: str, pos: int, after: str) -> bool:
        """Whether the template wrote a quoted slot's text between literal quotes at `pos`."""
        value = self.values(slot.message).get(slot.field)
        if not slot.quoted or not isinstance(value, str):
            return False
        as_json = (self.text(slot) or "") + after
        return not real.startswith(as_json, pos) and real.startswith(f'"{value}"{after}', pos)

    def rebuilt(self, items: Sequence[_Item]) -> str:
        """The rendering `items` stand for, every slot's value written in."""
        return "".join(item if isinstance(item, str) else self.text(item) or "" for item in items)


def segment_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    generation_prompt: bool,
    template: str = "",
    rewrites: bool = False,
) -> list[Segment]:
    """Cut the rendered conversation into template and content segments (module docstring).

    With `rewrites`, an assistant message the template renders differently from its content (a
    Qwen3-style template dropping old reasoning) is a segment of its rendered text, marked
    `rewritten`; every other message's content must still be rendered verbatim.
    """
    conv = _Conversation.of(tokenizer, messages)
    real = _render(tokenizer, conv.dicts(_none), generation_prompt)
    skeleton = conv.unquoted(
        conv.split(_render(tokenizer, conv.dicts(_every), generation_prompt)), real
    )
    order = [item.ref for item in skeleton if isinstance(item, _Slot)]
    in_order = all(a < b for a, b in itertools.pairwise(order))
    missing = [ref for ref in conv.refs() if ref not in order and conv.turns[ref[0]] is None]
    if in_order and not missing:
        rebuilt = conv.rebuilt(skeleton)
        if rebuilt == real and all(
            conv.text(s) is not None for s in skeleton if isinstance(s, _Slot)
        ):
            return _join_turns(tokenizer, conv, _segments(conv, skeleton))
        if not rewrites:
            pos = first_difference(rebuilt, real)
            raise ChatTemplateError(
                f"chat template {template!r} does not render content verbatim (it depends on or "
                f"rewrites the content) at character {pos}: {_snippet(real, pos)!r}"
            )
    elif not rewrites or not in_order or any(messages[i].role != "assistant" for i, _ in missing):
        raise ChatTemplateError(
            f"chat template {template!r} does not render each message's content exactly once, "
            f"in order (got message order {[str(i) for i, _ in order]})"
        )
    segments = _segment_rewritten(tokenizer, conv, skeleton, real, generation_prompt, template)
    return _join_turns(tokenizer, conv, segments)


def _segments(conv: _Conversation, items: Sequence[_Item]) -> list[Segment]:
    """Segments of a rendering whose every slot holds its value as written: template text and
    content, and an empty rewritten segment for a structured message none of whose fields the
    template shows (where exactly its text went is not knowable, and nothing of it is left)."""
    out: list[Segment] = []
    for item in items:
        if isinstance(item, str):
            out += [Segment(item, None)] if item else []
        else:
            out.append(Segment(conv.text(item) or "", item.message))
    return _segments_with_dropped(conv, out)


def _segment_rewritten(
    tokenizer: PreTrainedTokenizerBase,
    conv: _Conversation,
    skeleton: Sequence[_Item],
    real: str,
    generation_prompt: bool,
    template: str,
) -> list[Segment]:
    """Segments of a rendering that rewrites (or drops) assistant content.

    Rendered again with every slot but the plain assistant messages' marked, the text between
    two marked slots is template text with the (rewritten) assistant content inside. The
    all-slotted rendering (`skeleton`) says where in it each assistant slot sits: between the
    same template text.
    """

    def others(i: int, k: int) -> bool:
        return not conv.plain_assistant(i)

    parts = conv.unquoted(
        conv.split(_render(tokenizer, conv.dicts(others), generation_prompt)), real
    )
    slots = [item for item in parts if isinstance(item, _Slot)]
    expected = [s.ref for s in skeleton if isinstance(s, _Slot) and others(*s.ref)]
    rebuilt = conv.rebuilt(parts)
    if [s.ref for s in slots] != expected or rebuilt != real or None in map(conv.text, slots):
        pos = first_difference(rebuilt, real)
        raise ChatTemplateError(
            f"chat template {template!r} does not render content verbatim (other than an "
            f"assistant message's text) at character {pos}: {_snippet(real, pos)!r}"
        )
    regions = _slot_regions(skeleton, conv)
    segments: list[Segment] = []
    bounds = [-1, *(s.message for s in slots), len(conv.messages)]
    for k, (left, right) in enumerate(itertools.pairwise(bounds)):
        inside = [i for i in range(left + 1, right) if conv.plain_assistant(i)]
        text = parts[2 * k]
        assert isinstance(text, str)
        segments.extend(_locate_assistants(text, conv, inside, regions[k], template))
        if k < len(slots):
            segments.append(Segment(conv.text(slots[k]) or "", slots[k].message))
    return _segments_with_dropped(conv, segments)


def _segments_with_dropped(conv: _Conversation, segments: list[Segment]) -> list[Segment]:
    """`segments` with an empty rewritten segment for each message that has none, placed before
    the first content of a later message."""
    shown = {s.message for s in segments}
    out = list(segments)
    for i in range(len(conv.messages)):
        if i not in shown:
            at = next(
                (k for k, s in enumerate(out) if s.message is not None and s.message > i), None
            )
            out.insert(len(out) if at is None else at, Segment("", i, rewritten=True))
    return out


def _slot_regions(skeleton: Sequence[_Item], conv: _Conversation) -> list[list[_Item]]:
    """The all-slotted rendering between consecutive slots of other than plain assistant
    messages: template texts and the plain assistant slots it holds, in order."""
    regions: list[list[_Item]] = [[]]
    for item in skeleton:
        if isinstance(item, str) or conv.plain_assistant(item.message):
            regions[-1].append(item)
        else:
            regions.append([])
    return regions


def _locate_assistants(
    text: str,
    conv: _Conversation,
    inside: Sequence[int],
    region: Sequence[_Item],
    template: str,
) -> list[Segment]:
    """Split `text`, template text holding the plain assistant messages `inside`, into segments.

    An assistant message the template drops entirely becomes an empty rewritten segment at the
    start of the region (where exactly its text went is not knowable, and nothing of it is left).
    """
    shown = [item for item in region if isinstance(item, _Slot)]
    out = [Segment("", i, rewritten=True) for i in inside if i not in {s.message for s in shown}]
    if text == conv.rebuilt(region):
        for item in region:
            if isinstance(item, str):
                out += [Segment(item, None)] if item else []
            else:
                out.append(Segment(conv.text(item) or "", item.message))
        return out
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
            f"chat template {template!r} rewrites assistant message {shown[0].message} in a way "
            "that cannot be located in its rendering"
        )
    body = text[len(before) : len(text) - len(after)]
    written = conv.text(shown[0])
    out += [
        Segment(before, None),
        Segment(body, shown[0].message, rewritten=body != written),
        Segment(after, None),
    ]
    return [seg for seg in out if seg.text or seg.message is not None]


# ---- structured turns ------------------------------------------------------------------------


def _join_turns(
    tokenizer: PreTrainedTokenizerBase, conv: _Conversation, segments: list[Segment]
) -> list[Segment]:
    """Each structured assistant message's field segments, as one verbatim segment of its text
    (with `parts`) where its rendering reproduces it, else marked `rewritten`."""
    out = list(segments)
    for i, turn in enumerate(conv.turns):
        at = [k for k, s in enumerate(out) if s.message == i and s.text]
        if turn is None or not at:
            continue
        out = _join_turn(conv, out, i, at[0], at[-1], _context_tail(tokenizer, conv, i))
    return out


def _context_tail(tokenizer: PreTrainedTokenizerBase, conv: _Conversation, i: int) -> str | None:
    """The template text after the last slot of the conversation before message i, rendered
    with the generation prompt: where a turn sampled as message i begins."""
    if i == 0:
        return None
    try:
        items = conv.split(_render(tokenizer, conv.dicts(_every, count=i), True))
    except ChatTemplateError:
        return None
    tail = items[-1]
    return tail if isinstance(tail, str) else None


def _join_turn(
    conv: _Conversation, out: list[Segment], i: int, a: int, z: int, tail: str | None
) -> list[Segment]:
    """`out` with message i's segments (`a`..`z`) and the template text around them joined."""
    inner = [replace(s, rewritten=True) if s.message == i else s for s in out[a : z + 1]]
    lo = a - 1 if a > 0 and out[a - 1].message is None else a
    hi = z + 2 if z + 1 < len(out) and out[z + 1].message is None else z + 1
    before = out[a - 1].text if lo < a else ""
    after = out[z + 1].text if hi > z + 1 else ""
    cut = len(tail) if tail is not None and before.startswith(tail) else None
    alone = all(s.message in (None, i) for s in inner)
    joined = None
    if cut is not None and alone:
        joined = _verbatim(conv.messages[i].content, i, before[cut:], inner, after)
    if joined is not None:
        new = [Segment(before[:cut], None), *joined]
    elif cut is not None:
        new = [Segment(before[:cut], None), Segment(before[cut:], None), *inner]
        new.append(Segment(after, None))
    else:
        new = [Segment(before, None), *inner, Segment(after, None)]
    kept = [s for s in new if s.text or s.message is not None]
    return [*out[:lo], *kept, *out[hi:]]


def _verbatim(
    sampled: str, i: int, head: str, inner: Sequence[Segment], after: str
) -> list[Segment] | None:
    """The turn's text as one segment when the rendering from where its context ends (`head`,
    its fields and template text `inner`, then `after`) starts with it and it covers every
    field; None otherwise."""
    middle = head + "".join(s.text for s in inner)
    if len(sampled) < len(middle) or not (middle + after).startswith(sampled):
        return None
    rest = len(sampled) - len(middle)
    parts = [Segment(head, None), *inner, Segment(after[:rest], None)]
    kept = tuple(s for s in parts if s.text)
    return [Segment(sampled, i, parts=kept), Segment(after[rest:], None)]
