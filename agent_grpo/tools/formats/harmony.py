"""gpt-oss Harmony: a call is a `commentary` message addressed to `functions.NAME`.

The generation prompt ends with `<|start|>assistant`, so a sampled turn is one or more messages:

    <|channel|>analysis<|message|>Need the calculator.<|end|><|start|>assistant<|channel|>
    commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "6 * 7"}<|call|>

(one line in the model's text). Every message whose header names a recipient (`to=...`, in the
role or the channel part of the header) is a call; its content is the JSON arguments, ended by
`<|call|>`, which is also the stop string. Other messages (analysis, a preamble, the final
answer) are not calls. Tools are announced as Harmony's developer message lays them out: a
`# Tools` section with TypeScript-like types in `namespace functions` (`render_typescript`).

What the parser refuses (`parse` errors): a recipient other than `functions.NAME` (the builtin
`browser` and `python` tools are not ours), a call ended by `<|end|>` or `<|return|>`, a content
type other than JSON, arguments that are not a JSON object. A call whose `<|call|>` is missing at
the very end of the turn is read (the token may have been taken off as the turn's end), so a
call cut right after its closing `}` is read too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from agent_grpo.tools.formats.base import (
    TOOL_NAME,
    ParsedToolCall,
    StructuredTurn,
    ToolCallParseError,
    arguments_call,
    as_function,
    dump_json,
    parse_error,
    short_repr,
)

__all__ = ["HarmonyToolCallFormat", "render_typescript"]

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
NAMESPACE = "functions."
_RECIPIENT = re.compile(r"\bto=([^\s<]*)")
_CONTENT_END = re.compile("|".join(re.escape(token) for token in (END, CALL, RETURN, START)))
_MARKUP = (START, MESSAGE, CHANNEL, CONSTRAIN, END, CALL, RETURN)


class _Message(NamedTuple):
    raw: str
    """The message's text, header included."""
    header: str
    """Everything before `<|message|>` (`<|start|>assistant<|channel|>... to=...`)."""
    content: str | None
    """The text after `<|message|>`; None when the header never reaches it."""
    ended_by: str | None
    """`<|end|>`, `<|call|>` or `<|return|>`; None when the turn's text ends it."""


class HarmonyToolCallFormat:
    """Harmony: a `commentary` message `to=functions.NAME` whose content is the JSON arguments."""

    name = "harmony"

    @property
    def stop_strings(self) -> list[str]:
        """`<|call|>` ends the turn after a call."""
        return [CALL]

    def parse(self, text: str) -> list[ParsedToolCall | ToolCallParseError]:
        """Every message of the turn that has a recipient, in order."""
        return [_call(m) for m in _messages(text) if _RECIPIENT.search(m.header)]

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call message, as the model writes it after `<|start|>assistant` (several are
        joined with `<|start|>assistant`)."""
        header = f"{CHANNEL}commentary to={NAMESPACE}{name} {CONSTRAIN}json"
        return f"{header}{MESSAGE}{dump_json(dict(arguments))}{CALL}"

    def render_tools(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        """The developer message's `# Tools` section: `namespace functions { ... }`."""
        types = [_function_type(as_function(schema)["function"]) for schema in schemas]
        section = ["## functions\n", "namespace functions {\n", *types, "} // namespace functions"]
        return "# Tools\n\n" + "\n".join(section)

    def structure(self, text: str) -> StructuredTurn | None:
        """The turn as gpt-oss templates take it: an analysis message as `reasoning`, then one
        final message as `content`, or one or more calls. None for any other shape: a preamble,
        two analysis messages, a malformed call, Harmony markup inside a message's text (which
        gpt-oss templates refuse to render)."""
        messages = list(_messages(text))
        reasoning = messages.pop(0).content if messages and _is_analysis(messages[0]) else None
        if len(messages) == 1 and _is_final(messages[0]):
            turn = StructuredTurn(content=messages[0].content or "", reasoning=reasoning)
        elif messages and all(_is_call(m, m is messages[-1]) for m in messages):
            calls = [_call(m) for m in messages]
            named = [
                c for c in calls if isinstance(c, ParsedToolCall) and TOOL_NAME.fullmatch(c.name)
            ]
            if len(named) != len(calls):
                return None
            turn = StructuredTurn(reasoning=reasoning, calls=tuple(named))
        else:
            return None
        texts = (turn.content, turn.reasoning or "")
        return None if any(token in t for t in texts for token in _MARKUP) else turn


def _messages(text: str) -> Iterator[_Message]:
    """The turn's messages, in order (a last header without content included)."""
    pos = 0
    while (body := text.find(MESSAGE, pos)) != -1:
        start = body + len(MESSAGE)
        stop, token = _content_end(text, start)
        after = stop + len(token) if token is not None and token != START else stop
        ended_by = None if token == START else token
        yield _Message(text[pos:after], text[pos:body], text[start:stop], ended_by)
        pos = after
    if pos < len(text):
        yield _Message(text[pos:], text[pos:], None, None)


def _content_end(text: str, start: int) -> tuple[int, str | None]:
    """Where a message's content ends and the token that ends it (`<|start|>` for a message
    never ended before the next one begins; None at the end of the text)."""
    found = _CONTENT_END.search(text, start)
    return (found.start(), found[0]) if found else (len(text), None)


def _channel(message: _Message) -> str | None:
    """The header's channel (`analysis`, `commentary`, `final`), None without one."""
    if CHANNEL not in message.header:
        return None
    words = message.header.rsplit(CHANNEL, 1)[1].split()
    return words[0] if words else ""


def _is_analysis(message: _Message) -> bool:
    return (
        _channel(message) == "analysis"
        and not _RECIPIENT.search(message.header)
        and message.content is not None
        and message.ended_by == END
    )


def _is_final(message: _Message) -> bool:
    """A final message, ended by `<|return|>` or by the turn (its `<|return|>` taken off as the
    turn's end)."""
    return (
        _channel(message) == "final"
        and not _RECIPIENT.search(message.header)
        and message.content is not None
        and message.ended_by in (RETURN, None)
    )


def _is_call(message: _Message, last: bool) -> bool:
    """A message with a recipient ended by `<|call|>` (or, the turn's last, by the turn)."""
    ends = (CALL, None) if last else (CALL,)
    return bool(_RECIPIENT.search(message.header)) and message.ended_by in ends


def _call(message: _Message) -> ParsedToolCall | ToolCallParseError:
    """The call a message with a recipient makes."""
    match = _RECIPIENT.search(message.header)
    recipient = match[1] if match else ""
    if not recipient.startswith(NAMESPACE):
        return parse_error(
            message.raw, f"calls go to {NAMESPACE}NAME, not to={short_repr(recipient)[1:-1]}"
        )
    name = recipient.removeprefix(NAMESPACE)
    if message.content is None:
        return parse_error(message.raw, f"the call never reaches {MESSAGE}", name)
    if message.ended_by in (END, RETURN):
        return parse_error(
            message.raw, f"a call must end with {CALL}, not {message.ended_by}", name
        )
    content_type = message.header[match.end() if match else 0 :].replace(CONSTRAIN, " ").split()
    content_type = [word for word in content_type if not word.startswith(("<|", "to="))]
    if content_type and content_type[-1] != "json":
        found = short_repr(content_type[-1])
        return parse_error(message.raw, f"call arguments must be json, not {found}", name)
    return arguments_call(message.raw, name, message.content)


# ---- tool declarations ---------------------------------------------------------------------------


def _function_type(function: Mapping[str, Any]) -> str:
    """`// description` lines and `type NAME = (_: {...}) => any;` (or `() => any` without
    parameters), then the blank line Harmony keeps after each function."""
    lines = [f"// {line}" for line in str(function.get("description") or "").splitlines()]
    parameters = function.get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    name = function.get("name", "")
    if isinstance(parameters, dict) and properties:
        lines.append(f"type {name} = (_: {render_typescript(parameters)}) => any;\n")
    else:
        lines.append(f"type {name} = () => any;\n")
    return "\n".join(lines)


def render_typescript(schema: Any, indent: str = "", defs: Mapping[str, Any] | None = None) -> str:
    """A JSON schema as Harmony's TypeScript-like type: objects with `// description` lines,
    `?` on optional keys and `// default: X` comments, `number` for integers, string enums as
    `"a" | "b"`, `T[]` for arrays, unions with ` | `; what it cannot say is `any`."""
    if not isinstance(schema, dict):
        return "any"
    defs = schema.get("$defs", defs) if isinstance(schema.get("$defs"), dict) else defs
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/") and defs:
        target = defs.get(ref.removeprefix("#/$defs/"))
        return render_typescript(target, indent, {}) if isinstance(target, dict) else "any"
    options = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(options, list) and options:
        return " | ".join(dict.fromkeys(render_typescript(o, indent, defs) for o in options))
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join("number" if t == "integer" else str(t) for t in kind) or "any"
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return " | ".join(_literal(value) for value in schema["enum"])
    if kind == "object":
        return _object_type(schema, indent, defs)
    if kind == "array":
        items = schema.get("items")
        return f"{render_typescript(items, indent, defs)}[]" if items else "Array<any>"
    return {"integer": "number", "number": "number", "string": "string",
            "boolean": "boolean", "null": "null"}.get(str(kind), "any")  # fmt: skip


def _object_type(schema: Mapping[str, Any], indent: str, defs: Mapping[str, Any] | None) -> str:
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return "object"
    required = set(schema.get("required") or ())
    lines = ["{"]
    for key, field in properties.items():
        field = field if isinstance(field, dict) else {}
        if field.get("description"):
            lines.append(f"{indent}// {field['description']}")
        optional = "" if key in required else "?"
        line = f"{indent}{key}{optional}: {render_typescript(field, indent + '    ', defs)},"
        if "default" in field:
            line += f" // default: {_default(field)}"
        lines.append(line)
    lines.append(f"{indent}}}")
    return "\n".join(lines)


def _literal(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else dump_json(value)


def _default(field: Mapping[str, Any]) -> str:
    """Harmony's default comment: enum strings bare, other strings quoted, the rest as JSON."""
    value = field["default"]
    if isinstance(value, str):
        return value if field.get("enum") else f'"{value}"'
    return dump_json(value)
