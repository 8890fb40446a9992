"""A small notes store served over MCP: the server behind Notes-v0.

    python -m agent_grpo.tools.notes_server --db notes.db              # stdio (what Notes-v0 runs)
    python -m agent_grpo.tools.notes_server --db notes.db --port 8000  # streamable HTTP, /mcp

A note is a unique title and a text. The tools are `list_notes`, `read_note`, `write_note` and
`delete_note`; a wrong title or an oversized note is an error result that says what to do.

Notes live in a SQLite file, opened for each call and committed before the call returns, so the
file is the whole state: a restarted server has the same notes, and whoever holds the file (the
environment) loads a task's notes with `load_notes` and reads the final state with `read_notes`,
without going through the server. The storage functions need only the standard library; the
server itself needs the `mcp` package.
"""

from __future__ import annotations

import argparse
import sqlite3
from collections.abc import Mapping, Sequence
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

__all__ = ["MAX_TEXT_CHARS", "MAX_TITLE_CHARS", "build_server", "load_notes", "main", "read_notes"]

MAX_TITLE_CHARS = 100
"""Longest title a note may have."""
MAX_TEXT_CHARS = 2000
"""Longest text a note may have."""
_SCHEMA = "CREATE TABLE IF NOT EXISTS notes (title TEXT PRIMARY KEY, text TEXT NOT NULL)"

Title = Annotated[str, Field(description="The note's title, exactly as list_notes shows it.")]


def _open(db: Path) -> sqlite3.Connection:
    connection = sqlite3.connect(db, timeout=10)
    connection.execute(_SCHEMA)
    return connection


def load_notes(db: Path, notes: Mapping[str, str]) -> None:
    """Replace every note in the store with `notes` (title -> text)."""
    with closing(_open(db)) as connection, connection:
        connection.execute("DELETE FROM notes")
        connection.executemany("INSERT INTO notes VALUES (?, ?)", notes.items())


def read_notes(db: Path) -> dict[str, str]:
    """Every note in the store, title -> text, sorted by title."""
    with closing(_open(db)) as connection:
        rows = connection.execute("SELECT title, text FROM notes ORDER BY title").fetchall()
    return dict(rows)


def _text(db: Path, title: str) -> str | None:
    with closing(_open(db)) as connection:
        row = connection.execute("SELECT text FROM notes WHERE title = ?", (title,)).fetchone()
    return None if row is None else str(row[0])


def build_server(db: Path) -> MCPServer:
    """The MCP server over the store in `db`."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer(
        "notes",
        instructions="A notes store. Each note has a unique title and a text.",
        log_level="WARNING",
    )

    def missing(title: str) -> ToolError:
        return ToolError(f"no note titled {title!r}; list_notes shows the titles")

    @server.tool()
    def list_notes() -> str:
        """The titles of all notes, one per line, sorted."""
        return "\n".join(read_notes(db)) or "(no notes)"

    @server.tool()
    def read_note(title: Title) -> str:
        """The text of one note."""
        text = _text(db, title)
        if text is None:
            raise missing(title)
        return text

    @server.tool()
    def write_note(
        title: Annotated[str, Field(description="Title of the note to create or replace.")],
        text: Annotated[str, Field(description="The note's whole new text.")],
    ) -> str:
        """Create a note, or replace the text of the note with this title."""
        if not title.strip() or len(title) > MAX_TITLE_CHARS or len(text) > MAX_TEXT_CHARS:
            raise ToolError(
                f"a title is 1 to {MAX_TITLE_CHARS} characters and a text at most {MAX_TEXT_CHARS}"
            )
        existed = _text(db, title) is not None
        with closing(_open(db)) as connection, connection:
            connection.execute("INSERT OR REPLACE INTO notes VALUES (?, ?)", (title, text))
        return f"{'replaced' if existed else 'created'} note {title!r}"

    @server.tool()
    def delete_note(title: Title) -> str:
        """Delete one note."""
        with closing(_open(db)) as connection, connection:
            deleted = connection.execute("DELETE FROM notes WHERE title = ?", (title,)).rowcount
        if not deleted:
            raise missing(title)
        return f"deleted note {title!r}"

    return server


def main(argv: Sequence[str] | None = None) -> None:
    """Serve the store named by `--db` over stdio, or over HTTP on 127.0.0.1 with `--port`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", type=Path, required=True, help="SQLite file (created if missing)")
    parser.add_argument("--port", type=int, help="serve streamable HTTP on this port")
    args = parser.parse_args(argv)
    server = build_server(args.db)
    if args.port is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
