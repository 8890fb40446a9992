"""Tool arguments described by a JSON schema from elsewhere (an MCP server), as a pydantic model.

`agent_grpo.tools.tool` builds a tool's argument model from a Python signature; a tool from a server
comes with a JSON schema instead. `schema_args_model` wraps that schema in a model with the same
interface, so the parser, `run_tool_call` and the prompt treat both kinds alike: validation
raises pydantic's `ValidationError` with one entry per problem (`missing`, `extra_forbidden`, or
the schema's own complaint, located at the offending field), and `model_json_schema` returns the
schema the model is shown. Validation is `jsonschema`'s (a dependency of `mcp`), so every keyword
the schema uses is enforced, not only the ones pydantic could express.

Where we depart from the schema: with `forbid_extra` (the default), arguments the top-level
schema does not name are refused unless it mentions `additionalProperties` itself. Schemas
generated from function signatures rarely say `additionalProperties: false`, and a model must not
learn that invented arguments are fine. The schema shown drops `title` annotations, as built-in
tools do.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic_core import InitErrorDetails, PydanticCustomError

__all__ = ["JsonSchemaArgs", "schema_args_model", "schema_problems", "without_titles"]


class JsonSchemaArgs(BaseModel):
    """Tool arguments checked against a JSON schema that came from elsewhere (an MCP server).

    `model_validate` raises pydantic's `ValidationError` with one entry per problem (`missing`,
    `extra_forbidden`, or the schema's own message), so callers report it like any bad call, and
    `model_json_schema` returns the schema the model is shown.
    """

    model_config = ConfigDict(extra="allow")
    shown_schema: ClassVar[dict[str, Any]] = {}
    """The schema the model sees."""
    checker: ClassVar[Any] = None
    """The `jsonschema` validator the arguments must pass."""

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Self:
        """Check `obj` against the schema first, then keep it as is (every key an extra)."""
        problems = schema_problems(cls.checker, obj)
        if problems:
            raise ValidationError.from_exception_data(cls.__name__, problems)
        return super().model_validate(obj, *args, **kwargs)

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The schema shown to the model (the generator arguments do not apply)."""
        return copy.deepcopy(cls.shown_schema)


def schema_args_model(
    name: str, schema: Mapping[str, Any], forbid_extra: bool = True
) -> type[JsonSchemaArgs]:
    """A `JsonSchemaArgs` model for one tool; raises `ValueError` for an invalid schema."""
    import jsonschema  # a dependency of mcp, imported only when a server's tools are built

    checked = dict(schema)
    if forbid_extra and "properties" in checked and "additionalProperties" not in checked:
        checked["additionalProperties"] = False
    validator_class = jsonschema.validators.validator_for(checked)
    try:
        validator_class.check_schema(checked)
    except jsonschema.SchemaError as error:
        raise ValueError(f"tool {name}: invalid input schema: {error.message}") from None
    model = create_model(f"{name}_args", __base__=JsonSchemaArgs, __module__=__name__)
    model.shown_schema = without_titles(dict(schema))
    model.checker = validator_class(checked)
    return model


def schema_problems(checker: Any, arguments: Any) -> list[InitErrorDetails]:
    """Every way `arguments` breaks the schema, as pydantic error entries (deduplicated)."""
    problems: dict[tuple[str, tuple[Any, ...]], InitErrorDetails] = {}
    for error in checker.iter_errors(arguments):
        for problem in _as_pydantic(error):
            problems.setdefault((str(problem["type"]), tuple(problem["loc"])), problem)
    return list(problems.values())


def _as_pydantic(error: Any) -> list[InitErrorDetails]:
    path = tuple(error.absolute_path)
    instance = error.instance
    if error.validator == "required" and isinstance(instance, dict):
        missing = [p for p in error.validator_value if p not in instance]
        return [{"type": "missing", "loc": (*path, p), "input": instance} for p in missing]
    if error.validator == "additionalProperties" and isinstance(instance, dict):
        extra = [k for k in instance if not _declared(error.schema, k)]
        return [{"type": "extra_forbidden", "loc": (*path, k), "input": instance[k]} for k in extra]
    reason = PydanticCustomError("json_schema", "{reason}", {"reason": _reason(error)})
    return [{"type": reason, "loc": path, "input": instance}]


def _declared(schema: Mapping[str, Any], key: str) -> bool:
    """Whether an object schema names `key` (in `properties` or a `patternProperties` pattern)."""
    patterns = schema.get("patternProperties", {})
    return key in schema.get("properties", {}) or any(re.search(p, key) for p in patterns)


def _reason(error: Any) -> str:
    """The schema's complaint without the value (the caller shows the value itself)."""
    if error.validator == "type":
        kinds = error.validator_value
        return f"should be of type {' or '.join(kinds) if isinstance(kinds, list) else kinds}"
    if error.validator == "enum":
        return f"should be one of {json.dumps(error.validator_value)[:200]}"
    return str(error.message)[:300]


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
"""Keywords whose value maps names to schemas: there `title` is a name, not an annotation."""


def without_titles(schema: Any) -> Any:
    """A schema without `title` annotations (prompt tokens that say nothing the names do not)."""
    if isinstance(schema, list):
        return [without_titles(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: without_titles(sub) for name, sub in value.items()}
        else:
            out[key] = without_titles(value)
    return out
