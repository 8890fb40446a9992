"""Named crash points for the crash tests: `AGENT_GRPO_CRASH_AT=NAME:STEP` makes the process
SIGKILL itself when it reaches point NAME during step STEP.

A real `kill -9` at a chosen instant, not an exception a `finally` could tidy up after: the
tests (tests/test_crash.py) prove the run directory survives exactly what a power cut or the
OOM killer does. Unset (always, outside those tests), a crash point is one dict lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["CRASH_ENV", "crash_point"]

CRASH_ENV = "AGENT_GRPO_CRASH_AT"
"""The environment variable naming the crash point, `NAME:STEP`."""


def crash_point(name: str, step: int) -> None:
    """SIGKILL this process if `AGENT_GRPO_CRASH_AT` is `name:step`."""
    if os.environ.get(CRASH_ENV) == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
