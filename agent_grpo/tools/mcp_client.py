"""Tools from MCP servers, through the official `mcp` SDK (the `mcp` extra).

`McpServer` says how to reach a server: a command started as a subprocess and spoken to over its
stdin/stdout, or a URL (streamable HTTP). `McpClient` holds the connection to one server and turns
the tools it lists into ordinary `Tool`s; `envs.mcp_env.McpToolEnv` is the env built on it.

The tools behave like built-in ones. The server's input schema is what the model sees and what
its arguments are validated against before anything is sent (`tools/schema_args.py`), so a bad
call is `invalid_arguments` (malformed) without a round trip. Calls run through `run_tool_call`
with the server's `timeout_s` and `max_output_chars`. A result is its text content, blocks joined
by newlines. An error result (`isError`) raises `McpToolError`, and a server that exits or stops
answering raises `McpServerError`: both reach the model as `Error: ...` (kind `raised`), a call
past its deadline as a `timeout`. `mcp` is imported only when a server is first needed.

Where we depart from common practice:

- The SDK is async and the env API is sync, called from worker threads. Instead of `asyncio.run`
  per call (a new connection, and a new server, every time), each client owns an event loop on a
  daemon thread, started at first use; every SDK object lives on it and sync methods submit to it.
- A call past its deadline is cancelled, then the server is asked for its tool list with a short
  deadline (`probe_timeout_s`). One that cannot answer is hung: it is killed (a URL session is
  dropped). A server that exits is treated the same way. Either way a new one is started at once
  in the background, so the next call does not pay for the start; whatever the old one kept in
  memory is lost (Notes-v0 keeps its state in a file for that reason).
- A stdio server's stderr goes to a pipe the client's loop drains, keeping only the last
  `STDERR_TAIL_BYTES` (shown in startup errors, and by `McpClient.stderr_tail`): a file kept
  everything, and a noisy server filled the disk with it (docs/benchmarks.md, "MCP servers").
- Stopping a stdio server is the SDK's: stdin closed, 2 s, SIGTERM to its process group, 2 s,
  SIGKILL. The server runs in its own session, so the kill takes its children with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import json
import math
import os
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self, TextIO, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, Field, model_validator

from agent_grpo.logs import get_logger
from agent_grpo.tools.schema_args import schema_args_model
from agent_grpo.tools.tool import Tool, check_tool_name

if TYPE_CHECKING:
    from mcp.client import Transport
    from mcp.types import CallToolResult, ContentBlock

__all__ = [
    "CANCEL_GRACE_S",
    "SHUTDOWN_BOUND_S",
    "STDERR_TAIL_BYTES",
    "McpClient",
    "McpServer",
    "McpServerError",
    "McpToolError",
    "result_text",
]

_log = get_logger(__name__)
T = TypeVar("T")

CANCEL_GRACE_S = 1.0
"""The loop-side deadline of a call is `timeout_s` plus this, so `run_tool_call`'s own timeout
reports first (as `timeout`) and the cancel and probe happen after it has given up."""
SHUTDOWN_BOUND_S = 10.0
"""Longest wait for a connection to close: the SDK's stop sequence takes at most about 7 s."""
STDERR_TAIL_BYTES = 64 * 1024
"""Most bytes of a stdio server's stderr kept (the last ones written)."""


class McpServer(BaseModel):
    """How to reach one MCP server, and the limits its tools run under."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    command: list[str] | None = None
    """Program and arguments of a stdio server, e.g. `["python", "-m", "my.server"]`."""
    url: str | None = None
    """URL of a streamable-HTTP server, e.g. `http://127.0.0.1:8000/mcp` (instead of a command)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for a stdio server, over the SDK's minimal set (HOME, PATH, ...)."""
    cwd: str | None = None
    """Working directory of a stdio server (default: ours)."""
    tools: list[str] | None = None
    """Names of the tools to expose, in this order; None exposes every tool the server lists."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Seconds one call may run before it is abandoned with a `timeout` error."""
    max_output_chars: int = Field(default=8000, gt=0)
    """Longest result text accepted; longer is an `oversized` error."""
    startup_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds to start the server and finish the handshake before it is killed."""
    probe_timeout_s: float = Field(default=2.0, gt=0)
    """Seconds a server has to list its tools after a timed-out call before it counts as hung."""
    forbid_extra_arguments: bool = True
    """Reject arguments the schema does not name, unless it sets `additionalProperties` itself."""

    @model_validator(mode="after")
    def _one_target(self) -> Self:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of command (a stdio server) and url")
        if self.command is not None and not self.command:
            raise ValueError("command must name a program")
        return self


class McpServerError(RuntimeError):
    """The server could not be started, exited, or stopped answering."""


class McpToolError(RuntimeError):
    """The server answered a call with an error result; the message is the server's text."""


# --- Results ------------------------------------------------------------------------------------


def result_text(result: CallToolResult, tool_name: str = "") -> str:
    """The text the model sees; raises `McpToolError` for an error result."""
    parts = [_block_text(block) for block in result.content]
    text = "\n".join(parts)
    if not parts and result.structured_content is not None:
        text = json.dumps(result.structured_content, ensure_ascii=False)
    if result.is_error:
        # The SDK's MCPServer prefixes every error; the model already knows which tool it called.
        text = text.removeprefix(f"Error executing tool {tool_name}: ")
        raise McpToolError(text or "the server reported an error without a message")
    return text


def _block_text(block: ContentBlock) -> str:
    """A content block as text: text as is, other kinds as a short placeholder."""
    if block.type == "text":
        return block.text
    if block.type == "resource":
        inner = block.resource
        return getattr(inner, "text", None) or f"[resource {inner.uri}]"
    if block.type == "resource_link":
        return f"[resource {block.uri}]"
    return f"[{block.type} {block.mime_type}]"


# --- The client: one connection, on a private event loop ---------------------------------------


@dataclass
class _Connection:
    """One session with a server, held open by `task` until `stop` is set."""

    stop: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to close the session (and stop a stdio server)."""
    ready: asyncio.Future[Any] = field(default_factory=asyncio.Future)
    """Resolves to the SDK `Client` once the handshake is done, or to the startup error."""
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    """Bounds the startup (its deadline), and cancels one that is closed before it finishes."""
    task: asyncio.Task[None] | None = None
    """The task that owns the SDK context managers (they must exit where they were entered)."""

    @property
    def client(self) -> Any:
        """The SDK `Client` (only once `ready` holds it)."""
        return self.ready.result()

    @property
    def alive(self) -> bool:
        """Whether the session is up and not closing."""
        up = self.ready.done() and not self.ready.cancelled() and self.ready.exception() is None
        return up and not self.stop.is_set() and self.task is not None and not self.task.done()


class McpClient:
    """The connection to one MCP server: sync methods, safe to call from any thread."""

    def __init__(self, server: McpServer) -> None:
        self.server = server
        self._lock = threading.Lock()
        self._session: _Session | None = None
        self._tools: list[Tool] | None = None

    def tools(self) -> list[Tool]:
        """The server's tools as `Tool`s, listed once (this starts the server if needed)."""
        if self._tools is None:
            listing = self._run(lambda s: s.list_tools(), self.server.startup_timeout_s)
            listed = {t.name: t for t in listing}
            wanted = self.server.tools if self.server.tools is not None else list(listed)
            missing = [name for name in wanted if name not in listed]
            if missing:
                raise McpServerError(f"the server has no tool {missing}; it has {sorted(listed)}")
            self._tools = [self._tool(listed[name]) for name in wanted]
        return list(self._tools)

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Call one tool and return its text; raises `McpToolError`, `McpServerError` or
        `TimeoutError` (after `timeout_s` plus a grace; `run_tool_call` gives up sooner)."""
        bound = self.server.startup_timeout_s + self.server.timeout_s + self.server.probe_timeout_s
        return self._run(lambda s: s.call_tool(name, arguments), bound)

    def stderr_tail(self) -> str:
        """The last `STDERR_TAIL_BYTES` a stdio server wrote to its stderr ("" before it starts)."""
        with self._lock:
            session = self._session
        if session is None:
            return ""
        return asyncio.run_coroutine_threadsafe(session.stderr_text(), session.loop).result(5)

    def close(self) -> None:
        """Close the session and stop the server (killed if it does not exit); idempotent.

        A later call starts everything again.
        """
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            session.close()

    def _run(self, work: Callable[[_Session], Coroutine[Any, Any, T]], bound: float) -> T:
        """Run `work` on the session's loop and wait for it (at most `bound` plus shutdown)."""
        with self._lock:
            if self._session is None:
                if importlib.util.find_spec("mcp") is None:
                    raise ImportError("MCP tools need the mcp SDK: pip install 'agent-grpo[mcp]'")
                self._session = _Session(self.server)
            session = self._session
        future = asyncio.run_coroutine_threadsafe(work(session), session.loop)
        try:
            return future.result(bound + SHUTDOWN_BOUND_S)
        except concurrent.futures.CancelledError:
            raise McpServerError("the MCP client was closed during the call") from None
        except TimeoutError:
            if future.done():  # the coroutine itself raised TimeoutError
                raise
            future.cancel()
            raise McpServerError(f"no answer from the MCP client within {bound:g} s") from None

    def _tool(self, listed: Any) -> Tool:
        def call(**arguments: Any) -> str:
            return self.call_tool(listed.name, arguments)

        try:
            check_tool_name(listed.name)  # a server's name must not reach a prompt as markup
            args = schema_args_model(
                listed.name, listed.input_schema, self.server.forbid_extra_arguments
            )
        except ValueError as error:
            raise McpServerError(str(error)) from None
        return Tool(
            name=listed.name,
            description=" ".join((listed.description or "").split()),
            args_model=args,
            fn=call,
            is_async=False,
            timeout_s=self.server.timeout_s,
            max_output_chars=self.server.max_output_chars,
        )


class _Session:
    """A client's life between starts and `close()`: its event-loop thread and, on that loop,
    the connection to the server (replaced when the server crashes or hangs)."""

    def __init__(self, server: McpServer) -> None:
        self.server = server
        self.name = server.url or " ".join(server.command or [])[:80]
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name=f"mcp {self.name}", daemon=True
        )
        self._thread.start()
        # Touched only on the loop:
        self._connection: _Connection | None = None
        self._connecting: asyncio.Lock | None = None
        self._closing = False
        self._errlog: _StderrTail | None = None

    def close(self) -> None:
        """Stop the server, then the loop (from any thread but the loop's)."""
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(
                SHUTDOWN_BOUND_S + 5
            )
        except Exception as error:  # a stuck shutdown must not keep close() from returning
            _log.warning("MCP server %s did not shut down cleanly: %r", self.name, error)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()

    async def list_tools(self) -> list[Any]:
        """Every tool the server lists (page by page)."""
        client = (await self._connect()).client
        tools: list[Any] = []
        cursor: str | None = None
        while True:
            page = await client.list_tools(cursor=cursor)
            tools += page.tools
            if not (cursor := page.next_cursor):
                return tools

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """One call, with the deadline, the probe and the replacement of a dead server."""
        connection = await self._connect()
        try:
            with anyio.fail_after(self.server.timeout_s + CANCEL_GRACE_S):
                result = await connection.client.call_tool(name, arguments)
        except TimeoutError:
            hung = not await self._answers(connection)
            after = "killed as hung and replaced" if hung else "it still answers"
            raise TimeoutError(f"no result after {self.server.timeout_s:g} s ({after})") from None
        except Exception as error:  # MCPError, a broken pipe, a result that does not validate
            if await self._answers(connection):
                raise McpToolError(str(error)) from None  # a protocol-level error for this call
            raise McpServerError(
                f"the MCP server stopped answering ({error}); a new one is starting"
            ) from None
        return result_text(result, name)

    async def _answers(self, connection: _Connection) -> bool:
        """Whether the server lists its tools within `probe_timeout_s`. If not, it is stopped
        and a new one started in the background, so the next call need not wait for it."""
        try:
            with anyio.fail_after(self.server.probe_timeout_s):
                await connection.client.list_tools(cache_mode="refresh")
            return True
        except Exception:
            assert self._connecting is not None
            async with self._connecting:
                if self._connection is connection:  # not one a concurrent call already replaced
                    await self._close_connection()
            asyncio.create_task(self._connect()).add_done_callback(_ignore_outcome)
            return False

    async def _connect(self) -> _Connection:
        """The live connection, connecting first when there is none."""
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._closing:
                raise McpServerError("the MCP client is closed")
            if self._connection is None or not self._connection.alive:
                await self._close_connection()
                self._connection = _Connection()
                self._connection.task = asyncio.create_task(self._hold(self._connection))
            connection = self._connection
            await asyncio.shield(connection.ready)
            return connection

    async def _hold(self, connection: _Connection) -> None:
        """Open the session, hand it over, keep it open until `stop`; leaving stops the server."""
        from mcp import Client

        startup = self.server.startup_timeout_s
        try:
            connection.scope.deadline = anyio.current_time() + startup
            with connection.scope:
                async with Client(self._transport()) as client:
                    connection.scope.deadline = math.inf
                    connection.ready.set_result(client)
                    await connection.stop.wait()
            if not connection.ready.done():
                why = "was closed" if connection.stop.is_set() else f"took over {startup:g} s"
                raise McpServerError(f"the MCP server {why} while starting; it was stopped")
        except Exception as error:
            if not connection.ready.done():
                connection.ready.set_exception(_startup_error(error, self._stderr_tail()))
            elif not connection.stop.is_set():
                _log.warning("MCP session with %s ended: %r", self.name, error)
        finally:
            connection.stop.set()

    def _transport(self) -> Transport | str:
        """The URL, or a stdio transport whose stderr goes to a file (for startup errors)."""
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        if self.server.url is not None:
            return self.server.url
        assert self.server.command is not None
        if self._errlog is None:  # one for the session's life: every restarted server writes to it
            self._errlog = _StderrTail(self.loop)
        program, *args = self.server.command
        params = StdioServerParameters(
            command=program, args=args, env=self.server.env or None, cwd=self.server.cwd
        )
        return stdio_client(params, errlog=self._errlog.file)

    async def _close_connection(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        connection.stop.set()
        if not connection.ready.done():
            connection.scope.cancel()  # still starting: stop waiting for the handshake
        if connection.task is not None:
            await asyncio.wait({connection.task}, timeout=SHUTDOWN_BOUND_S)

    async def _shutdown(self) -> None:
        self._closing = True
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        # Not under the lock: a connect in progress holds it, and closing cancels that connect.
        await self._close_connection()
        async with self._connecting:  # a connect that was waiting has now seen `_closing`
            await self._close_connection()
        if self._errlog is not None:
            self._errlog.close()
        # Calls still in flight (abandoned after a timeout, say) end now, not with the loop.
        others = asyncio.all_tasks() - {asyncio.current_task()}
        for task in others:
            task.cancel()
        if others:
            await asyncio.wait(others, timeout=1)

    async def stderr_text(self) -> str:
        """What the server last wrote to its stderr (on the loop, where the tail is drained)."""
        return self._errlog.text() if self._errlog is not None else ""

    def _stderr_tail(self, chars: int = 800) -> str:
        tail = (self._errlog.text() if self._errlog is not None else "")[-chars:].strip()
        return f"; its stderr ends: {tail}" if tail else ""


class _StderrTail:
    """The last `limit` bytes written to `file` (a stdio server's stderr): a pipe that `loop`
    drains as data comes, and `text()` drains first, so it holds all a dead server wrote."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int = STDERR_TAIL_BYTES) -> None:
        self._read_fd, write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self.file: TextIO = os.fdopen(write_fd, "w", encoding="utf-8", errors="replace")
        """The write end, given to the server as its stderr."""
        self._limit = limit
        self._tail = bytearray()
        self._loop = loop
        loop.add_reader(self._read_fd, self._drain)

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self._read_fd, 1 << 16):
                self._tail += chunk
                del self._tail[: -self._limit]

    def text(self) -> str:
        """The kept tail, as text (on the loop)."""
        self._drain()
        return self._tail.decode("utf-8", errors="replace")

    def close(self) -> None:
        """Stop draining and close both ends (on the loop)."""
        self._loop.remove_reader(self._read_fd)
        self.file.close()
        os.close(self._read_fd)


def _ignore_outcome(task: asyncio.Task[Any]) -> None:
    """Retrieve a background reconnect's result: a failure shows at the next call instead."""
    if not task.cancelled():
        task.exception()


def _startup_error(error: BaseException, stderr: str) -> McpServerError:
    """A startup failure in one line: the innermost error of the SDK's exception groups."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    if isinstance(error, McpServerError):
        return McpServerError(f"{error}{stderr}")
    kind = type(error).__name__
    return McpServerError(f"could not start the MCP server: {kind}: {error}{stderr}")
