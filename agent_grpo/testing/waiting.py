"""Waiting in tests for what another thread or process does in its own time."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(condition: Callable[[], object], timeout_s: float) -> bool:
    """Poll `condition()` until it is true or `timeout_s` passes; whether it became true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return bool(condition())
