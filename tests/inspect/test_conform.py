"""`agent-grpo conform`: every tokenizer the tests have conforms (SmolLM2, the second embedded
model when it is fetched, the history-rewriting test templates and the ones that render calls
from structured `tool_calls`); a template or a tool format that would train wrongly fails, with
the check named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from agent_grpo.inspect.conform import conform
from agent_grpo.inspect.rewriting_templates import (
    DEEPSEEK_V3_STYLE,
    QWEN3_STYLE,
    TEST_TEMPLATES,
    FamilyTemplate,
    with_template,
)
from agent_grpo.tools.formats import DeepSeekV3ToolCallFormat, HarmonyToolCallFormat
from agent_grpo.tools.formats.hermes import HermesToolCallFormat
from agent_grpo.trajectory.tokens import ChatTemplateError


def _conform_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent_grpo.cli", "conform", *args],
        text=True,
        capture_output=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("template", [None, *sorted(TEST_TEMPLATES)])
def test_every_test_tokenizer_conforms(embedded_model_dir: Path, template: str | None) -> None:
    extra = [] if template is None else ["--template", template]
    done = _conform_cli(str(embedded_model_dir), "--conversations", "40", *extra)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1].endswith(": conforms") and "forged control tokens: 0" in done.stdout
    history = next(line for line in lines if " history: " in line)
    assert ("append-only" in history) == (template is None)


def test_a_forking_template_conforms_and_says_how_often(tokenizer: PreTrainedTokenizerBase) -> None:
    report = conform(
        with_template(tokenizer, QWEN3_STYLE), HermesToolCallFormat(), model="q", conversations=30
    )
    assert report.ok, report.lines()
    history = next(c for c in report.checks if c.name == "history")
    assert history.detail.startswith("forking: ")


@pytest.mark.parametrize(
    ("template", "fmt"),
    [("harmony-style", HarmonyToolCallFormat()), ("deepseek-v3-style", DeepSeekV3ToolCallFormat())],
)
def test_templates_that_render_calls_from_tool_calls_conform(
    tokenizer: PreTrainedTokenizerBase, template: str, fmt: HarmonyToolCallFormat
) -> None:
    tok = with_template(tokenizer, TEST_TEMPLATES[template])
    report = conform(tok, fmt, model=template, conversations=20)
    assert report.ok, report.lines()
    assistant = next(c for c in report.checks if c.name == "assistant messages")
    assert assistant.detail == (
        f"structured by the {fmt.name} parser (tool_calls): a call as the model writes it "
        "renders back as sampled (append-only)"
    )


def test_a_tool_format_the_template_does_not_structure_fails(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    tok = with_template(tokenizer, TEST_TEMPLATES["harmony-style"])
    report = conform(tok, HermesToolCallFormat(), model="mixed", conversations=5)
    failed = [c for c in report.checks if not c.ok]
    assert [c.name for c in failed] == ["assistant messages"]
    assert "hermes calls would be rendered as text" in failed[0].detail


def test_a_template_writing_arguments_its_own_way_cannot_be_used(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    # indented JSON is not what `tojson` writes by default: the arguments cannot be located
    indented = DEEPSEEK_V3_STYLE.replace("arguments | tojson", "arguments | tojson(indent=2)")
    tok = with_template(
        tokenizer, FamilyTemplate(indented, TEST_TEMPLATES["deepseek-v3-style"].special_tokens)
    )
    with pytest.raises(ChatTemplateError, match="does not render"):
        conform(tok, DeepSeekV3ToolCallFormat(), model="indented", conversations=5)


class _LossyFormat(HermesToolCallFormat):
    """Writes calls its own parser cannot read back (drops the arguments)."""

    def render_call(self, name: str, arguments: object) -> str:
        return super().render_call(name, {})


def test_a_format_that_does_not_round_trip_fails(tokenizer: PreTrainedTokenizerBase) -> None:
    report = conform(tokenizer, _LossyFormat(), model="lossy", conversations=5)
    failed = [c.name for c in report.checks if not c.ok]
    assert failed == ["tool calls round trip (render, sample, parse)"]
    assert report.lines()[-1] == "lossy: FAILS 1 checks"


@pytest.mark.slow  # a subprocess that imports transformers
def test_a_template_that_rewrites_tool_output_cannot_be_used(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    # `trim` on every message: content is not rendered verbatim, so it cannot be segmented
    # safely (a forged turn could hide in what the template changed)
    trimming = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with_template(tokenizer, trimming).save_pretrained(tmp_path)
    done = _conform_cli(str(tmp_path), "--conversations", "5")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.startswith(f"conform {tmp_path}: cannot be used: chat template")
    assert "verbatim" in done.stdout and len(done.stdout.splitlines()) == 1


@pytest.mark.slow
def test_the_second_embedded_model_conforms() -> None:
    from agent_grpo.models.embedded import COMPLETE_STAMP, embedded_model_dir

    if not (embedded_model_dir("gemma3-270m") / COMPLETE_STAMP).exists():
        pytest.skip("gemma3-270m is not fetched (agent-grpo model fetch gemma3-270m)")
    done = _conform_cli("gemma3-270m", "--conversations", "40")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "'<end_of_turn>' (id 106)" in done.stdout and done.stdout.endswith(": conforms\n")
