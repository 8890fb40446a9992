"""The trainer: the loop (`loop.py`), the update (`update.py`), batches (`batch.py`), metrics,
checkpoints, parallelism and the warm start. `train(config)` runs a whole job.

`train` is imported lazily so that `agent_grpo.train.config` can be imported by lower layers
(evaluation, rollouts) without pulling in the whole trainer.

The package itself is callable: `agent_grpo.train(config)` is the Python API's
`agent_grpo.api.train` (any config form; returns a `Run`), this `train` the loop it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_grpo.callable_module import make_callable

if TYPE_CHECKING:
    from agent_grpo.train.loop import train

__all__ = ["train"]


def __getattr__(name: str) -> Any:
    if name == "train":
        from agent_grpo.train.loop import train

        return train
    raise AttributeError(f"module 'agent_grpo.train' has no attribute {name!r}")


make_callable(__name__, "agent_grpo.api:train")
