"""The `agent-grpo` command line: its parser imports nothing heavy, and the lazily registered
subcommands show the help of their own modules."""

from __future__ import annotations

import argparse

import pytest

from agent_grpo import cli
from agent_grpo.testing.cli_runs import fresh_python


def _subcommand_help(parser: argparse.ArgumentParser) -> dict[str, str | None]:
    """Each subcommand's help line, as `agent-grpo --help` lists it."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {choice.dest: choice.help for choice in action._choices_actions}


@pytest.mark.slow
def test_help_imports_no_torch_transformers_or_matplotlib() -> None:
    script = (
        "import sys\n"
        "from agent_grpo import cli\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted({'torch', 'transformers', 'matplotlib', 'pandas'} & set(sys.modules))\n"
        "assert not heavy, f'agent-grpo --help imported {heavy}'\n"
    )
    out = fresh_python(script)
    assert "replay" in out and "conform" in out


@pytest.mark.parametrize("command", sorted(cli.LAZY_COMMANDS))
def test_a_lazy_subcommand_lists_the_help_its_module_gives(command: str) -> None:
    light = _subcommand_help(cli.build_parser())
    full = _subcommand_help(cli.build_parser(command))
    assert light[command] == full[command]


def test_a_lazy_subcommand_parses_in_full_when_asked_for() -> None:
    args = cli.parse_args(cli.build_parser("replay"), ["replay", "run", "--step", "3"])
    assert args.step == 3 and callable(args.func)


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "c.yaml", "--resume", "steps=3", "seed=1"],
        ["train", "c.yaml", "steps=3", "--resume", "seed=1"],
        ["train", "--resume", "c.yaml", "steps=3", "seed=1"],
        ["train", "c.yaml", "steps=3", "seed=1", "--resume"],
    ],
)
def test_train_takes_overrides_on_either_side_of_resume(argv: list[str]) -> None:
    args = cli.parse_args(cli.build_parser("train"), argv)
    assert args.resume and args.config == "c.yaml" and args.overrides == ["steps=3", "seed=1"]


@pytest.mark.parametrize("command", ["replay", "inspect", "export"])
def test_a_folder_that_holds_no_run_is_one_line(
    tmp_path, capsys, command: str, cli_logging: None
) -> None:
    assert cli.main([command, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path} is not a run directory (no trajectories/ or metrics)\n"


def test_an_error_line_shows_the_controls_of_what_it_quotes(
    tmp_path, capsys, cli_logging: None
) -> None:
    # a config value (or a run's config, a record) quoted in the one line: shown, not obeyed
    hostile = "\x1b]0;TITLE\x07\x1b[2J\u202e"
    assert cli.main(["replay", str(tmp_path / hostile)]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\u202e" not in err and "\x07" not in err
    assert "\\x1b]0;TITLE\\x07\\x1b[2J\\u202e is not a run directory" in err


def test_a_log_line_shows_the_controls_of_what_it_quotes(cli_logging: None) -> None:
    import logging

    from rich.logging import RichHandler

    from agent_grpo.logs import setup_logging

    setup_logging()
    handlers = logging.getLogger("agent_grpo").handlers
    handler = next(h for h in handlers if isinstance(h, RichHandler))
    record = logging.LogRecord("agent_grpo.x", logging.WARNING, __file__, 1,
                               "index entry of %s", ("g\x1b]52;c;eA==\x07/0",), None)  # fmt: skip
    assert handler.format(record) == "index entry of g\\x1b]52;c;eA==\\x07/0"
