"""Trajectories and tokens: the stored record of one episode (`record.py`), the builder that
tags every token with its provenance (`tokens.py`) and the invariants checked on each record
(`invariants.py`).

The record's public names are re-exported here, so `from agent_grpo.trajectory import
TrajectoryRecord` works as it did when this was one module.
"""

from agent_grpo.trajectory import record
from agent_grpo.trajectory.record import *  # noqa: F403  (the names in record.__all__)

__all__ = list(record.__all__)
