"""Property tests: random multi-turn conversations with hostile tool outputs, built turn by turn,
satisfy every invariant and equal the from-scratch rendering of the final conversation."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerBase

from agent_grpo.testing.records import builder_record
from agent_grpo.testing.reference_tokens import render_reference
from agent_grpo.trajectory.invariants import check_invariants
from agent_grpo.trajectory.record import Message, Provenance, Termination, TrajectoryRecord
from agent_grpo.trajectory.tokens import encode_plain
from agent_grpo.trajectory.tree import TokenBuilder

EOS = 2
HOSTILE = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>assistant\n",
    "<tool_call>",
    "</tool_call>",
    "<repo_name>",
    "\n",
    "\n\n",
    " ",
    "\t",
    "\r\n",
    "é",
    "日本",
    "🙂",
    "\u200b",
    "\ue000slot0\ue001",  # what the segmenter substitutes for content
    "\x16",  # this tokenizer has no token for byte 0x16: it drops it
    "\U00040000",  # unassigned, UTF-8 lead byte 0xF1 missing from the vocabulary: lossy too
]
# The lossy bytes are left to HOSTILE, so most conversations are lossless and get the text check.
LOSSY = "\x04\x06\x13\x14\x16\x1d"
letters = st.characters(exclude_categories=("Cs", "Cn"), exclude_characters=LOSSY)
text_pieces = st.one_of(st.sampled_from(HOSTILE), st.text(letters, max_size=12))
hostile_text = st.lists(text_pieces, max_size=6).map("".join)


@dataclass
class Turn:
    """One generated turn: the text the engine sampled, whether it sampled EOS, what came back."""

    model_text: str
    eos: bool
    observations: list[Message]


observation = st.builds(
    Message, role=st.sampled_from(["tool", "user"]), content=hostile_text, name=st.none()
)
turns = st.lists(
    st.builds(
        Turn,
        model_text=hostile_text,
        eos=st.booleans(),
        observations=st.lists(observation, min_size=1, max_size=3),
    ),
    min_size=1,
    max_size=8,
)
prompts = st.tuples(st.one_of(st.none(), hostile_text), hostile_text).map(
    lambda p: (
        ([Message(role="system", content=p[0])] if p[0] is not None else [])
        + [Message(role="user", content=p[1])]
    )
)


def build(
    tokenizer: PreTrainedTokenizerBase, prompt: list[Message], turns: list[Turn], end_on_model: bool
) -> tuple[TokenBuilder, list[list[int]], list[list[int]]]:
    """Drive a builder like a rollout engine; returns it, each turn's context and sampled ids."""
    builder, contexts, sampled = TokenBuilder(tokenizer, prompt), [], []
    for k, turn in enumerate(turns):
        # What an engine could sample: any ids, special ones included (they are never re-encoded).
        ids = tokenizer.encode(turn.model_text, add_special_tokens=False) + [EOS] * turn.eos
        contexts.append(builder.token_ids)
        sampled.append(ids)
        builder.add_model_turn(ids, [-0.01 * (i + 1) for i in range(len(ids))])
        if not (end_on_model and k == len(turns) - 1):
            builder.add_observations(turn.observations)
    return builder, contexts, sampled


def round_trips(tokenizer: PreTrainedTokenizerBase, text: str) -> bool:
    """Whether the tokenizer can represent `text` at all (this vocabulary lacks a few bytes)."""
    return tokenizer.decode(encode_plain(tokenizer, text)) == text


def to_record(builder: TokenBuilder) -> TrajectoryRecord:
    """A record holding exactly what the builder built, ended by the turn limit."""
    return builder_record(builder, termination=Termination(kind="truncated", reason="max_turns"))


property_settings = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@property_settings
@given(prompt=prompts, turns=turns, end_on_model=st.booleans())
def test_builder_matches_reference_and_invariants(
    tokenizer: PreTrainedTokenizerBase, prompt: list[Message], turns: list[Turn], end_on_model: bool
) -> None:
    builder, contexts, sampled = build(tokenizer, prompt, turns, end_on_model)
    check_invariants(to_record(builder), tokenizer, contexts=contexts)
    ids, provenance = render_reference(
        tokenizer, builder.messages, sampled, prompt_messages_count=len(prompt)
    )
    assert ids == builder.token_ids
    assert provenance == builder.provenance
    if not all(round_trips(tokenizer, m.content) for m in builder.messages):
        return
    # The ids stand for exactly the rendered conversation (text-level check, no segmentation).
    rendered = tokenizer.apply_chat_template(
        [m.to_template() for m in builder.messages],
        tokenize=False,
        add_generation_prompt=not end_on_model,
    )
    decoded = tokenizer.decode(builder.token_ids)
    assert rendered == decoded if not end_on_model else rendered.startswith(decoded)


@property_settings
@given(prompt=prompts, turns=turns)
def test_observation_and_prompt_content_never_hold_special_ids(
    tokenizer: PreTrainedTokenizerBase, prompt: list[Message], turns: list[Turn]
) -> None:
    builder, _, _ = build(tokenizer, prompt, turns, end_on_model=False)
    specials = set(tokenizer.added_tokens_decoder)
    observed = [
        t
        for t, p in zip(builder.token_ids, builder.provenance, strict=True)
        if p is Provenance.OBSERVATION
    ]
    assert specials.isdisjoint(observed)
    # Every turn header comes from the template: one `<|im_start|>` per rendered message, plus the
    # default system prompt when there is none, plus the generation prompt.
    # (Sampled ids may hold `<|im_start|>` too: the engine is free to sample it.)
    headers = [
        t
        for t, p in zip(builder.token_ids, builder.provenance, strict=True)
        if p is not Provenance.MODEL
    ]
    headers_count = headers.count(1)
    assert headers_count == len(builder.messages) + (prompt[0].role != "system") + 1
