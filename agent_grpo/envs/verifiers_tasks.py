"""Reading Verifiers-v0's tasks: a verifiers v1 taskset built as verifiers builds it, split, and
checked for what can be scored offline.

`load_tasks` builds the taskset that `env.kwargs.taskset` names from its `args` (a `vf.Taskset`
subclass gets them validated by its own config type, a function gets them as arguments, an
installed id, `name` or `owner/name`, goes through verifiers' loader) and iterates it as
verifiers does (each task's `idx` set, the config's `system_prompt` file applied), once per
process and arguments: every episode makes an env, and reloading would cost each one a dataset
load. `split_tasks` sets the held-out tasks apart and drops training tasks with a held-out
prompt. `check_scoring` refuses, in one line, what needs more than one offline episode, or a
sandbox, to run and score.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
from typing import Any

from pydantic import ValidationError

__all__ = ["check_scoring", "import_verifiers", "load_tasks", "one_line", "split_tasks"]


VERSION = "0.4.0"
"""The verifiers release this adapter follows: the v1 API changes between releases."""
INSTALL = (f"pip install --no-deps verifiers=={VERSION} 'agent-grpo[verifiers]' (--no-deps: its "
           "mcp==2.0.0 and openai<3 pins serve its own rollouts, which Verifiers-v0 does not "
           "use)")  # fmt: skip


@functools.cache
def _installed_version() -> str:
    """The installed verifiers release, read once per process."""
    return importlib.metadata.version("verifiers")


def import_verifiers() -> Any:
    """`verifiers.v1`, or a one-line ImportError saying how to install the release we follow."""
    if importlib.util.find_spec("verifiers") is None:
        raise ImportError(f"Verifiers-v0 needs verifiers: {INSTALL}")
    if (found := _installed_version()) != VERSION:
        raise ImportError(f"Verifiers-v0 follows verifiers {VERSION}'s v1 API, not {found}'s: "
                          f"{INSTALL}")  # fmt: skip
    import verifiers.v1

    return verifiers.v1


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`, for one-line errors."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def problems(error: ValidationError) -> str:
    """Every problem of a validation error, on one line."""
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())


def _find(name: str) -> Any:
    """What `name` names: a `module:attribute`, or an installed taskset id's Taskset class (a
    Hub id `owner/name` imports as the installed package `name`, as verifiers loads it)."""
    from verifiers.v1.utils.loaders import taskset_class

    module, _, attribute = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute) if attribute else (
            taskset_class(name))  # fmt: skip
    except (ImportError, AttributeError, TypeError, ValueError) as error:
        why = one_line(error)
        raise ValueError(f"verifiers taskset {name!r} cannot be loaded: {why}") from None


def build_taskset(name: str, args: dict[str, Any]) -> Any:
    """The taskset `name` names, built from `args`."""
    vf = import_verifiers()
    from verifiers.v1.utils.generic import concrete_type

    found = _find(name)
    if isinstance(found, type) and issubclass(found, vf.Taskset):
        config_type = concrete_type(found, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        fields = args if ":" in name else {**args, "id": name}  # an id is its config's `id`
        try:
            config = config_type.model_validate(fields)
        except ValidationError as error:
            raise ValueError(f"verifiers taskset {name!r} args {args}: {problems(error)}") from None
        return found(config)
    built = found(**args)  # a function: `args` are its arguments
    if not isinstance(built, vf.Taskset):
        raise ValueError(f"{name!r} made a {type(built).__name__}, not a verifiers Taskset")
    return built


@functools.cache
def _load(name: str, args_json: str) -> tuple[Any, tuple[Any, ...]]:
    taskset = build_taskset(name, json.loads(args_json))
    if not taskset.bounded:
        raise ValueError(f"verifiers taskset {name!r} is infinite: Verifiers-v0 loads every task "
                         "to split them, so give it a finite taskset")  # fmt: skip
    tasks = tuple(taskset)  # verifiers' read path: `idx` set, a `system_prompt` file applied
    if not tasks:
        raise ValueError(f"verifiers taskset {name!r} with args {args_json} has no tasks")
    if any(task.data.prompt is None for task in tasks):
        raise ValueError(f"verifiers taskset {name!r} has a task without a prompt (a user "
                         "simulator opens it): Verifiers-v0 needs the prompt")  # fmt: skip
    return taskset, tasks


def load_tasks(name: str, args: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """The taskset and its tasks, loaded once per process and arguments."""
    return _load(name, json.dumps(args, sort_keys=True, default=str))


def _prompt_key(task: Any) -> str:
    return json.dumps(task.data.model_dump(mode="json")["prompt"], sort_keys=True)


def split_tasks(
    tasks: tuple[Any, ...], heldout: tuple[Any, ...] | None, fraction: float
) -> dict[str, tuple[Any, ...]]:
    """Training and held-out tasks (without `heldout`, the last `fraction` of `tasks`); a
    training task whose prompt is also held out is dropped."""
    if heldout is None:
        cut = len(tasks) - math.ceil(fraction * len(tasks))
        tasks, heldout = tasks[:cut], tasks[cut:]
    held = {_prompt_key(task) for task in heldout}
    train = tuple(task for task in tasks if _prompt_key(task) not in held)
    if not train:
        raise ValueError("verifiers taskset: no training task is left once held-out tasks are "
                         "set apart (give more tasks, or heldout_args)")  # fmt: skip
    return {"train": train, "heldout": heldout}


_RUNTIME_HOOKS = ("setup", "finalize", "stage_verifier")
"""`Task` methods verifiers runs with the episode's runtime (a sandbox); Verifiers-v0 has none."""


def _runtime_hooks(task: Any) -> list[str]:
    """The task's lifecycle hooks that its class overrides, each of which gets a runtime."""
    vf = import_verifiers()
    return [name for name in _RUNTIME_HOOKS
            if getattr(type(task), name) is not getattr(vf.Task, name)]  # fmt: skip


def _needs_runtime(fn: Any) -> bool:
    """Whether a reward or metric takes a `runtime` without a default."""
    runtime = inspect.signature(fn).parameters.get("runtime")
    return runtime is not None and runtime.default is inspect.Parameter.empty


def check_scoring(task: Any) -> list[str]:
    """The names of the task's rewards and metrics (its `@vf.reward`/`@vf.metric` methods and
    those its config plugs in); ValueError, one line, for what cannot run and be scored from one
    episode without a model client or a sandbox."""
    kind = type(task).__name__
    if task.config.judges:
        raise ValueError(f"{kind} has judges, which need a model client: Verifiers-v0 scores "
                         "one episode offline")  # fmt: skip
    if type(task).NEEDS_CONTAINER:
        raise ValueError(f"{kind} needs a container, which Verifiers-v0 does not start")
    if hooks := _runtime_hooks(task):
        raise ValueError(f"{kind}.{hooks[0]} runs with a runtime (a sandbox), which "
                         "Verifiers-v0 does not start")  # fmt: skip
    rewards = task.hooks("reward")
    if not rewards:
        raise ValueError(f"{kind} has no @vf.reward: there is nothing to train on")
    scoring = [*rewards, *task.hooks("metric")]
    for fn in scoring:
        # verifiers would skip it offline; a reward left out would change what we train on
        if _needs_runtime(fn):
            raise ValueError(f"{kind}.{fn.__name__} needs a runtime (a sandbox), which "
                             "Verifiers-v0 does not start")  # fmt: skip
        if not inspect.iscoroutinefunction(inspect.unwrap(fn)):  # verifiers gathers them
            raise ValueError(f"{kind}.{fn.__name__} must be `async def`: verifiers awaits it")
    return [fn.__name__ for fn in scoring]
