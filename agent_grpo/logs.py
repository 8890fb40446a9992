"""Logging setup shared by every entry point: rich console output, one format, one place."""

from __future__ import annotations

import logging

from rich.logging import RichHandler

__all__ = ["get_logger", "setup_logging"]


def setup_logging(level: str | int = "INFO") -> None:
    """Route the `agent_grpo` loggers to a rich console handler (idempotent)."""
    root = logging.getLogger("agent_grpo")
    root.setLevel(level)
    if not any(isinstance(h, RichHandler) for h in root.handlers):
        handler = RichHandler(show_path=False, rich_tracebacks=False, markup=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    root.propagate = False


def get_logger(name: str) -> logging.Logger:
    """Return a logger under the `agent_grpo` namespace."""
    return logging.getLogger(name if name.startswith("agent_grpo") else f"agent_grpo.{name}")
