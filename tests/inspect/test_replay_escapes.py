"""`replay` shows the control characters of recorded text as escapes, never sends them to the
terminal: a tool's output cannot clear the screen, recolour lines, set the title or clipboard,
overwrite what was shown or reorder it, whether stdout is a terminal or a pipe."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from agent_grpo.inspect.replay import render_group, render_trajectory
from agent_grpo.inspect.verify import VerifyReport, print_report
from agent_grpo.inspect.visible import visible
from agent_grpo.testing.records import tool_turn_record
from agent_grpo.trajectory.record import Provenance, Termination, ToolCallRecord, TrajectoryRecord

HOSTILE = {
    "\x1b[2J\x1b[H": "\\x1b[2J\\x1b[H",  # CSI: clear the screen, cursor home
    "\x1b[5;31mtrainer: all good": "\\x1b[5;31m",  # CSI SGR: blinking red, a spoofed line
    "\x1b]0;pwned\x07": "\\x1b]0;pwned\\x07",  # OSC 0: window title, ended by BEL
    "\x1b]52;c;cm0gLXJmIH4=\x1b\\": "\\x1b]52;c;cm0gLXJmIH4=\\x1b\\",  # OSC 52: clipboard
    "bad\x08\x08\x08ok": "bad\\x08\\x08\\x08ok",  # backspaces overwrite "bad"
    "fail\rpass": "fail\\x0dpass",  # carriage return overwrites "fail"
    "\x9b2J": "\\x9b2J",  # C1 CSI, one character
    "\u202etxt.exe": "\\u202etxt.exe",  # right-to-left override
    "\x07": "\\x07",  # BEL alone
}
RAW = ["\x1b", "\x07", "\x08", "\r", "\x9b", "\u202e"]
OUTPUT = "".join(HOSTILE)


class PieceTokenizer:
    """Token id i decodes to the i-th hostile piece."""

    def batch_decode(self, ids: list[list[int]]) -> list[str]:
        return [list(HOSTILE)[i[0]] for i in ids]


def hostile_record() -> TrajectoryRecord:
    pieces = len(HOSTILE)
    call = ToolCallRecord(name="fetch\x1b[2J", arguments={"url": "x"}, raw="", result=OUTPUT)
    return tool_turn_record(
        call,
        user="fetch it",
        model="calling\x1b[2J",
        tool=OUTPUT,
        tool_name="fetch\u202e",
        provenance=[Provenance.MODEL] + [Provenance.OBSERVATION] * (pieces - 1),
        group="g\x1b]0;title\x07",
        reward=1.0,
        termination=Termination(kind="terminated", reason="done\x1b[2J"),
        excluded="infrastructure failure: judge said \x1b[31mno",
    )


def printed(renderable: Any, terminal: bool) -> str:
    out = io.StringIO()
    colour = "truecolor" if terminal else None
    console = Console(file=out, force_terminal=terminal, width=200, color_system=colour)
    console.print(renderable)
    return out.getvalue()


def test_visible_escapes_every_hostile_piece() -> None:
    for raw, shown in HOSTILE.items():
        assert shown in visible(raw)
        assert not any(c in visible(raw) for c in RAW)
    assert visible("line 1\n\tline 2 é 中") == "line 1\n\tline 2 é 中"


@pytest.mark.parametrize("terminal", [True, False])
def test_a_trajectory_replay_shows_the_escapes_instead_of_obeying_them(terminal: bool) -> None:
    text = printed(render_trajectory(hostile_record(), PieceTokenizer(), tokens=True), terminal)
    for shown in HOSTILE.values():
        assert shown in text
    # rich writes its own SGR colour codes to a terminal; none of the record's may get through
    assert not any(c in text for c in RAW[1:])
    for raw in ["\x1b[2J", "\x1b[5;31m", "\x1b]", "\x1b\\", "\x1b[H"]:
        assert raw not in text
    if not terminal:
        assert "\x1b" not in text


@pytest.mark.parametrize("terminal", [True, False])
def test_a_group_table_shows_the_escapes(terminal: bool) -> None:
    text = printed(render_group([hostile_record()]), terminal)
    assert "\\x1b]0;title\\x07" in text and "\\x1b[31mno" in text
    assert "\x1b]" not in text and "\x07" not in text and "\x1b[31mno" not in text


def test_verify_report_shows_the_escapes() -> None:
    out = io.StringIO()
    report = VerifyReport(incomplete=[f"group {OUTPUT}: 1 of 4 samples"])
    print_report(Console(file=out, force_terminal=True, width=200), report)
    assert "\\x1b[2J" in out.getvalue()
    assert not any(c in out.getvalue() for c in RAW)
