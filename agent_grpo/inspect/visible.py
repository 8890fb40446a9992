"""Recorded text made safe to print as rich text: `visible` (`agent_grpo/controls.py`) shows
every control character a terminal would obey as an escape, and `visible_text` keeps rich from
reading the rest as markup."""

from __future__ import annotations

from rich.text import Text

from agent_grpo.controls import visible

__all__ = ["visible", "visible_text"]


def visible_text(text: str, style: str = "") -> Text:
    """`visible(text)` as a rich `Text`: printed as is, never read as rich markup either."""
    return Text(visible(text), style=style)
