"""Every config key with its type, default and docstring, read from the config models: what
`agent-grpo config --schema` prints and docs/config.md holds (a test regenerates the page and
compares), so the docs cannot drift from the code.

Keys are spelled as overrides take them (`rollout.sampling.max_tokens=64`); items of a list of
sections are `rewards[].weight`. A section chosen by `type` (a discriminated union) lists each
variant's keys under a `type: <name>` note. Defaults are those of the enclosing default object, so
`run.name` defaults to `eval` under `agent-grpo eval`, as the code has it.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

__all__ = ["KeyDoc", "entry_points", "key_docs", "schema_markdown", "type_text"]


@dataclass(frozen=True)
class KeyDoc:
    """One config key as the schema page lists it."""

    key: str
    """Dotted key, as an override spells it (`[]` marks the items of a list)."""
    type: str
    """The accepted values: `int (>= 0)`, `"hf" | "vllm"`, `section`, ..."""
    default: str
    """The default, as markdown: YAML in backticks, `required` if there is none, empty for a
    section whose keys are listed below it."""
    doc: str
    """The field's docstring on one line."""
    variant: str = ""
    """`type: <name>` when the key exists only in one variant of a section chosen by `type`."""


def entry_points() -> list[tuple[str, type[BaseModel]]]:
    """The commands whose configs the page documents, with their config classes (imported
    here, so importing this module stays light)."""
    from agent_grpo.config.jobs import EvalRunConfig, TrainConfig

    return [("agent-grpo train", TrainConfig), ("agent-grpo eval", EvalRunConfig)]


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def _strip_annotated(tp: Any) -> Any:
    return typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp


def _union_args(tp: Any) -> tuple[Any, ...]:
    """The members of `X | Y` (or `Optional[X]`), or `(tp,)` for anything else."""
    tp = _strip_annotated(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return tuple(_strip_annotated(a) for a in typing.get_args(tp))
    return (tp,)


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _sections(tp: Any) -> tuple[list[type[BaseModel]], bool]:
    """The config classes a field holds (one, or a union's), and whether as a list of them."""
    tp = _strip_annotated(tp)
    in_list = typing.get_origin(tp) is list
    inner = typing.get_args(tp)[0] if in_list else tp
    return [a for a in _union_args(inner) if _is_model(a)], in_list


def _tag(cls: type[BaseModel]) -> str | None:
    """The `type` value that selects `cls` in a discriminated union, if it has one."""
    field = cls.model_fields.get("type")
    return field.default if field is not None and isinstance(field.default, str) else None


def type_text(tp: Any) -> str:
    """A type annotation in words: `int`, `"a" | "b"`, `float | null`, `list of str`, ..."""
    tp = _strip_annotated(tp)
    members = _union_args(tp)
    if len(members) > 1:
        return " | ".join(type_text(a) for a in members)
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is Literal:
        return " | ".join(json.dumps(v) for v in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {type_text(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict or tp is dict:
        return "mapping"
    if _is_model(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


_BOUNDS = {
    annotated_types.Ge: (">=", "ge"),
    annotated_types.Gt: (">", "gt"),
    annotated_types.Le: ("<=", "le"),
    annotated_types.Lt: ("<", "lt"),
}


def _constraints(field: FieldInfo) -> list[str]:
    """`>= 0`, `matches ^...$`: what `Field(...)` adds to the type."""
    found = []
    for item in field.metadata:
        for kind, (symbol, attr) in _BOUNDS.items():
            if isinstance(item, kind):
                found.append(f"{symbol} {getattr(item, attr)}")
        if getattr(item, "pattern", None):
            found.append(f"matches `{item.pattern}`")
    return found


def _field_type(field: FieldInfo) -> str:
    sections, in_list = _sections(field.annotation)
    tags = [t for t in map(_tag, sections) if t is not None]
    if len(sections) > 1 and len(tags) == len(sections):  # a union chosen by `type`
        kind = f"section by `type`: {', '.join(tags)}"
        text = f"list of ({kind})" if in_list else kind
        if type(None) in _union_args(field.annotation):
            text += " | null"
    else:
        text = type_text(field.annotation)
    bounds = _constraints(field)
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _value_text(field: FieldInfo, value: Any) -> str:
    """A default as markdown: YAML on one line in backticks. A section's keys are listed below
    it: only its variant is named, or that an optional section is given by default."""
    if isinstance(value, BaseModel):
        if len(_sections(field.annotation)[0]) > 1:
            return f"`{{type: {_tag(type(value))}}}`"
        return "given (keys below)" if type(None) in _union_args(field.annotation) else ""
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return f"{len(value)} sections"
    return f"`{_yaml(value)}`"


def _yaml(value: Any) -> str:
    """`value` as YAML on one line: a string in JSON's quotes (escapes and all, never folded),
    anything else as PyYAML writes it (`1.0e-05`: its reader takes `1e-05` for a string)."""
    if isinstance(value, str):
        return json.dumps(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"))
    return text.removesuffix("\n...\n").strip()


def _default(field: FieldInfo, holder: BaseModel | None, name: str) -> tuple[str, Any]:
    """`(text, value)` of a field's default within `holder` (None: the class's own default)."""
    if holder is not None:
        value = getattr(holder, name)
        return _value_text(field, value), value
    if field.is_required():
        return "required", None
    value = field.get_default(call_default_factory=True)
    return _value_text(field, value), value


def key_docs(
    cls: type[BaseModel], holder: BaseModel | None = None, prefix: str = "", variant: str = ""
) -> list[KeyDoc]:
    """Every key of `cls` and of the sections below it, in field order, with the defaults of
    `holder` (an instance of `cls`; None: the class defaults)."""
    rows: list[KeyDoc] = []
    for name, field in cls.model_fields.items():
        key = f"{prefix}{name}"
        text, value = _default(field, holder, name)
        rows.append(KeyDoc(key, _field_type(field), text, _one_line(field.description), variant))
        rows += _section_rows(field, key, value)
    return rows


def _section_rows(field: FieldInfo, key: str, value: Any) -> list[KeyDoc]:
    """The keys under a section field: each variant's, when it is chosen by `type`."""
    sections, in_list = _sections(field.annotation)
    prefix = f"{key}[]." if in_list else f"{key}."
    if len(sections) == 1:
        holder = value if isinstance(value, sections[0]) else None
        return key_docs(sections[0], holder, prefix)
    rows = []
    for cls in sections:
        tag = _tag(cls)
        holder = value if isinstance(value, cls) else None
        variant = f"type: {tag}"
        rows.append(KeyDoc(f"{prefix}type", json.dumps(tag), "", _one_line(cls.__doc__), variant))
        rows += [r for r in key_docs(cls, holder, prefix, variant) if r.key != f"{prefix}type"]
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(rows: list[KeyDoc]) -> Iterator[str]:
    yield "| key | type | default | description |"
    yield "|---|---|---|---|"
    for row in rows:
        doc = f"*{row.variant}*: {row.doc}" if row.variant else row.doc
        cells = (f"`{row.key}`", row.type, row.default, doc)
        yield "| " + " | ".join(_cell(c) for c in cells) + " |"


HEADER = """\
# Config keys

Generated from the config models by `agent-grpo config --schema > docs/config.md`
(`tests/config/test_schema.py` fails when this page is out of date: regenerate it, never edit
it by hand). Each key can be set in the YAML file or as a `dotted.key=value` override on the
command line; an unknown key is an error. A section chosen by `type` lists the keys of each of
its variants, marked with the `type` they belong to; `rewards[]` are the items of a list.
"""


def schema_markdown() -> str:
    """The whole docs/config.md page."""
    parts = [HEADER]
    for command, cls in entry_points():
        parts.append(f"## `{command}` ({cls.__name__})\n\n{_one_line(cls.__doc__)}\n")
        parts.append("\n".join(_table(key_docs(cls, cls()))) + "\n")
    return "\n".join(parts)
