"""MCP servers as an env's tools: `McpWorkspace` (one server and its private folder) and
`McpToolEnv`, a tool environment whose tools are a server's.

A `McpToolEnv` subclass is a task generator and a verifier, as for any `ToolEnv`, plus the server
(`mcp_server`, or the constructor's `mcp_server=` from a config). The first `reset()` starts the
server and lists its tools; `close()` stops it. Other envs that take a server among their tools
(Dataset-v0's `mcp_server`) hold a `McpWorkspace` the same way. Where we depart from a plain
`ToolEnv`:

- Each env gets a private `workdir`, and `{workdir}` in the server's command, `env` and `cwd`
  stands for it: a server restarted after a crash or a hang has lost its memory, so episode
  state belongs in files there (Notes-v0 keeps a SQLite file).
- `prepare(task)` runs after the task is drawn, to set the server's state up for it.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from agent_grpo.envs.text_env import ToolEnv
from agent_grpo.tools.mcp_client import McpClient, McpServer
from agent_grpo.tools.tool import Tool

__all__ = ["McpServer", "McpToolEnv", "McpWorkspace", "with_workdir"]

TaskT = TypeVar("TaskT")


class McpWorkspace:
    """One MCP server for one env, with a private `workdir` (`{workdir}` in its command, env and
    cwd). The server starts when its tools are first asked for; `close()` stops it and removes
    the folder, and so does dropping the workspace without closing it."""

    def __init__(self, server: McpServer | Mapping[str, Any]) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="agent-grpo-mcp-"))
        self.client = McpClient(with_workdir(McpServer.model_validate(server), self.workdir))
        self._release = weakref.finalize(self, _release, self.client, self.workdir)

    def tools(self) -> list[Tool]:
        """The server's tools (listed once, which starts it); recreates `workdir` if a `close()`
        removed it and the env is used again."""
        self.workdir.mkdir(exist_ok=True)
        return self.client.tools()

    def close(self) -> None:
        """Stop the server and remove `workdir`; a later `tools()` starts over."""
        _release(self.client, self.workdir)


class McpToolEnv(ToolEnv[TaskT]):
    """A `ToolEnv` whose tools are an MCP server's, listed (and the server started) at the first
    reset; `close()` stops the server."""

    mcp_server: ClassVar[McpServer | None] = None
    """The server every instance uses, unless the constructor is given one."""
    concurrent_reset = True  # each instance starts its own server in its own workdir

    def __init__(
        self, mcp_server: McpServer | Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        server = mcp_server if mcp_server is not None else type(self).mcp_server
        if server is None:
            raise ValueError(f"{type(self).__name__} needs an mcp_server")
        self.workspace = McpWorkspace(server)
        self.mcp = self.workspace.client  # what subclasses call (`self.mcp.call_tool`)
        self.workdir = self.workspace.workdir

    def prepare(self, task: TaskT) -> None:
        """Set the server's state up for `task`, after the task is drawn (default: nothing)."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """Take the server's tools (listed once), draw the task and `prepare` the server."""
        self.tools = self.workspace.tools()
        messages, info = super().reset(seed=seed, options=options)
        assert self.task is not None
        self.prepare(self.task)
        return messages, info

    def close(self) -> None:
        """Stop the server and remove `workdir`; a later reset starts over."""
        self.workspace.close()
        super().close()


def with_workdir(server: McpServer, workdir: Path) -> McpServer:
    """`server` with `{workdir}` in its command, env values and cwd replaced by `workdir`."""

    def fill(text: str) -> str:
        return text.replace("{workdir}", str(workdir))

    return server.model_copy(
        update={
            "command": None if server.command is None else [fill(a) for a in server.command],
            "env": {k: fill(v) for k, v in server.env.items()},
            "cwd": None if server.cwd is None else fill(server.cwd),
        }
    )


def _release(client: McpClient, workdir: Path) -> None:
    client.close()
    shutil.rmtree(workdir, ignore_errors=True)
