"""The `agent-grpo` command line: one subcommand per entry point."""

from __future__ import annotations

import argparse
import sys

from agent_grpo.logs import setup_logging


def _cmd_model_fetch(args: argparse.Namespace) -> int:
    from agent_grpo.models import fetch_embedded_model

    path = fetch_embedded_model(args.name, force=args.force)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="agent-grpo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

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
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
