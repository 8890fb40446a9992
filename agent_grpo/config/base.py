"""Typed configuration: pydantic models with a docstring under every field, loaded from YAML.

Every entry point owns exactly one config class derived from `ConfigModel`. Unknown keys are
errors (a typo in a YAML file must never be silently ignored), and a validation error names the
file and the dotted key that is wrong.
"""

from __future__ import annotations

import difflib
from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

__all__ = [
    "ConfigError",
    "ConfigModel",
    "anchor_file_names",
    "apply_overrides",
    "close_match",
    "load_config",
    "named",
]


_NUMBERS = (int, float, int | None, float | None)
"""Field types a YAML `true`/`false` never stands for."""


class ConfigModel(BaseModel):
    """Base for every config: strict keys, field docstrings become field descriptions."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        protected_namespaces=(),
    )

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        # pydantic reads `true` as 1 for an int field: `steps=true` would train one step
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name) if isinstance(name, str) else None
                if isinstance(value, bool) and field is not None and field.annotation in _NUMBERS:
                    raise ValueError(f"{name} is {str(value).lower()}, not a number")
        return data

    retired_keys: ClassVar[dict[str, str]] = {}
    """Dotted keys this config no longer takes -> what to do instead: a config that still sets
    one fails with that message, not with a bare "extra inputs are not permitted"."""

    @classmethod
    def anchor_files(cls, raw: dict[str, Any], folder: Path) -> None:
        """Make the file names `raw` (this config's mapping in a config file) holds relative to
        the file's `folder` absolute, before validation (`anchor_file_names`): each part's config
        in turn; a config that holds file names itself overrides this."""
        for name, field in cls.model_fields.items():
            part, value = field.annotation, raw.get(name)
            if isinstance(part, type) and issubclass(part, ConfigModel) and isinstance(value, dict):
                part.anchor_files(value, folder)


C = TypeVar("C", bound=ConfigModel)


class ConfigError(ValueError):
    """A config file or override that cannot be turned into a valid config."""


def close_match(word: str, choices: Iterable[str], cutoff: float = 0.7) -> str | None:
    """The choice `word` is most likely a typo of (case ignored), for "did you mean": or None."""
    lowered = {c.lower(): c for c in choices}
    found = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=cutoff)
    return lowered[found[0]] if found else None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that sets one key twice (which it would
    resolve silently to the last value: an `algo:` section written twice trains on one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may repeat
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # the safe loader's own error says what is wrong
                break
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is set twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)


def _parse_override_value(text: str) -> Any:
    """Parse the right-hand side of `key=value` the way YAML would (`3` is an int, `a` a str)."""
    return _load_yaml(text) if text != "" else ""


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with `dotted.key=value` overrides applied."""
    out: dict[str, Any] = _deep_copy(data)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        try:
            node[parts[-1]] = _parse_override_value(value)
        except yaml.YAMLError as error:
            raise ConfigError(f"override {item!r}: not a YAML value: {_yaml_problem(error)}"
                              ) from None  # fmt: skip
    return out


def _deep_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def _describe(error: ValidationError, source: str) -> str:
    """One line naming `source` and each bad dotted key: the CLI prints it after `error:`."""
    problems = []
    for err in error.errors():
        loc = ".".join(str(p) for p in err["loc"])
        # A model validator's message already names its keys; pydantic prefixes "Value error, ".
        msg = str(err["msg"]).removeprefix("Value error, ")
        problems.append(f"{loc}: {msg}" if loc else msg)
    return f"invalid config {source}: " + "; ".join(problems)


def validate_config(cls: type[C], data: dict[str, Any], source: str = "<dict>") -> C:
    """Validate a plain dict into `cls`, raising ConfigError naming `source` and each bad key."""
    for key, instead in cls.retired_keys.items():
        if _has_key(data, key):
            raise ConfigError(f"invalid config {source}: {key} was removed: {instead}")
    try:
        return cls.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_describe(error, source)) from None


def _has_key(data: dict[str, Any], dotted: str) -> bool:
    """Whether the nested mapping `data` sets the dotted key."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        data = data.get(part)  # type: ignore[assignment]
        if not isinstance(data, dict):
            return False
    return leaf in data


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's multi-line message as one line: the problem and where it is."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or " ".join(str(error).split())
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def load_config(cls: type[C], path: str | Path, overrides: list[str] | None = None) -> C:
    """Load a YAML file into `cls`, after applying `dotted.key=value` overrides."""
    path = Path(path)
    try:
        raw = _load_yaml(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"config file {path} is not UTF-8 text ({error.reason} at byte "
                          f"{error.start})") from None  # fmt: skip
    except OSError as error:
        raise ConfigError(f"config file {path} cannot be read: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(error)}") from None
    if raw is None:  # not every default on purpose: `{}` says that
        raise ConfigError(f"config file {path} is empty (write {{}} for every default)")
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    merged = apply_overrides(raw, overrides or [])
    cls.anchor_files(merged, path.parent)
    return validate_config(cls, merged, str(path))


def anchor_file_names(value: Any, folder: Path) -> Any:
    """`value` (a file name, a list of them, or a dict of either) with each relative name that
    exists in `folder`, and not from the current directory, made absolute: a config next to its
    data runs from any directory, and the run's resolved config names the files it read."""
    if isinstance(value, dict):
        return {key: anchor_file_names(item, folder) for key, item in value.items()}
    if isinstance(value, list):
        return [anchor_file_names(item, folder) for item in value]
    if not isinstance(value, str) or "://" in value or Path(value).is_absolute():
        return value
    if Path(value).exists() or not (folder / value).exists():
        return value  # the current directory first, as a reader of the file would look
    return str((folder / value).resolve())


def named(config: C, name: str) -> C:
    """A copy of a job config (one with a `run` section) whose `run.name` is `name`."""
    run = config.run.model_copy(update={"name": name})  # type: ignore[attr-defined]
    return config.model_copy(update={"run": run})


def dump_config(config: ConfigModel) -> str:
    """Render a config back to YAML (the resolved config stored in each run directory)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
