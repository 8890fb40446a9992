"""The parent's side of one sandboxed call: start its first process, confine it, read its output
within the caps and the deadline, stop it, and reap everything it started.

Where this departs from common practice, and why:
- No `preexec_fn`: the rollout calls the sandbox from threads, and Python between fork and exec
  in a threaded parent can deadlock. The first process is a one-line `sh` gate that stops itself;
  the parent moves it into the call's cgroup and sets its rlimits (`prlimit(2)`), then continues
  it. Nothing the code starts can begin outside the cgroup or the rlimits.
- The rlimits are set by the parent on the gate, which still runs as us: root here lacks
  CAP_SYS_RESOURCE, so it could not `prlimit` a process of another uid.
- On a kill, the sandbox's PID 1 goes first, not bwrap's monitor (see `_stop`), so not even a
  zombie is left to the machine's init.
- bwrap reports a program killed by signal N as exit status 128+N, like a shell, so a program
  that calls `sys.exit(137)` reads as killed by SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_grpo.sandbox.bwrap import SAFE_PATH
from agent_grpo.sandbox.cgroup import CallCgroup
from agent_grpo.sandbox.errors import SandboxError
from agent_grpo.sandbox.uid import SH, system_tool

__all__ = ["BwrapStatus", "Launch", "RawRun", "code_exit", "run_launch"]

# The call's first process: stops itself until the parent has put it in the cgroup and set its
# rlimits (then it sends SIGCONT), and execs the rest: `setpriv` to the leased uid when we are
# root, then bwrap (or, in the fallback, the interpreter). It is started by `setpriv
# --pdeathsig KILL`: the kernel's SIGHUP to orphaned stopped groups does not reach a group in its
# own session, so without it a gate whose parent died while it waited would stay stopped forever
# (as gates did before it). From bwrap on, `--die-with-parent` does the same.
_GATE = 'kill -STOP $$ && exec "$@"; exit 125'
_STOP_GRACE_S = 1.0
"""How long bwrap's monitor gets to reap the killed sandbox before the process-group SIGKILL."""
_EXIT_GRACE_S = 0.2
"""How long to keep reading after the first process exits (only leftover writers hold pipes)."""
_EMPTY_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Launch:
    """How to start one call: the command after the gate, and the fds it inherits."""

    argv: list[str]
    """bwrap's command line, or (fallback) the interpreter's."""
    cwd: str
    """Host working dir of the first process."""
    code_workdir: str
    """The working dir as the code sees it."""
    pass_fds: tuple[int, ...]
    """Extra fds the command inherits (bwrap's code file and status pipe)."""
    status: BwrapStatus | None
    """bwrap's `--json-status-fd` reports; None in the fallback."""


@dataclass
class BwrapStatus:
    """The JSON objects bwrap writes on its status fd: `child-pid` (the host pid of the
    sandbox's PID 1) once it started it, and `exit-code` when that ended."""

    fd: int
    """Read end of the status pipe."""
    data: bytearray = field(default_factory=bytearray)
    """Everything read so far."""

    def fields(self) -> dict[str, Any]:
        """Read what is available and merge every complete object so far."""
        os.set_blocking(self.fd, False)
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.fd, 65536):
                self.data += chunk
        merged: dict[str, Any] = {}
        decoder, text, at = json.JSONDecoder(), self.data.decode(errors="replace"), 0
        with contextlib.suppress(ValueError):  # a partial object at the end: read later
            while (at := _skip_space(text, at)) < len(text):
                obj, at = decoder.raw_decode(text, at)
                merged.update(obj)
        return merged


def _skip_space(text: str, at: int) -> int:
    """The index of the first non-whitespace character of `text` at or after `at`."""
    return len(text) - len(text[at:].lstrip())


@dataclass(frozen=True)
class RawRun:
    """What `run_launch` observed, before decoding."""

    stdout: bytes
    """Raw standard output, capped."""
    stderr: bytes
    """Raw standard error, capped."""
    timed_out: bool
    """Whether the wall time ran out."""
    truncated: bool
    """Whether an output cap was hit."""
    exit: tuple[int | None, int | None]
    """(exit status, signal number) of the code."""
    oom_kills: int
    """Processes the kernel killed at the memory cap."""
    peak_memory_bytes: int | None
    """The cgroup's peak memory."""


def run_launch(
    launch: Launch,
    cgroup: CallCgroup | None,
    rlimits: dict[int, tuple[int, int]],
    wall_time_s: float,
    max_output_bytes: int,
    stdin_fd: int,
) -> RawRun:
    """Start the gate, release it into its cgroup and rlimits, collect output, reap everything."""
    start = time.monotonic()
    proc = _spawn(launch, stdin_fd)
    try:
        exited = os.pidfd_open(proc.pid)  # readable once it exits
    except OSError:
        proc.kill()
        proc.wait()
        raise
    try:
        _release(proc.pid, cgroup, rlimits)
        deadline = start + wall_time_s
        out, err, truncated = _collect(proc, exited, deadline, max_output_bytes)
        timed_out = not truncated and not _wait_exit(exited, deadline)
    finally:
        _stop(proc, exited, launch.status)
        os.close(exited)
    if cgroup is not None:
        _empty(cgroup)
    status = launch.status.fields() if launch.status is not None else {}
    exit_code, signum = code_exit(proc.returncode, status, bwrap=launch.status is not None)
    oom_kills = cgroup.oom_kills() if cgroup else 0
    if exit_code is None and signum is None:
        if not (timed_out or truncated or oom_kills):
            raise SandboxError(f"sandbox setup failed: {err.decode(errors='replace').strip()}")
        signum = signal.SIGKILL  # we (or the OOM killer) ended it before it reported
    return RawRun(
        stdout=out,
        stderr=err,
        timed_out=timed_out,
        truncated=truncated,
        exit=(exit_code, signum),
        oom_kills=oom_kills,
        peak_memory_bytes=cgroup.peak_memory_bytes() if cgroup else None,
    )


def _spawn(launch: Launch, stdin_fd: int) -> subprocess.Popen[bytes]:
    """Start the gate (then `launch.argv`) in a new session, with a scrubbed environment."""
    gate = [system_tool("setpriv"), "--pdeathsig", "KILL", "--", SH, "-c", _GATE, "gate"]
    return subprocess.Popen(
        [*gate, *launch.argv],
        stdin=stdin_fd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=launch.cwd,
        env={"PATH": SAFE_PATH, "LANG": "C.UTF-8", "HOME": launch.code_workdir},
        start_new_session=True,
        pass_fds=launch.pass_fds,
    )


def _release(pid: int, cgroup: CallCgroup | None, rlimits: dict[int, tuple[int, int]]) -> None:
    """Put the gate in its cgroup, set its rlimits, and continue it once it has stopped itself.

    The gate forks nothing before it is continued, so this need not wait for its stop, and the
    cgroup move (one RCU grace period in cgroup v1, a call's largest fixed cost after its two
    process starts: docs/benchmarks.md) overlaps its start. Only SIGCONT must come
    after the stop: sent before, it would be lost and the gate would stop for good.
    """
    try:
        if cgroup is not None:
            cgroup.join(pid)
        for which, value in rlimits.items():
            resource.prlimit(pid, which, value)
    except OSError as error:
        raise SandboxError(f"could not confine the sandbox's first process: {error}") from error
    info = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)
    if info is None or info.si_code != os.CLD_STOPPED:
        raise SandboxError("the sandbox's first process ended before it could be confined")
    os.kill(pid, signal.SIGCONT)


def _collect(
    proc: subprocess.Popen[bytes], exited: int, deadline: float, cap: int
) -> tuple[bytes, bytes, bool]:
    """Read stdout and stderr until EOF, the deadline, or either passing `cap` bytes.

    Once the first process has exited (`exited`, its pidfd, is readable) only leftover writers
    can hold the pipes open, so reading goes on for `_EXIT_GRACE_S` at most.
    """
    assert proc.stdout is not None and proc.stderr is not None
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    truncated = False
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        selector.register(exited, selectors.EVENT_READ)
        while len(selector.get_map()) > 1 and not truncated:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in selector.select(remaining):
                if key.fd == exited:
                    selector.unregister(exited)
                    deadline = min(deadline, time.monotonic() + _EXIT_GRACE_S)
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                truncated = truncated or len(buffer) + len(chunk) > cap
                buffer += chunk[: cap - len(buffer)]
    return bytes(buffers[proc.stdout.fileno()]), bytes(buffers[proc.stderr.fileno()]), truncated


def _wait_exit(exited: int, deadline: float) -> bool:
    """Wait (without reaping) until the pidfd `exited` says its process exited, or the deadline."""
    readable, _, _ = select.select([exited], [], [], max(0.0, deadline - time.monotonic()))
    return bool(readable)


def _stop(proc: subprocess.Popen[bytes], exited: int, status: BwrapStatus | None) -> None:
    """End the call if it still runs, and reap its first process.

    Under bwrap the sandbox's PID 1 is killed first: its death takes every process of the
    namespace with it, and bwrap's monitor then reaps it and exits. Killing the monitor first
    would orphan PID 1 and leave its zombie to the machine's init. The process-group SIGKILL
    after that is for the fallback, and for a bwrap that has not started PID 1 yet.
    """
    if proc.returncode is None and not _wait_exit(exited, 0) and status is not None:
        _kill_sandbox_init(proc.pid, status)
        _wait_exit(exited, time.monotonic() + _STOP_GRACE_S)
    if proc.returncode is None:
        # Not reaped yet, so its pgid cannot have been reused by anyone else.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _kill_sandbox_init(monitor: int, status: BwrapStatus) -> None:
    """SIGKILL the sandbox's PID 1 if bwrap reported it and it is still the monitor's child.

    The pidfd pins the process; the parent check runs after it was opened, and the signal only
    reaches the pinned process, so a reused pid is never signalled.
    """
    child = status.fields().get("child-pid")
    if not isinstance(child, int):
        return
    try:
        fd = os.pidfd_open(child)
    except ProcessLookupError:
        return
    try:
        stat = Path(f"/proc/{child}/stat").read_text()
        if int(stat.rsplit(")", 1)[1].split()[1]) == monitor:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except (OSError, ValueError, IndexError):
        pass  # gone meanwhile
    finally:
        os.close(fd)


def _empty(cgroup: CallCgroup) -> None:
    """Kill what is left in the call's cgroup and wait until it holds no process."""
    deadline = time.monotonic() + _EMPTY_TIMEOUT_S
    while tasks := cgroup.tasks():
        if time.monotonic() > deadline:
            raise SandboxError(f"processes {tasks} of a sandbox cgroup survived SIGKILL")
        cgroup.kill()
        time.sleep(0.002)


def code_exit(
    returncode: int | None, status: dict[str, Any], *, bwrap: bool
) -> tuple[int | None, int | None]:
    """(exit status, signal number) of the code, from bwrap's report or the returncode."""
    code = status.get("exit-code") if bwrap else returncode
    if code is None:
        return None, None
    if not bwrap and code < 0:
        return None, -code
    if bwrap and code > 128 and code - 128 in signal.valid_signals():
        return None, code - 128
    return code, None
