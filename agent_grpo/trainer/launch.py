"""What torchrun tells this process, and how a torchrun rank ends: no torch import, so the CLI
can ask before it loads anything heavy (a config mistake is then one line in a second, not
after the seconds torch and transformers take to import).

Why a rank ends through `end_rank` and not a normal exit: `agent_grpo/trainer/parallel.py`'s
module docstring (gloo can abort the rank in the interpreter's final garbage collection).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

__all__ = ["end_rank", "launched_world_size"]


def launched_world_size() -> int:
    """How many processes torchrun launched (its `WORLD_SIZE`); 1 outside torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def end_rank(code: int) -> NoReturn:
    """End this torchrun rank with exit status `code`, skipping the interpreter's teardown.

    What a normal exit does first is done here, in its order: non-daemon threads are joined
    (thread pools finish their work), the atexit handlers run (logging flushes and closes its
    files, Ray shuts down, MCP servers stop) and Python's stdout and stderr are flushed. Only the
    teardown after that is skipped: the final garbage collection, in which gloo can abort the
    rank (see `parallel.py`'s module docstring).
    """
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):  # a closed or broken pipe must not change `code`
            if stream is not None:
                stream.flush()
    os._exit(code)
