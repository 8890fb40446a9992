"""Qwen3-Coder: XML calls, `<tool_call><function=NAME><parameter=KEY>value</parameter>...`.

A call as the template writes it:

    <tool_call>
    <function=calculator>
    <parameter=expression>
    6 * 7
    </parameter>
    </function>
    </tool_call>

Tools are announced as XML (`<tools><function><name>...<parameters><parameter>...`), the way
Qwen3-Coder's chat template renders a JSON schema, followed by its instructions.

Values are untyped text: the template writes a string as it is, an object or array as JSON, and
anything else with Python's `str()` (`True`, `None`, `3.5`). So `parse` returns every value as
the text between the tags (one newline after `<parameter=KEY>` and one before `</parameter>`
dropped), and `typed_arguments` reads it by the tool's JSON schema, as vLLM's `qwen3_coder`
parser does: kept as text where the schema allows a string (or says nothing), else JSON (with
`True`/`False`/`None` read as Python wrote them). A value that does not decode stays text and the
args model reports it; JSON we refuse to hold (too deep, huge integers, NaN) is a `parse` error.

What the parser refuses (`parse` errors): a `<tool_call>` never closed, one that does not hold
exactly `<function=NAME>...</function>` (Hermes JSON inside the tags included), a
`<parameter=KEY>` never closed, text between parameters, a parameter given twice.

The format has no escape: a string argument holding `</parameter>`, `<tool_call>` or
`</tool_call>` (or text a tokenizer reads as a special token, `<|`, `<｜`) cannot be written, so
`render_call` refuses it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent_grpo.tools.formats.base import (
    MAX_JSON_DEPTH,
    ParsedToolCall,
    ToolCallParseError,
    as_function,
    dump_json,
    find_tagged_blocks,
    load_json,
    parse_error,
    short_repr,
)

__all__ = ["Qwen3CoderToolCallFormat"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_UNWRITABLE = (PARAMETER_END, OPEN, CLOSE, "<|", "<｜")
_PYTHON_WORDS = {"True": True, "False": False, "None": None}
_SPACE = re.compile(r"\s*")

_INSTRUCTIONS = """

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
<parameter=example_parameter_2>
This is the value for the second parameter
that can span
multiple lines
</parameter>
</function>
</tool_call>

<IMPORTANT>
Reminder:
- Function calls MUST follow the specified format: an inner <function=...></function> block \
must be nested within <tool_call></tool_call> XML tags
- Required parameters MUST be specified
- You may provide optional reasoning for your function call in natural language BEFORE the \
function call, but NOT after
- If there is no function call available, answer the question like normal with your current \
knowledge and do not tell the user about function calls
</IMPORTANT>"""


class Qwen3CoderToolCallFormat:
    """Qwen3-Coder's XML calls; values are text until `typed_arguments` reads them."""

    name = "qwen3_coder"

    @property
    def stop_strings(self) -> list[str]:
        """End the turn after the first complete call."""
        return [CLOSE]

    def parse(self, text: str) -> list[ParsedToolCall | ToolCallParseError]:
        """Every `<tool_call>` block of the turn, in order; values as text."""
        return [
            _function_call(raw, inner)
            if inner is not None
            else parse_error(raw, f"{OPEN} is never closed")
            for raw, inner in find_tagged_blocks(text, OPEN, CLOSE)
        ]

    def typed_arguments(
        self, call: ParsedToolCall, schema: Mapping[str, Any]
    ) -> ParsedToolCall | ToolCallParseError:
        """Each text value read as the tool's schema types its parameter."""
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        defs = schema.get("$defs")
        defs = defs if isinstance(defs, dict) else {}
        typed: dict[str, Any] = {}
        for key, value in call.arguments.items():
            if not isinstance(value, str):
                typed[key] = value
                continue
            result, problem = _typed_value(value, _json_types(properties.get(key), defs))
            if problem is not None:
                message = f"parameter {short_repr(key)} of {call.name}: {problem}"
                return parse_error(call.raw, message, call.name)
            typed[key] = result
        return call.model_copy(update={"arguments": typed})

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call as the template writes it; refuses values the format cannot hold."""
        lines = [OPEN, f"{FUNCTION}{name}>"]
        for key, value in arguments.items():
            if any(c in key for c in "<>\n") or not key:
                raise ValueError(f"qwen3_coder cannot write a parameter named {key!r}")
            lines += [f"{PARAMETER}{key}>", _value_text(key, value), PARAMETER_END]
        return "\n".join([*lines, FUNCTION_END, CLOSE])

    def render_tools(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        """Qwen3-Coder's `# Tools` block: each schema as XML, then the calling instructions."""
        functions = "".join(_function_xml(as_function(s)["function"]) for s in schemas)
        head = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
        return f"{head}{functions}\n</tools>{_INSTRUCTIONS}"


# ---- parsing -------------------------------------------------------------------------------------


def _function_call(raw: str, inner: str) -> ParsedToolCall | ToolCallParseError:
    """The call inside one closed `<tool_call>` block."""
    body = inner.strip()
    if not body.startswith(FUNCTION):
        return parse_error(raw, f"{OPEN} must hold {FUNCTION}NAME>...{FUNCTION_END}")
    head_end = body.find(">", len(FUNCTION))
    if head_end == -1:
        return parse_error(raw, f"{FUNCTION} is never closed with '>'")
    name = body[len(FUNCTION) : head_end]
    if not name.strip():
        message = f"tool call needs a non-empty function name, got {short_repr(name)}"
        return ToolCallParseError(kind="missing_name", message=message, raw=raw)
    if not body.endswith(FUNCTION_END):
        return parse_error(raw, f"{FUNCTION}{short_repr(name)[1:-1]}> is never closed", name)
    arguments = _parameters(body[head_end + 1 : -len(FUNCTION_END)])
    if isinstance(arguments, str):
        return parse_error(raw, f"{arguments} in the call of {short_repr(name)}", name)
    return ParsedToolCall(name=name, arguments=arguments, raw=raw)


def _parameters(text: str) -> dict[str, str] | str:
    """Each `<parameter=KEY>value</parameter>` of a function body, or what is wrong with it."""
    arguments: dict[str, str] = {}
    pos = _SPACE.match(text).end()  # type: ignore[union-attr]
    while pos < len(text):
        if not text.startswith(PARAMETER, pos):
            return f"unexpected text {short_repr(text[pos : pos + 40])} (expected {PARAMETER}KEY>)"
        key_end = text.find(">", pos + len(PARAMETER))
        if key_end == -1:
            return f"{PARAMETER} is never closed with '>'"
        key = text[pos + len(PARAMETER) : key_end]
        close = text.find(PARAMETER_END, key_end + 1)
        if close == -1:
            return f"{PARAMETER}{short_repr(key)[1:-1]}> is never closed"
        if key in arguments:
            return f"parameter {short_repr(key)} is given twice"
        value = text[key_end + 1 : close]
        value = value.removeprefix("\n")
        arguments[key] = value.removesuffix("\n")
        pos = _SPACE.match(text, close + len(PARAMETER_END)).end()  # type: ignore[union-attr]
    return arguments


def _json_types(schema: Any, defs: Mapping[str, Any], depth: int = 0) -> set[str]:
    """The JSON types a parameter's schema allows (empty: it does not say)."""
    if not isinstance(schema, dict) or depth > 16:
        return set()
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return _json_types(defs.get(ref.removeprefix("#/$defs/")), defs, depth + 1)
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else set()
    if isinstance(declared, list):
        types |= {t for t in declared if isinstance(t, str)}
    for key in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(key) or ():
            types |= _json_types(option, defs, depth + 1)
    values = schema.get("enum", [schema["const"]] if "const" in schema else [])
    for value in values if isinstance(values, list) else ():
        types.add(_type_of(value))
    return types


def _type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "null" if value is None else "object"


def _typed_value(text: str, types: set[str]) -> tuple[Any, str | None]:
    """`text` read as one of `types`: (value, None), or (None, why it cannot be held)."""
    if not types or "string" in types:
        return text, None
    if text.strip() in _PYTHON_WORDS:
        return _PYTHON_WORDS[text.strip()], None
    value, problem = load_json(text, depth=MAX_JSON_DEPTH - 2)
    if problem is None:
        return value, None
    return (text, None) if problem.syntax else (None, problem.message)


# ---- writing -------------------------------------------------------------------------------------


def _value_text(key: str, value: Any) -> str:
    """A value as the template writes it: strings as they are, objects and arrays as JSON,
    other scalars as Python's `str()`."""
    if isinstance(value, str):
        bad = next((m for m in _UNWRITABLE if m in value), None)
        if bad is not None:
            raise ValueError(f"qwen3_coder cannot write parameter {key!r}: its text holds {bad!r}")
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"qwen3_coder cannot write parameter {key!r}: {value} is not a number")
    if isinstance(value, bool | int | float) or value is None:
        return str(value)
    return dump_json(value)


def _function_xml(function: Mapping[str, Any]) -> str:
    """One tool in the template's XML: name, description, each parameter, other keys."""
    out = f"\n<function>\n<name>{function.get('name', '')}</name>"
    if "description" in function:
        out += f"\n<description>{str(function['description']).strip()}</description>"
    out += "\n<parameters>"
    parameters = function.get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    for name, fields in (properties or {}).items() if isinstance(properties, dict) else ():
        out += f"\n<parameter>\n<name>{name}</name>"
        if isinstance(fields, dict) and "type" in fields:
            out += f"\n<type>{_template_string(fields['type'])}</type>"
        if isinstance(fields, dict) and "description" in fields:
            out += f"\n<description>{str(fields['description']).strip()}</description>"
        out += _extra_keys(fields, {"name", "type", "description"}) + "\n</parameter>"
    out += _extra_keys(parameters, {"type", "properties"}) + "\n</parameters>"
    out += _extra_keys(function, {"type", "name", "description", "parameters"})
    return out + "\n</function>"


def _extra_keys(fields: Any, handled: set[str]) -> str:
    """The template's `render_extra_keys`: every other key as `<key>value</key>`."""
    if not isinstance(fields, dict):
        return ""
    return "".join(
        f"\n<{key}>{_template_string(value)}</{key}>"
        for key, value in fields.items()
        if key not in handled
    )


def _template_string(value: Any) -> str:
    """How the template prints a schema value: mappings and lists as JSON, the rest as text."""
    return dump_json(value) if isinstance(value, dict | list) else str(value)
