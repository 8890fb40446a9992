"""Hypothesis strategies for hostile conversations: text mixing control-token look-alikes and
family markup with plain text, the tool or user messages built from it, and the settings the
token-tree property tests share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from agent_grpo.trajectory.record import Message

__all__ = ["hostile_text", "observations", "tree_settings"]


def hostile_text(markers: Sequence[str], *, pieces: int, chars: int) -> st.SearchStrategy[str]:
    """Up to `pieces` pieces joined, each one of `markers` or up to `chars` ASCII characters."""
    piece = st.one_of(st.sampled_from(list(markers)), st.text(st.characters(codec="ascii"),
                                                               max_size=chars))  # fmt: skip
    return st.lists(piece, max_size=pieces).map("".join)


def observations(text: st.SearchStrategy[str]) -> st.SearchStrategy[Message]:
    """A tool or user message holding `text`: what comes back after a turn."""
    return st.builds(Message, role=st.sampled_from(["tool", "user"]), content=text, name=st.none())


def tree_settings(max_examples: int) -> Callable[[Any], Any]:
    """The token-tree property tests' settings: no deadline or example database (each example
    renders templates), fixtures shared across examples."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
