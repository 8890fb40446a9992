"""Envs kept between episodes (`EnvPool`): an env whose episode is over is reset for a later task
of the same env id and kwargs instead of being closed and built again.

Gymnasium's contract makes `reset(seed=...)` start an episode over, which is how its vector envs
run: an env that has played an episode and one built fresh play the same episode for the same
seed. Most of our envs cost nothing to build, but those that start something of their own pay for
it on every episode when built fresh: a Notes-v0 env starts its MCP server (a Python process,
about half a second) at its first reset and stops it at close (about a tenth), against about a
millisecond to reset one whose server runs. A rollout of 8 Notes-v0 episodes a step spent
2.6 s starting servers and 1.1 s stopping them (`docs/benchmarks.md`).

An env kind opts in with `TextEnv.reusable`; every other env is closed when its episode's group
is taken, as before. Not the default, because an env whose reset leaves state behind (a file in
a server's folder, a counter an action bumps) would hand the next episode a wrong start and
train on it with no error; each built-in that opts in is checked by
`tests/envs/test_reuse.py` (an episode on a used env equals the same episode on a fresh one).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from typing import Any

import gymnasium

from agent_grpo.envs.registry import make_env

__all__ = ["EnvFactory", "EnvKey", "EnvPool", "env_key", "is_reusable"]

EnvFactory = Callable[..., gymnasium.Env[Any, Any]]
"""Builds an env from an env id (or `package.module:Class` path) and its kwargs (`make_env`)."""

EnvKey = tuple[str, str]
"""An env id and its kwargs as canonical JSON: envs of one key are interchangeable."""


class EnvPool:
    """Envs by env id and kwargs: called like `make_env`, it hands out an idle env of the same
    id and kwargs where there is one, else builds one; `release` takes an env back when its
    episode is over (kept when its kind is `reusable`, closed otherwise); `close` closes the
    idle ones (so does leaving it as a context manager). Safe to call from several threads (a
    rollout resets envs at once)."""

    def __init__(self, factory: EnvFactory = make_env) -> None:
        self.factory = factory
        self.built = 0
        """Envs built so far (the rest of those handed out were reused)."""
        self._idle: dict[EnvKey, list[gymnasium.Env[Any, Any]]] = {}
        self._handed: dict[int, EnvKey] = {}  # id(env) -> its key, while an episode holds it
        self._lock = threading.Lock()

    def __call__(self, env_id: str, **kwargs: Any) -> gymnasium.Env[Any, Any]:
        """An idle env of `env_id` and `kwargs`, or a new one; the caller resets it."""
        key = env_key(env_id, kwargs)
        with self._lock:
            idle = self._idle.get(key)
            env = idle.pop() if idle else None
        if env is None:
            env = self.factory(env_id, **kwargs)
            with self._lock:
                self.built += 1
        with self._lock:
            self._handed[id(env)] = key
        return env

    @property
    def idle(self) -> int:
        """Envs waiting for a later episode."""
        with self._lock:
            return sum(len(envs) for envs in self._idle.values())

    def release(self, env: gymnasium.Env[Any, Any] | None) -> None:
        """Take back `env` (from this pool) whose episode is over: kept for a later episode if
        its kind is `reusable`, else closed. Closing errors are swallowed: a broken env must
        not lose the records of its group."""
        if env is None:
            return
        with self._lock:
            key = self._handed.pop(id(env), None)
            if key is not None and is_reusable(env):
                self._idle.setdefault(key, []).append(env)
                return
        close_quietly(env)

    def discard(self, env: gymnasium.Env[Any, Any] | None) -> None:
        """Never hand `env` out again (its step failed or hangs), and close it in a thread of
        its own: a hung step may hold what its `close` waits for."""
        if env is None:
            return
        with self._lock:
            self._handed.pop(id(env), None)
        threading.Thread(target=close_quietly, args=(env,), daemon=True).start()

    def close(self) -> None:
        """Close every idle env; the pool can be used again after."""
        with self._lock:
            idle = [env for envs in self._idle.values() for env in envs]
            self._idle.clear()
        for env in idle:
            close_quietly(env)

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_reusable(env: gymnasium.Env[Any, Any]) -> bool:
    """Whether `env`'s kind starts an episode over completely at reset (`TextEnv.reusable`)."""
    return getattr(env.unwrapped, "reusable", False) is True


def close_quietly(env: gymnasium.Env[Any, Any] | None) -> None:
    """Close `env`, swallowing its errors (closing a broken env must not lose other records)."""
    with contextlib.suppress(Exception):
        if env is not None:
            env.close()


def env_key(env_id: str, kwargs: dict[str, Any]) -> EnvKey:
    """The key envs built from `env_id` and `kwargs` are kept under (kwargs no JSON type can
    hold are keyed by their `repr`)."""
    return env_id, json.dumps(kwargs, sort_keys=True, default=repr)
