"""The end of an assistant turn comes from the tokenizer and its chat template, not `eos_token`:
`turn_end_ids`, the token builder, the hf backend's stops, the openai/vLLM stop ids and the warm
start's expert turns, on copies of the real tokenizer whose EOS is not the turn end
(`eos_not_turn_end` in conftest: EOS 0 with turn end 2, and EOS 2 with turn end 0)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from agent_grpo.rollout.backends.base import SamplingConfig
from agent_grpo.rollout.backends.factory import build_backend
from agent_grpo.rollout.backends.hf import HFBackend
from agent_grpo.rollout.config import OpenAIBackendConfig
from agent_grpo.testing.records import builder_record
from agent_grpo.testing.reference_tokens import render_reference
from agent_grpo.trainer.warm_start import expert_record
from agent_grpo.trajectory.invariants import check_branch_renders, check_invariants
from agent_grpo.trajectory.record import Message
from agent_grpo.trajectory.tokens import ChatTemplateError, TurnEnd, env_action, turn_end_ids
from agent_grpo.trajectory.tree import TokenBuilder

IM_END, ENDOFTEXT = 2, 0
PROMPT = [
    Message(role="system", content="You add numbers."),
    Message(role="user", content="What is 2+3?"),
]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
RESULT = Message(role="tool", content="5", name="add")
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def ends(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int]:
    """(turn end, EOS) of a tokenizer from `eos_not_turn_end`."""
    return (IM_END, ENDOFTEXT) if tokenizer.eos_token_id == ENDOFTEXT else (ENDOFTEXT, IM_END)


def render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> str:
    text = tokenizer.apply_chat_template(
        [m.to_template() for m in messages], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(text, str)
    return text


def test_turn_end_is_read_off_the_template(
    tokenizer: PreTrainedTokenizerBase, eos_not_turn_end: PreTrainedTokenizerBase
) -> None:
    assert turn_end_ids(tokenizer) == TurnEnd(IM_END, (IM_END,))
    turn_end, _ = ends(eos_not_turn_end)
    assert turn_end_ids(eos_not_turn_end) == TurnEnd(turn_end, (ENDOFTEXT, IM_END))


def test_a_template_closing_with_plain_text_or_none_falls_back_to_eos(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = PLAIN_TEMPLATE  # "assistant: ok\n": no special token after the content
    assert turn_end_ids(plain) == TurnEnd(IM_END, (IM_END,))
    plain.chat_template = None
    assert turn_end_ids(plain) == TurnEnd(IM_END, (IM_END,))
    plain.chat_template = PLAIN_TEMPLATE
    plain.eos_token = None
    with pytest.raises(ChatTemplateError, match="no id can end a turn"):
        turn_end_ids(plain)


def test_a_sampled_turn_end_closes_the_turn_once(
    eos_not_turn_end: PreTrainedTokenizerBase,
) -> None:
    tok = eos_not_turn_end
    turn_end, _ = ends(tok)
    builder = TokenBuilder(tok, PROMPT)
    contexts = [builder.token_ids]
    ids = [*tok.encode(CALL, add_special_tokens=False), turn_end]
    span = builder.add_model_turn(ids, [-0.5] * len(ids))
    assert span.ended_turn and span.model_text == CALL
    builder.add_observations([RESULT])
    # The sampled turn end is the template's: one copy, and the text is the plain rendering.
    got = builder.token_ids
    assert got[span.end - 1] == turn_end and got[span.end] != turn_end
    conversation = [*PROMPT, Message(role="assistant", content=CALL), RESULT]
    assert tok.decode(got) == render(tok, conversation)
    contexts.append(got)
    answer = [*tok.encode("5", add_special_tokens=False), turn_end]
    builder.add_model_turn(answer, [-0.25] * len(answer))
    record = builder_record(builder)
    check_invariants(record, tok, contexts=contexts)
    reference = render_reference(
        tok, builder.messages, [ids, answer], prompt_messages_count=len(PROMPT)
    )
    assert reference == (builder.token_ids, builder.provenance)


def test_a_sampled_eos_that_is_not_the_turn_end_is_content(
    eos_not_turn_end: PreTrainedTokenizerBase,
) -> None:
    tok = eos_not_turn_end
    turn_end, eos = ends(tok)
    builder = TokenBuilder(tok, PROMPT)
    ids = [*tok.encode("5", add_special_tokens=False), eos]
    span = builder.add_model_turn(ids, [-0.5, -0.5])
    assert not span.ended_turn and span.model_text == "5" + tok.decode([eos])
    builder.add_observations([Message(role="user", content="Sure?")])
    # The template closes the turn in full after the sampled EOS.
    assert builder.token_ids[span.end - 1 : span.end + 1] == [eos, turn_end]
    check_invariants(builder_record(builder), tok)
    reference = render_reference(tok, builder.messages, [ids], prompt_messages_count=len(PROMPT))
    assert reference == (builder.token_ids, builder.provenance)
    # what the env acts on is the model's words: an exact-match verifier once saw "5<eos>"
    again = builder.add_model_turn([*tok.encode("6", add_special_tokens=False), turn_end], [-1, -1])
    assert builder.actions == ["5", "6"] and again.model_text == "6"
    # and `replay --verify` re-runs the env on the same words, from the recorded text
    assert [env_action(tok, m.content) for m in builder.messages[2::2]] == ["5", "6"]


def test_a_template_closing_turns_unlike_how_they_ended_forks(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    # `<|im_end|>` without a system message (what `turn_end_ids` probes), `<|endoftext|>` with
    # one, as gpt-oss samples `<|return|>` and writes `<|end|>` in the history: merging the
    # sampled `<|im_end|>` into that closing would falsify the sequence, so the next context
    # renders the turn as the template writes it, in a new branch.
    odd = copy.deepcopy(tokenizer)
    odd.chat_template = (
        "{% set end = '<|endoftext|>' if messages[0]['role'] == 'system' else '<|im_end|>' %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ end }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert turn_end_ids(odd).id == IM_END
    builder = TokenBuilder(odd, PROMPT)
    first = builder.add_model_turn([28, IM_END], [-1.0, -1.0])
    builder.add_observations([RESULT])
    assert builder.branch_count == 2
    fork = builder.forks()[0]
    # it shares the turn's text (the same id as plain text) and differs at the closing
    assert fork.reason == "template rewrote turn 0" and fork.fork_at == first.start + 1
    # the turn as the template writes it: its text, then the template's own closing
    assert fork.token_ids[first.start : first.start + 3] == [28, ENDOFTEXT, 198]
    builder.add_model_turn([28, IM_END], [-1.0, -1.0])
    record = builder_record(builder)
    check_invariants(record, odd)
    check_branch_renders(record, odd)
    assert [t.branch for t in record.turns] == [0, 1]


@pytest.mark.parametrize("which", ["turn end", "eos"])
def test_hf_backend_stops_on_the_turn_end_and_on_eos(
    tiny_model, eos_not_turn_end: PreTrainedTokenizerBase, which: str
) -> None:
    model, _ = tiny_model
    tok = eos_not_turn_end
    turn_end, eos = ends(tok)
    wanted = turn_end if which == "turn end" else eos

    def prefer(_module: torch.nn.Module, _inputs: object, logits: torch.Tensor) -> torch.Tensor:
        boosted = logits.clone()  # [B, 1, V]
        boosted[..., wanted] += 1e4  # the model wants to end its turn at once
        return boosted

    model.lm_head.register_forward_hook(prefer)
    backend = HFBackend(model, tok)
    assert backend.eos_token_ids == {ENDOFTEXT, IM_END}
    builder = TokenBuilder(tok, PROMPT)
    sampling = SamplingConfig(temperature=0.0, max_tokens=5)
    [generation] = backend.generate([builder.token_ids], sampling, [0])
    assert generation.token_ids == [wanted] and generation.finish_reason == "stop"
    span = builder.add_model_turn(generation.token_ids, generation.logprobs)
    assert span.ended_turn == (wanted == turn_end)


def test_openai_backend_is_built_with_the_turn_end_stops(
    eos_not_turn_end: PreTrainedTokenizerBase,
) -> None:
    config = OpenAIBackendConfig(base_url="http://127.0.0.1:9", model="m")
    backend = build_backend(config, torch.nn.Linear(1, 1), eos_not_turn_end, "unused")
    try:
        assert backend.stop_token_ids == (ENDOFTEXT, IM_END)  # type: ignore[attr-defined]
    finally:
        backend.close()


def test_expert_turns_end_with_the_turn_end(eos_not_turn_end: PreTrainedTokenizerBase) -> None:
    tok = eos_not_turn_end
    turn_end, _ = ends(tok)
    record = expert_record(tok, "agent_grpo/Calculator-v0", seed=3)
    check_invariants(record, tok)
    ids = record.token_ids
    assert len(record.turns) >= 2
    for turn in record.turns:
        assert ids[turn.token_end - 1] == turn_end  # closed by the template's own id, once
        assert ids[turn.token_end : turn.token_end + 1] != [turn_end]
        assert tok.decode([turn_end]) not in turn.model_text
    model_ids = [ids[t.token_start : t.token_end] for t in record.turns]
    reference = render_reference(
        tok, record.messages, model_ids, prompt_messages_count=record.prompt_messages_count
    )
    assert reference == (ids, record.provenance)
