"""agent-grpo: train LLM agents with GRPO on multi-turn, tool-using tasks, correct to the token.

The Python API (docs/python-api.md), imported on first use so that `import agent_grpo` stays
light (no torch):

- `agent_grpo.train(config)`: the `agent-grpo train` job; returns its `Run`.
- `agent_grpo.evaluate(config)`: the `agent-grpo eval` job; returns its `Run`.
- `agent_grpo.load_run(path)`: a run directory read for analysis (`agent_grpo.runs.Run`).

`agent_grpo.train` and `agent_grpo.evaluate` are also the trainer package and the evaluation
module; both are callable as the API functions (agent_grpo/callable_module.py says why).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent_grpo.runs import Run, load_run

__version__ = "0.1.0"

__all__ = ["Run", "evaluate", "load_run", "train"]

_CALLABLE_MODULES = ("train", "evaluate")
_RUNS = ("Run", "load_run")


def __getattr__(name: str) -> Any:
    if name in _CALLABLE_MODULES:  # importing binds the (callable) module as our attribute
        return importlib.import_module(f"agent_grpo.{name}")
    if name in _RUNS:
        return getattr(importlib.import_module("agent_grpo.runs"), name)
    raise AttributeError(f"module 'agent_grpo' has no attribute {name!r}")
