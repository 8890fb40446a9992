"""A stdio MCP server's stderr is kept as a bounded tail (the last `STDERR_TAIL_BYTES`), which
still ends the error message when the server fails: a file kept everything (300 MB in 14 s from
a noisy server)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from agent_grpo.tools.mcp_client import STDERR_TAIL_BYTES, McpClient, McpServer, McpServerError

NOISY = [sys.executable, str(Path(__file__).with_name("noisy_mcp_server.py"))]
LAST_LINE = "noisy server: cannot open its database, giving up"
NOISE_MB = 32


def largest_open_file() -> int:
    """Size in bytes of the largest regular file this process holds open (0 if none)."""
    sizes = [0]
    for fd in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            sizes.append(st.st_size)
    return max(sizes)


def test_a_noisy_servers_stderr_is_a_bounded_tail_that_ends_the_failure_message() -> None:
    client = McpClient(McpServer(command=[*NOISY, str(NOISE_MB)]))
    before = largest_open_file()
    try:
        with pytest.raises(McpServerError, match="could not start") as failed:
            client.tools()
        assert str(failed.value).endswith(f"noise \n{LAST_LINE}")
        assert largest_open_file() <= max(before, STDERR_TAIL_BYTES)  # no file holds the noise
        tail = client.stderr_tail()
        assert tail.endswith(LAST_LINE + "\n") and len(tail.encode()) == STDERR_TAIL_BYTES
    finally:
        client.close()
