"""Running the CLI in tests: `agent-grpo` (or a script) as a subprocess, the replay/inspect
parsers in-process, and reading the metrics a run wrote."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from agent_grpo.inspect.curves import add_inspect_parser
from agent_grpo.inspect.replay import add_replay_parser

__all__ = [
    "RULE",
    "RULE_REWARD",
    "TINY_CONFIG",
    "agent_grpo",
    "deterministic",
    "fresh_python",
    "inspect_cli",
    "metrics",
    "tiny_train",
]

TINY_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "calculator-tiny.yaml"
"""The smoke-test config the in-process runs start from."""

TIMING_KEYS = ("time", "per_s")

RULE = """
def even_tokens(record):
    ids = [t for t, p in zip(record.token_ids, record.provenance) if p == "model"]
    return sum(t % 2 == 0 for t in ids) / max(1, len(ids))
"""
"""A reward rule written beside the run (`e2e_rules.py`), so a subprocess imports it from cwd."""
# A random tiny model never solves a task: this rule gives each group reward variance.
RULE_REWARD = 'rewards=[{type: rule, name: even, function: "e2e_rules:even_tokens"}]'
"""The config override that rewards with `RULE`."""


def agent_grpo(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run `agent-grpo ARGS` in a fresh interpreter, failing the test with its output."""
    (cwd / "e2e_rules.py").write_text(RULE)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "160",
        "PYTHONPATH": str(cwd),
    }
    done = subprocess.run(
        [sys.executable, "-m", "agent_grpo.cli", *args],
        cwd=cwd,
        env=env,
        text=True,
        capture_output=True,
        timeout=900,
    )
    assert done.returncode == 0, (
        f"agent-grpo {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    )
    return done


def fresh_python(script: str) -> str:
    """Run `python -c SCRIPT` in a fresh interpreter (nothing imported yet, so a script can check
    what an import pulls in); its stdout, failing the test with its stderr unless it exits 0."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def metrics(run: Path) -> list[dict[str, float]]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: dict[str, float]) -> dict[str, float]:
    """A metrics row without wall-clock figures (and without metrics that do not apply, None:
    `kl_ref` with beta = 0)."""
    return {k: v for k, v in row.items() if v is not None and not any(t in k for t in TIMING_KEYS)}


def inspect_cli(argv: list[str]) -> int:
    """Run `agent-grpo replay|inspect ARGV` in-process (no logging setup) and return its code."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    add_replay_parser(sub)
    add_inspect_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


def tiny_train(tmp: Path, model_dir: Path, *settings: str) -> Path:
    """Run `train` in-process on the model at `model_dir` from `TINY_CONFIG`: no eval, no warm
    start, no TensorBoard; `settings` are further overrides. Returns the run directory."""
    from agent_grpo.config.base import load_config
    from agent_grpo.config.jobs import TrainConfig
    from agent_grpo.trainer.loop import train

    overrides = [f"model.name_or_path={model_dir}", f"run.root={tmp}", "eval=null",
                 "warm_start=null", "run.tensorboard=false", *settings]  # fmt: skip
    return train(load_config(TrainConfig, TINY_CONFIG, overrides))
