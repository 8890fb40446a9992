"""The `agent-grpo` command line: one subcommand per entry point, one typed config each."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from agent_grpo.config import ConfigError
from agent_grpo.logs import setup_logging


def _cmd_model_fetch(args: argparse.Namespace) -> int:
    from agent_grpo.models import fetch_embedded_model

    print(fetch_embedded_model(args.name, force=args.force))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from agent_grpo.config import load_config
    from agent_grpo.train import train
    from agent_grpo.train.config import TrainConfig

    config = load_config(TrainConfig, args.config, args.overrides)
    print(train(config, resume=args.resume))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from agent_grpo.config import load_config
    from agent_grpo.eval_run import run_eval_job
    from agent_grpo.train.config import EvalRunConfig

    config = load_config(EvalRunConfig, args.config, args.overrides)
    print(run_eval_job(config))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from agent_grpo.config_schema import schema_markdown

    print(schema_markdown(), end="")
    return 0


def _cmd_envs(args: argparse.Namespace) -> int:
    from agent_grpo.registry import list_envs

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


def build_parser(*, with_replay: bool = True) -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="agent-grpo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = _add_config_command(sub, "train", "train a policy with GRPO", _cmd_train)
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    _add_config_command(sub, "eval", "evaluate a model on held-out seeds", _cmd_eval)
    sub.add_parser("envs", help="list registered environments").set_defaults(func=_cmd_envs)
    config = sub.add_parser("config", help="describe the config keys")
    config.add_argument(
        "--schema", action="store_true", required=True,
        help="print every key with its type, default and docstring (docs/config.md)",
    )  # fmt: skip
    config.set_defaults(func=_cmd_config)
    if with_replay:  # rich/matplotlib-heavy; `model fetch` must not depend on it
        from agent_grpo.inspect.replay import add_inspect_parser, add_replay_parser

        add_replay_parser(sub)
        add_inspect_parser(sub)
    model = sub.add_parser("model", help="manage the embedded default model")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    fetch = model_sub.add_parser("fetch", help="fetch, verify and convert the embedded model")
    fetch.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    fetch.add_argument("--force", action="store_true", help="fetch and convert again")
    fetch.set_defaults(func=_cmd_model_fetch)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `agent-grpo` command."""
    setup_logging()
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(with_replay=argv[:1] != ["model"]).parse_args(argv)
    from agent_grpo.models import CorruptModelError, ModelFetchError, ModelNotFoundError
    from agent_grpo.store import RunDirWriteError
    from agent_grpo.tokens import ChatTemplateError

    clear = (
        ConfigError, ModelNotFoundError, ModelFetchError, CorruptModelError, ChatTemplateError,
        RunDirWriteError,  # a full disk: the run directory stays readable and resumable
    )  # fmt: skip
    try:
        return int(args.func(args))
    except clear as error:  # the input or the disk is wrong: one line naming it, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
