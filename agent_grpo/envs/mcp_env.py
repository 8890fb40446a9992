"""`McpToolEnv`: a tool environment whose tools are an MCP server's.

A subclass is a task generator and a verifier, as for any `ToolEnv`, plus the server
(`mcp_server`, or the constructor's `mcp_server=` from a config). The first `reset()` starts the
server and lists its tools; `close()` stops it. Where we depart from a plain `ToolEnv`:

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

__all__ = ["McpServer", "McpToolEnv", "with_workdir"]

TaskT = TypeVar("TaskT")


class McpToolEnv(ToolEnv[TaskT]):
    """A `ToolEnv` whose tools are an MCP server's, listed (and the server started) at the first
    reset; `close()` stops the server."""

    mcp_server: ClassVar[McpServer | None] = None
    """The server every instance uses, unless the constructor is given one."""

    def __init__(
        self, mcp_server: McpServer | Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        server = mcp_server if mcp_server is not None else type(self).mcp_server
        if server is None:
            raise ValueError(f"{type(self).__name__} needs an mcp_server")
        # A private directory for the server's files: `{workdir}` in its command, env and cwd.
        self.workdir = Path(tempfile.mkdtemp(prefix="agent-grpo-mcp-"))
        self.mcp = McpClient(with_workdir(McpServer.model_validate(server), self.workdir))
        # Stops the server and removes the directory even if the env is dropped without close().
        self._release = weakref.finalize(self, _release, self.mcp, self.workdir)

    def prepare(self, task: TaskT) -> None:
        """Set the server's state up for `task`, after the task is drawn (default: nothing)."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """Take the server's tools (listed once), draw the task and `prepare` the server."""
        self.workdir.mkdir(exist_ok=True)  # close() removed it, and the env is used again
        self.tools = self.mcp.tools()
        messages, info = super().reset(seed=seed, options=options)
        assert self.task is not None
        self.prepare(self.task)
        return messages, info

    def close(self) -> None:
        """Stop the server and remove `workdir`; a later reset starts over."""
        _release(self.mcp, self.workdir)
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
