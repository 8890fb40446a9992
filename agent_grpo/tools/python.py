"""The `python` tool: run model-written code in the bubblewrap sandbox and report what it printed.

The sandbox keeps at most `PYTHON_LIMITS.max_output_bytes` of stdout and of stderr, so the text
this tool returns always fits under its `max_output_chars`: a chatty program gets its output cut
with a note, never an `oversized` error. The tool timeout is the sandbox wall time plus a margin,
so the sandbox (which can kill the code) always ends the run before the tool layer gives up on it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from agent_grpo.sandbox.runner import SandboxLimits, SandboxResult, run_sandboxed
from agent_grpo.tools.tool import tool

__all__ = ["PYTHON_LIMITS", "format_sandbox_result", "python"]

PYTHON_LIMITS = SandboxLimits(max_output_bytes=3500)
"""Limits for the tool: defaults, with output caps small enough for a chat turn."""
_MAX_OUTPUT_CHARS = 8000
# Teardown after a wall-time kill takes well under a second; the rest is headroom on a busy box.
_TOOL_TIMEOUT_S = PYTHON_LIMITS.wall_time_s + 5.0


@tool(timeout_s=_TOOL_TIMEOUT_S, max_output_chars=_MAX_OUTPUT_CHARS, needs_sandbox=True)
def python(
    code: Annotated[
        str, Field(description="A complete Python 3 program; print() what you want to see.")
    ],
) -> str:
    """Run a Python 3 program (standard library only, no network) and return what it printed.

    Each call is a fresh process: variables do not carry over between calls.
    """
    return format_sandbox_result(run_sandboxed(code, limits=PYTHON_LIMITS), PYTHON_LIMITS)


def format_sandbox_result(result: SandboxResult, limits: SandboxLimits) -> str:
    """Stdout, then stderr and any exit status, timeout or truncation note, as one text."""
    parts = [result.stdout] if result.stdout else []
    if result.stderr:  # tracebacks say `main.py`, not a random temp path
        parts.append(f"[stderr]\n{result.stderr.replace(result.workdir + '/', '')}")
    if result.output_truncated:
        parts.append(f"[output cut at {limits.max_output_bytes} bytes per stream; program killed]")
    if result.timed_out:
        parts.append(f"[timed out after {limits.wall_time_s:g} s; program killed]")
    elif result.memory_limit_hit:
        parts.append(f"[memory limit of {limits.memory_mb} MiB reached; a process was killed]")
    elif result.killed_by == "SIGXCPU":
        parts.append(f"[CPU time limit of {limits.cpu_time_s} s reached; program killed]")
    elif result.killed_by and not result.output_truncated:
        parts.append(f"[killed by {result.killed_by}]")
    elif result.exit_code:
        parts.append(f"[exit status {result.exit_code}]")
    return "\n".join(part.rstrip("\n") for part in parts) or "(no output)"
