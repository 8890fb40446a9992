"""Finding environments: built-ins, plugins from entry points, and `package.module:Class` paths.

Built-ins register under `agent_grpo/<Name>-v0` when `agent_grpo.envs` is imported. Other
packages add environments through the entry-point group `agent_grpo.envs`: each entry point names
a zero-argument function that calls `gymnasium.register` (ours is
`builtin = "agent_grpo.envs:register_builtin_envs"`). `register_envs()` runs them all once per
process; a plugin that fails to load is logged and skipped, so one broken package does not hide
every other environment.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import (
    EnvSpec,
    find_highest_version,
    get_env_id,
    load_env_creator,
    parse_env_id,
)

from agent_grpo.logs import get_logger

__all__ = [
    "ENTRY_POINT_GROUP",
    "TOOL_FORMAT_KWARG",
    "EnvListing",
    "env_spec",
    "file_kwargs",
    "is_registered",
    "list_envs",
    "make_env",
    "register_envs",
]

ENTRY_POINT_GROUP = "agent_grpo.envs"
"""Entry-point group scanned for environment plugins."""
TOOL_FORMAT_KWARG = "tool_call_format"
"""The `env.kwargs` key `make_env` applies to a `ToolEnv` itself (see `make_env`)."""

_log = get_logger(__name__)
_plugin_ids: dict[str, str] = {}
_loaded = False


@dataclass(frozen=True)
class EnvListing:
    """One environment known to `agent-grpo envs`."""

    id: str
    """Gymnasium id to pass to `make_env` or `env.id` in a config."""
    entry_point: str
    """Where the class lives (`module:Class`)."""
    source: str
    """`builtin`, or the name of the entry point that registered it."""

    def __str__(self) -> str:
        """One line for `agent-grpo envs`: id, entry point and source."""
        return f"{self.id:<32} {self.entry_point}  [{self.source}]"


def register_envs(force: bool = False) -> None:
    """Register the built-ins and run every `agent_grpo.envs` entry point (once, unless forced)."""
    global _loaded
    from agent_grpo.envs import register_builtin_envs

    register_builtin_envs()
    if _loaded and not force:
        return
    _loaded = True
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        before = set(gym.registry)
        try:
            entry.load()()
        except Exception as error:
            _log.warning("environment plugin %s (%s) failed: %s", entry.name, entry.value, error)
            continue
        for env_id in set(gym.registry) - before:
            _plugin_ids[env_id] = entry.name


def is_registered(env_id: str) -> bool:
    """Whether `env_id` is an id installed code registered (the built-ins, entry points): making
    it imports nothing it names itself, unlike a `module:Class` path or gymnasium's `module:Id`."""
    register_envs()
    if ":" in env_id:  # gymnasium's `module:Id` imports the module first
        return False
    if env_id in gym.registry:
        return True
    try:  # a version-less id, which `make` resolves to its highest registered version
        namespace, name, version = parse_env_id(env_id)
    except gym.error.Error:
        return False
    return version is None and find_highest_version(namespace, name) is not None


def _is_path(id_or_path: str) -> bool:
    module, sep, attr = id_or_path.partition(":")
    return bool(sep and module and attr) and "/" not in module


def make_env(id_or_path: str, **kwargs: Any) -> gym.Env[Any, Any]:
    """Make an environment from a registered id or a `package.module:Class` path.

    `tool_call_format` (a format name such as `llama3`, or a format object) is not passed to the
    constructor: it is set on the env after construction when the env is a `ToolEnv`, so every
    tool env takes it whatever its constructor's signature, and ignored by an env without tools.
    Preflight puts the run's `model.tool_format` there (agent_grpo/preflight.py)."""
    register_envs()
    from agent_grpo.envs.text_env import ToolEnv, as_tool_format

    given = kwargs.pop(TOOL_FORMAT_KWARG, None)
    tool_format = None if given is None else as_tool_format(given)  # a bad name: before building
    if id_or_path in gym.registry or not _is_path(id_or_path):
        env = gym.make(id_or_path, **kwargs)
    else:
        # The path is a valid gymnasium id (names may hold `.` and `:`), so the env gets a spec
        # and the same wrappers as a registered one, without polluting the global registry.
        env = gym.make(EnvSpec(id=id_or_path, entry_point=id_or_path), **kwargs)
    if tool_format is not None and isinstance(env.unwrapped, ToolEnv):
        env.unwrapped.tool_call_format = tool_format
    return env


def env_spec(id_or_path: str) -> EnvSpec:
    """The spec `make_env(id_or_path)` builds from, found without importing or constructing
    the environment; raises gymnasium's errors (`NameNotFound` says "Did you mean")."""
    register_envs()
    if id_or_path in gym.registry:
        return gym.registry[id_or_path]
    if _is_path(id_or_path):
        return EnvSpec(id=id_or_path, entry_point=id_or_path)
    namespace, name, version = parse_env_id(id_or_path)
    latest = find_highest_version(namespace, name)
    if version is None and latest is not None:  # what gym.make picks for an id without -vN
        return gym.spec(get_env_id(namespace, name, latest))
    return gym.spec(id_or_path)


def file_kwargs(id_or_path: str) -> tuple[str, ...]:
    """The constructor arguments the env declares as file names (`TextEnv.file_kwargs`); none
    for an env that does not resolve (preflight says why, in one line)."""
    try:
        creator: Any = env_spec(id_or_path).entry_point
        if isinstance(creator, str):
            creator = load_env_creator(creator)
    except Exception:
        return ()
    return tuple(getattr(creator, "file_kwargs", ()))


def list_envs() -> list[EnvListing]:
    """Built-in and plugin environments, sorted by id."""
    from agent_grpo.envs import BUILTIN_ENVS, NAMESPACE

    register_envs()
    builtin = {f"{NAMESPACE}/{name}" for name in BUILTIN_ENVS}
    listings = []
    for env_id in sorted(builtin | set(_plugin_ids)):
        spec = gym.registry[env_id]
        entry_point = (
            spec.entry_point if isinstance(spec.entry_point, str) else repr(spec.entry_point)
        )
        source = "builtin" if env_id in builtin else _plugin_ids[env_id]
        listings.append(EnvListing(id=env_id, entry_point=entry_point, source=source))
    return listings
