"""A misbehaving MCP server for `tests/test_mcp.py`, run as `python tests/mcp_servers.py [flags]`.

Its tools answer, fail, crash the process, sleep without blocking, or block the whole event loop
(a hung server). Flags make it misbehave before it serves: exit at once, hang, or ignore SIGTERM
(so only SIGKILL stops it). `--pid-file` records its pid for tests that never reach a tool.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ImageContent, TextContent

server = MCPServer("flaky", log_level="WARNING")


@server.tool()
def echo(text: str, times: int = 1) -> str:
    """Return the text, repeated."""
    return text * times


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@server.tool()
def fail(reason: str) -> str:
    """Report an error result."""
    raise ToolError(f"refused: {reason}")


@server.tool()
def picture() -> list[TextContent | ImageContent]:
    """A caption and an image."""
    return [TextContent(type="text", text="a red dot"),
            ImageContent(type="image", data="iVBORw0KGgo=", mime_type="image/png")]  # fmt: skip


@server.tool()
def crash() -> str:
    """Exit the server process at once."""
    os._exit(3)


@server.tool()
async def nap(seconds: float) -> str:
    """Sleep without blocking the server."""
    import anyio

    await anyio.sleep(seconds)
    return "rested"


@server.tool()
async def stuck() -> str:
    """Block the server's event loop for an hour: nothing else gets an answer."""
    time.sleep(3600)
    return "unreachable"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pid-file", type=Path)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--exit-at-start", action="store_true")
    parser.add_argument("--hang-at-start", action="store_true")
    args = parser.parse_args()
    if args.pid_file:
        args.pid_file.write_text(str(os.getpid()))
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.exit_at_start:
        print("flaky: the configuration is broken", file=sys.stderr, flush=True)
        sys.exit(2)
    if args.hang_at_start:
        time.sleep(3600)
    server.run()


if __name__ == "__main__":
    main()
