"""Typed tools: a decorated function becomes a `Tool` with a pydantic argument model and a schema.

`@tool` reads a function's signature and docstring once. The same pydantic model validates the
model's arguments and renders the JSON schema shown to the model, so the prompt can never promise
an argument shape the validator rejects.

`run_tool_call` / `arun_tool_call` never raise and never wait past the tool's timeout. Every
failure becomes a `ToolCallRecord` with an `error_kind`:

- `invalid_arguments`: the arguments fail validation (the message names each field and problem).
  Validation is pydantic's lax mode, so `"3"` for an `int` is accepted; `"abc"` is not.
- `timeout`: the tool ran past `timeout_s`.
- `raised`: the tool raised (the message has the exception type and text).
- `oversized`: the result text is longer than `max_output_chars`. We return an error rather than a
  truncated result, so the model learns to ask for less instead of reasoning over a silently cut
  text; tools that want truncation (the sandboxed `python` tool) cut their own output first.

Where we depart from common practice: sync tools run in a fresh *daemon* thread per call, not in a
`ThreadPoolExecutor`. A Python thread cannot be killed, so a hung tool's thread is abandoned after
the timeout; a pool would keep it and block interpreter exit (and `asyncio.run`'s executor
shutdown) on it. Abandoned threads keep whatever they hold, so code that must be killable (model-
written code above all) belongs in the process sandbox, `agent_grpo.sandbox.runner`. An async tool
that blocks its event loop without awaiting cannot be interrupted by `arun_tool_call`; from
`run_tool_call` it runs on its own loop in a worker thread and is abandoned like a sync tool.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import re
import threading
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, overload

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic.json_schema import GenerateJsonSchema

from agent_grpo.tools.formats.base import TOOL_NAME, short_repr
from agent_grpo.trajectory.record import ToolCallRecord

__all__ = [
    "TOOL_NAME",
    "Tool",
    "args_model_from_signature",
    "arun_tool_call",
    "check_tool_name",
    "format_tool_result",
    "result_to_text",
    "run_tool_call",
    "tool",
]


@dataclass(frozen=True)
class Tool:
    """A function the model may call, with its validated argument model and limits."""

    name: str
    """Name the model calls the tool by."""
    description: str
    """What the tool does, shown to the model (the docstring's first paragraph)."""
    args_model: type[BaseModel]
    """Pydantic model of the arguments; validates calls and renders the JSON schema."""
    fn: Callable[..., Any]
    """The decorated function (sync or async)."""
    is_async: bool
    """Whether `fn` is a coroutine function."""
    timeout_s: float
    """Seconds one call may run before it is abandoned with a `timeout` error."""
    max_output_chars: int
    """Longest result text accepted; longer is an `oversized` error."""
    needs_sandbox: bool = False
    """Whether it runs code in the sandbox: preflight refuses a run where the sandbox cannot."""

    def __post_init__(self) -> None:
        check_tool_name(self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the underlying function directly (no validation, timeout or size cap)."""
        return self.fn(*args, **kwargs)

    def json_schema(self) -> dict[str, Any]:
        """The OpenAI function-calling schema of this tool."""
        parameters = self.args_model.model_json_schema(schema_generator=_SchemaWithoutTitles)
        parameters.pop("title", None)
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": parameters,
            },
        }


def check_tool_name(name: object) -> None:
    """ValueError, one line naming the tool, unless `name` fits `TOOL_NAME`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool name {short_repr(name)} cannot be used: it is empty")
    if TOOL_NAME.fullmatch(name):
        return
    if len(name) > 64:
        why = f"it is {len(name)} characters long (at most 64)"
    else:
        bad = next(c for c in name if not TOOL_NAME.fullmatch(c))
        why = f"it holds {bad!r}"
    raise ValueError(
        f"tool name {short_repr(name)} cannot be used: {why}; a tool name is made of letters, "
        "digits, '_', '.' and '-' (it is written into prompts, where other text could read as "
        "template markup)"
    )


class _SchemaWithoutTitles(GenerateJsonSchema):
    """Schema generator that drops per-field titles ("Code" for `code`): prompt tokens, no info."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload
def tool(
    fn: None = None,
    /,
    *,
    name: str | None = None,
    timeout_s: float = 10.0,
    max_output_chars: int = 8000,
    needs_sandbox: bool = False,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    timeout_s: float = 10.0,
    max_output_chars: int = 8000,
    needs_sandbox: bool = False,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Turn a typed function into a `Tool`; use as `@tool` or `@tool(timeout_s=2)`."""

    def build(f: Callable[..., Any]) -> Tool:
        tool_name = name or f.__name__
        return Tool(
            name=tool_name,
            description=_first_paragraph(inspect.getdoc(f) or ""),
            args_model=args_model_from_signature(f, model_name=f"{tool_name}_args"),
            fn=f,
            is_async=inspect.iscoroutinefunction(f),
            timeout_s=timeout_s,
            max_output_chars=max_output_chars,
            needs_sandbox=needs_sandbox,
        )

    return build if fn is None else build(fn)


def args_model_from_signature(fn: Callable[..., Any], model_name: str) -> type[BaseModel]:
    """Build a strict-keys pydantic model from `fn`'s annotations, defaults and docstring."""
    hints = typing.get_type_hints(fn, include_extras=True)
    doc_args = _docstring_args(inspect.getdoc(fn) or "")
    fields: dict[str, Any] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(f"tool {fn.__name__}: argument {param.name!r} must be a named argument")
        if param.name not in hints:
            raise TypeError(f"tool {fn.__name__}: argument {param.name!r} needs a type annotation")
        default = ... if param.default is param.empty else param.default
        field = Field(default=default)
        if param.name in doc_args and not _has_description(hints[param.name]):
            field = Field(default=default, description=doc_args[param.name])
        fields[param.name] = (hints[param.name], field)
    # extra="forbid": an argument the model invents is an error it can learn from, not ignored.
    return create_model(model_name, __config__=ConfigDict(extra="forbid"), **fields)


def _has_description(annotation: Any) -> bool:
    """Whether an `Annotated[...]` annotation already carries a Field description."""
    extras = getattr(annotation, "__metadata__", ())
    return any(isinstance(m, FieldInfo) and m.description for m in extras)


def _first_paragraph(doc: str) -> str:
    """The docstring's first paragraph on one line."""
    return " ".join(doc.strip().split("\n\n")[0].split())


_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters):\s*$")
_ARG_LINE = re.compile(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _docstring_args(doc: str) -> dict[str, str]:
    """Per-argument descriptions from a Google-style `Args:` section."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if _SECTION.match(line)), None)
    if start is None:
        return {}
    section_indent = len(lines[start]) - len(lines[start].lstrip())
    out: dict[str, str] = {}
    current: str | None = None
    entry_indent = None
    for line in lines[start + 1 :]:
        indent = len(line) - len(line.lstrip())
        if line.strip() and indent <= section_indent:
            break  # the next section ("Returns:") begins
        match = _ARG_LINE.match(line.strip())
        if match and (entry_indent is None or indent <= entry_indent):
            entry_indent, current = indent, match.group(1)
            out[current] = match.group(2).strip()
        elif current and line.strip():
            out[current] = f"{out[current]} {line.strip()}".strip()
    return out


def run_tool_call(tool: Tool, arguments: dict[str, Any], *, raw: str = "") -> ToolCallRecord:
    """Validate and run one call in a worker thread, with the tool's timeout; never raises."""
    start = time.perf_counter()
    kwargs, error = _validate(tool, arguments)
    if error is not None:
        return _record(tool, arguments, raw, start, error=error, kind="invalid_arguments")
    outcome: dict[str, Any] = {}
    worker = threading.Thread(
        target=_run_in_thread, args=(tool, kwargs, outcome), name=f"tool-{tool.name}", daemon=True
    )
    worker.start()
    worker.join(tool.timeout_s)
    if worker.is_alive():
        return _record(tool, arguments, raw, start, error=_timeout_error(tool), kind="timeout")
    return _finish(tool, arguments, raw, start, outcome)


async def arun_tool_call(tool: Tool, arguments: dict[str, Any], *, raw: str = "") -> ToolCallRecord:
    """Async twin of `run_tool_call`: async tools run on this loop, sync ones in a thread."""
    start = time.perf_counter()
    kwargs, error = _validate(tool, arguments)
    if error is not None:
        return _record(tool, arguments, raw, start, error=error, kind="invalid_arguments")
    task = asyncio.ensure_future(_call_async(tool, kwargs))
    # asyncio.wait, not wait_for: wait_for waits for a cancelled task to finish, so a tool that
    # swallows CancelledError would hang us past the timeout.
    done, _ = await asyncio.wait({task}, timeout=tool.timeout_s)
    if not done:
        task.cancel()
        task.add_done_callback(_consume_result)
        return _record(tool, arguments, raw, start, error=_timeout_error(tool), kind="timeout")
    outcome: dict[str, Any] = {}
    if task.cancelled():  # the tool cancelled itself; `task.exception()` would raise
        outcome["error"] = asyncio.CancelledError("the tool's task was cancelled")
    elif task.exception() is not None:
        outcome["error"] = task.exception()
    else:
        outcome["value"] = task.result()
    return _finish(tool, arguments, raw, start, outcome)


def format_tool_result(record: ToolCallRecord) -> str:
    """The text sent back to the model: the result, or `Error: ...` saying what to fix."""
    if record.error is None:
        return record.result or ""
    message = record.error.removeprefix("Error:").strip()
    return f"Error: {message}"


async def _call_async(tool: Tool, kwargs: dict[str, Any]) -> Any:
    if tool.is_async:
        return await tool.fn(**kwargs)
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def deliver(outcome: dict[str, Any]) -> None:
        if future.done():  # cancelled by the timeout
            return
        if "error" in outcome:
            future.set_exception(outcome["error"])
        else:
            future.set_result(outcome["value"])

    def work() -> None:
        outcome: dict[str, Any] = {}
        _run_in_thread(tool, kwargs, outcome)
        # RuntimeError: the loop closed while the abandoned tool was still running.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(deliver, outcome)

    threading.Thread(target=work, name=f"tool-{tool.name}", daemon=True).start()
    return await future


def _consume_result(task: asyncio.Future[Any]) -> None:
    """Mark a cancelled-after-timeout task's exception retrieved, so asyncio does not log it."""
    if not task.cancelled():
        task.exception()


_CANCEL_GRACE_S = 1.0


def _run_in_thread(tool: Tool, kwargs: dict[str, Any], outcome: dict[str, Any]) -> None:
    """Worker-thread body: run the tool (an async one on its own loop) into `outcome`."""
    try:
        if tool.is_async:
            outcome["value"] = asyncio.run(_with_timeout(tool, kwargs))
        else:
            outcome["value"] = tool.fn(**kwargs)
    except BaseException as error:  # a tool calling sys.exit() must not escape either
        outcome["error"] = error


async def _with_timeout(tool: Tool, kwargs: dict[str, Any]) -> Any:
    # The caller has given up at timeout_s; cancelling a little later lets a well-behaved
    # coroutine's loop close and its thread end, without racing the caller's own timeout.
    return await asyncio.wait_for(tool.fn(**kwargs), tool.timeout_s + _CANCEL_GRACE_S)


def _validate(tool: Tool, arguments: Any) -> tuple[dict[str, Any], str | None]:
    """Validated keyword arguments, or an error message naming each bad field."""
    if not isinstance(arguments, dict):
        kind = type(arguments).__name__
        return {}, f"arguments to {tool.name} must be a JSON object, got {kind}. {_usage(tool)}"
    try:
        validated = tool.args_model.model_validate(arguments)
    except ValidationError as error:
        problems = "; ".join(_describe_problem(e) for e in error.errors())
        return {}, f"invalid arguments to {tool.name}: {problems}. {_usage(tool)}"
    except Exception as error:  # the tool's own validator raised something pydantic passes on
        problem = f"{type(error).__name__}: {_exception_text(error)}"
        return {}, f"invalid arguments to {tool.name}: {problem}. {_usage(tool)}"
    return dict(validated), None  # dict(model), not model_dump: nested models stay models


def _describe_problem(error: Any) -> str:
    # Field names can be model-written (an unexpected argument), so they are cut like values.
    field = short_repr(".".join(str(p) for p in error["loc"]) or "<arguments>")
    if error["type"] == "missing":
        return f"missing required argument {field}"
    if error["type"] == "extra_forbidden":
        return f"unexpected argument {field}"
    return f"argument {field}: {error['msg']} (got {short_repr(error.get('input'))})"


def _usage(tool: Tool) -> str:
    """`Expected arguments: code (string, required), ...` for error messages."""
    schema = tool.args_model.model_json_schema()
    required = set(schema.get("required", []))
    parts = []
    for field, spec in schema.get("properties", {}).items():
        kind = spec.get("type") or "|".join(s.get("type", "?") for s in spec.get("anyOf", []))
        parts.append(f"{field} ({kind}, {'required' if field in required else 'optional'})")
    return f"Expected arguments: {', '.join(parts) or 'none'}."


def _timeout_error(tool: Tool) -> str:
    return (
        f"tool {tool.name} timed out after {tool.timeout_s:g} s and was abandoned. "
        "Call it with a smaller or simpler request."
    )


def _finish(
    tool: Tool, arguments: dict[str, Any], raw: str, start: float, outcome: dict[str, Any]
) -> ToolCallRecord:
    """Turn a finished call's value or exception into a record (size cap applied)."""
    if "error" in outcome:
        error = outcome["error"]
        message = f"tool {tool.name} raised {type(error).__name__}: {_exception_text(error)}"
        return _record(tool, arguments, raw, start, error=message, kind="raised")
    try:
        text = result_to_text(outcome.get("value"))
    except Exception as error:
        message = f"tool {tool.name} returned a result that is not text: {error}"
        return _record(tool, arguments, raw, start, error=message, kind="raised")
    if len(text) > tool.max_output_chars:
        message = (
            f"tool {tool.name} returned {len(text)} characters; the limit is "
            f"{tool.max_output_chars}. Ask for less output (a summary, a slice, fewer results)."
        )
        return _record(tool, arguments, raw, start, error=message, kind="oversized")
    return _record(tool, arguments, raw, start, result=text)


def _exception_text(error: BaseException) -> str:
    """`str(error)`, or a placeholder when even that raises (a broken `__str__` is the tool's
    bug, and must not escape a call documented never to raise)."""
    try:
        return str(error)
    except Exception:
        return "<the exception could not be shown>"


def result_to_text(value: Any) -> str:
    """A tool's return value as the text the model sees: str as is, containers as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    if isinstance(value, dict | list | tuple | int | float | bool) or value is None:
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def _record(
    tool: Tool,
    arguments: Any,
    raw: str,
    start: float,
    *,
    result: str | None = None,
    error: str | None = None,
    kind: str | None = None,
) -> ToolCallRecord:
    return ToolCallRecord(
        name=tool.name,
        arguments=arguments if isinstance(arguments, dict) else None,
        raw=raw,
        result=result,
        error=error,
        error_kind=kind,
        latency_s=time.perf_counter() - start,
    )
