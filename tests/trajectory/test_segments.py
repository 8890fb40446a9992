"""Cutting a rendering at its slots when assistant messages are structured: each field is content,
the markup between them template text, a field written through `tojson` is its JSON text, a
verbatim turn is one segment whose parts cut the same text, and a template that writes a field
its own way is refused."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerBase

from agent_grpo.inspect.rewriting_templates import (
    DEEPSEEK_V3_STYLE,
    TEST_TEMPLATES,
    FamilyTemplate,
    with_template,
)
from agent_grpo.tools.formats import DeepSeekV3ToolCallFormat, HarmonyToolCallFormat
from agent_grpo.trajectory.record import Message
from agent_grpo.trajectory.segments import ChatTemplateError, Segment, segment_conversation

ANALYSIS = "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant"
CALL = ANALYSIS + HarmonyToolCallFormat().render_call("add", {"a": 1})
PROMPT = [Message(role="system", content="Add."), Message(role="user", content="1?")]
RESULT = Message(role="tool", content='say "hi"\n', name="add")


@pytest.fixture(scope="module")
def harmony(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    return with_template(tokenizer, TEST_TEMPLATES["harmony-style"])


def test_a_turn_the_template_renders_back_is_one_segment_with_its_parts(
    harmony: PreTrainedTokenizerBase,
) -> None:
    messages = [*PROMPT, Message(role="assistant", content=CALL), RESULT]
    segments = segment_conversation(harmony, messages, generation_prompt=True)
    [turn] = [s for s in segments if s.message == 2]
    assert turn.text == CALL and not turn.rewritten
    assert "".join(p.text for p in turn.parts) == CALL
    fields = [p.text for p in turn.parts if p.message is not None]
    assert fields == ["Need the tool.", '{"a": 1}']  # the reasoning and the arguments
    assert all(p.rewritten for p in turn.parts if p.message is not None)
    markup = [p.text for p in turn.parts if p.message is None]
    assert markup[0] == "<|channel|>analysis<|message|>" and markup[-1] == "<|call|>"
    assert markup[-2].endswith("to=functions.add <|constrain|>json<|message|>")
    # the turn starts where the generation prompt ends; the template text after it is its own
    before = segments[segments.index(turn) - 1]
    assert before == Segment("<|end|><|start|>assistant", None)
    after = segments[segments.index(turn) + 1]
    assert after.text.startswith("<|start|>functions.add to=assistant")
    # gpt-oss writes a tool result through `tojson`: its text is the JSON string
    [result] = [s for s in segments if s.message == 3]
    assert result.text == json.dumps(RESULT.content)


def test_a_turn_rendered_otherwise_is_its_fields_between_template_text(
    harmony: PreTrainedTokenizerBase,
) -> None:
    final = Message(role="assistant", content="<|channel|>final<|message|>2")
    messages = [*PROMPT, Message(role="assistant", content=CALL), RESULT, final]
    messages.append(Message(role="user", content="Thanks"))
    segments = segment_conversation(harmony, messages, generation_prompt=True, rewrites=True)
    # a final answer follows: the call's analysis is dropped, its arguments are what is left
    turn = [s for s in segments if s.message == 2]
    assert turn == [Segment('{"a": 1}', 2, rewritten=True)]
    # the final answer renders back as sampled (its `<|end|>` is the template's)
    [answer] = [s for s in segments if s.message == 4]
    assert answer.text == final.content and [p.text for p in answer.parts if p.message] == ["2"]


def test_a_turn_all_of_whose_fields_are_dropped_is_an_empty_rewritten_segment(
    harmony: PreTrainedTokenizerBase,
) -> None:
    thinking_only = ANALYSIS + "<|channel|>final<|message|>"  # an empty answer after analysis
    messages = [*PROMPT, Message(role="assistant", content=thinking_only)]
    messages.append(Message(role="user", content="And?"))
    segments = segment_conversation(harmony, messages, generation_prompt=True, rewrites=True)
    assert [s for s in segments if s.message == 2] == [Segment("", 2, rewritten=True)]


def test_arguments_a_template_writes_its_own_way_are_refused(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    tokens = TEST_TEMPLATES["deepseek-v3-style"].special_tokens
    # indented JSON is not what `tojson` writes by default: the arguments cannot be located
    printed = DEEPSEEK_V3_STYLE.replace("arguments | tojson", "arguments | tojson(indent=2)")
    tok = with_template(tokenizer, FamilyTemplate(printed, tokens))
    call = DeepSeekV3ToolCallFormat().render_call("add", {"a": 1})
    messages = [*PROMPT, Message(role="assistant", content=call), RESULT]
    with pytest.raises(ChatTemplateError, match="does not render content verbatim"):
        segment_conversation(tok, messages, generation_prompt=True)
    with pytest.raises(ChatTemplateError, match="does not render"):
        segment_conversation(tok, messages, generation_prompt=True, rewrites=True)


@pytest.mark.parametrize(
    ("write", "text"),
    [
        ("'\"' + m['content'] + '\"'", RESULT.content),  # between literal quotes: verbatim
        ("m['content'] | tojson", json.dumps(RESULT.content)),  # a JSON string
    ],
)
def test_tool_output_written_between_quotes_or_as_json(
    tokenizer: PreTrainedTokenizerBase, write: str, text: str
) -> None:
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'tool' %}{{ " + write + " }}{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = with_template(tokenizer, template)
    messages = [*PROMPT, Message(role="assistant", content="call"), RESULT]
    segments = segment_conversation(tok, messages, generation_prompt=True)
    [result] = [s for s in segments if s.message == 3]
    assert result.text == text
    assert "".join(s.text for s in segments) == tok.apply_chat_template(
        [m.to_template() for m in messages], tokenize=False, add_generation_prompt=True
    )
