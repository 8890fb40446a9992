"""Checks a config must pass before any model work, so that a mistake is one line naming it
(the CLI prints `error: ...` and exits 2) instead of a traceback minutes in, and no run
directory is made for a run that cannot start.

In order:
- the model (`check_model_source`): "did you mean smollm2-135m-instruct?" for a mistyped
  embedded name, a checkpoint or run directory given instead of the `model/` inside it, missing
  or corrupt files, a hub id with no cached copy while the hub is offline;
- the environment id, with gymnasium's "Did you mean", or ours across namespaces
  (`Calculator-v0` -> `agent_grpo/Calculator-v0`), and its entry point;
- the tool-call format of a tool env (`bind_tool_format`): `model.tool_format`, or under `auto`
  the format the tokenizer's chat template shows (a template of no known format is refused), is
  written into `env.kwargs.tool_call_format`, the one place every env of the run is built from
  (rollouts on any worker, evaluation, warm start, `replay --verify` from `config.yaml`);
- `env.kwargs` against the constructor: an unknown or missing argument, with the names it takes;
- one reset (`check_reset`): it must not raise (an MCP server that cannot start is one line) and
  must return `(messages, info)`, the chat messages the collector builds the prompt from;
- that the sandbox can run, when a tool of the env needs it (`Tool.needs_sandbox`, the `python`
  tool): without bubblewrap every call would be a `SandboxError`, and the run would train on
  episodes of reward 0;
- that `reset` is deterministic: each env is reset twice with the same seed, and a second
  instance once more. Every member of a group is a fresh env reset with the group's seed, so a
  reset that varies gives each member a different task and the group baseline compares unrelated
  episodes: GRPO still runs, and learns noise;
- one turn (`check_step`): a plain answer, which a text or tool env takes as the final one and
  hands to its verifier. A verifier that raises would otherwise end every episode as an env
  error of reward 0 (the base eval reports success 0.000) and stop the warm start later; here
  it is one line with the user's file and line;
- with a warm start, the env's scripted expert on one seed (`check_expert`), as the warm start
  runs it: an env with no expert, or a verifier that raises only on a right answer (which the
  plain turn above never gives), would otherwise pass the base eval and stop the warm start with
  a traceback.

Where we depart from gymnasium's `env_checker`: it checks spaces and API shapes on a constructed
env; we check only what would silently break a GRPO run, and turn a config mistake into one line.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sysconfig
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.registration import EnvSpec

from agent_grpo.config.base import ConfigError, close_match
from agent_grpo.config.jobs import (
    BackendConfig,
    EnvConfig,
    EvalRunConfig,
    ModelConfig,
    TrainConfig,
)
from agent_grpo.envs.registry import TOOL_FORMAT_KWARG, env_spec, make_env
from agent_grpo.envs.text_env import (
    HELDOUT_SEEDS,
    TRAIN_SEEDS,
    ToolEnv,
    read_state,
    read_turn_reward,
)
from agent_grpo.models.loading import check_model_source, load_tokenizer, resolve_model_path
from agent_grpo.rollout.config import RayWorkers
from agent_grpo.sandbox.runner import sandbox_refusal
from agent_grpo.tools.formats.registry import AUTO, get_tool_format, tool_format_for
from agent_grpo.tools.mcp_client import McpServerError
from agent_grpo.trajectory.record import Message

__all__ = [
    "CHECK_ANSWER",
    "CHECK_SEEDS",
    "ConstructorArguments",
    "PreflightError",
    "bind_tool_format",
    "chat_template_of",
    "check_env",
    "check_expert",
    "check_reset",
    "check_reset_deterministic",
    "check_sandbox",
    "check_step",
    "constructor_arguments",
    "kwargs_problem",
    "preflight_eval",
    "preflight_train",
    "resolve_env",
]

CHECK_SEEDS = (TRAIN_SEEDS.start, HELDOUT_SEEDS.start)
"""Task seeds the determinism check resets with: one training and one held-out seed."""
CHECK_ANSWER = "Answer: 0"
"""The turn `check_step` takes: no tool call, so a text or tool env verifies it as the answer."""


class PreflightError(ConfigError):
    """A config that validates but cannot run (a missing env, a bad constructor argument, a
    non-deterministic reset), found before any model work."""


def preflight_train(config: TrainConfig) -> None:
    """Everything `agent-grpo train` can check before loading a model or making a run dir;
    binds the tool-call format into `config.env.kwargs`."""
    check_model_source(config.model.name_or_path)
    workers = config.rollout.workers
    gpus = workers.num_gpus_per_worker if isinstance(workers, RayWorkers) else None
    check_engine(config.rollout.backend, config.model.name_or_path, gpus)
    bind_tool_format(config.model, config.env)
    check_env(config.env, expert=config.warm_start is not None)


def preflight_eval(config: EvalRunConfig) -> None:
    """Everything `agent-grpo eval` can check before loading a model or making a run dir;
    binds the tool-call format into `config.env.kwargs`."""
    check_model_source(config.model.name_or_path)
    check_engine(config.backend, config.model.name_or_path)
    bind_tool_format(config.model, config.env)
    check_env(config.env)


def check_engine(backend: BackendConfig, name_or_path: str, gpus: float | None = None) -> None:
    """A vllm engine that will run on CPU can run the model's attention: the one in this process
    (evaluations, and rollouts without Ray) on a machine where torch sees no GPU, and Ray
    actors given no GPU (`gpus`, each actor's; None: no Ray actors)."""
    if backend.type != "vllm":
        return
    import torch

    if torch.cuda.is_available() and (gpus is None or gpus > 0):  # GPU attention kernels
        return
    found = _model_config_json(name_or_path)
    if found is None:
        return
    from agent_grpo.rollout.backends.vllm import cpu_head_size_problem

    problem = cpu_head_size_problem(json.loads(found.read_text()), name_or_path)
    if problem is not None:
        raise PreflightError(problem)


def _model_config_json(name_or_path: str) -> Path | None:
    """The model's `config.json` (a LoRA adapter's: its base model's), in its directory or the
    hub cache's copy; None if there is none to read (a hub model not yet downloaded)."""
    source = resolve_model_path(name_or_path)
    if Path(source).is_dir():
        path, adapter = Path(source) / "config.json", Path(source) / "adapter_config.json"
        if not path.is_file() and adapter.is_file():
            base = json.loads(adapter.read_text()).get("base_model_name_or_path")
            return _model_config_json(str(base)) if base else None
        return path if path.is_file() else None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(source, "config.json")
    return Path(cached) if isinstance(cached, str) else None


def check_env(env: EnvConfig, expert: bool = False) -> None:
    """The env id resolves, its constructor takes `env.kwargs`, a reset returns chat messages,
    the sandbox its tools need can run, its reset is deterministic, it takes a turn, and, with
    `expert` (a warm start), its expert plays an episode."""
    spec, creator = resolve_env(env.id)
    first = _construct(env, spec, creator)
    try:
        check_reset(env, first)
        check_sandbox(env.id, first)
        check_reset_deterministic(env, first)
        check_step(env.id, first)
        if expert:
            check_expert(env.id, first)
    finally:
        first.close()


# ---------------------------------------------------------------------------------------------
# The id and the entry point


def resolve_env(env_id: str) -> tuple[EnvSpec, Callable[..., Any]]:
    """The spec `make_env(env_id)` uses and the callable it constructs the env with, imported
    but not called; PreflightError naming the id if either cannot be found."""
    try:
        spec = env_spec(env_id)
    except gym.error.Error as error:
        raise PreflightError(f"env.id {env_id!r}: {_with_suggestion(str(error), env_id)}") from None
    if spec.entry_point is None:
        raise PreflightError(f"env.id {env_id!r} is registered without an entry point")
    if callable(spec.entry_point):
        return spec, spec.entry_point
    return spec, _load_entry_point(env_id, spec.entry_point)


def _with_suggestion(message: str, env_id: str) -> str:
    """Gymnasium's message, plus a close registered id when it suggests none (it only looks
    within the namespace typed, so `Calculator-v0` never finds `agent_grpo/Calculator-v0`)."""
    if "did you mean" in message.lower():
        return message
    match = close_match(env_id, list(gym.registry), cutoff=0.6)
    return f"{message} Did you mean `{match}`?" if match else message


def _load_entry_point(env_id: str, entry_point: str) -> Callable[..., Any]:
    """Import `module:attr`; PreflightError naming the id and the import that failed."""
    module_name, _, attr = entry_point.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise PreflightError(f"env.id {env_id!r}: cannot import {module_name}: {error}") from None
    if not hasattr(module, attr):
        match = close_match(attr, [n for n in dir(module) if not n.startswith("_")])
        hint = f": did you mean {module_name}:{match}?" if match else ""
        raise PreflightError(f"env.id {env_id!r}: {module_name} has no {attr!r}{hint}")
    creator: Callable[..., Any] = getattr(module, attr)
    return creator


# ---------------------------------------------------------------------------------------------
# The tool-call format


def bind_tool_format(model: ModelConfig, env: EnvConfig) -> str | None:
    """Set `env.kwargs.tool_call_format` to the format the run's tool env must use and return
    it (None for an env class without tools, which takes no format).

    An `env.kwargs.tool_call_format` already there (a config written back from a run's
    `config.yaml`, or set by hand) is kept when `model.tool_format` is `auto` or agrees with it."""
    _, creator = resolve_env(env.id)
    if isinstance(creator, type) and not issubclass(creator, ToolEnv):
        return None
    given = env.kwargs.get(TOOL_FORMAT_KWARG)
    if given is not None:
        return _given_tool_format(model, given)
    template = chat_template_of(model.name_or_path) if model.tool_format == AUTO else None
    try:
        name = tool_format_for(model.tool_format, template)
    except ValueError as error:
        raise PreflightError(f"model {model.name_or_path}: {error}") from None
    env.kwargs = {**env.kwargs, TOOL_FORMAT_KWARG: name}
    return name


def _given_tool_format(model: ModelConfig, given: Any) -> str:
    """The `env.kwargs.tool_call_format` a config sets, if it names a format `model` allows."""
    if not isinstance(given, str):
        raise PreflightError(f"env.kwargs.{TOOL_FORMAT_KWARG} must be a format name, got {given!r}")
    try:
        get_tool_format(given)
    except ValueError as error:
        raise PreflightError(f"env.kwargs.{TOOL_FORMAT_KWARG}: {error}") from None
    if model.tool_format not in (AUTO, given):
        raise PreflightError(
            f"env.kwargs.{TOOL_FORMAT_KWARG}={given} disagrees with "
            f"model.tool_format={model.tool_format}; set one of them"
        )
    return given


def chat_template_of(name_or_path: str) -> str | None:
    """The chat template text of a model's tokenizer (every named template, joined, when it has
    several); read from the files of a local directory, loaded for a hub id."""
    source = Path(resolve_model_path(name_or_path))
    if not source.is_dir():
        return _template_text(load_tokenizer(str(source)).chat_template)
    if (source / "chat_template.jinja").is_file():
        return (source / "chat_template.jinja").read_text()
    config = source / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        return _template_text(json.loads(config.read_text()).get("chat_template"))
    except (ValueError, AttributeError):  # not JSON, or not an object: load_tokenizer will say
        return None


def _template_text(template: Any) -> str | None:
    """A `chat_template` value as text: a string, or the named templates (a list of
    `{"name", "template"}` in tokenizer_config.json, a dict on a tokenizer) joined."""
    if isinstance(template, str):
        return template
    if isinstance(template, dict):
        template = [{"template": text} for text in template.values()]
    if isinstance(template, list):
        texts = [t.get("template") for t in template if isinstance(t, dict)]
        return "\n".join(t for t in texts if isinstance(t, str)) or None
    return None


# ---------------------------------------------------------------------------------------------
# The constructor's arguments


@dataclass(frozen=True)
class ConstructorArguments:
    """The keyword arguments an env constructor takes, read from its signature (and, through
    `**kwargs`, from the `__init__` of each base class it forwards them to)."""

    names: list[str]
    """Every argument name it accepts, in signature order."""
    required: list[str]
    """Names without a default (of the constructor itself)."""
    open_ended: bool
    """Whether it takes any name (a `**kwargs` that reaches no closed signature)."""


def _inits(creator: Callable[..., Any]) -> Iterator[tuple[Callable[..., Any], bool]]:
    """`(function, is_method)` for the creator and, for a class, each `__init__` up its MRO."""
    if not isinstance(creator, type):
        yield creator, False
        return
    for klass in creator.__mro__:
        if klass is not object and "__init__" in vars(klass):
            yield vars(klass)["__init__"], True


def constructor_arguments(creator: Callable[..., Any]) -> ConstructorArguments | None:
    """What `creator` takes as keyword arguments; None when its signature cannot be read."""
    names: list[str] = []
    required: list[str] | None = None
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for function, is_method in _inits(creator):
        try:
            params = list(inspect.signature(function).parameters.values())
        except (TypeError, ValueError):
            return None
        params = params[1:] if is_method else params  # `self`
        own = [p for p in params if p.kind in named]
        names += [p.name for p in own if p.name not in names]
        if required is None:
            required = [p.name for p in own if p.default is inspect.Parameter.empty]
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return ConstructorArguments(names, required, open_ended=False)
    # `**kwargs` all the way up: a plain function takes anything; object.__init__ takes nothing.
    return ConstructorArguments(names, required or [], open_ended=not isinstance(creator, type))


def kwargs_problem(creator: Callable[..., Any], kwargs: dict[str, Any]) -> str | None:
    """Why `creator(**kwargs)` cannot bind, in words, or None if its signature allows it."""
    args = constructor_arguments(creator)
    if args is None:
        return None
    label = getattr(creator, "__qualname__", repr(creator))
    unknown = [] if args.open_ended else [k for k in kwargs if k not in args.names]
    if unknown:
        match = close_match(unknown[0], args.names)
        hint = f" (did you mean {match}?)" if match else ""
        return f"{label} takes no argument {unknown[0]!r}{hint}; it takes: {', '.join(args.names)}"
    missing = [n for n in args.required if n not in kwargs]
    return f"{label} needs {', '.join(missing)}" if missing else None


def _construct(env: EnvConfig, spec: EnvSpec, creator: Callable[..., Any]) -> gym.Env[Any, Any]:
    """`make_env` as the run will call it; a constructor that refuses `env.kwargs` is one line.

    The signature is only consulted once the constructor has failed, so a `**kwargs` the
    signature walk misreads can never reject a config that works; a TypeError the signature
    does not explain is a bug in the env and keeps its traceback."""
    try:
        return make_env(env.id, **env.kwargs)
    except TypeError:
        problem = kwargs_problem(creator, _constructor_kwargs({**spec.kwargs, **env.kwargs}))
        if problem is None:
            raise
        raise PreflightError(f"env.kwargs of {spec.id}: {problem}") from None
    except ValueError as error:  # the usual way a constructor refuses an argument's value
        given = _constructor_kwargs(env.kwargs)
        if not given:
            raise
        message = " ".join(str(error).split())
        raise PreflightError(f"env.kwargs {given} of {spec.id}: {message}") from None


def _constructor_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`env.kwargs` as the constructor sees them: without the format `make_env` applies."""
    return {k: v for k, v in kwargs.items() if k != TOOL_FORMAT_KWARG}


# ---------------------------------------------------------------------------------------------
# One reset and one turn


def check_reset(env: EnvConfig, instance: gym.Env[Any, Any]) -> None:
    """Reset `instance` once; PreflightError if that raises (an MCP server that cannot start,
    named by its key) or returns anything but `(messages, info)`."""
    try:
        with warnings.catch_warnings(record=True) as warned:  # gymnasium's, shown if it is valid
            warnings.simplefilter("always")
            result = instance.reset(seed=CHECK_SEEDS[0])
    except McpServerError as error:
        where = "env.kwargs.mcp_server" if "mcp_server" in env.kwargs else f"env {env.id}"
        raise PreflightError(f"{where}: {_one_line(str(error))}") from None
    except Exception as error:
        raise _env_raised(env.id, f"reset(seed={CHECK_SEEDS[0]})", error) from None
    observation, info = _returned(env.id, "reset", ("observation", "info"), result)
    problem = _messages_problem(observation)
    if problem is not None:
        raise PreflightError(
            f"env {env.id}: reset()'s observation must be the prompt as a list of chat "
            f"messages ({{'role': ..., 'content': ...}}); {problem}"
        )
    if not isinstance(info, dict):
        raise PreflightError(f"env {env.id}: reset()'s info must be a dict, got {_shown(info)}")
    _check_credit_keys(env.id, "reset()", info)
    for w in warned:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def check_step(env_id: str, instance: gym.Env[Any, Any]) -> None:
    """One turn, `CHECK_ANSWER`, on `instance` just reset; PreflightError with the raising line
    if the step (its verifier, for a text or tool env) raises, or its result is not a step's."""
    try:
        result = instance.step(CHECK_ANSWER)
    except Exception as error:
        raise _env_raised(env_id, f"the turn {CHECK_ANSWER!r}", error) from None
    observation, _, terminated, truncated, info = _returned(env_id, "step", _STEP_FIELDS, result)
    problem = None if terminated or truncated else _messages_problem(observation, empty=True)
    if problem is not None:
        raise PreflightError(
            f"env {env_id}: step()'s observation must be a list of chat messages; {problem}"
        )
    if isinstance(info, dict):
        _check_credit_keys(env_id, "step()", info)


_STEP_FIELDS = ("observation", "reward", "terminated", "truncated", "info")
"""What gymnasium's `step()` returns, in order."""


def _env_raised(env_id: str, doing: str, error: BaseException) -> PreflightError:
    """The one line for an env that raised while `doing` something, at the user's line."""
    return PreflightError(f"env {env_id}: {doing} raised {_raised(error)}")


def _returned(env_id: str, method: str, fields: tuple[str, ...], result: Any) -> tuple[Any, ...]:
    """`result` of the env's `method()`, if it is the tuple of `fields` gymnasium asks for."""
    if not (isinstance(result, tuple) and len(result) == len(fields)):
        shape, got = ", ".join(fields), _shown(result)
        raise PreflightError(f"env {env_id}: {method}() must return ({shape}), got {got}")
    return result


def _check_credit_keys(env_id: str, where: str, info: dict[str, Any]) -> None:
    """The optional `state` and `turn_reward` info keys (turn-level credit) read as the rollout
    reads them; a wrong type is one line here instead of a traceback mid-rollout."""
    try:
        read_state(info)
        read_turn_reward(info)
    except TypeError as error:
        raise PreflightError(f"env {env_id}: {where}'s {error}") from None


def check_expert(env_id: str, instance: gym.Env[Any, Any]) -> None:
    """The scripted expert's episode on `instance` reset with `CHECK_SEEDS[0]`, turn by turn as
    `warm_start.expert_record` plays it; PreflightError if the env has no expert, or the expert
    or a step it takes (the verifier judging the expert's answer) raises."""
    expert = getattr(instance.unwrapped, "expert_action", None)
    if not callable(expert):
        name = type(instance.unwrapped).__name__
        raise PreflightError(_no_expert(env_id, f"{name} has no expert_action"))
    instance.reset(seed=CHECK_SEEDS[0])
    done = False
    while not done:
        try:
            action = expert()
        except NotImplementedError as error:  # TextEnv's default: the env has no expert
            raise PreflightError(_no_expert(env_id, _one_line(str(error)))) from None
        except Exception as error:
            raise _env_raised(env_id, "expert_action()", error) from None
        try:
            _, _, terminated, truncated, _ = instance.step(action)
        except Exception as error:
            doing = f"the expert's turn {_cut(action)} (warm_start imitates it)"
            raise _env_raised(env_id, doing, error) from None
        done = bool(terminated or truncated)


def _no_expert(env_id: str, why: str) -> str:
    return (
        f"env {env_id}: warm_start imitates the env's scripted expert, and it has none ({why}); "
        "write its expert_action() or set warm_start: null"
    )


def _cut(text: str, width: int = 60) -> str:
    """`repr(text)`, cut to `width` characters."""
    shown = repr(text)
    return shown if len(shown) <= width else f"{shown[: width - 3]}..."


def _messages_problem(observation: Any, empty: bool = False) -> str | None:
    """Why `observation` is not a list of chat messages (an empty one only if `empty`)."""
    if not isinstance(observation, list):
        return f"got {_shown(observation)}"
    if not observation and not empty:
        return "got an empty list"
    for i, message in enumerate(observation):
        try:
            Message.model_validate(message)
        except ValueError as error:  # pydantic's ValidationError
            first = error.errors()[0] if hasattr(error, "errors") else {"msg": str(error)}
            at = ".".join(str(x) for x in first.get("loc", ()))
            return f"message {i} {_shown(message)}: {at + ': ' if at else ''}{first['msg']}"
    return None


def _shown(value: Any, width: int = 80) -> str:
    """`type: repr`, the repr cut to `width` characters."""
    text = repr(value)
    text = text if len(text) <= width else f"{text[: width - 3]}..."
    return f"{type(value).__name__} {text}"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _raised(error: BaseException) -> str:
    """`Type: message at file:line in function: source`, at the innermost frame of the user's
    code: outside the standard library and installed packages, and outside agent_grpo where
    any frame is (a user's verifier calling one of our helpers points at the user's call); the
    innermost frame of all when the error is a library's (gymnasium's wrappers, say)."""
    frames = traceback.extract_tb(error.__traceback__)
    paths = sysconfig.get_paths()
    libraries = tuple({paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
    package = str(Path(__file__).resolve().parent)
    ours = [f for f in frames if not f.filename.startswith(libraries) and f.filename != __file__]
    theirs = [f for f in ours if not str(Path(f.filename).resolve()).startswith(package)]
    message = _one_line(f"{type(error).__name__}: {error}")
    if not frames:
        return message
    frame = (theirs or ours or frames)[-1]
    source = f": {frame.line}" if frame.line else ""
    return f"{message} (at {frame.filename}:{frame.lineno} in {frame.name}{source})"


# ---------------------------------------------------------------------------------------------
# The sandbox


def check_sandbox(env_id: str, env: gym.Env[Any, Any]) -> None:
    """PreflightError when a tool of `env` runs code in the sandbox and the sandbox refuses to."""
    tools = env.unwrapped.tools if isinstance(env.unwrapped, ToolEnv) else ()
    needing = [t.name for t in tools if t.needs_sandbox]
    if needing and (refusal := sandbox_refusal()) is not None:
        raise PreflightError(
            f"env {env_id} runs code in the sandbox (tool {needing[0]}): {refusal}"
        )


# ---------------------------------------------------------------------------------------------
# Deterministic reset


def check_reset_deterministic(env: EnvConfig, first: gym.Env[Any, Any]) -> None:
    """Reset `first` twice and a second instance once with each of `CHECK_SEEDS`; PreflightError
    naming the env if the observations differ."""
    second = make_env(env.id, **env.kwargs)
    try:
        for seed in CHECK_SEEDS:
            a, _ = first.reset(seed=seed)
            b, _ = first.reset(seed=seed)
            c, _ = second.reset(seed=seed)
            for other, where in ((b, "the same env"), (c, "a second env")):
                if not same_observation(a, other):
                    raise PreflightError(_nondeterministic(env.id, seed, where, a, other))
    finally:
        second.close()


def same_observation(a: Any, b: Any) -> bool:
    """Exact equality of two observations (chat messages, arrays, or nests of them)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_observation(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_observation(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _nondeterministic(env_id: str, seed: int, where: str, a: Any, b: Any) -> str:
    return (
        f"env {env_id}: reset(seed={seed}) is not deterministic: {where} reset with the same "
        f"seed gave {_difference(a, b)}, so each member of a group would get a different task. "
        "Draw the task from the seed (np.random.default_rng(seed), or self.np_random after "
        "super().reset(seed=seed))"
    )


def _difference(a: Any, b: Any, width: int = 30) -> str:
    """Where two observations' reprs first differ: `...x... instead of ...y...`."""
    ra, rb = repr(a), repr(b)
    i = next((i for i, (x, y) in enumerate(zip(ra, rb, strict=False)) if x != y), len(ra))
    start = max(0, i - width // 2)
    return f"{rb[start : i + width]!r} instead of {ra[start : i + width]!r}"
