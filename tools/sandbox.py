"""Run model-written Python inside bubblewrap, with whole-tree limits, and leave nothing behind.

Each call runs `python -I -S -u main.py` (isolated mode, stdlib only, unbuffered) under `bwrap`
(`sandbox_bwrap.py`): new user, mount, PID, IPC, UTS, cgroup and network namespaces (network kept
only with `network=True`), no capabilities, no new user namespaces, no kernel keyrings (a seccomp
filter, `sandbox_seccomp.py`), a read-only root holding only
the interpreter, its stdlib and shared libraries, and private size-capped tmpfs mounts for `/tmp`
(holding the working dir) and `/dev/shm`. A cgroup per call (`sandbox_cgroup.py`) caps memory and
processes of the whole tree; rlimits cap CPU seconds, address space, file size and open files per
process; the parent enforces the wall time and the output caps. When the call ends everything goes
with its namespaces: the tmpfs with the mount namespace, SysV IPC objects with the IPC namespace,
every process with the PID namespace and the cgroup, which is emptied and removed. No cleanup
walks a tree the code could write.

As root, each call leases a private uid (61000-61511, flock-guarded) and bwrap itself runs as that
uid, so concurrent calls share no uid either (nor its kernel quotas). Not root, bwrap runs as us.

Where this departs from common practice, and why:
- There is no in-process launcher (no `preexec_fn`): the rollout calls us from threads, and Python
  between fork and exec in a threaded parent can deadlock. The first process is a one-line `sh`
  gate that stops itself while the parent moves it into the call's cgroup and sets its rlimits;
  continued, it execs util-linux `setpriv` (to the leased uid), which execs bwrap. Nothing the
  code starts can begin outside the cgroup or the rlimits.
- Without bubblewrap (or with one older than 0.8) the sandbox refuses to run code, unless
  `AGENT_GRPO_SANDBOX_FALLBACK=rlimits` opts into the weak fallback: rlimits, a private uid as root,
  a host temp dir removed as that uid, and no namespaces. It says so once, loudly.
- bwrap reports a code killed by signal N as exit status 128+N, like a shell, so a program that
  calls `sys.exit(137)` reads as killed by SIGKILL.

docs/sandbox.md lists what is isolated and what is not, with the test that shows each line.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import pwd
import random
import resource
import select
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from agent_grpo.config import ConfigModel
from agent_grpo.tools.sandbox_bwrap import (
    BWRAP_MIN_VERSION,
    SAFE_PATH,
    WORKDIR,
    Bwrap,
    Interpreter,
    bwrap_argv,
    find_bwrap,
    find_interpreter,
)
from agent_grpo.tools.sandbox_cgroup import CallCgroup, create_cgroup, dispose_cgroup, find_layout
from agent_grpo.tools.sandbox_seccomp import blocked_syscalls_filter, native_abi

__all__ = ["FALLBACK_ENV", "SandboxError", "SandboxLimits", "SandboxResult", "run_sandboxed"]

FALLBACK_ENV = "AGENT_GRPO_SANDBOX_FALLBACK"
"""`rlimits` opts into the weak fallback where bubblewrap is missing; anything else refuses."""
_UID_RANGE = range(61000, 61512)
_SH = "/bin/sh"
# The call's first process: stops itself until the parent has put it in the cgroup and set its
# rlimits (then it sends SIGCONT), and execs the rest: `setpriv` to the leased uid when we are
# root, then bwrap (or, in the fallback, the interpreter). It is started by `setpriv
# --pdeathsig KILL`: the kernel's SIGHUP to orphaned stopped groups does not reach a group in its
# own session, so without it a gate whose parent died while it waited would stay stopped forever
# (measured). From bwrap on, `--die-with-parent` does the same.
_GATE = 'kill -STOP $$ && exec "$@"; exit 125'
_BWRAP_TASKS = 2
"""Tasks bwrap itself holds in the call's cgroup: its monitor and the namespace's init."""
_STOP_GRACE_S = 1.0
"""How long bwrap's monitor gets to reap the killed sandbox before the process-group SIGKILL."""
_EXIT_GRACE_S = 0.2
"""How long to keep reading after the first process exits (only leftover writers hold pipes)."""
_SWEEP_TIMEOUT_S = 5.0
_log = logging.getLogger(__name__)
_said: set[str] = set()
_said_lock = threading.Lock()
_cgroup_names = itertools.count()


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not an error of the code it runs)."""


class SandboxLimits(ConfigModel):
    """Resource limits for one sandboxed run."""

    wall_time_s: float = 5.0
    """Wall-clock seconds before the whole process tree is killed."""
    cpu_time_s: int = 5
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU at the limit, SIGKILL a second later."""
    memory_mb: int = 512
    """Memory of the whole tree, in MiB (cgroup), and address space per process (RLIMIT_AS)."""
    disk_mb: int = 64
    """Size of each private tmpfs (`/tmp`, holding the working dir, and `/dev/shm`), in MiB."""
    max_output_bytes: int = 64_000
    """Most bytes kept of stdout and of stderr, each; producing more kills the run."""
    max_processes: int = 64
    """Most processes (threads included) of the whole tree at once (pids cgroup, RLIMIT_NPROC)."""
    network: bool = False
    """Allow network access; False runs the code in an empty network namespace."""
    python: str | None = None
    """Interpreter for the code; None picks ours, else the system python3 (stdlib only)."""


class SandboxResult(BaseModel):
    """What one sandboxed run produced and how it ended."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    stdout: str
    """Standard output (UTF-8; invalid bytes and NUL become U+FFFD), at most `max_output_bytes`."""
    stderr: str
    """Standard error, the same way."""
    exit_code: int | None
    """The code's exit status; None when a signal ended it."""
    timed_out: bool
    """Whether the wall-time limit ended the run."""
    killed_by: str | None
    """Name of the signal that ended the code (SIGKILL on timeout, overflow or OOM; SIGXCPU)."""
    output_truncated: bool
    """Whether stdout or stderr went past `max_output_bytes` (the run was then killed)."""
    memory_limit_hit: bool
    """Whether the kernel killed a process of the call for going past the tree's memory cap."""
    peak_memory_bytes: int | None
    """Most memory the call's tree held at once, files in its tmpfs included (None: no cgroup)."""
    duration_s: float
    """Wall-clock seconds from start until every process of the call was gone."""
    isolation: Literal["bwrap", "rlimits"]
    """`bwrap`: the namespaced sandbox; `rlimits`: the opted-into weak fallback."""
    network_isolated: bool
    """Whether the code ran without network access (an empty network namespace)."""
    cgroup: Literal[1, 2] | None
    """Version of the cgroup that limited the whole tree; None: per-process limits only."""
    uid: int
    """The host uid the code ran as (a private unprivileged one when we are root)."""
    workdir: str
    """The working dir the code ran in, as the code saw it (gone by the time this returns)."""


def run_sandboxed(
    code: str, *, limits: SandboxLimits | None = None, stdin: str = ""
) -> SandboxResult:
    """Run `code` as a Python program in a fresh sandbox and collect its output."""
    limits = limits or SandboxLimits()
    bwrap = _choose_isolation()
    tasks = limits.max_processes + (_BWRAP_TASKS if bwrap else 0)
    with _lease_uid() as uid, _call_cgroup(uid, limits, tasks) as cgroup:
        python = find_interpreter(limits.python, uid is not None)
        if python is None:
            raise SandboxError("no Python interpreter the sandbox uid can reach; set `python`")
        start = time.monotonic()
        with contextlib.ExitStack() as stack:  # closes every fd below exactly once
            stdin_fd = stack.enter_context(_memfd(stdin.encode()))
            if bwrap:
                launch = _bwrap_launch(stack, bwrap, python, limits, code)
            else:
                launch = _fallback_launch(stack, uid, python, code)
            raw = _run(launch, uid, cgroup, limits, tasks, stdin_fd)
            if uid is not None and cgroup is None:
                _sweep_uid(uid)
        exit_code, signum = raw.exit
        return SandboxResult(
            stdout=_decode(raw.stdout),
            stderr=_decode(raw.stderr),
            exit_code=exit_code,
            timed_out=raw.timed_out,
            killed_by=signal.Signals(signum).name if signum else None,
            output_truncated=raw.truncated,
            memory_limit_hit=raw.oom_kills > 0,
            peak_memory_bytes=raw.peak_memory_bytes,
            duration_s=time.monotonic() - start,
            isolation="bwrap" if bwrap else "rlimits",
            network_isolated=bwrap is not None and not limits.network,
            cgroup=cgroup.version if cgroup else None,
            uid=os.geteuid() if uid is None else uid,
            workdir=launch.code_workdir,
        )


@dataclass(frozen=True)
class _Launch:
    """How to start one call: the command after the gate, and the fds it inherits."""

    argv: list[str]
    """bwrap's command line, or (fallback) the interpreter's."""
    cwd: str
    """Host working dir of the first process."""
    code_workdir: str
    """The working dir as the code sees it."""
    pass_fds: tuple[int, ...]
    """Extra fds the command inherits (bwrap's code file and status pipe)."""
    status: _BwrapStatus | None
    """bwrap's `--json-status-fd` reports; None in the fallback."""


@dataclass
class _BwrapStatus:
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
            while (at := len(text) - len(text[at:].lstrip())) < len(text):
                obj, at = decoder.raw_decode(text, at)
                merged.update(obj)
        return merged


def _bwrap_launch(
    stack: contextlib.ExitStack, bwrap: Bwrap, python: Interpreter, limits: SandboxLimits, code: str
) -> _Launch:
    """The bwrap command, with the code in a memfd that bwrap copies into the sandbox's tmpfs."""
    code_fd = stack.enter_context(_memfd(code.encode()))
    status_r, status_w = _pipe(stack)
    abi = native_abi()
    seccomp_fd = stack.enter_context(_memfd(blocked_syscalls_filter(abi))) if abi else None
    argv = bwrap_argv(
        bwrap,
        python,
        network=limits.network,
        disk_bytes=limits.disk_mb << 20,
        code_fd=code_fd,
        status_fd=status_w,
        seccomp_fd=seccomp_fd,
    )
    fds = (code_fd, status_w, *([seccomp_fd] if seccomp_fd is not None else []))
    return _Launch(argv, "/", WORKDIR, fds, _BwrapStatus(status_r))


def _fallback_launch(
    stack: contextlib.ExitStack, uid: int | None, python: Interpreter, code: str
) -> _Launch:
    """The interpreter itself, in a host temp dir (the weak fallback)."""
    workdir = stack.enter_context(_host_workdir(uid, code))
    return _Launch([python.executable, "-I", "-S", "-u", "main.py"], workdir, workdir, (), None)


@dataclass(frozen=True)
class _RawRun:
    """What `_run` observed, before decoding."""

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


def _run(
    launch: _Launch,
    uid: int | None,
    cgroup: CallCgroup | None,
    limits: SandboxLimits,
    tasks: int,
    stdin_fd: int,
) -> _RawRun:
    """Start the gate, release it into its cgroup, collect output, reap everything."""
    start = time.monotonic()
    proc = _spawn([*_drop_argv(uid), *launch.argv], launch, stdin_fd)
    exited = os.pidfd_open(proc.pid)  # readable once it exits; pins its pid until we reap it
    try:
        _release(proc.pid, cgroup, _rlimits(limits, uid, tasks))
        deadline = start + limits.wall_time_s
        out, err, truncated = _collect(proc, exited, deadline, limits.max_output_bytes)
        timed_out = not truncated and not _wait_exit(exited, deadline)
    finally:
        _stop(proc, exited, launch.status)
        os.close(exited)
    if cgroup is not None:
        _empty(cgroup)
    status = launch.status.fields() if launch.status is not None else {}
    killed = timed_out or truncated
    exit_code, signum = _code_exit(proc.returncode, status, bwrap=launch.status is not None)
    oom_kills = cgroup.oom_kills() if cgroup else 0
    if exit_code is None and signum is None:
        if not killed and not oom_kills:
            raise SandboxError(f"sandbox setup failed: {err.decode(errors='replace').strip()}")
        signum = signal.SIGKILL  # we (or the OOM killer) ended it before it reported
    return _RawRun(
        stdout=out,
        stderr=err,
        timed_out=timed_out,
        truncated=truncated,
        exit=(exit_code, signum),
        oom_kills=oom_kills,
        peak_memory_bytes=cgroup.peak_memory_bytes() if cgroup else None,
    )


def _spawn(argv: list[str], launch: _Launch, stdin_fd: int) -> subprocess.Popen[bytes]:
    """Start the gate (then `argv`) in a new session, with a scrubbed environment."""
    return subprocess.Popen(
        [_tool("setpriv"), "--pdeathsig", "KILL", "--", _SH, "-c", _GATE, "gate", *argv],
        stdin=stdin_fd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=launch.cwd,
        env={"PATH": SAFE_PATH, "LANG": "C.UTF-8", "HOME": launch.code_workdir},
        start_new_session=True,
        pass_fds=launch.pass_fds,
    )


@lru_cache(maxsize=4)
def _tool(name: str) -> str:
    """The path of a system tool the sandbox needs (util-linux `setpriv`)."""
    path = shutil.which(name, path=SAFE_PATH)
    if path is None:
        raise SandboxError(f"`{name}` (util-linux) is not installed; the sandbox needs it")
    return path


def _release(pid: int, cgroup: CallCgroup | None, rlimits: dict[int, tuple[int, int]]) -> None:
    """Put the gate in its cgroup, set its rlimits, and continue it once it has stopped itself.

    The gate forks nothing before it is continued, so this need not wait for its stop, and the
    cgroup move (one RCU grace period, 5-10 ms here) overlaps its start. Only SIGCONT must come
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


def _rlimits(limits: SandboxLimits, uid: int | None, tasks: int) -> dict[int, tuple[int, int]]:
    """Per-process rlimits for the call's first process (inherited by all it starts).

    Each is clamped to our own hard limit: only lowering needs no CAP_SYS_RESOURCE (which root
    lacks in some containers, this one included). RLIMIT_NPROC counts every process of the
    uid: for a leased uid that is this call's tree; for our own uid (not root) it has to leave
    room for the processes we already have.
    """
    mib = 1 << 20
    nproc = tasks if uid is not None else tasks + _count_pids(os.getuid())
    wanted = {
        resource.RLIMIT_CPU: (limits.cpu_time_s, limits.cpu_time_s + 1),
        resource.RLIMIT_AS: (limits.memory_mb * mib, limits.memory_mb * mib),
        resource.RLIMIT_NPROC: (nproc, nproc),
        resource.RLIMIT_FSIZE: (limits.disk_mb * mib, limits.disk_mb * mib),
        resource.RLIMIT_NOFILE: (256, 256),
        resource.RLIMIT_CORE: (0, 0),
    }
    return {which: _clamp(value, resource.getrlimit(which)[1]) for which, value in wanted.items()}


def _clamp(value: tuple[int, int], hard: int) -> tuple[int, int]:
    if hard == resource.RLIM_INFINITY:
        return value
    return min(value[0], hard), min(value[1], hard)


def _drop_argv(uid: int | None) -> list[str]:
    """util-linux `setpriv`: become the leased uid (no groups, no new privileges), then exec.

    The uid is dropped after exec, not by Popen(user=...): that disables vfork, and forking a
    trainer holding 3 GB took 118 ms here against 0.2 ms with vfork.
    """
    if uid is None:
        return []
    ids = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return [_tool("setpriv"), *ids, "--no-new-privs", "--"]


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


def _stop(proc: subprocess.Popen[bytes], exited: int, status: _BwrapStatus | None) -> None:
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


def _kill_sandbox_init(monitor: int, status: _BwrapStatus) -> None:
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
    deadline = time.monotonic() + _SWEEP_TIMEOUT_S
    while tasks := cgroup.tasks():
        if time.monotonic() > deadline:
            raise SandboxError(f"processes {tasks} of a sandbox cgroup survived SIGKILL")
        cgroup.kill()
        time.sleep(0.002)


def _code_exit(
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


def _decode(data: bytes) -> str:
    """UTF-8 text with invalid bytes and NUL replaced by U+FFFD (NUL truncates text elsewhere)."""
    return data.decode("utf-8", errors="replace").replace("\0", "\ufffd")


def _choose_isolation() -> Bwrap | None:
    """bwrap when a recent one is installed; else None (the fallback) if opted into; else refuse."""
    bwrap = find_bwrap()
    if bwrap is not None and bwrap.version >= BWRAP_MIN_VERSION:
        return bwrap
    wanted = ".".join(map(str, BWRAP_MIN_VERSION))
    problem = (
        "bubblewrap (bwrap) is not installed"
        if bwrap is None
        else f"bubblewrap {'.'.join(map(str, bwrap.version))} is older than {wanted}"
    )
    choice = os.environ.get(FALLBACK_ENV, "")
    if choice == "rlimits":
        _say_once(
            f"{problem}. {FALLBACK_ENV}=rlimits: running model-written code with the WEAK "
            "fallback: rlimits and (as root) a private uid only, no namespaces. The code can read "
            "every world-readable file, reach the network and write world-writable dirs. "
            "Install bubblewrap for real isolation (docs/sandbox.md)."
        )
        return None
    message = (
        f"{problem}: refusing to run model-written code. Install bubblewrap {wanted}+ "
        "(`make sandbox-deps` as root, or `apt-get install bubblewrap`), or set "
        f"{FALLBACK_ENV}=rlimits to accept the weak fallback (docs/sandbox.md)."
    )
    _say_once(message)
    raise SandboxError(message)


def _say_once(message: str) -> None:
    """Log `message` at ERROR level the first time only."""
    with _said_lock:
        if message in _said:
            return
        _said.add(message)
    _log.error("%s", message)


@contextlib.contextmanager
def _memfd(data: bytes) -> Iterator[int]:
    """An anonymous in-memory file holding `data`, positioned at its start."""
    fd = os.memfd_create("agent-grpo-sandbox", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)  # a memfd takes any size in one write
        os.lseek(fd, 0, os.SEEK_SET)
        yield fd
    finally:
        os.close(fd)


def _pipe(stack: contextlib.ExitStack) -> tuple[int, int]:
    """A pipe whose two ends `stack` closes (once: a second close could hit another thread's fd)."""
    r, w = os.pipe()
    stack.callback(os.close, r)
    stack.callback(os.close, w)
    return r, w


@contextlib.contextmanager
def _call_cgroup(uid: int | None, limits: SandboxLimits, tasks: int) -> Iterator[CallCgroup | None]:
    """The call's cgroup, removed afterwards; None (and a warning, once) where there is none."""
    layout = find_layout()
    if layout is None:
        _say_once(
            "no writable cgroup (v2 with memory+pids delegated, or v1 memory and pids): sandbox "
            "memory and process limits apply per process (RLIMIT_AS, RLIMIT_NPROC), not per call"
        )
        yield None
        return
    # A leased uid names its cgroup, so a stale one left by a crash is found and disposed of.
    name = f"agent-grpo-sbx-{uid if uid is not None else f'{os.getpid()}-{next(_cgroup_names)}'}"
    memory = (limits.memory_mb + limits.disk_mb) << 20  # the tmpfs is RAM, charged here too
    try:
        cgroup = create_cgroup(layout, name, memory, tasks)
    except (OSError, RuntimeError) as error:
        raise SandboxError(f"could not create the sandbox cgroup {name}: {error}") from error
    try:
        yield cgroup
    finally:
        try:
            dispose_cgroup(cgroup)
        except (OSError, RuntimeError) as error:
            raise SandboxError(f"could not remove the sandbox cgroup {name}: {error}") from error


@contextlib.contextmanager
def _lease_uid() -> Iterator[int | None]:
    """Hold a private unused uid for one run (None when we cannot switch uid: not root)."""
    if os.geteuid() != 0:
        yield None
        return
    lock_dir = Path(tempfile.gettempdir()) / "agent-grpo-sandbox-uids"
    lock_dir.mkdir(mode=0o700, exist_ok=True)
    if lock_dir.stat(follow_symlinks=False).st_uid != 0 or lock_dir.is_symlink():
        raise SandboxError(f"{lock_dir} is not a directory owned by root; refusing to use it")
    candidates = list(_UID_RANGE)
    random.shuffle(candidates)  # concurrent callers rarely contend for the same lock
    for uid in candidates:
        if _uid_has_account(uid):
            continue
        fd = os.open(lock_dir / str(uid), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            if find_layout() is None:  # else a stale cgroup of this uid is disposed of instead
                _sweep_uid(uid)
            yield uid
        finally:
            os.close(fd)
        return
    raise SandboxError(f"all {len(candidates)} sandbox uids are in use")


def _uid_has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _count_pids(uid: int) -> int:
    """Live (non-zombie) processes owned by `uid`, from /proc."""
    count = 0
    for entry in os.scandir("/proc"):
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                state = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
                count += state != "Z"
    return count


def _sweep_uid(uid: int) -> None:
    """SIGKILL every process of a leased uid (used only where no cgroup holds the call).

    `kill(-1)` issued as that uid reaches exactly its processes, atomically with respect to fork.
    """
    deadline = time.monotonic() + _SWEEP_TIMEOUT_S
    while _count_pids(uid):
        if time.monotonic() > deadline:
            raise SandboxError(f"processes of sandbox uid {uid} survived SIGKILL sweeps")
        subprocess.run([*_drop_argv(uid), _SH, "-c", "kill -9 -1"], env={}, timeout=10)
        time.sleep(0.01)


@contextlib.contextmanager
def _host_workdir(uid: int | None, code: str) -> Iterator[str]:
    """Fallback only: a host temp dir holding main.py, removed afterwards as the code's own uid."""
    path = tempfile.mkdtemp(prefix="agent-grpo-sbx-")
    try:
        Path(path, "main.py").write_text(code)
        if uid is not None:
            for p in (path, os.path.join(path, "main.py")):
                os.chown(p, uid, uid, follow_symlinks=False)
        yield path
    finally:
        _remove_as(uid, path)


def _remove_as(uid: int | None, path: str) -> None:
    """`rm -rf` the dir as `uid` (the code's own rights): root never walks a tree the code wrote.

    `chmod -R` first restores rights the code took away from itself; neither follows symlinks,
    and both iterate (no recursion limit on deep trees).
    """
    script = 'chmod -R u+rwX -- "$0" 2>/dev/null; rm -rf -- "$0"'
    argv = [*_drop_argv(uid), _SH, "-c", script, path]
    subprocess.run(argv, env={"PATH": SAFE_PATH}, timeout=60)
    if os.path.lexists(path):
        raise SandboxError(f"could not remove the sandbox working dir {path}")
