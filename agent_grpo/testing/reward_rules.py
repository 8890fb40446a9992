"""Reward rules for training tests, importable as `agent_grpo.testing.reward_rules:NAME`.

A random tiny model never solves a task, so the verifier gives every member 0: these rules give
groups reward variance, no variance, or a non-finite reward, deterministically from the tokens.
"""

from __future__ import annotations

from typing import Any


def _model_ids(record: Any) -> list[int]:
    """The ids the model sampled, in every branch of the episode (provenance compares as text)."""
    return [
        t
        for row in record.rows()
        for t, p in zip(row.token_ids, row.provenance, strict=True)
        if p == "model"
    ]


def even_tokens(record: Any) -> float:
    """Fraction of the episode's model tokens with an even id: varies within a group."""
    ids = _model_ids(record)
    return sum(t % 2 == 0 for t in ids) / max(1, len(ids))


def nan_for_first_member(record: Any) -> float:
    """NaN for member 0 of every group, `even_tokens` otherwise."""
    return float("nan") if record.index_in_group == 0 else even_tokens(record)


def constant(record: Any) -> float:
    """The same reward for everyone: every group is dead."""
    return 0.5


def member_index(record: Any) -> float:
    """The member's index in its group: every group of 2+ has reward variance."""
    return float(record.index_in_group)


def reward_override(name: str, rule: str) -> str:
    """The config override that rewards with this module's `rule`, as component `name`."""
    return f"rewards=[{{type: rule, name: {name}, function: '{__name__}:{rule}'}}]"
