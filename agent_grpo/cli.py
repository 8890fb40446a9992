"""The `agent-grpo` command line."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `agent-grpo` command."""
    args = sys.argv[1:] if argv is None else argv
    print("agent-grpo", args)
    return 0
