"""Notes-v0: look up, copy, rename or delete notes in an MCP server
(agent_grpo/tools/notes_server.py, over stdio).
Its SQLite file is in the env's `workdir`: `prepare` loads the task's notes, `verify` reads them
back, so the store must end exactly as asked (nothing else touched)."""

from __future__ import annotations

import sys
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from agent_grpo.envs.answers import exact_verdict
from agent_grpo.envs.mcp_env import McpServer, McpToolEnv
from agent_grpo.envs.text_env import Verdict
from agent_grpo.tools.notes_server import load_notes, read_notes

_TITLES = ["groceries", "door code", "wifi", "dentist", "travel", "books", "garden", "gym",
           "bank", "birthdays", "recipes", "car", "locker", "plumber", "school"]  # fmt: skip
_WORDS = ["gate", "room", "code", "bus", "table", "shelf", "pin", "desk", "line", "seat"]
Kind = Literal["lookup", "copy", "rename", "delete"]
_KINDS: dict[Kind, tuple[str, str]] = {  # the request, and the expert's calls
    "lookup": ("What does my note '{source}' say? Answer with its exact text.", "read_note"),
    "copy": ("Copy my note '{source}' to a new note '{target}'.", "read_note write_note"),
    "rename": ("Rename my note '{source}' to '{target}'.", "read_note write_note delete_note"),
    "delete": ("Delete my note '{source}'.", "delete_note"),
}


class NotesTask(BaseModel):
    """One request about the notes, and the notes at the start."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    kind: Kind
    """lookup: answer with the note's text; copy, rename: to `target`; delete: remove it."""
    source: str
    """Title of the note the task is about."""
    target: str
    """New title for copy and rename (one no note has)."""
    initial: dict[str, str]
    """The notes at the start, title -> text."""

    def expected(self) -> dict[str, str]:
        """The notes the task asks for, sorted by title."""
        notes = dict(self.initial)
        if self.kind in ("copy", "rename"):
            notes[self.target] = notes[self.source]
        if self.kind in ("rename", "delete"):
            del notes[self.source]
        return dict(sorted(notes.items()))


class NotesEnv(McpToolEnv[NotesTask]):
    """Do what the user asks with their notes, through the notes server's tools."""

    reusable = True  # `prepare` replaces every note in the server's store

    system_prompt = ("You keep the user's notes with the notes tools. Do what the user asks. When "
                     "finished, reply with: Answer: <the text asked for, or done>")  # fmt: skip
    mcp_server = McpServer(command=[sys.executable, "-m", "agent_grpo.tools.notes_server",
                                    "--db", "{workdir}/notes.db"])  # fmt: skip
    default_max_turns = 5

    def generate_task(self, rng: np.random.Generator) -> NotesTask:
        """Random notes (`<word> <number>` texts) and a request about the first of them."""
        titles = [_TITLES[int(i)] for i in rng.permutation(len(_TITLES))[:5]]  # 4 notes, 1 free
        initial = {t: f"{rng.choice(_WORDS)} {rng.integers(100, 10_000)}" for t in titles[:-1]}
        kind = list(_KINDS)[int(rng.integers(len(_KINDS)))]
        return NotesTask(kind=kind, source=titles[0], target=titles[-1], initial=initial)

    def prepare(self, task: NotesTask) -> None:
        """Load the task's notes into the store."""
        load_notes(self.workdir / "notes.db", task.initial)

    def user_prompt(self, task: NotesTask) -> str:
        """The request."""
        return _KINDS[task.kind][0].format(source=task.source, target=task.target)

    def verify(self, task: NotesTask, answer: str) -> Verdict:
        """The store must hold exactly the requested notes (and a lookup must give the text)."""
        final, wanted = read_notes(self.workdir / "notes.db"), task.expected()
        if final != wanted:
            return Verdict(success=False, expected=str(wanted), given=str(final),
                           detail="the notes differ from the requested ones")  # fmt: skip
        if task.kind == "lookup":
            return exact_verdict(answer, task.initial[task.source])
        return Verdict(success=True, expected="notes", given=answer)

    def expert_action(self) -> str:
        """Make the kind's calls in order (acting on what the server returned), then answer."""
        task = self.task
        assert task is not None
        done = [c.result or "" for c in self.tool_calls if c.error is None]
        text = done[0] if done else ""
        source, write = {"title": task.source}, {"title": task.target, "text": text}
        arguments = {"read_note": source, "delete_note": source, "write_note": write}
        plan = _KINDS[task.kind][1].split()
        if len(done) < len(plan):
            return self.call(plan[len(done)], **arguments[plan[len(done)]])
        return f"Answer: {text}" if task.kind == "lookup" else "Answer: done"
