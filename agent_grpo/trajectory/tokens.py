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

`TokenBuilder` builds the sequence turn by turn; `tests/reference_tokens.py` builds it from the
finished conversation in one go, so "builder == from-scratch rendering" is a checkable property.
`agent_grpo.trajectory.invariants.check_invariants` checks a finished `TrajectoryRecord`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from agent_grpo.trajectory.record import Lengths, Message, Provenance, valid_text

__all__ = [
    "ChatTemplateError",
    "Segment",
    "TemplateNotAppendOnlyError",
    "TokenBuilder",
    "TurnEnd",
    "TurnSpan",
    "count_lengths",
    "encode_plain",
    "encode_template",
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


class TemplateNotAppendOnlyError(ChatTemplateError):
    """Rendering a longer conversation changed text that earlier turns were conditioned on."""

    def __init__(self, template: str, position: int, before: str, after: str) -> None:
        self.template = template
        self.position = position
        super().__init__(
            f"chat template {template!r} is not append-only: the rendering after adding messages "
            f"differs from the one before at character {position}: "
            f"before {_snippet(before, position)!r}, after {_snippet(after, position)!r}"
        )


@dataclass(frozen=True)
class Segment:
    """One piece of a rendered conversation: template text, or one message's content."""

    text: str
    """The rendered text of this piece."""
    message: int | None
    """Index of the message whose content this is; None for template text."""


@dataclass(frozen=True)
class TurnSpan:
    """Where one assistant turn's sampled tokens lie in the sequence."""

    index: int
    """0-based turn number."""
    start: int
    """Index of the turn's first model token."""
    end: int
    """Index one past the turn's last model token."""
    model_text: str
    """Decode of the sampled ids minus a trailing turn end: the assistant message content, and
    what `TurnRecord.model_text` must hold."""
    ended_turn: bool
    """Whether the last sampled id is the turn end (`TurnEnd.id`), which the template then does
    not repeat."""


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


def segment_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    generation_prompt: bool,
    template: str = "",
) -> list[Segment]:
    """Cut the rendered conversation into template and content segments (see module docstring)."""
    marker = _slot_marker(messages)
    slotted = [
        m.model_copy(update={"content": f"{marker}{i}{_SLOT_END}"}) for i, m in enumerate(messages)
    ]
    pieces = re.split(
        re.escape(marker) + r"(\d+)" + _SLOT_END, _render(tokenizer, slotted, generation_prompt)
    )
    if [int(p) for p in pieces[1::2]] != list(range(len(messages))):
        raise ChatTemplateError(
            f"chat template {template!r} does not render each message's content exactly once, "
            f"in order (got message order {pieces[1::2]})"
        )
    segments: list[Segment] = []
    for i, between in enumerate(pieces[0::2]):
        if between:
            segments.append(Segment(between, None))
        if i < len(messages):
            segments.append(Segment(messages[i].content, i))
    real = _render(tokenizer, messages, generation_prompt)
    rebuilt = "".join(s.text for s in segments)
    if rebuilt != real:
        pos = _first_difference(rebuilt, real)
        raise ChatTemplateError(
            f"chat template {template!r} does not render content verbatim (it depends on or "
            f"rewrites the content) at character {pos}: {_snippet(real, pos)!r}"
        )
    return segments


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


class TokenBuilder:
    """Append-only token sequence with provenance, built turn by turn by a rollout engine."""

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
        self._ids: list[int] = []
        self._provenance: list[Provenance] = []
        self._logprobs: list[float | None] = []
        self._messages: list[Message] = list(prompt_messages)
        self._spans: list[TurnSpan] = []
        self.prompt_messages_count = len(prompt_messages)
        """How many leading messages are the prompt."""
        segments = segment_conversation(
            tokenizer, self._messages, generation_prompt=True, template=self._template
        )
        for seg in segments:
            encode = encode_template if seg.message is None else encode_plain
            self._append(encode(tokenizer, seg.text), Provenance.PROMPT)
        # The rendered text the tokens stand for; a sampled turn end is left out until its
        # template.
        self._text = "".join(s.text for s in segments)

    def _append(
        self, ids: list[int], provenance: Provenance, logprobs: Sequence[float | None] | None = None
    ) -> None:
        self._ids.extend(ids)
        self._provenance.extend([provenance] * len(ids))
        self._logprobs.extend([None] * len(ids) if logprobs is None else logprobs)

    @property
    def _awaiting_model(self) -> bool:
        return (
            self._messages[-1].role != "assistant"
            or len(self._messages) == self.prompt_messages_count
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
        ended = bool(ids) and ids[-1] == self.turn_end.id
        content = turn_text(self._tok, ids, self.turn_end.id)
        span = TurnSpan(len(self._spans), len(self._ids), len(self._ids) + len(ids), content, ended)
        self._append(ids, Provenance.MODEL, [float(lp) for lp in logprobs])
        self._spans.append(span)
        self._messages.append(Message(role="assistant", content=content))
        self._text += content
        return span

    def add_observations(self, messages: Sequence[Message]) -> None:
        """Append the template and observation tokens of the messages after a model turn."""
        if self._awaiting_model:
            raise ValueError("observations must follow a model turn")
        if not messages or any(m.role == "assistant" for m in messages):
            raise ValueError("observations are one or more non-assistant messages")
        after = [*self._messages, *messages]
        before_text = _render(self._tok, self._messages, generation_prompt=False)
        after_text = _render(self._tok, after, generation_prompt=True)
        self._require_prefix(self._text, before_text)
        self._require_prefix(before_text, after_text)
        segments = segment_conversation(
            self._tok, after, generation_prompt=True, template=self._template
        )
        last_model = next(i for i, s in enumerate(segments) if s.message == len(self._messages) - 1)
        # Text prefixes can agree while slots do not, e.g. when the generation prompt holds text
        # that the template otherwise renders as the start of the assistant content.
        if sum(len(s.text) for s in segments[: last_model + 1]) != len(self._text):
            raise ChatTemplateError(
                f"chat template {self._template!r} renders the last assistant content elsewhere "
                "than after the generation prompt"
            )
        drop = self._spans[-1].ended_turn
        for seg in segments[last_model + 1 :]:
            if seg.message is None:
                ids = encode_template(self._tok, seg.text)
                self._append(
                    _drop_turn_end(ids, self.turn_end.id, self._template) if drop else ids,
                    Provenance.TEMPLATE,
                )
            else:
                if drop:
                    raise ChatTemplateError(f"chat template {self._template!r} has no end of turn")
                self._append(encode_plain(self._tok, seg.text), Provenance.OBSERVATION)
            drop = False
        self._messages = after
        self._text = after_text

    def _require_prefix(self, before: str, after: str) -> None:
        if not after.startswith(before):
            raise TemplateNotAppendOnlyError(
                self._template, _first_difference(before, after), before, after
            )

    @property
    def token_ids(self) -> list[int]:
        """Every token so far: the exact context the engine must be conditioned on next."""
        return list(self._ids)

    @property
    def provenance(self) -> list[Provenance]:
        """Origin of each token."""
        return list(self._provenance)

    @property
    def sampler_logprobs(self) -> list[float | None]:
        """Sampler logprob of each model token; None for every other token."""
        return list(self._logprobs)

    @property
    def messages(self) -> list[Message]:
        """The conversation so far (assistant content is the decode of the sampled ids)."""
        return list(self._messages)

    @property
    def turn_spans(self) -> list[TurnSpan]:
        """Per-turn model spans, in order."""
        return list(self._spans)

    @property
    def context_length(self) -> int:
        """Length of the context the engine is conditioned on next (all of `token_ids`)."""
        return len(self._ids)

    def lengths(self) -> Lengths:
        """Token counts by provenance, and turns taken."""
        return count_lengths(self._provenance, len(self._spans))


def count_lengths(provenance: Sequence[Provenance], turns: int) -> Lengths:
    """Token counts by provenance, and the number of turns."""
    return Lengths(
        prompt=provenance.count(Provenance.PROMPT),
        model=provenance.count(Provenance.MODEL),
        template=provenance.count(Provenance.TEMPLATE),
        observation=provenance.count(Provenance.OBSERVATION),
        total=len(provenance),
        turns=turns,
    )
