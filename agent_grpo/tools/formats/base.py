"""What every tool-call format shares: the protocol, the parsed values, hostile-safe JSON, and
`parse_tool_calls`, which checks a turn's calls against the env's tools.

A format (one module per model family beside this one) says how tools are announced in the
system prompt (`render_tools`), how a call is written (`render_call`, for expert policies and SFT
data) and how calls are read back from sampled text (`parse`). Its `render_call` must
round-trip through its `parse`, including arguments that hold the format's own closing markup:
JSON bodies are written by `dump_json`, which escapes such markup (`</` as `<\\/`, `<tag`, `<|`
and `<｜` with `\\u003c`, `[WORD` with `\\u005b`), and text no escape can protect is refused.

Parsing never raises on model output: every call becomes a `ParsedToolCall` or a typed
`ToolCallParseError` value, so a malformed call can be counted, rewarded or fed back to the model.
Departures from lenient parsers (vLLM's among them): a call cut off before its closing marker
(turn cut by max tokens) is a `parse` error, not a best-effort call, and arguments must be a JSON
object (a JSON-encoded string of an object, which some models emit, is not unwrapped), so the
reward sees exactly what was written. For the same reason, and so that every parsed call can be
stored, a call is a `parse` error when its JSON is nested deeper than `MAX_JSON_DEPTH`, holds an
integer too long for Python to read, or holds a number JSON cannot hold (`NaN`, `Infinity`, or a
float such as `1e999` that overflows).

A format whose arguments are untyped text (Qwen3-Coder's `<parameter=x>value</parameter>`) also
has `typed_arguments` (`TypesArguments`): `parse_tool_calls` gives it the tool's JSON schema, as
vLLM's parser is given the request's tools, before validating.
"""

from __future__ import annotations

import functools
import json
import math
import re
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = [
    "MAX_JSON_DEPTH",
    "TOOL_NAME",
    "JsonProblem",
    "ParsedToolCall",
    "StructuredTurn",
    "StructuresTurns",
    "SupportsArgs",
    "ToolCallFormat",
    "ToolCallParseError",
    "TypesArguments",
    "after_reasoning",
    "arguments_call",
    "as_function",
    "call_from_object",
    "decode_call_json",
    "decode_json_prefix",
    "dump_json",
    "find_tagged_blocks",
    "load_json",
    "parse_error",
    "parse_tool_calls",
    "short_repr",
]

MAX_JSON_DEPTH = 64
"""Deepest nesting of objects and arrays a tool call may have, counting the call object itself
as one level (no real tool needs a tenth)."""


TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""What a tool name may be: it is written into prompts and calls of every format, where a space,
a quote, `<`, `>`, `|`, `[` or a newline could read as template markup (`<|im_end|>`,
`[TOOL_CALLS]`, a closing tag)."""


class _Value(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class ParsedToolCall(_Value):
    """A well-formed tool call: a name and a JSON object of arguments."""

    name: str
    """Tool name as written by the model."""
    arguments: dict[str, Any]
    """Arguments as parsed (not yet coerced by the tool's args model)."""
    raw: str
    """The exact text of the call, tags included."""


class ToolCallParseError(_Value):
    """A tool call that could not be used; a value returned by parsers, never raised."""

    kind: Literal["parse", "missing_name", "unknown_tool", "invalid_arguments"]
    """parse: not JSON / not closed / not the format's layout; missing_name: no usable name;
    unknown_tool: no such tool; invalid_arguments: the arguments do not fit the tool's args
    model."""
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
    def name(self) -> str:
        """The format's registry name (`hermes`, `llama3`, ...)."""
        ...

    @property
    def stop_strings(self) -> list[str]:
        """Strings that may end a turn right after a call (kept in the sampled output)."""
        ...

    def parse(self, text: str) -> list[ParsedToolCall | ToolCallParseError]:
        """Every call in one assistant turn, in order; never raises."""
        ...

    def render_tools(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        """The instructions and tool schemas to place in the system prompt."""
        ...

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call as the model writes it; `parse` reads it back unchanged. Raises ValueError
        for arguments the format cannot write."""
        ...


class StructuredTurn(_Value):
    """A sampled turn as the structured assistant message some chat templates render it from
    (gpt-oss, DeepSeek V3): its text, its reasoning and its calls, read by the format's parser."""

    content: str = ""
    """What the template renders as the message's text (Harmony: the final channel; DeepSeek:
    the text before the calls); empty for none."""
    reasoning: str | None = None
    """The reasoning the template renders from its own field (Harmony's analysis channel, which
    gpt-oss templates read from `thinking`); None for none."""
    calls: tuple[ParsedToolCall, ...] = ()
    """The calls, in order, each named by `TOOL_NAME` (a name the template writes as its own
    text can then hold nothing that reads as markup)."""


@runtime_checkable
class StructuresTurns(Protocol):
    """A format whose family's chat templates render calls from a message's `tool_calls` (and
    reasoning from a field of its own), not from the message's text."""

    def structure(self, text: str) -> StructuredTurn | None:
        """A sampled turn as those fields, read by the format's parser; None when the turn is not
        in the family's layout (a malformed call, text after the calls), so that it is handed to
        the template as its text. Never raises."""
        ...


@runtime_checkable
class TypesArguments(Protocol):
    """A format whose parsed argument values are text, typed by the tool's JSON schema."""

    def typed_arguments(
        self, call: ParsedToolCall, schema: Mapping[str, Any]
    ) -> ParsedToolCall | ToolCallParseError:
        """`call` with each argument value read as the schema's type says; never raises."""
        ...


def parse_error(raw: str, message: str, name: str | None = None) -> ToolCallParseError:
    """A `parse` error for `raw` (the shorthand every format uses)."""
    return ToolCallParseError(kind="parse", message=message, raw=raw, name=name)


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


# ---- JSON that cannot hurt ----------------------------------------------------------------------


class JsonProblem(NamedTuple):
    """Why a text could not be used as a JSON value."""

    message: str
    """Said in a few words, never echoing the text."""
    syntax: bool
    """True when the text is not JSON at all; False for JSON we refuse to hold (too deep, an
    integer too long, a non-finite number)."""


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


_DECODER = json.JSONDecoder(
    parse_int=_json_int, parse_float=_finite_float, parse_constant=_no_constant
)
_WHITESPACE = re.compile(r"[ \t\n\r]*")


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


def _too_deep() -> JsonProblem:
    return JsonProblem(f"tool call JSON is nested deeper than {MAX_JSON_DEPTH} levels", False)


def _decoded(decode: Callable[[], Any], depth: int) -> tuple[Any, JsonProblem | None]:
    """Run `decode` (a `json` call with our number hooks) and check the depth; never raises."""
    try:
        value = decode()
    except RecursionError:
        return None, _too_deep()
    except json.JSONDecodeError as error:
        return None, JsonProblem(f"tool call is not valid JSON: {error}", True)
    except ValueError as error:  # from the three number hooks above
        return None, JsonProblem(f"tool call holds a number that cannot be read: {error}", False)
    if _json_depth(value) > depth:
        return None, _too_deep()
    return value, None


def load_json(text: str, *, depth: int = MAX_JSON_DEPTH) -> tuple[Any, JsonProblem | None]:
    """The JSON value `text` holds (whitespace around it allowed), or why not; never raises.

    `depth` is the most levels the value may nest: `MAX_JSON_DEPTH` for a whole call object,
    `MAX_JSON_DEPTH - 1` for an arguments object written on its own (the call is one level)."""
    return _decoded(lambda: _DECODER.decode(text), depth)


def decode_json_prefix(
    text: str, start: int = 0, *, depth: int = MAX_JSON_DEPTH
) -> tuple[Any, int, JsonProblem | None]:
    """The JSON value that begins at `start` (after whitespace) and the index just past it, for
    calls written one after another (`{...}; {...}`); never raises."""
    begin = _WHITESPACE.match(text, start).end()  # type: ignore[union-attr]
    found: list[int] = []

    def decode() -> Any:
        value, end = _DECODER.raw_decode(text, begin)
        found.append(end)
        return value

    value, problem = _decoded(decode, depth)
    return value, (found[0] if found else begin), problem


_TAG_OPEN = re.compile(r"<(?=[A-Za-z|｜])")
_BRACKET_WORD = re.compile(r"\[(?=[A-Z/])")


def dump_json(value: Any, *, indent: int | None = None) -> str:
    """JSON text that no template or tokenizer can read as markup: `</` (a closing tag) is
    written `<\\/`, a `<` before a letter, `|` or `｜` (an opening tag, a special token) and a `[`
    before a capital or `/` (Mistral's `[TOOL_CALLS]`, `[ARGS]`) as `\\u` escapes; all decode to
    the same value. Outside strings JSON never holds these, so only strings change. Raises
    ValueError for NaN and infinities, which JSON cannot hold."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, indent=indent)
    text = _TAG_OPEN.sub(r"\\u003c", text.replace("</", "<\\/"))
    return _BRACKET_WORD.sub(r"\\u005b", text)


def as_function(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A tool schema in the wrapped OpenAI form `{"type": "function", "function": {...}}`,
    whether it came bare (`{"name", "description", "parameters"}`) or wrapped."""
    return dict(schema) if "function" in schema else {"type": "function", "function": dict(schema)}


# ---- calls from decoded JSON ---------------------------------------------------------------------


def call_from_object(
    raw: str, obj: Any, arguments_keys: Sequence[str] = ("arguments",)
) -> ParsedToolCall | ToolCallParseError:
    """A call from a decoded `{"name": str, <arguments key>: {...}}`; the arguments default to
    {} when absent. `arguments_keys` are the keys the format accepts for the arguments (Llama's
    template writes `parameters`); a call that sets two of them is refused."""
    if not isinstance(obj, dict):
        found = type(obj).__name__
        return parse_error(raw, f"tool call must be a JSON object, got {found}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallParseError(
            kind="missing_name",
            message=f'tool call needs a non-empty string "name", got {short_repr(name)}',
            raw=raw,
        )
    present = [key for key in arguments_keys if key in obj]
    if len(present) > 1:
        both = " and ".join(f'"{key}"' for key in present)
        return parse_error(raw, f"tool call {short_repr(name)} sets both {both}", name)
    key = present[0] if present else arguments_keys[0]
    arguments = obj.get(key, {})
    if not isinstance(arguments, dict):
        found = type(arguments).__name__
        message = f'"{key}" of {short_repr(name)} must be a JSON object, got {found}'
        return ToolCallParseError(kind="invalid_arguments", message=message, raw=raw, name=name)
    return ParsedToolCall(name=name, arguments=arguments, raw=raw)


def decode_call_json(raw: str, inner: str) -> ParsedToolCall | ToolCallParseError:
    """Decode `{"name": str, "arguments": {...}}`; `arguments` defaults to {} when absent."""
    obj, problem = load_json(inner)
    if problem is not None:
        return parse_error(raw, problem.message)
    return call_from_object(raw, obj)


def arguments_call(raw: str, name: str, text: str) -> ParsedToolCall | ToolCallParseError:
    """A call whose name the markup gives and whose `text` is the JSON arguments object alone
    (Harmony, DeepSeek, Mistral v11)."""
    if not name.strip():
        message = f"tool call needs a non-empty function name, got {short_repr(name)}"
        return ToolCallParseError(kind="missing_name", message=message, raw=raw)
    arguments, problem = load_json(text, depth=MAX_JSON_DEPTH - 1)
    if problem is not None:
        return parse_error(raw, problem.message, name)
    if not isinstance(arguments, dict):
        found = type(arguments).__name__
        message = f"arguments of {short_repr(name)} must be a JSON object, got {found}"
        return ToolCallParseError(kind="invalid_arguments", message=message, raw=raw, name=name)
    return ParsedToolCall(name=name, arguments=arguments, raw=raw)


# ---- checking calls against the tools ------------------------------------------------------------

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


@functools.lru_cache(maxsize=256)
def _arguments_schema(args_model: type[BaseModel]) -> dict[str, Any]:
    """The JSON schema of a tool's arguments ({} when pydantic cannot write one)."""
    try:
        return args_model.model_json_schema()
    except Exception:  # a field type with no JSON schema: its values stay text
        return {}


def _check_call(
    call: ParsedToolCall, tools: Mapping[str, SupportsArgs], fmt: ToolCallFormat
) -> ParsedToolCall | ToolCallParseError:
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        message = f"unknown tool {short_repr(call.name)}; available tools: {known}"
        return ToolCallParseError(
            kind="unknown_tool", message=message, raw=call.raw, name=call.name
        )
    if isinstance(fmt, TypesArguments):
        typed = fmt.typed_arguments(call, _arguments_schema(tool.args_model))
        if isinstance(typed, ToolCallParseError):
            return typed
        call = typed
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


REASONING_OPEN, REASONING_CLOSE = "<think>", "</think>"
"""The tags reasoning models (Qwen3, QwQ, DeepSeek-R1) put around a turn's reasoning."""


def after_reasoning(text: str) -> str:
    """A turn's text after its reasoning, where its calls are (what vLLM's Qwen3 and DeepSeek-R1
    reasoning parsers hand the tool parser once the reasoning is closed): after the first
    `</think>`; the whole text when the turn closes no reasoning.

    A call a model mentions or drafts in reasoning it then closes is not a call. A turn whose
    reasoning never closes keeps its calls: the call's stop string (`</tool_call>`) ends a turn
    that calls from inside `<think>` before any `</think>`, as Qwen3.5-style models do, and
    dropping those calls would end the episode on an empty answer. A model without reasoning
    that writes `</think>` has the text before it ignored."""
    _, close, tail = text.partition(REASONING_CLOSE)
    return tail if close else text


def parse_tool_calls(
    text: str,
    tools: Mapping[str, SupportsArgs] | None = None,
    fmt: ToolCallFormat | None = None,
) -> list[ParsedToolCall | ToolCallParseError]:
    """Parse every call in `text` (Hermes unless `fmt`); with `tools`, also check names, type
    text arguments (`TypesArguments`) and validate arguments."""
    if fmt is None:
        from agent_grpo.tools.formats.hermes import HermesToolCallFormat

        fmt = HermesToolCallFormat()
    calls = fmt.parse(text)
    if tools is None:
        return calls
    return [_check_call(c, tools, fmt) if isinstance(c, ParsedToolCall) else c for c in calls]
