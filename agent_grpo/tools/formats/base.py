"""Tool-call formats: how tool calls are written in an assistant turn, and how tools are announced.

The default is the Hermes/Qwen format: each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, several per turn
allowed. A format is one small class implementing `ToolCallFormat`; `find_tagged_blocks` and
`decode_call_json` are the shared pieces, so a new tagged-JSON format is a few lines.

Parsing never raises on model output: every call becomes a `ParsedToolCall` or a typed
`ToolCallParseError` value, so a malformed call can be counted, rewarded or fed back to the model.
Departures from lenient parsers: an unclosed `<tool_call>` (turn cut by max tokens) is a `parse`
error, not a best-effort call, and `arguments` must be a JSON object (a JSON-encoded string of an
object, which some models emit, is not unwrapped), so the reward sees exactly what was written.
For the same reason, and so that every parsed call can be stored, a call is a `parse` error when
its JSON is nested deeper than `MAX_JSON_DEPTH`, holds an integer too long for Python to read, or
holds a number JSON cannot hold (`NaN`, `Infinity`, or a float such as `1e999` that overflows).
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = [
    "MAX_JSON_DEPTH",
    "HermesToolCallFormat",
    "ParsedToolCall",
    "SupportsArgs",
    "ToolCallFormat",
    "ToolCallParseError",
    "decode_call_json",
    "find_tagged_blocks",
    "parse_tool_calls",
    "short_repr",
]

MAX_JSON_DEPTH = 64
"""Deepest nesting of objects and arrays a tool call may have (no real tool needs a tenth)."""


class _Value(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class ParsedToolCall(_Value):
    """A well-formed tool call: a name and a JSON object of arguments."""

    name: str
    """Tool name as written by the model."""
    arguments: dict[str, Any]
    """Arguments as parsed from JSON (not yet coerced by the tool's args model)."""
    raw: str
    """The exact text of the call, tags included."""


class ToolCallParseError(_Value):
    """A tool call that could not be used; a value returned by parsers, never raised."""

    kind: Literal["parse", "missing_name", "unknown_tool", "invalid_arguments"]
    """parse: not JSON / not closed; missing_name: no usable `name`; unknown_tool: no such tool;
    invalid_arguments: the arguments do not fit the tool's args model."""
    message: str
    """What is wrong, written so it can be shown to the model."""
    raw: str
    """The exact text of the call, tags included."""
    name: str | None = None
    """The tool name, when one could be read."""


class SupportsArgs(Protocol):
    """Anything with a pydantic model of its arguments (e.g. `agent_grpo.tools.tool.Tool`)."""

    @property
    def args_model(self) -> type[BaseModel]:
        """The pydantic model the call's arguments must validate against."""
        ...


class ToolCallFormat(Protocol):
    """How tool calls are written by the model and how tools are described to it."""

    @property
    def stop_strings(self) -> list[str]:
        """Strings that may end a turn right after a call (kept in the sampled output)."""
        ...

    def parse(self, text: str) -> list[ParsedToolCall | ToolCallParseError]:
        """Every call in one assistant turn, in order."""
        ...

    def render_tools(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        """The instructions and tool schemas to place in the system prompt."""
        ...


def find_tagged_blocks(text: str, open_tag: str, close_tag: str) -> list[tuple[str, str | None]]:
    """(raw, inner) for each `open_tag...close_tag` block; inner is None when it is not closed."""
    blocks: list[tuple[str, str | None]] = []
    start = text.find(open_tag)
    while start != -1:
        body = start + len(open_tag)
        close = text.find(close_tag, body)
        reopen = text.find(open_tag, body)
        if close == -1 or (reopen != -1 and reopen < close):
            # Unclosed: the block runs up to the next opening tag, or to the end of the turn.
            end = len(text) if reopen == -1 else reopen
            blocks.append((text[start:end], None))
            start = reopen
            continue
        end = close + len(close_tag)
        blocks.append((text[start:end], text[body:close]))
        start = text.find(open_tag, end)
    return blocks


def _json_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:  # longer than `sys.get_int_max_str_digits()`
        raise ValueError(f"an integer of {len(text)} digits is too long") from None


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _json_depth(value: Any) -> int:
    """Nesting depth of objects and arrays in a decoded JSON value (a scalar is 0); iterative."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth + 1)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _load_json(inner: str) -> tuple[Any, str | None]:
    """The decoded JSON value, or an error message; never raises."""
    try:
        obj = json.loads(
            inner, parse_int=_json_int, parse_float=_finite_float, parse_constant=_no_constant
        )
    except RecursionError:
        return None, f"tool call JSON is nested deeper than {MAX_JSON_DEPTH} levels"
    except json.JSONDecodeError as error:
        return None, f"tool call is not valid JSON: {error}"
    except ValueError as error:  # from the three number hooks above
        return None, f"tool call holds a number that cannot be read: {error}"
    if _json_depth(obj) > MAX_JSON_DEPTH:
        return None, f"tool call JSON is nested deeper than {MAX_JSON_DEPTH} levels"
    return obj, None


def decode_call_json(raw: str, inner: str) -> ParsedToolCall | ToolCallParseError:
    """Decode `{"name": str, "arguments": {...}}`; `arguments` defaults to {} when absent."""
    obj, problem = _load_json(inner)
    if problem is not None:
        return ToolCallParseError(kind="parse", message=problem, raw=raw)
    if not isinstance(obj, dict):
        found = type(obj).__name__
        return ToolCallParseError(
            kind="parse", message=f"tool call must be a JSON object, got {found}", raw=raw
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallParseError(
            kind="missing_name",
            message=f'tool call needs a non-empty string "name", got {short_repr(name)}',
            raw=raw,
        )
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCallParseError(
            kind="invalid_arguments",
            message=f'"arguments" of {name} must be a JSON object, got {type(arguments).__name__}',
            raw=raw,
            name=name,
        )
    return ParsedToolCall(name=name, arguments=arguments, raw=raw)


_HERMES_INSTRUCTIONS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class HermesToolCallFormat:
    """Hermes/Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several per turn."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    @property
    def stop_strings(self) -> list[str]:
        """End the turn after the first complete call."""
        return [self.close_tag]

    def parse(self, text: str) -> list[ParsedToolCall | ToolCallParseError]:
        """Every `<tool_call>` block of the turn, in order."""
        return [
            decode_call_json(raw, inner)
            if inner is not None
            else ToolCallParseError(
                kind="parse", message=f"{self.open_tag} is never closed", raw=raw
            )
            for raw, inner in find_tagged_blocks(text, self.open_tag, self.close_tag)
        ]

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call laid out as the tool block shows it (for expert policies and SFT data)."""
        body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
        # `<\/` is JSON for `</`: a `</tool_call>` inside an argument must not close the block.
        body = body.replace("</", "<\\/")
        return f"{self.open_tag}\n{body}\n{self.close_tag}"

    def render_tools(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        """Qwen2.5's tool block: one `{"type": "function", "function": schema}` per line."""
        lines = [json.dumps(_as_function(schema), ensure_ascii=False) for schema in schemas]
        return _HERMES_INSTRUCTIONS.format(tools="\n".join(lines))


def _as_function(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    # Accept both the bare `{"name", "description", "parameters"}` and the wrapped OpenAI form.
    return schema if "function" in schema else {"type": "function", "function": dict(schema)}


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 80


def short_repr(value: Any) -> str:
    """`repr(value)` cut to about 80 characters: model-written values go into error messages,
    and a megabyte argument must not come back as a megabyte observation."""
    return _SHORT_REPR.repr(value)


def _describe_validation(name: str, error: ValidationError) -> str:
    problems = []
    for item in error.errors():
        # An unexpected argument's name is model-written too, so it is cut like the values.
        field = ".".join(str(part) for part in item["loc"])[:80] or "<arguments>"
        given = "" if item["type"] == "missing" else f" (got {short_repr(item['input'])})"
        problems.append(f"{field}: {item['msg']}{given}")
    return f"invalid arguments for {name}: " + "; ".join(problems)


def _check_call(
    call: ParsedToolCall, tools: Mapping[str, SupportsArgs]
) -> ParsedToolCall | ToolCallParseError:
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        message = f"unknown tool {short_repr(call.name)}; available tools: {known}"
        return ToolCallParseError(
            kind="unknown_tool", message=message, raw=call.raw, name=call.name
        )
    try:
        tool.args_model.model_validate(call.arguments)
    except ValidationError as error:
        message = _describe_validation(call.name, error)
        return ToolCallParseError(
            kind="invalid_arguments", message=message, raw=call.raw, name=call.name
        )
    except Exception as error:  # a tool's own validator that raises, say, TypeError
        message = f"invalid arguments for {call.name}: {type(error).__name__}: {error}"
        return ToolCallParseError(
            kind="invalid_arguments", message=message[:500], raw=call.raw, name=call.name
        )
    return call


def parse_tool_calls(
    text: str,
    tools: Mapping[str, SupportsArgs] | None = None,
    fmt: ToolCallFormat | None = None,
) -> list[ParsedToolCall | ToolCallParseError]:
    """Parse every call in `text`; with `tools`, also check names and validate arguments."""
    calls = (fmt or HermesToolCallFormat()).parse(text)
    if tools is None:
        return calls
    return [_check_call(c, tools) if isinstance(c, ParsedToolCall) else c for c in calls]
