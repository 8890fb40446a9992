"""Reading Dataset-v0's tasks: a Hugging Face `datasets` dataset, its columns mapped by a config.

`DatasetSource` is the part of Dataset-v0's kwargs that says where the rows come from and which
columns hold what. `load_tasks` reads the train and held-out splits into `DatasetTask`s once per
process (every episode makes a new env, and rereading would cost each one a dataset load), checks
that the splits and columns exist (an error names what is missing and what there is), and drops
training rows whose prompt is also a held-out prompt, so that a dataset whose splits overlap
still never shows a held-out task in training.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = [
    "PACKAGE_DIR",
    "SHIPPED_FILES",
    "ChatMessage",
    "DatasetSource",
    "DatasetTask",
    "ExpertCall",
    "SplitTasks",
    "load_tasks",
]

PACKAGE_DIR = Path(__file__).parent
"""The installed `agent_grpo/envs/` folder: relative data files are also looked up here."""
SHIPPED_FILES = {
    "train": "data/arithmetic_word_problems-train.jsonl",
    "test": "data/arithmetic_word_problems-test.jsonl",
}
"""The shipped word problems (made by `scripts/make_word_problems.py`): the default dataset."""
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class ChatMessage(BaseModel):
    """One message of a conversational prompt (TRL's format: `{"role": ..., "content": ...}`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    role: Literal["system", "user", "assistant"]
    """Who says it; a system message may only come first."""
    content: str
    """What is said."""


class DatasetTask(BaseModel):
    """One row of the dataset, as a task."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    prompt: str
    """The user message: the row's prompt column (a conversational row: its messages as JSON,
    which is what the splits are told apart by)."""
    messages: tuple[ChatMessage, ...] = ()
    """A conversational row's messages (TRL's format: the prompt column holds a list of
    `{role, content}`), ending with a user message; empty: `prompt` is the one user message."""
    answer: str
    """The reference answer (or, for the regex verifier, the pattern an answer must match)."""
    row: int
    """The row's index in its split, for logs."""
    expert_arguments: dict[str, str] = {}
    """The arguments of the expert's tool call, read from the row (see `ExpertCall`)."""


class ExpertCall(BaseModel):
    """A tool call the scripted expert makes before it answers, its arguments read from columns."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    tool: str
    """The tool's name (one of the env's `tools`)."""
    arguments: dict[str, str]
    """Each argument's column: `{expression: formula}` calls `tool(expression=row["formula"])`."""


SplitTasks = dict[Literal["train", "heldout"], tuple[DatasetTask, ...]]
"""Tasks by the env's split names."""


class DatasetSource(BaseModel):
    """Where Dataset-v0's rows come from and which columns hold the prompt and the answer."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    path: str | None = None
    """A hub id (`openai/gsm8k`, where the network allows), a builder (`json`, `parquet`, `csv`)
    or a local folder; None: the builder that `data_files`' extension names."""
    name: str | None = None
    """The dataset's configuration, if it has several (`main` for GSM8K)."""
    data_files: dict[str, str | list[str]] | None = None
    """Files by split, `{train: a.jsonl, test: b.jsonl}`. Relative paths are looked up in the
    current directory, then in the folder of the config file that names them (made absolute
    when the config loads), then in the installed `agent_grpo/envs/`. With neither `path` nor
    `data_files`: the shipped arithmetic word problems."""
    train_split: str = "train"
    """The split training tasks come from."""
    heldout_split: str = "test"
    """The split evaluation tasks come from: the dataset's own held-out split."""
    prompt_column: str = "question"
    """The column holding the problem text."""
    answer_column: str = "answer"
    """The column holding the reference answer."""
    answer_pattern: str | None = None
    """A regex whose first group is the reference inside the answer column (GSM8K: `####\\s*(.+)`);
    None: the whole cell."""
    verifier: Literal["math", "exact", "text", "regex"] = "math"
    """How answers are judged: math-verify equivalence, exact text, normalized words, or a regex
    (then the answer column holds the pattern)."""
    expert_call: ExpertCall | None = None
    """A tool call the expert makes before answering (its demonstrations then show the tool in
    use); None: the expert only answers."""


def _resolve(file: str) -> str:
    """`file` from here if it exists (absolute), else from PACKAGE_DIR if it exists there; URLs,
    globs and files found nowhere as they are (`datasets` reports those)."""
    if "://" in file or "*" in file:
        return file
    for candidate in (Path(file), PACKAGE_DIR / file):
        if candidate.exists():
            return str(candidate.resolve())
    return file


def _files(source: DatasetSource) -> dict[str, str | list[str]] | None:
    files = source.data_files if source.path or source.data_files else SHIPPED_FILES
    if files is None:
        return None
    return {s: _resolve(f) if isinstance(f, str) else [_resolve(x) for x in f]
            for s, f in files.items()}  # fmt: skip


def _builder(files: dict[str, str | list[str]] | None) -> str:
    first = next(iter(files.values())) if files else ""
    name = first if isinstance(first, str) else first[0]
    builder = _BUILDERS.get(Path(name).suffix)
    if builder is None:
        raise ValueError(f"cannot tell the format of {name!r}: set path to json, parquet or csv")
    return builder


def _load(source: DatasetSource) -> Any:
    """The dataset's splits (`source.data_files` already resolved)."""
    try:
        import datasets
    except ImportError:
        raise ImportError("Dataset-v0 needs datasets: pip install 'agent-grpo[datasets]'") from None
    files = source.data_files
    # datasets fails on an empty file with StopIteration or a message naming no file.
    for split, file in (files or {}).items():
        for name in [file] if isinstance(file, str) else file:
            if Path(name).is_file() and Path(name).stat().st_size == 0:
                raise ValueError(f"the data file of split {split!r} is empty: {name}")
    path = source.path or _builder(files)
    try:
        return datasets.load_dataset(path, source.name, data_files=files)
    except FileNotFoundError as error:
        raise ValueError(f"dataset {path!r}: {_first_line(error)}") from None
    except datasets.exceptions.DatasetGenerationError as error:
        # a row that does not parse (a CSV row with a column too many, a JSON line cut short):
        # the message that names it is the cause's
        raise ValueError(f"dataset {path!r} does not load: {_first_line(error.__cause__ or error)}"
                         ) from None  # fmt: skip


def _first_line(error: BaseException) -> str:
    """An error's message on one line, at most 300 characters."""
    return " ".join(str(error).split())[:300] or type(error).__name__


def _column(data: Any, split: str, name: str, field: str) -> list[Any]:
    if name not in data[split].column_names:
        columns = ", ".join(data[split].column_names)
        raise ValueError(f"{field} {name!r} is not a column of {split!r}; its columns: {columns}")
    return list(data[split][name])


def _reference(cell: Any, source: DatasetSource, row: int, split: str) -> str:
    if cell is None:  # a row without the column, or null: never the reference "None"
        raise ValueError(f"row {row} of {split!r} has no {source.answer_column!r} (answer_column)")
    text = str(cell).strip()
    if source.answer_pattern is not None:
        match = re.search(source.answer_pattern, text)
        if match is None:
            raise ValueError(f"answer_pattern finds nothing in row {row} of {split!r}: {text!r}")
        text = match.group(1).strip()
    if source.verifier == "regex":
        try:
            re.compile(text)
        except re.error as error:
            raise ValueError(f"row {row} of {split!r} is not a regex ({error}): {text!r}") from None
    return text


def _prompt(
    cell: Any, source: DatasetSource, row: int, split: str
) -> tuple[str, tuple[ChatMessage, ...]]:
    """A prompt cell as text, or a conversational cell (TRL's list of messages) as its messages;
    anything else (a dict, a list of something else) is refused, never turned into its repr."""
    where = f"row {row} of {split!r}: prompt_column {source.prompt_column!r}"
    if isinstance(cell, str | int | float) and not isinstance(cell, bool):
        return str(cell), ()
    if not isinstance(cell, list) or not cell:
        raise ValueError(f"{where} holds {type(cell).__name__} {str(cell)[:80]!r}, not text or "
                         "a list of chat messages")  # fmt: skip
    try:
        messages = tuple(ChatMessage.model_validate(m) for m in cell)
    except ValidationError:
        raise ValueError(f"{where} holds a list that is not chat messages: each must be "
                         f"{{role: system|user|assistant, content: text}}; got {str(cell)[:120]}"
                         ) from None  # fmt: skip
    if any(m.role == "system" for m in messages[1:]):
        raise ValueError(f"{where}: a system message may only come first")
    if messages[-1].role != "user":
        raise ValueError(f"{where}: the conversation must end with a user message, the turn "
                         "the model answers")  # fmt: skip
    text = json.dumps([m.model_dump() for m in messages], ensure_ascii=False)
    return text, messages


def _split_tasks(data: Any, split: str, source: DatasetSource) -> list[DatasetTask]:
    if split not in data:
        raise ValueError(
            f"the dataset has no split {split!r}; its splits: {', '.join(sorted(data))}"
        )
    prompts = _column(data, split, source.prompt_column, "prompt_column")
    answers = _column(data, split, source.answer_column, "answer_column")
    if not prompts:
        raise ValueError(f"split {split!r} is empty")
    call = source.expert_call.arguments if source.expert_call else {}
    values = {arg: _column(data, split, col, "expert_call column") for arg, col in call.items()}
    tasks = []
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        text, messages = _prompt(p, source, i, split)
        tasks.append(
            DatasetTask(
                prompt=text,
                messages=messages,
                answer=_reference(a, source, i, split),
                row=i,
                expert_arguments={arg: str(v[i]) for arg, v in values.items()},
            )
        )
    return tasks


def load_tasks(source: DatasetSource) -> SplitTasks:
    """The training and held-out tasks (read once per process); training holds no held-out prompt.

    `source` may be a subclass (the env's whole config): only `DatasetSource`'s fields count. The
    cache is keyed on the resolved files, so a relative path means what it means from here."""
    fields = source.model_dump(include=set(DatasetSource.model_fields))
    return _load_tasks(json.dumps({**fields, "data_files": _files(source)}))


@functools.cache
def _load_tasks(source_json: str) -> SplitTasks:
    source = DatasetSource.model_validate_json(source_json)
    data = _load(source)
    heldout = _split_tasks(data, source.heldout_split, source)
    held_prompts = {t.prompt for t in heldout}
    train = [t for t in _split_tasks(data, source.train_split, source)
             if t.prompt not in held_prompts]  # fmt: skip
    if not train:
        raise ValueError(f"every prompt of split {source.train_split!r} is also held out")
    return {"train": tuple(train), "heldout": tuple(heldout)}
