"""Modules that moved in the 0.2 layout (docs/architecture.md): importing an old path fails with
an `ImportError` that names the new one, instead of a bare "No module named".

A meta-path finder sees the import before the normal search; it answers only for the old names
below and leaves every other import alone. Names that moved out of a module that still exists
fail the same way through that module's `__getattr__` (`moved_names`).
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import NoReturn

__all__ = ["MOVED", "install", "moved_names"]

MOVED = {
    "agent_grpo.env": "agent_grpo.envs.text_env",
    "agent_grpo.registry": "agent_grpo.envs.registry",
    "agent_grpo.mcp_env": "agent_grpo.envs.mcp_env",
    "agent_grpo.tool": "agent_grpo.tools.tool",
    "agent_grpo.toolcalls": "agent_grpo.tools.formats",
    "agent_grpo.tools.call_format": "agent_grpo.tools.formats",
    "agent_grpo.mcp_tools": "agent_grpo.tools.mcp_client",
    "agent_grpo.schema_args": "agent_grpo.tools.schema_args",
    "agent_grpo.tools.sandbox": "agent_grpo.sandbox.runner",
    "agent_grpo.tools.sandbox_bwrap": "agent_grpo.sandbox.bwrap",
    "agent_grpo.tools.sandbox_cgroup": "agent_grpo.sandbox.cgroup",
    "agent_grpo.tools.sandbox_error": "agent_grpo.sandbox.errors",
    "agent_grpo.tools.sandbox_process": "agent_grpo.sandbox.process",
    "agent_grpo.tools.sandbox_seccomp": "agent_grpo.sandbox.seccomp",
    "agent_grpo.tools.sandbox_uid": "agent_grpo.sandbox.uid",
    "agent_grpo.tokens": "agent_grpo.trajectory.tokens",
    "agent_grpo.invariants": "agent_grpo.trajectory.invariants",
    "agent_grpo.attention": "agent_grpo.models.attention",
    "agent_grpo.logprobs": "agent_grpo.models.logprobs",
    "agent_grpo.store": "agent_grpo.run_dir.writer",
    "agent_grpo.runs": "agent_grpo.run_dir.reader",
    "agent_grpo.evaluate": "agent_grpo.evaluation.heldout (the job: agent_grpo.evaluate())",
    "agent_grpo.eval_run": "agent_grpo.evaluation.job",
    "agent_grpo.callable_module": "nothing: agent_grpo.train and agent_grpo.evaluate are functions",
    "agent_grpo.config_schema": "agent_grpo.config.schema",
    "agent_grpo.train": "agent_grpo.trainer, whose other modules keep their names "
    "(the job: agent_grpo.train())",
    "agent_grpo.train.config": "agent_grpo.config.jobs",
    "agent_grpo.train.evaluation": "agent_grpo.evaluation.in_training",
    "agent_grpo.train.rollout": "agent_grpo.rollout.step",
    "agent_grpo.train.workers": "agent_grpo.rollout.sources",
    "agent_grpo.rollout.backend": "agent_grpo.rollout.backends.base",
    "agent_grpo.rollout.hf_backend": "agent_grpo.rollout.backends.hf",
    "agent_grpo.rollout.vllm_backend": "agent_grpo.rollout.backends.vllm",
    "agent_grpo.rollout.openai_backend": "agent_grpo.rollout.backends.openai",
    "agent_grpo.rollout.kv_cache": "agent_grpo.rollout.backends.kv_cache",
    "agent_grpo.rollout.packed_linear": "agent_grpo.rollout.backends.packed_linear",
    "agent_grpo.rollout.factory": "agent_grpo.rollout.backends.factory",
    "agent_grpo.testing.templates": "agent_grpo.inspect.rewriting_templates",
}
"""Old module -> where its contents live now."""


def _new_place(name: str) -> str | None:
    """Where the old module `name` went.

    An old package lists where its moved submodules went as well: importing
    `agent_grpo.train.config` imports the package `agent_grpo.train` first, and that import is the
    one that fails, so its message is the only one the user sees.
    """
    if name not in MOVED:
        return None
    children = "".join(
        f"; {old} -> {new}" for old, new in MOVED.items() if old.startswith(name + ".")
    )
    return MOVED[name] + children


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Raises for the moved modules; `None` (keep looking) for everything else."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> None:
        new = _new_place(fullname)
        if new is not None:
            raise ModuleNotFoundError(f"{fullname} moved: import {new}", name=fullname)
        return None


def install() -> None:
    """Put the finder first on `sys.meta_path` (once)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())


def moved_names(module: str, names: Mapping[str, str]) -> Callable[[str], NoReturn]:
    """A module's `__getattr__` for the names that moved out of it (name -> its new module).

    `from module import name` then fails with an `ImportError` naming the new module; any other
    missing name is the usual `AttributeError`.
    """

    def __getattr__(name: str) -> NoReturn:
        if name in names:
            raise ImportError(f"{module}.{name} moved: import it from {names[name]}", name=module)
        raise AttributeError(f"module {module!r} has no attribute {name!r}", name=name)

    return __getattr__
