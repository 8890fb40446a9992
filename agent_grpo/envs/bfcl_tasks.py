"""BFCL v4 multi-turn tasks, read from the installed `bfcl-eval` package, and the call strings
its backends execute.

Everything here is BFCL's own data: the 200 `multi_turn_base` entries (`question`,
`initial_config`, `involved_classes`), their `possible_answer` ground truth, and the function docs
of each backend class (`data/multi_turn_func_doc/`). BFCL executes and checks calls as Python
call strings (`cd(folder='documents')`); `call_string` writes one from a parsed tool call the way
BFCL's FC handlers do (`model_handler.utils.convert_to_function_call`), and `parse_call` reads
a ground-truth string back into a name and keyword arguments, so a policy can replay it in any
tool-call format.

Where we depart from BFCL's loader (`bfcl_eval.utils.load_dataset_entry`): we read the same files
ourselves, because importing `bfcl_eval.utils` creates `result/`, `score/` and `.file_locks/`
beside site-packages and needs `filelock` locks for a read-only load. We add the same "Python 3
syntax" hint to each description that it adds, and convert the docs' types (`dict`, `float`,
`any`) to JSON schema with BFCL's own table (`GORILLA_TO_OPENAPI`), as its `convert_to_tool`
does for OpenAI-style tools; the `response` schemas are left out, as OpenAI-style handlers do.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import importlib.util
import inspect
import json
import keyword
from collections.abc import Mapping, Sequence
from importlib.resources import files
from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = [
    "CATEGORY",
    "BfclTask",
    "bfcl_eval",
    "call_string",
    "function_docs",
    "json_schema_parameters",
    "load_tasks",
    "parse_call",
]

CATEGORY = "multi_turn_base"
"""The BFCL test category the tasks come from."""
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."
"""What BFCL appends to every Python function's description
(`bfcl_eval.utils._get_language_specific_hint`)."""


class BfclTask(BaseModel):
    """One BFCL multi-turn entry with its ground truth."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    id: str
    """BFCL's entry id (`multi_turn_base_17`)."""
    index: int
    """The entry's place in the category (17 for `multi_turn_base_17`)."""
    turns: tuple[str, ...]
    """The user message of each turn, in order."""
    initial_config: dict[str, Any]
    """Each backend class's starting state, as BFCL loads it (`_load_scenario`)."""
    involved_classes: tuple[str, ...]
    """The backend classes whose functions the model may call (`GorillaFileSystem`, ...)."""
    ground_truth: tuple[tuple[str, ...], ...]
    """Per turn, the call strings BFCL's checker compares the model's calls with."""

    def test_entry(self) -> dict[str, Any]:
        """The entry as BFCL's checker takes it (`id`, `initial_config`, `involved_classes`)."""
        return {"id": self.id, "initial_config": copy.deepcopy(self.initial_config),
                "involved_classes": list(self.involved_classes)}  # fmt: skip


def bfcl_eval() -> Any:
    """The `bfcl_eval` package; ImportError with the install line when it is missing."""
    if importlib.util.find_spec("bfcl_eval") is None:
        raise ImportError(
            "BFCL-v0 needs bfcl-eval: pip install --no-deps bfcl-eval==2026.3.23 "
            "'agent-grpo[bfcl]' (--no-deps: its own pins, numpy==1.26.4 among them, are for "
            "its API clients, which BFCL-v0 does not use)"
        )
    return importlib.import_module("bfcl_eval")


def _data_lines(relative: str) -> list[dict[str, Any]]:
    """The JSON lines of one of the package's data files."""
    text = (files(bfcl_eval()) / "data" / relative).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@functools.cache
def load_tasks() -> tuple[BfclTask, ...]:
    """The category's entries with their ground truth, in BFCL's order (read once)."""
    from bfcl_eval.constants.category_mapping import VERSION_PREFIX

    name = f"{VERSION_PREFIX}_{CATEGORY}.json"
    entries = _data_lines(name)
    answers = {a["id"]: a["ground_truth"] for a in _data_lines(f"possible_answer/{name}")}
    return tuple(_task(entry, answers) for entry in entries)


def _task(entry: Mapping[str, Any], answers: Mapping[str, Any]) -> BfclTask:
    turns = entry["question"]
    if any(len(turn) != 1 or turn[0]["role"] != "user" for turn in turns):
        raise ValueError(f"BFCL entry {entry['id']}: a turn is not one user message")
    truth = answers[entry["id"]]
    if len(truth) != len(turns):
        raise ValueError(f"BFCL entry {entry['id']}: {len(truth)} answers for {len(turns)} turns")
    return BfclTask(
        id=entry["id"],
        index=int(entry["id"].rsplit("_", 1)[1]),
        turns=tuple(turn[0]["content"] for turn in turns),
        initial_config=entry.get("initial_config", {}),
        involved_classes=tuple(entry["involved_classes"]),
        ground_truth=tuple(tuple(calls) for calls in truth),
    )


@functools.cache
def function_docs(class_name: str) -> tuple[dict[str, Any], ...]:
    """BFCL's function docs of one backend class, each with BFCL's Python hint appended."""
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    docs = _data_lines(f"multi_turn_func_doc/{MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]}")
    return tuple({**doc, "description": doc["description"] + PYTHON_HINT} for doc in docs)


def json_schema_parameters(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A function doc's `parameters` as a JSON schema: every `type` through BFCL's
    `GORILLA_TO_OPENAPI` (an unknown or missing one is `string`, as BFCL makes it)."""
    schema = _converted(parameters)
    schema["type"] = "object"
    return schema


def _converted(schema: Mapping[str, Any]) -> dict[str, Any]:
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI

    out = dict(schema)
    out["type"] = GORILLA_TO_OPENAPI.get(str(schema.get("type")), "string")
    if schema.get("type") == "float":  # BFCL marks it so, for a model that writes 3 for 3.0
        out["format"] = "float"
    if "properties" in schema:
        out["properties"] = {k: _converted(v) for k, v in schema["properties"].items()}
    if "items" in schema:
        out["items"] = _converted(schema["items"])
    return out


def call_string(name: str, arguments: Mapping[str, Any]) -> str:
    """The call BFCL executes for a parsed tool call, written as its FC handlers write it
    (`name(k=repr(v),...)`); `name` must be one of the task's functions (the parser checks).
    BFCL `eval`s the result, so an argument name that is not a plain identifier is refused here
    too, whatever the schema check before it let through (a name is model-written text)."""
    bad = [k for k in arguments if not k.isidentifier() or keyword.iskeyword(k)]
    if bad or not name.isidentifier():
        raise ValueError(f"not a call BFCL can run: function {name!r}, argument names {bad}")
    return f"{name}({','.join(f'{k}={v!r}' for k, v in arguments.items())})"


def parse_call(call: str, classes: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """A ground-truth call string as a function name and keyword arguments (positional ones
    named from the backend method's signature); ValueError, one line, when it is not a call of
    literals to a function of `classes`."""
    try:
        node = ast.parse(call, mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            raise ValueError("not a plain function call")
        args = [ast.literal_eval(a) for a in node.args]
        keywords = {str(k.arg): ast.literal_eval(k.value) for k in node.keywords}
    except (SyntaxError, ValueError) as error:
        raise ValueError(f"BFCL call {call!r}: {error}") from None
    names = _parameter_names(node.func.id, tuple(classes))
    return node.func.id, {**dict(zip(names, args, strict=False)), **keywords}


@functools.cache
def _parameter_names(name: str, classes: tuple[str, ...]) -> tuple[str, ...]:
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING

    for class_name in classes:
        backend = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name]), class_name)
        method = getattr(backend, name, None)
        if callable(method):
            return tuple(p for p in inspect.signature(method).parameters if p != "self")
    raise ValueError(f"BFCL call {name!r}: no function of {', '.join(classes)} has that name")
