"""The formats by name, and the format a chat template shows: each family's markers (templates
written here from the public formats), ChatML without tool markup, and the templates refused."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerBase

from agent_grpo.envs.calculator import CalculatorEnv
from agent_grpo.inspect.rewriting_templates import TEST_TEMPLATES
from agent_grpo.tools.formats import (
    TOOL_FORMATS,
    ParsedToolCall,
    detect_tool_format,
    get_tool_format,
    tool_format_for,
)

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TEMPLATES = {
    "hermes": (
        "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\nYou may call one or more functions"
        " to assist with the user query.\\n\\n<tools>' }}{%- for tool in tools %}{{- tool | tojson"
        " }}{%- endfor %}{{- '</tools>\\n\\nFor each function call, return a json object with "
        "function name and arguments within <tool_call></tool_call> XML tags' }}{%- endif %}"
        '{%- if message.tool_calls %}{{- \'<tool_call>\\n{"name": "\' }}{%- endif %}' + CHATML
    ),
    "qwen3_coder": (
        "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{%- for args_name, "
        "args_value in tool_call.arguments|items %}{{- '<parameter=' + args_name + '>\\n' }}"
        "{{- '\\n</parameter>\\n' }}{%- endfor %}{{- '</function>\\n</tool_call>' }}" + CHATML
    ),
    "llama3": (
        "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if tools is not none %}"
        "{{- 'Environment: ipython\\n' }}{%- endif %}{%- if builtin_tools is defined %}"
        "{{- '<|python_tag|>' + tool_call.name + '.call(' }}{%- else %}{{- '{\"name\": \"' + "
        "tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{%- endif %}{{- '<|eot_id|>' }}"
    ),
    "mistral": (
        "{%- if tools %}{{- '[AVAILABLE_TOOLS] [' }}{%- endif %}{{- '[/AVAILABLE_TOOLS]' }}"
        "{{- '[INST] ' + message['content'] + '[/INST]' }}{{- '[TOOL_CALLS] [' }}{%- for tool_call"
        " in message.tool_calls %}{{- '{\"name\": \"' + tool_call.function.name + '\"' }}"
        "{%- endfor %}{{- ']' + eos_token }}"
    ),
    "mistral_v11": (
        "{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}{{- '[AVAILABLE_TOOLS]' + "
        "tools|tojson + '[/AVAILABLE_TOOLS]' }}{%- for tool in message.tool_calls %}"
        "{{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' + arguments }}{%- endfor %}"
    ),
    "harmony": (
        "{{- '<|start|>developer<|message|>' }}{{- '# Tools\\n\\n## functions\\n\\nnamespace "
        "functions {\\n\\n' }}{{- '<|start|>assistant to=' + 'functions.' + tool_call.name + "
        "'<|channel|>commentary ' + (tool_call.content_type | default('json')) + '<|message|>' "
        "}}{{- '<|call|>' }}{{- '<|start|>functions.' + name + ' to=assistant<|channel|>commentary"
        "<|message|>' }}<|constrain|>{{- '<|end|>' }}"
    ),
    "deepseek_v3": (
        "{{'<｜User｜>' + message['content'] + '<｜Assistant｜>'}}{{'<｜tool▁calls▁begin｜>"
        "<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + "
        "'\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + "
        "'<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}"
    ),
}

REFUSED = {
    "deepseek_v31": (
        "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + "
        "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}",
        "tool-call markup of no known format",
    ),
    "llama4": (
        "{{- '<|header_start|>system<|header_end|>\\n\\n' }}{%- if tools is not none %}"
        "{{- 'You have access to the following functions.' }}{%- endif %}",
        "tool-call markup of no known format",
    ),
    "chatml_with_a_tool_role": (
        CHATML + "{% if message['role'] == 'tool' %}{{ message['content'] }}{% endif %}",
        "tool-call markup of no known format",
    ),
    "gemma": (
        "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}",
        "shows no tool-call format and is not ChatML",
    ),
    "none": (None, "has no chat template"),
}


def test_every_format_is_registered_under_its_own_name() -> None:
    for name, cls in TOOL_FORMATS.items():
        fmt = get_tool_format(name)
        assert isinstance(fmt, cls) and fmt.name == name
        assert isinstance(fmt.stop_strings, list)


def test_every_format_drives_a_tool_env() -> None:
    for name in TOOL_FORMATS:
        env = CalculatorEnv(tool_call_format=name)
        messages, _ = env.reset(seed=5)
        assert "calculator" in messages[0]["content"]
        [call] = env.tool_call_format.parse(env.call("calculator", expression="2 * 3"))
        assert isinstance(call, ParsedToolCall), name
        assert call.arguments == {"expression": "2 * 3"}


def test_an_unknown_name_is_one_line_listing_the_known_formats() -> None:
    with pytest.raises(ValueError) as error:
        get_tool_format("qwen")
    message = str(error.value)
    assert "\n" not in message and message.startswith("unknown tool-call format 'qwen'")
    assert message.endswith(
        "known formats: auto, deepseek_v3, harmony, hermes, llama3, mistral, mistral_v11, "
        "qwen3_coder"
    )


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_family_is_recognised_from_its_template(name: str) -> None:
    assert detect_tool_format(TEMPLATES[name]) == name
    assert tool_format_for("auto", TEMPLATES[name]) == name


@pytest.mark.parametrize(
    ("template", "name"), [("harmony-style", "harmony"), ("deepseek-v3-style", "deepseek_v3")]
)
def test_the_test_templates_that_render_tool_calls_are_their_family(
    template: str, name: str
) -> None:
    assert tool_format_for("auto", TEST_TEMPLATES[template].text) == name


def test_a_template_that_wraps_results_in_tool_response_is_hermes() -> None:
    gemma = (
        "{%- elif message.role == 'tool' -%}{{- '<start_of_turn>user\\n<tool_response>\\n' + "
        "message.content + '\\n</tool_response><end_of_turn>\\n' -}}"
    )
    assert detect_tool_format(gemma) == "hermes"


def test_chatml_without_tool_markup_is_hermes(tokenizer: PreTrainedTokenizerBase) -> None:
    assert detect_tool_format(CHATML) == "hermes"
    assert detect_tool_format(tokenizer.chat_template) == "hermes"  # the embedded SmolLM2


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_templates_of_no_known_format_are_refused(case: str) -> None:
    template, why = REFUSED[case]
    assert detect_tool_format(template) is None
    with pytest.raises(ValueError) as error:
        tool_format_for("auto", template)
    assert why in str(error.value) and "\n" not in str(error.value)
    assert "set model.tool_format to one of deepseek_v3, harmony, hermes" in str(error.value)


def test_a_named_format_skips_detection() -> None:
    assert tool_format_for("llama3", None) == "llama3"
    assert tool_format_for("harmony", TEMPLATES["hermes"]) == "harmony"
    with pytest.raises(ValueError, match="unknown tool-call format"):
        tool_format_for("nope", TEMPLATES["hermes"])
