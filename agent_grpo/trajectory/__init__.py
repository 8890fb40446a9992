"""Trajectories and tokens: the stored record of one episode (`record.py`), the builder that
tags every token with its provenance (`tokens.py`) and the invariants checked on each record
(`invariants.py`).

The record's types are re-exported here: `from agent_grpo.trajectory import TrajectoryRecord`.
"""

from agent_grpo.trajectory.record import (
    Lengths,
    Message,
    Provenance,
    Termination,
    ToolCallRecord,
    TrajectoryRecord,
    TurnRecord,
)

__all__ = [
    "Lengths",
    "Message",
    "Provenance",
    "Termination",
    "ToolCallRecord",
    "TrajectoryRecord",
    "TurnRecord",
]
