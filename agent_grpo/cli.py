"""The `agent-grpo` command line: one subcommand per entry point, one typed config each."""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Any

from agent_grpo.config.base import ConfigError
from agent_grpo.controls import visible
from agent_grpo.logs import setup_logging


def _cmd_model_fetch(args: argparse.Namespace) -> int:
    from agent_grpo.models.embedded import fetch_embedded_model

    print(fetch_embedded_model(args.name, force=args.force))
    return 0


def _quiet_transformers() -> None:
    """transformers' own bars ("Loading weights", "Writing model shards") would interleave with
    the run's display; its warnings stay."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _cmd_train(args: argparse.Namespace) -> int:
    from agent_grpo.config.base import load_config
    from agent_grpo.config.jobs import TrainConfig
    from agent_grpo.preflight import preflight_train

    config = load_config(TrainConfig, args.config, args.overrides)
    # the checks `train` starts with, run before the trainer is imported (torch and transformers
    # take seconds): a mistake is one line in about a second
    preflight_train(config)
    from agent_grpo.trainer.loop import train_checked

    _quiet_transformers()
    changed = args.accept_config_change
    print(train_checked(config, resume=args.resume, accept_config_change=changed))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from agent_grpo.config.base import load_config
    from agent_grpo.config.jobs import EvalRunConfig
    from agent_grpo.preflight import preflight_eval

    config = load_config(EvalRunConfig, args.config, args.overrides)
    preflight_eval(config)  # before the heavy imports, as in `_cmd_train`
    from agent_grpo.evaluation.job import run_checked_eval_job

    _quiet_transformers()
    print(run_checked_eval_job(config))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from agent_grpo.export import export_run

    print(export_run(args.run, args.out or f"{args.run.rstrip('/')}-export"))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from agent_grpo.config.schema import schema_markdown

    print(schema_markdown(), end="")
    return 0


def _cmd_envs(args: argparse.Namespace) -> int:
    from agent_grpo.envs.registry import list_envs

    for env_id in list_envs():
        print(env_id)
    return 0


def _add_config_command(
    sub: Any,
    name: str,
    help_text: str,
    func: object,
) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text)
    parser.add_argument("config", help="YAML config file (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    parser.set_defaults(func=func)
    return parser


# Subcommands whose modules import torch, transformers or rich: each is registered in full only
# when it is the one asked for, so `agent-grpo --help` and every other command import none of
# them. The help line here is the one `agent-grpo --help` shows (a test keeps it equal to the
# module's own).
LAZY_COMMANDS: dict[str, tuple[str, str, str]] = {
    "replay": ("agent_grpo.inspect.replay", "add_replay_parser",
               "show stored trajectories, token by token"),
    "inspect": ("agent_grpo.inspect.curves", "add_inspect_parser",
                "per-step metrics table and curves of a run"),
    "conform": ("agent_grpo.inspect.conform", "add_conform_parser",
                "check a model's tokenizer, chat template and tool-call format"),
}  # fmt: skip


def _add_lazy_commands(sub: Any, command: str | None) -> None:
    """Register `command`'s parser from its module if it is a lazy one; the others as a name and
    a help line only."""
    import importlib

    for name, (module, adder, help_text) in LAZY_COMMANDS.items():
        if name == command:
            getattr(importlib.import_module(module), adder)(sub)
        else:
            sub.add_parser(name, help=help_text)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser for every subcommand; `command` (the one on the command line) is the
    one of `LAZY_COMMANDS` whose module is imported to register it in full."""
    parser = argparse.ArgumentParser(prog="agent-grpo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = _add_config_command(sub, "train", "train a policy with GRPO", _cmd_train)
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    train.add_argument(
        "--accept-config-change", action="store_true",
        help="with --resume: continue with a changed config (recorded in config-changes.jsonl)",
    )  # fmt: skip
    _add_config_command(sub, "eval", "evaluate a model on held-out seeds", _cmd_eval)
    sub.add_parser("envs", help="list registered environments").set_defaults(func=_cmd_envs)
    config = sub.add_parser("config", help="describe the config keys")
    config.add_argument(
        "--schema", action="store_true", required=True,
        help="print every key with its type, default and docstring (docs/config.md)",
    )  # fmt: skip
    config.set_defaults(func=_cmd_config)
    export = sub.add_parser("export", help="a run's latest weights as a Hugging Face directory")
    export.add_argument("run", help="run directory")
    export.add_argument("--out", help="output directory (default: RUN-export)")
    export.set_defaults(func=_cmd_export)
    _add_lazy_commands(sub, command)
    from agent_grpo.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS  # no torch

    model = sub.add_parser("model", help="manage the embedded models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    fetch = model_sub.add_parser("fetch", help="fetch, verify and convert an embedded model")
    names = ", ".join(sorted(EMBEDDED_MODELS))
    fetch.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"one of: {names}")
    fetch.add_argument("--force", action="store_true", help="fetch and convert again")
    fetch.set_defaults(func=_cmd_model_fetch)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`argv` parsed, with `dotted.key=value` overrides taken wherever they stand: argparse ends
    a `nargs="*"` positional at the first flag, so `train CFG --resume steps=3` would leave
    `steps=3` unrecognised."""
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and not any(e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `agent-grpo` command; its exit status.

    `agent-grpo train` as one rank of several (torchrun) does not return: the rank ends through
    `end_rank`, as gloo can abort it in the interpreter's teardown, and a failure is printed
    with its traceback and ends the rank with status 1.
    """
    setup_logging()
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(build_parser(argv[0] if argv else None), argv)
    if args.func is not _cmd_train:
        return _run(args)
    from agent_grpo.trainer.launch import end_rank, launched_world_size

    if launched_world_size() == 1:
        return _run(args)
    try:
        code = _run(args)
    except Exception:
        traceback.print_exc()
        code = 1
    end_rank(code)


def _run(args: argparse.Namespace) -> int:
    """The subcommand's exit status; a mistake in the user's input is one line on stderr."""
    try:
        return int(args.func(args))
    except Exception as error:
        # a config mistake needs no import: it is reported before torch loads
        if not isinstance(error, ConfigError) and not isinstance(error, _user_errors()):
            raise
        # the input is wrong: one line, no traceback, its quoted values' controls not obeyed
        print(f"error: {visible(str(error))}", file=sys.stderr)
        return 2


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that name a problem in the user's input or setup, printed as one line. Imported
    only once one is raised (they import torch and transformers), so `agent-grpo model fetch`
    and a config mistake stay light."""
    from agent_grpo.models.loading import CorruptModelError, ModelFetchError, ModelNotFoundError
    from agent_grpo.rollout.collector import EnvStepError, PromptTooLongError
    from agent_grpo.run_dir.writer import (
        DamagedCheckpointError,
        NotARunDirectory,
        RunDirWriteError,
    )
    from agent_grpo.trajectory.tokens import ChatTemplateError

    # RunDirWriteError: a full disk; the run directory stays readable and resumable.
    return (ConfigError, ModelNotFoundError, ModelFetchError, CorruptModelError,
            ChatTemplateError, EnvStepError, PromptTooLongError, RunDirWriteError,
            NotARunDirectory, DamagedCheckpointError)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
