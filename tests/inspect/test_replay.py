"""Terminal replay, --verify, --recompute-logprobs and `inspect`, on synthetic records."""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from agent_grpo.envs.registry import make_env
from agent_grpo.inspect.curves import metrics_table
from agent_grpo.inspect.drift import logprob_drift, recompute_logprobs
from agent_grpo.inspect.replay import (
    render_group,
    render_trajectory,
    token_rows,
    top_disagreements,
)
from agent_grpo.inspect.verify import verify_record
from agent_grpo.models.loading import load_model
from agent_grpo.models.logprobs import reference_token_logprobs
from agent_grpo.rollout.collector import CollectOptions
from agent_grpo.run_dir.writer import RunWriter
from agent_grpo.testing.backends import ScriptedBackend
from agent_grpo.testing.cli_runs import inspect_cli
from agent_grpo.testing.records import calculator_record, expert_record
from agent_grpo.trajectory.record import Provenance, Termination, TrajectoryRecord


def _text(renderable: Any) -> str:
    console = Console(width=220, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


@pytest.fixture
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rich consoles the CLI creates print 220 columns, so tables are not cut."""
    monkeypatch.setenv("COLUMNS", "220")


# Token rows: ratio, clip flags, disagreements


def test_token_rows_hand_computed(tokenizer: Any) -> None:
    record = calculator_record(tokenizer, old_shift={0: 0.5, 1: -0.3, 3: -0.1}, advantage=-0.75)
    rows = token_rows(record, tokenizer, clip_eps=0.2)
    assert [r.token_id for r in rows] == record.token_ids
    assert "".join(r.text for r in rows) == tokenizer.decode(record.token_ids)
    model = [r for r in rows if r.provenance is Provenance.MODEL]
    assert math.isclose(model[0].ratio, math.exp(0.5))  # 1.6487: clipped
    assert math.isclose(model[1].ratio, math.exp(-0.3))  # 0.7408: clipped
    assert math.isclose(model[3].ratio, math.exp(-0.1))  # 0.9048: inside 1 +- 0.2
    assert [r.clipped for r in model[:4]] == [True, True, False, False]
    assert model[2].ratio == 1.0 and model[2].sampler == pytest.approx(-0.3)
    assert model[2].ref == pytest.approx(-0.31)
    assert all(r.advantage == -0.75 for r in model)
    others = [r for r in rows if r.provenance is not Provenance.MODEL]
    assert all(r.ratio is None and r.advantage is None and not r.clipped for r in others)
    top = top_disagreements(rows, 3)
    assert [r.index for r in top] == [model[0].index, model[1].index, model[3].index]


def test_no_old_logprobs_means_no_ratio(tokenizer: Any) -> None:
    record = calculator_record(tokenizer).model_copy(update={"old_logprobs": None})
    rows = token_rows(record, tokenizer)
    assert all(r.ratio is None and not r.clipped for r in rows)
    assert top_disagreements(rows, 5) == []
    assert "no trainer logprobs recorded" in _text(
        render_trajectory(record, tokenizer, tokens=True)
    )


# Rendering


def test_render_trajectory_shows_turns_tools_and_outcome(tokenizer: Any) -> None:
    out = _text(render_trajectory(calculator_record(tokenizer, tool_error=True, reward=0.0)))
    for expected in (
        "What is 2+2?",
        "turn 0: assistant, finish=stop",
        '{"a": 2, "b": 2}',
        "[raised] division by zero",
        "tool (add)",
        "The answer is 4.",
        '"expected": "4"',
        "termination terminated: final_answer",
        "reward 0.0000",
    ):
        assert expected in out, expected


def test_render_trajectory_tokens_flags_clipped_and_top_k(tokenizer: Any) -> None:
    record = calculator_record(tokenizer, old_shift={0: 0.5, 3: -0.1})
    out = _text(render_trajectory(record, tokenizer, tokens=True, clip_eps=0.2, top_k=2))
    assert "1.6487" in out and "0.9048" in out
    assert out.count("CLIP") == 2  # token 0, in the model-token table and the top-k table
    assert "top 2 sampler/trainer disagreements" in out
    assert "clipped (|ratio-1| > 0.2) 1/" in out
    assert "<|im_start|>" in out  # template tokens are shown, not hidden


def test_render_group_side_by_side() -> None:
    records = [
        calculator_record(index=i, reward=r, advantage=a)
        for i, (r, a) in enumerate([(1.0, 1.0), (0.0, -1.0), (1.0, 1.0), (0.0, -1.0)])
    ]
    out = _text(render_group(records[::-1]))
    lines = [line for line in out.splitlines() if "terminated" in line]
    assert [line.split("│")[1].strip() for line in lines] == ["0", "1", "2", "3"]
    assert "+1.0000" in lines[0] and "-1.0000" in lines[1]
    # The std the advantages divided by: unbiased over the group, sqrt(4 * 0.25 / 3)
    assert "advantage = (r - mean) / std over 4 of 4 counted: mean 0.5000 std 0.5774" in out


# --verify against the real registered environment


def test_verify_matches_real_env_and_reports_first_divergence() -> None:
    env_id = "agent_grpo/Calculator-v0"
    record = expert_record(env_id, seed=3)
    assert record.reward == 1.0
    assert verify_record(record, make_env) is None

    tool_index = next(i for i, m in enumerate(record.messages) if m.role == "tool")
    wrong_obs = record.model_copy(deep=True)
    wrong_obs.messages[tool_index].content = "999"
    found = verify_record(wrong_obs, make_env)
    assert found is not None and (found.turn, found.what) == (0, "observation")
    assert found.expected[0]["content"] == "999" and found.got[0]["content"] != "999"

    wrong_reward = record.model_copy(update={"reward_components": {"verifier": 0.0}})
    found = verify_record(wrong_reward, make_env)
    assert found is not None and (found.turn, found.what, found.got) == (1, "reward", 1.0)

    wrong_seed = record.model_copy(update={"seed": 4})
    found = verify_record(wrong_seed, make_env)
    assert found is not None and (found.turn, found.what) == (None, "prompt")

    cut = record.model_copy(
        update={
            "messages": record.messages[:-1],
            "termination": Termination(kind="terminated", reason="x"),
        }
    )  # the final answer is missing, yet the record claims the env ended it
    found = verify_record(cut, make_env)
    assert found is not None and found.what == "termination"


def test_cli_verify_uses_run_env_kwargs(
    tokenizer: Any,
    embedded_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    wide: None,
) -> None:
    env_id = "agent_grpo/Calculator-v0"
    expert = expert_record(env_id, seed=5, digits=1)
    texts = [m.content for m in expert.messages if m.role == "assistant"]
    records = _collect(
        ScriptedBackend(tokenizer, texts, eos=False, logprob=-1.0), tokenizer, {"digits": 1}, seed=5
    )
    model = f"model: {{name_or_path: {embedded_model_dir}}}\n"
    config = model + f"env: {{id: {env_id}, kwargs: {{digits: 1}}}}\n"
    run = RunWriter.create(tmp_path, run_id="with-kwargs", config_text=config)
    run.write_trajectories(0, records)
    assert inspect_cli(["replay", str(run.path), "--verify"]) == 0
    assert "verify s0-t0/0: ok" in capsys.readouterr().out
    bare = RunWriter.create(tmp_path, run_id="without", config_text=model)
    bare.write_trajectories(0, records)
    assert inspect_cli(["replay", str(bare.path), "--verify"]) == 1
    assert "verify s0-t0/0: DIVERGES at turn None (prompt)" in capsys.readouterr().out


def _collect(
    backend: Any,
    tokenizer: Any,
    env_kwargs: dict[str, Any] | None = None,
    seed: int = 3,
    **sampling: Any,
) -> list[TrajectoryRecord]:
    """One Calculator-v0 group of two, collected from `backend` (the records `train` stores)."""
    from agent_grpo.rollout.backends.base import SamplingConfig
    from agent_grpo.rollout.collector import Task, collect_groups
    from agent_grpo.rollout.config import RolloutConfig

    config = CollectOptions.from_config(
        RolloutConfig(group_size=2, max_context_tokens=600, sampling=SamplingConfig(**sampling))
    )
    task = Task(env_id="agent_grpo/Calculator-v0", seed=seed, env_kwargs=env_kwargs or {})
    return collect_groups([task], backend, tokenizer, config).records


def test_collected_records_round_trip_the_store_and_verify(
    tokenizer: Any,
    embedded_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    wide: None,
) -> None:
    expert = expert_record("agent_grpo/Calculator-v0", seed=3)
    texts = [m.content for m in expert.messages if m.role == "assistant"]
    records = _collect(ScriptedBackend(tokenizer, texts, eos=False, logprob=-1.0), tokenizer)
    assert [len(r.turns) for r in records] == [2, 2] and all(r.reward == 1.0 for r in records)
    config = f"model: {{name_or_path: {embedded_model_dir}}}\n"
    run = RunWriter.create(tmp_path, run_id="r", config_text=config)
    run.write_trajectories(0, records)
    assert run.read_trajectories(0) == records
    assert inspect_cli(["replay", str(run.path), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verify s0-t0/0: ok" in out and "verify s0-t0/1: ok" in out
    tampered = records[0].model_copy(deep=True)
    tampered.messages[-2].content = "<tool_call>\n{}\n</tool_call>"  # the tool observation
    found = verify_record(tampered, make_env)
    assert found is not None and (found.turn, found.what) == (0, "observation")


# --recompute-logprobs


def test_logprob_drift_hand_computed(tokenizer: Any) -> None:
    record = calculator_record(tokenizer, old_shift={1: 0.2})
    recomputed = list(record.sampler_logprobs)
    model_pos = [i for i, m in enumerate(record.loss_mask) if m]
    recomputed[model_pos[0]] += 0.3  # turn 0
    recomputed[model_pos[-1]] -= 0.1  # turn 1
    turn0, turn1 = logprob_drift(record, recomputed)
    n0 = turn0.tokens
    assert n0 == record.turns[0].token_end - record.turns[0].token_start
    assert turn0.sampler_max == pytest.approx(0.3) and turn0.sampler_mean == pytest.approx(0.3 / n0)
    # vs old: token 0 is 0.3 off, token 1 is 0.2 off (old was shifted), the rest agree
    assert turn0.old_max == pytest.approx(0.3) and turn0.old_mean == pytest.approx(0.5 / n0)
    assert turn1.sampler_max == pytest.approx(0.1)
    assert turn1.tokens == record.turns[1].token_end - record.turns[1].token_start


def test_recompute_logprobs_equals_reference_and_cli_reports_drift(
    tokenizer: Any,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    wide: None,
) -> None:
    model = load_model(tiny_model_dir)
    record = calculator_record(tokenizer).model_copy(update={"sampling_temperature": 0.7})
    got = recompute_logprobs(model, record)
    ids = torch.tensor([record.token_ids])
    want = reference_token_logprobs(model, ids, temperature=0.7)[0].tolist()
    for g, w, m in zip(got, want, record.loss_mask, strict=True):
        assert (g is None) == (not m) and (g is None or g == pytest.approx(w, abs=1e-5))
    exact = [None if v is None else v for v in got]
    first = record.turns[0].token_start
    exact_with_gap = list(exact)
    exact_with_gap[first] = exact[first] - 0.25  # type: ignore[operator]
    stored = record.model_copy(update={"sampler_logprobs": exact_with_gap, "old_logprobs": exact})
    run = RunWriter.create(
        tmp_path, run_id="r", config_text=f"model: {{name_or_path: {tiny_model_dir}}}\n"
    )
    run.write_trajectories(0, [stored])
    checkpoint = run.checkpoint_dir(1)  # the trainer's layout: the HF model in `model/`
    checkpoint.mkdir()
    (checkpoint / "model").symlink_to(tiny_model_dir)
    assert inspect_cli(["replay", str(run.path), "--recompute-logprobs", str(checkpoint)]) == 0
    out = capsys.readouterr().out
    turn0 = next(line for line in out.splitlines() if line.strip().startswith("│ 0"))
    cells = [c.strip() for c in turn0.split("│")[1:-1]]
    assert cells[2:] != [] and float(cells[3]) == pytest.approx(0.25, abs=1e-4)  # max vs sampler
    assert float(cells[5]) == pytest.approx(0.0, abs=1e-4)  # max vs old


def test_hf_sampler_logprobs_match_recomputed(tokenizer: Any, tiny_model_dir: Path) -> None:
    from agent_grpo.rollout.backends.hf import HFBackend

    model = load_model(tiny_model_dir)
    records = _collect(HFBackend(model, tokenizer), tokenizer, max_tokens=24, temperature=0.8)
    for record in records:
        drifts = logprob_drift(record, recompute_logprobs(model, record))
        assert sum(d.tokens for d in drifts) == sum(record.loss_mask) > 0
        assert max(d.sampler_max for d in drifts) < 1e-4  # engine and trainer agree (fp32 CPU)


# The replay command


@pytest.fixture
def run(tmp_path: Path, embedded_model_dir: Path, tokenizer: Any) -> RunWriter:
    run = RunWriter.create(
        tmp_path, run_id="r", config_text=f"model: {{name_or_path: {embedded_model_dir}}}\n"
    )
    run.write_trajectories(
        0,
        [
            calculator_record(
                tokenizer, group_id="s0-t0", index=i, reward=float(i % 2), success=i % 2 == 1
            )
            for i in range(2)
        ],
    )
    run.write_trajectories(
        1,
        [
            calculator_record(
                tokenizer,
                step=1,
                group_id="s1-t0",
                index=0,
                reward=0.0,
                success=False,
                tool_error=True,
            ),
            calculator_record(
                tokenizer,
                step=1,
                group_id="s1-t0",
                index=1,
                reward=0.0,
                success=False,
                termination="truncated",
            ),
        ],
    )
    return run


def test_cli_replay_defaults_to_latest_step_overview(
    run: RunWriter, capsys: pytest.CaptureFixture[str], wide: None
) -> None:
    assert inspect_cli(["replay", str(run.path)]) == 0
    out = capsys.readouterr().out
    assert "group s1-t0 (step 1)" in out and "s0-t0" not in out
    assert "trajectory" not in out  # overview only: no filter, group or sample given


def test_cli_replay_filters_and_tokens(
    run: RunWriter, capsys: pytest.CaptureFixture[str], wide: None
) -> None:
    assert inspect_cli(["replay", str(run.path), "--step", "1", "--errors"]) == 0
    out = capsys.readouterr().out
    assert "trajectory s1-t0/0" in out and "trajectory s1-t0/1" not in out
    assert inspect_cli(["replay", str(run.path), "--step", "1", "--truncated"]) == 0
    assert "trajectory s1-t0/1" in capsys.readouterr().out
    assert (
        inspect_cli(
            ["replay", str(run.path), "--step", "0", "--group", "0", "--sample", "1", "--tokens"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "trajectory s0-t0/1" in out and "model tokens" in out
    assert inspect_cli(["replay", str(run.path), "--step", "0", "--reward-min", "2"]) == 1
    assert "no records match" in capsys.readouterr().out


def test_replay_reads_the_index_once_for_every_group_it_shows_in_part(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # each group a filter shows in part needs its whole group for the baseline: read from the
    # index once, not once per group (20,000 records in 2,500 groups ran past 100 s)
    run = RunWriter.create(tmp_path, run_id="r")
    records = [
        calculator_record(group_id=f"g{g}", index=i, reward=float(i % 2), success=i % 2 == 1)
        for g in range(6)
        for i in range(4)
    ]
    run.write_trajectories(0, records)
    reads = []
    index = RunWriter.index

    def counted(self: RunWriter) -> list:  # type: ignore[type-arg]
        reads.append(1)
        return index(self)

    monkeypatch.setattr(RunWriter, "index", counted)
    assert inspect_cli(["replay", str(run.path), "--reward-min", "1"]) == 0
    out = capsys.readouterr().out
    assert all(f"group g{g}" in out for g in range(6))
    assert len(reads) == 2  # the filter's selection, then every group's baseline at once


# inspect


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _table(out: str) -> list[list[str]]:
    """Header and body rows of the rich table in `out`, as stripped cells."""
    lines = [line for line in out.splitlines() if line.startswith(("┃", "│"))]
    return [[c.strip() for c in line.strip("┃│ ").replace("┃", "│").split("│")] for line in lines]


def test_inspect_table_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("COLUMNS", "60")  # narrower than the table: it must widen, not cut
    run = RunWriter.create(tmp_path, run_id="r")
    first = {"reward_mean": 0.25, "reward_std": 0.125, "success_rate": 0.5, "clip_frac": 0.0625}
    run.write_metrics(0, first)
    run.write_metrics(1, {"reward_mean": 0.75, "kl_ref": 0.0123, "logprob_mismatch_mean": 0.0042})
    assert inspect_cli(["inspect", str(run.path)]) == 0
    assert _table(capsys.readouterr().out) == [
        ["step", "reward", "reward std", "success", "KL ref", "clip frac", "lp mismatch"],
        ["0", "0.25", "0.125", "0.5", "-", "0.0625", "-"],
        ["1", "0.75", "-", "-", "0.0123", "-", "0.0042"],
    ]
    width, height = _png_size(run.path / "curves.png")
    assert (width, height) == (1280, 480)  # 16x6 inches at 80 dpi


HOSTILE = "\x1b]52;c;cHduZWQ=\x07\x1b[2J\u202e[link=https://evil.example]x[/link] a$\\foo{$"
"""What a run directory's author can put in a metric key: a clipboard write, a screen clear, a
bidi override, rich markup and matplotlib mathtext that does not parse."""


def test_inspect_shows_a_hostile_metric_key_and_never_writes_through_a_symlink(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    run = RunWriter.create(tmp_path, run_id="r")
    run.write_metrics(0, {"reward_mean": 0.25, f"rewards/{HOSTILE}/mean": 0.5})
    run.write_metrics(1, {"reward_mean": 0.75, f"rewards/{HOSTILE}/mean": 0.25})
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (run.path / "curves.png").symlink_to(victim)
    assert inspect_cli(["inspect", str(run.path)]) == 0
    out = capsys.readouterr().out
    # every control shown as an escape, the markup as text; the PNG drawn (the mathtext once
    # stopped it) beside the symlink and renamed over it, the file it pointed to left alone
    assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out
    assert "\\x1b]52;c;cHduZWQ=\\x07\\x1b[2J\\u202e[link=https://evil.example]x[/link]" in out
    assert victim.read_text() == "mine"
    assert not (run.path / "curves.png").is_symlink() and _png_size(run.path / "curves.png")


def test_metrics_table_skips_nonfinite_and_missing() -> None:
    rows = [
        {"step": 3, "clip_frac": 0.5, "kl_ref": 0.25},
        {"step": 4, "reward_mean": float("nan"), "clip_frac": 0.125, "tool_errors": 2,
         "kl_ref": None},
    ]  # fmt: skip
    assert _table(_text(metrics_table(rows))) == [
        ["step", "tool errors", "KL ref", "clip frac"],  # reward: never a finite number
        ["3", "-", "0.25", "0.5"],
        ["4", "2", "-", "0.125"],
    ]
