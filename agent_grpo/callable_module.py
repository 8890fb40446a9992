"""Modules that can be called: `agent_grpo.train(config)` and `agent_grpo.evaluate(config)`.

`agent_grpo.train` is the trainer package and `agent_grpo.evaluate` the evaluation module, and
importing a submodule always binds it as an attribute of its parent (overwriting any function
of that name), so the Python API's two functions cannot simply be names in `agent_grpo`. Each of
the two modules is instead given a `ModuleType` subclass whose `__call__` is the API function
(setting a module's `__class__` to such a subclass is the documented way to customise a module
beyond `__getattr__`: the language reference, "Customizing module attribute access"). That holds
whichever way, and in whichever order, the module is imported.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__all__ = ["make_callable"]


def make_callable(module_name: str, target: str) -> None:
    """Make the (imported) module `module_name` callable as `target`, a `module:function`
    imported on the first call, so the module stays as light to import as it was."""
    target_module, _, function = target.partition(":")

    def call(self: types.ModuleType, *args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(target_module), function)(*args, **kwargs)

    call.__doc__ = f"Call `{target}`."
    kind = type("CallableModule", (types.ModuleType,), {"__call__": call, "__doc__": call.__doc__})
    sys.modules[module_name].__class__ = kind
