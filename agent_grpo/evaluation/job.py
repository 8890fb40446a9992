"""`agent-grpo eval`: evaluate one model on an environment's held-out seeds into a run dir."""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from agent_grpo.config.base import dump_config, named
from agent_grpo.config.jobs import EvalRunConfig
from agent_grpo.evaluation.heldout import env_stop_strings, evaluate_heldout
from agent_grpo.models.loading import load_model, load_tokenizer, resolve_model_path
from agent_grpo.preflight import preflight_eval
from agent_grpo.rollout.backends.factory import EngineLimits, build_backend
from agent_grpo.run_dir.writer import RunWriter

__all__ = ["run_checked_eval_job", "run_eval_job"]


def run_eval_job(config: EvalRunConfig) -> Path:
    """Evaluate, write metrics and trajectories, print a table; returns the run directory."""
    preflight_eval(config)  # a config mistake is one line here, before any model or run dir
    return run_checked_eval_job(config)


def run_checked_eval_job(config: EvalRunConfig) -> Path:
    """`run_eval_job` of a config `preflight_eval` has already checked (the CLI checks it before
    it imports this module)."""
    # the run directory first: a name in use takes a timestamp, before the evaluation runs, so
    # its results always have somewhere to go
    run = RunWriter.create_fresh(config.run.root, config.run.name,
                                 lambda taken: dump_config(named(config, taken)))  # fmt: skip
    path = resolve_model_path(config.model.name_or_path)
    tokenizer = load_tokenizer(path)
    model = load_model(path, dtype=getattr(torch, config.model.dtype)).eval()
    rows = config.eval.tasks * config.eval.samples
    limits = EngineLimits(max_seqs=rows, max_len=config.max_context_tokens)
    backend = build_backend(config.backend, model, tokenizer, path, None, limits)
    stop = env_stop_strings(config.env.id, config.env.kwargs)
    result, records = evaluate_heldout(
        backend,
        tokenizer,
        config.env,
        config.eval,
        max_context_tokens=config.max_context_tokens,
        seed=config.seed,
        stop=stop,
    )
    backend.close()
    run.write_metrics(0, result.row())
    run.write_trajectories(0, records)
    table = Table(title=f"{config.model.name_or_path} on {config.env.id}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.row().items():
        table.add_row(key.removeprefix("eval_"), f"{value:.3f}")
    Console().print(table)
    return run.path
