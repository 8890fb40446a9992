"""Logging setup shared by every entry point: rich console output, one format, one place."""

from __future__ import annotations

import logging

from rich.logging import RichHandler

from agent_grpo.controls import visible

__all__ = ["get_logger", "setup_logging"]


class _Visible(logging.Formatter):
    """The message with control characters shown, never obeyed: warnings quote records, run
    names and config values, which a model, a tool or a run directory's author wrote."""

    def format(self, record: logging.LogRecord) -> str:
        return visible(super().format(record))


def setup_logging(level: str | int = "INFO") -> None:
    """Route the `agent_grpo` loggers to a rich console handler (idempotent)."""
    root = logging.getLogger("agent_grpo")
    root.setLevel(level)
    if not any(isinstance(h, RichHandler) for h in root.handlers):
        handler = RichHandler(show_path=False, rich_tracebacks=False, markup=False)
        handler.setFormatter(_Visible("%(message)s"))
        root.addHandler(handler)
    root.propagate = False


def get_logger(name: str) -> logging.Logger:
    """Return a logger under the `agent_grpo` namespace."""
    return logging.getLogger(name if name.startswith("agent_grpo") else f"agent_grpo.{name}")
