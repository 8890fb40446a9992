"""agent-grpo: train LLM agents with GRPO on multi-turn, tool-using tasks, correct to the token.

The Python API (docs/python-api.md), imported on first use so that `import agent_grpo` stays
light (no torch):

- `agent_grpo.train(config)`: the `agent-grpo train` job; returns its `Run`.
- `agent_grpo.evaluate(config)`: the `agent-grpo eval` job; returns its `Run`.
- `agent_grpo.load_run(path)`: a run directory read for analysis (`agent_grpo.Run`).

The package's folders are its concepts (docs/architecture.md): `algo/`, `rollout/`, `trainer/`,
`evaluation/`, `run_dir/`, `inspect/`, `envs/`, `tools/`, `sandbox/`, `trajectory/`, `models/`,
`config/`, and `testing/` for the doubles tests use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agent_grpo import _moved

if TYPE_CHECKING:
    from agent_grpo.api import evaluate, train
    from agent_grpo.run_dir.reader import Run, load_run

__version__ = "0.1.0"

__all__ = ["Run", "evaluate", "load_run", "train"]

_LAZY = {
    "train": "agent_grpo.api",
    "evaluate": "agent_grpo.api",
    "Run": "agent_grpo.run_dir.reader",
    "load_run": "agent_grpo.run_dir.reader",
}

_moved.install()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agent_grpo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
