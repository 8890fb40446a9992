"""A stdio MCP server that floods its stderr and then fails, for `test_mcp_client.py`: run as
`python tests/tools/noisy_mcp_server.py MEGABYTES`. It writes MEGABYTES of noise to stderr, then
one last line naming why it gives up, and exits 1 before serving."""

from __future__ import annotations

import sys

LAST_LINE = "noisy server: cannot open its database, giving up"

if __name__ == "__main__":
    noise = "noise " * 170 + "\n"  # about 1 KiB a line
    for _ in range(int(sys.argv[1]) * 1024):
        sys.stderr.write(noise)
    sys.stderr.write(LAST_LINE + "\n")
    sys.exit(1)
