"""Verdicts for dataset answers: a regex, and mathematical equivalence through `math-verify`.

Both read the `Answer:` line, like every verdict in `agent_grpo.envs.answers`.

`math_verdict` compares with math-verify (`1/2`, `0.5` and `\\frac{1}{2}` agree; so do `x+1` and
`1+x`). Both sides are read as LaTeX inline math (`$...$` is added unless the text already has a
`$` or a `\\boxed{}`): a bare `\\frac12` or `\\sqrt{2}` is then parsed, where math-verify's plain
mode would find nothing.

math-verify bounds each parse and comparison with SIGALRM. Python delivers signals only to the main
thread, and the rollout steps environments in worker threads, where math-verify refuses to run
with its timeouts on. Its timer is also the process's only one: `signal.alarm(0)` after each step
cancels anybody else's alarm (pytest-timeout's, a user's). So math-verify never runs in this
process. Checks go, one at a time, to a worker process (`python -m agent_grpo.envs.math_verdicts`,
a plain subprocess: multiprocessing's spawn would re-run a user's unguarded script), where
math-verify runs on the worker's main thread with its own timeouts on (`timeout_s` each). Here each
check waits at most `MAX_STEPS * timeout_s + GRACE_S` from its start; a worker that misses that
deadline (stuck in C code, where a signal cannot reach Python) or dies is killed and replaced, and
the verdict is a failure with detail `no verdict`. A check math-verify itself times out is a wrong
answer.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import threading
import traceback
from typing import IO

from agent_grpo.envs.answers import extract_answer
from agent_grpo.envs.text_env import Verdict

__all__ = [
    "GRACE_S",
    "MAX_ANSWER_CHARS",
    "MAX_STEPS",
    "NO_VERDICT",
    "math_equivalent",
    "math_verdict",
    "regex_verdict",
]

MAX_STEPS = 6
"""math-verify steps one check may take, each bounded by `timeout_s`: two parses, then up to four
comparisons (each parse gives at most a value and its text)."""
GRACE_S = 5.0
"""Slack on top of the steps' timeouts before the worker is declared stuck."""
STARTUP_S = 120.0
"""How long a new worker may take to start and import math-verify (a loaded 2-core box)."""
WORKER_COMMAND = [sys.executable, "-m", "agent_grpo.envs.math_verdicts"]
"""How the worker is started."""
MAX_ANSWER_CHARS = 2000
"""A longer answer line is wrong without a check: no reference is that long, and math-verify's
regexes and sympy are slow on huge inputs."""
NO_VERDICT = "no verdict: the math-verify worker hung or died"
"""The detail of a verdict the worker never gave."""
_READY = "ready"

_lock = threading.Lock()
"""Serializes checks: the worker runs one at a time, and a deadline counts from a check's start."""
_worker: tuple[subprocess.Popen[bytes], int] | None = None
"""The worker and the pid that started it (a forked child starts its own)."""


def _as_latex(text: str) -> str:
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def _check(expected: str, given: str, timeout_s: int) -> bool:
    """In the worker, on its main thread: math-verify with its own timeouts on."""
    from math_verify import parse, verify

    gold = parse(_as_latex(expected), parsing_timeout=timeout_s)
    answer = parse(_as_latex(given), parsing_timeout=timeout_s)
    return bool(gold and answer) and verify(gold, answer, timeout_seconds=timeout_s)


def _serve(requests: IO[str], replies: IO[str]) -> None:
    """The worker's loop: one JSON `[expected, given, timeout_s]` a line in, `1` or `0` out."""
    import math_verify  # noqa: F401  (before `ready`, so no check's deadline pays for it)

    print(_READY, file=replies, flush=True)
    for line in requests:
        try:
            ok = _check(*json.loads(line))
        except Exception:  # math-verify catches its own errors; anything else is a wrong answer
            traceback.print_exc()
            ok = False
        print(int(ok), file=replies, flush=True)


def _stop_worker() -> None:
    global _worker
    if _worker is not None and _worker[1] == os.getpid():
        _worker[0].kill()
        _worker[0].wait()
    _worker = None


def _reply(process: subprocess.Popen[bytes], timeout_s: float) -> str | None:
    """The worker's next line, or None past `timeout_s` or when it died."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    line = process.stdout.readline() if ready else b""
    return line.decode().strip() or None


def _start_worker() -> subprocess.Popen[bytes]:
    # Our sys.path, so the worker imports this same agent_grpo even where it was put on the path
    # by hand rather than installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    pipe = subprocess.PIPE
    process = subprocess.Popen(WORKER_COMMAND, stdin=pipe, stdout=pipe, bufsize=0, env=env)
    if _reply(process, STARTUP_S) != _READY:
        process.kill()
        process.wait()
        raise RuntimeError("the math-verify worker did not start (is math-verify installed?)")
    return process


def _ask(line: str, deadline_s: float) -> str | None:
    """Send one request (with `_lock` held) and read the reply; None replaces the worker."""
    global _worker
    if _worker is None or _worker[1] != os.getpid():
        _worker = (_start_worker(), os.getpid())
    process = _worker[0]
    assert process.stdin is not None
    try:
        process.stdin.write(line.encode())
        reply = _reply(process, deadline_s)
    except BrokenPipeError:
        reply = None
    if reply is None:
        _stop_worker()
    return reply


def math_equivalent(expected: str, given: str, timeout_s: int = 5) -> bool | None:
    """Whether math-verify finds `given` equal to `expected`; None when the worker gave no
    verdict (past its deadline, or dead; it is then replaced). Safe from any thread."""
    request = json.dumps([expected, given, timeout_s]) + "\n"
    with _lock:
        reply = _ask(request, MAX_STEPS * timeout_s + GRACE_S)
    return None if reply is None else reply == "1"


def math_verdict(text: str, expected: str, timeout_s: int = 5) -> Verdict:
    """Success iff the answer line is mathematically equal to `expected` (math-verify)."""
    answer = extract_answer(text)
    if answer is None:
        return Verdict(success=False, expected=expected, detail="no 'Answer:' line")
    if len(answer) > MAX_ANSWER_CHARS:
        return Verdict(success=False, expected=expected, given=answer[:100], detail="too long")
    ok = math_equivalent(expected, answer, timeout_s)
    detail = NO_VERDICT if ok is None else "" if ok else "wrong"
    return Verdict(success=bool(ok), expected=expected, given=answer, detail=detail)


def regex_verdict(text: str, pattern: str) -> Verdict:
    """Success iff the whole answer line matches `pattern` (add `(?i)` to ignore case)."""
    answer = extract_answer(text)
    if answer is None:
        return Verdict(success=False, expected=pattern, detail="no 'Answer:' line")
    ok = re.fullmatch(pattern, answer) is not None
    return Verdict(success=ok, expected=pattern, given=answer, detail="" if ok else "no match")


atexit.register(_stop_worker)

if __name__ == "__main__":
    replies, sys.stdout = sys.stdout, sys.stderr  # a stray print() must not garble the replies
    _serve(sys.stdin, replies)
