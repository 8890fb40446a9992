"""Training through forks: two GRPO steps where every episode's token tree branches, because the
chat template opens reasoning in its generation prompt (Qwen3-Thinking, DeepSeek-R1), because a
gpt-oss-style template renders a call from `tool_calls` otherwise than it was sampled, or because
the context policy compacts the long tool outputs of Logs-v0. Every sampled token enters the loss
once, the trainer scores every branch, and the update has a gradient."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from agent_grpo.config.base import load_config
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.inspect.rewriting_templates import TEST_TEMPLATES, THINKING_PROMPT, with_template
from agent_grpo.testing.backends import SeededFinal
from agent_grpo.testing.cli_runs import agent_grpo, metrics
from agent_grpo.testing.reward_rules import reward_override
from agent_grpo.testing.tiny_model import save_tiny_model
from agent_grpo.trainer import setup
from agent_grpo.trainer.loop import train
from agent_grpo.trajectory.record import Provenance, TrajectoryRecord

ROOT = Path(__file__).resolve().parents[2]
CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call>'
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Use the calculator.<|end|><|start|>assistant"
    "<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>"
    '{"expression": "1 + 1"}<|call|>'
)
HARMONY_TIGHT = HARMONY_CALL.replace('": "', '":"')  # the template writes JSON with a space
READS = [
    f'<tool_call>\n{{"name": "read_log", "arguments": {{"log": "svc-1-{k}"}}}}\n</tool_call>'
    for k in range(3)
]

pytestmark = pytest.mark.slow


def records_of(run: Path) -> list[TrajectoryRecord]:
    return [
        TrajectoryRecord.from_json_line(line)
        for f in sorted((run / "trajectories").iterdir())
        for line in f.read_text().splitlines()
    ]


def forked_run(
    root: Path,
    model: Path,
    script: list[str],
    overrides: list[str],
    engine: Callable[[Any, list[str]], SeededFinal] = SeededFinal,
) -> Iterator[Path]:
    """Train 2 steps with a scripted engine (turns past the script answer by seed)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            setup,
            "build_engine",
            lambda config, sampler, tokenizer, *_: engine(tokenizer, script),
        )
        config = load_config(
            TrainConfig,
            ROOT / "configs/calculator-tiny.yaml",
            [
                f"model.name_or_path={model}",
                f"run.root={root}",
                "eval=null",
                "warm_start=null",
                "run.tensorboard=false",
                "rollout.sampling.max_tokens=48",
                "model.tool_format=hermes",
                "rollout.check_renders=true",
                reward_override("even", "even_tokens"),
                *overrides,
            ],
        )
        yield train(config)


def check_trains_each_token_once(run: Path) -> list[TrajectoryRecord]:
    records = records_of(run)
    steps = [row for row in metrics(run) if "reward_mean" in row]
    assert [row["step"] for row in steps] == [0.0, 1.0]
    for step, row in enumerate(steps):
        counted = [r for r in records if r.step == step and r.excluded is None]
        assert row["trained_tokens"] == sum(r.lengths.model for r in counted) > 0
    assert any(row["grad_norm"] > 0 for row in steps)  # a group with reward variance trained
    trained = [r for r in records if r.advantage]  # dead groups are left out of the loss
    assert trained
    for r in trained:  # pi_old scored on every model token of every branch
        for branch in r.rows():
            marks = [
                lp is not None
                for lp, p in zip(branch.old_logprobs or [], branch.provenance, strict=True)
                if p is Provenance.MODEL
            ]
            assert all(marks) and len(marks) == branch.provenance.count(Provenance.MODEL)
    return records


@pytest.fixture(scope="module")
def thinking_run(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerBase
) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("thinking")
    model = save_tiny_model(root / "model", tokenizer=with_template(tokenizer, THINKING_PROMPT))
    yield from forked_run(root, model, [CALC], ["run.name=thinking"])


def test_a_thinking_template_trains_through_a_fork_per_turn(thinking_run: Path) -> None:
    records = check_trains_each_token_once(thinking_run)
    for r in records:
        assert r.lengths.branches == len(r.turns) == 2 and r.forks[0].parent == 0
        assert [t.branch for t in r.turns] == [0, 1]  # one turn trained in each branch
        assert r.forks[0].reason.startswith("template text changed")


def harmony_engine(tokenizer: Any, script: list[str]) -> SeededFinal:
    """Harmony turns: calls stop on `<|call|>` (no EOS), answers in a final channel message; a
    prompt holds one `<|call|>` per call taken."""
    return SeededFinal(
        tokenizer,
        script,
        final="<|channel|>final<|message|>{}",
        turn_marker=("<|call|>", 0),
        stop_strings=("<|call|>",),
    )


def test_a_harmony_template_trains_calls_rendered_from_tool_calls(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    harmony = with_template(tokenizer, TEST_TEMPLATES["harmony-style"])
    model = save_tiny_model(tmp_path / "model", tokenizer=harmony)
    overrides = ["run.name=harmony", "model.tool_format=auto", "rollout.max_context_tokens=1024"]
    script = [HARMONY_CALL, HARMONY_TIGHT]
    run = next(forked_run(tmp_path, model, script, overrides, harmony_engine))
    assert "tool_call_format: harmony" in (run / "config.yaml").read_text()
    records = check_trains_each_token_once(run)
    for r in records:
        # the first call renders back as sampled; the second is written with other spacing
        assert [c.result for t in r.turns for c in t.tool_calls] == ["2", "2"]
        assert r.lengths.branches == 2 and [t.branch for t in r.turns] == [0, 0, 1]
        fork = r.forks[0]
        assert fork.reason == "template rewrote turn 1" and fork.parent == 0
        tokens = list(zip(fork.token_ids, fork.provenance, strict=True))
        context = [t for t, p in tokens if p is Provenance.CONTEXT]
        markup = [t for t, p in tokens if p is Provenance.TEMPLATE]
        # turn 0 as sampled, then turn 1's fields as plain text, its markup as template text
        assert harmony.decode(context).endswith('Use the calculator.{"expression": "1 + 1"}')
        call = harmony.convert_tokens_to_ids("<|call|>")
        assert context.count(call) == 1 and markup.count(call) == 1


def test_logs_compaction_trains_through_the_rewritten_context(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    overrides = [
        "run.name=logs",
        "env.id=agent_grpo/Logs-v0",
        "rollout.max_context_tokens=1100",
        "rollout.sampling.max_tokens=40",
        "rollout.context={type: compact}",
    ]
    run = next(forked_run(tmp_path, tiny_model_dir, READS, overrides))
    records = check_trains_each_token_once(run)
    for r in records:
        assert r.termination.reason != "max_context" and len(r.turns) == 4
        assert r.forks and all(f.reason == "context: compact" for f in r.forks)
        last = r.forks[-1].messages
        assert any(m.content.startswith("[summary of earlier tool outputs]") for m in last)
        assert max(len(row.token_ids) for row in r.rows()) <= 1100


def test_replay_shows_and_verifies_every_branch(thinking_run: Path) -> None:
    record = next(r for r in records_of(thinking_run) if r.forks)
    group = record.group_id.rsplit("t", 1)[1]
    where = ["--step", str(record.step), "--group", group, "--sample", str(record.index_in_group)]
    shown = agent_grpo("replay", str(thinking_run), *where, "--tokens", cwd=thinking_run).stdout
    assert "branch 1" in shown and "tokens of branch 1" in shown
    assert record.forks[0].reason.split(" at ")[0] in shown
    verified = agent_grpo("replay", str(thinking_run), "--verify", cwd=thinking_run).stdout
    assert verified.splitlines()[-1].startswith("verified 8 records: ok 8,")
    page = thinking_run / "page.html"
    agent_grpo("replay", str(thinking_run), "--html", str(page), cwd=thinking_run)
    assert '"branches": [{"branch": 1' in page.read_text()
