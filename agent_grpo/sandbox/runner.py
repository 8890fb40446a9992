"""Run model-written Python inside bubblewrap, with whole-tree limits, and leave nothing behind.

Each call runs `python -I -S -u main.py` (isolated mode, stdlib only, unbuffered) under `bwrap`
(`sandbox_bwrap.py`): new user, mount, PID, IPC, UTS, cgroup and network namespaces (network kept
only with `network=True`), no capabilities, no new user namespaces, a seccomp filter (`seccomp.py`:
kernel keyrings, inotify, file locks, sockets but unix ones without the network, ...), a read-only
root holding only the interpreter, its stdlib and shared libraries, and private size-capped tmpfs
mounts for `/tmp`
(holding the working dir) and `/dev/shm`. A cgroup per call (`sandbox_cgroup.py`) caps memory and
processes of the whole tree; rlimits cap CPU seconds, address space, file size and open files per
process; the parent enforces the wall time and the output caps (`sandbox_process.py`). When the call
ends everything goes with its namespaces: the tmpfs with the mount namespace, SysV IPC objects with
the IPC namespace, every process with the PID namespace and the cgroup, which is emptied and
removed. No cleanup walks a tree the code could write.

As root, each call leases a private uid (61000-61511, flock-guarded machine-wide; `uid.py`) and
bwrap itself runs as that uid, so concurrent calls share no uid either (nor its kernel quotas).
Not root, bwrap runs as us.

Where this departs from common practice, and why: without bubblewrap (or with one older than 0.8)
the sandbox refuses to run code, unless `AGENT_GRPO_SANDBOX_FALLBACK=rlimits` opts into the weak
fallback: rlimits, the cgroup, a private uid as root, a host temp dir removed as that uid, and no
namespaces. It says so once, loudly. The other departures are in the module each belongs to.

docs/sandbox.md lists what is isolated and what is not, with the test that shows each line.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import resource
import signal
import threading
import time
from collections.abc import Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict

from agent_grpo.config.base import ConfigModel
from agent_grpo.sandbox.bwrap import (
    BWRAP_MIN_VERSION,
    WORKDIR,
    Bwrap,
    Interpreter,
    bwrap_argv,
    find_bwrap,
    find_interpreter,
)
from agent_grpo.sandbox.cgroup import CallCgroup, create_cgroup, dispose_cgroup, find_layout
from agent_grpo.sandbox.errors import SandboxError
from agent_grpo.sandbox.process import BwrapStatus, Launch, run_launch
from agent_grpo.sandbox.seccomp import blocked_syscalls_filter, native_abi
from agent_grpo.sandbox.uid import count_pids, drop_argv, host_workdir, lease_uid, sweep_uid

__all__ = [
    "FALLBACK_ENV",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "run_sandboxed",
    "sandbox_refusal",
]

FALLBACK_ENV = "AGENT_GRPO_SANDBOX_FALLBACK"
"""`rlimits` opts into the weak fallback where bubblewrap is missing; anything else refuses."""
_UID_RANGE = range(61000, 61512)
_BWRAP_TASKS = 2
"""Tasks bwrap itself holds in the call's cgroup: its monitor and the namespace's init."""
_log = logging.getLogger(__name__)
_said: set[str] = set()
_said_lock = threading.Lock()
_cgroup_names = itertools.count()


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
    with (
        lease_uid(_UID_RANGE, sweep=find_layout() is None) as uid,
        _call_cgroup(uid, limits, tasks) as cgroup,
    ):
        python = find_interpreter(limits.python, uid is not None)
        if python is None:
            raise SandboxError("no Python interpreter the sandbox uid can reach; set `python`")
        start = time.monotonic()
        with contextlib.ExitStack() as stack:  # closes every fd below exactly once
            stdin_fd = stack.enter_context(_memfd(stdin.encode()))
            if bwrap:
                launch = _bwrap_launch(stack, bwrap, python, limits, code, uid)
            else:
                launch = _fallback_launch(stack, uid, python, code)
            rlimits = _rlimits(limits, uid, tasks)
            raw = run_launch(
                launch, cgroup, rlimits, limits.wall_time_s, limits.max_output_bytes, stdin_fd
            )
            if uid is not None and cgroup is None:
                sweep_uid(uid)
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


def _bwrap_launch(
    stack: contextlib.ExitStack,
    bwrap: Bwrap,
    python: Interpreter,
    limits: SandboxLimits,
    code: str,
    uid: int | None,
) -> Launch:
    """bwrap as `uid`, with the code in a memfd that bwrap copies into the sandbox's tmpfs."""
    code_fd = stack.enter_context(_memfd(code.encode()))
    status_r, status_w = _pipe(stack)
    abi = native_abi()
    rules = blocked_syscalls_filter(abi, network=limits.network) if abi else None
    seccomp_fd = stack.enter_context(_memfd(rules)) if rules is not None else None
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
    return Launch([*drop_argv(uid), *argv], "/", WORKDIR, fds, BwrapStatus(status_r))


def _fallback_launch(
    stack: contextlib.ExitStack, uid: int | None, python: Interpreter, code: str
) -> Launch:
    """The interpreter itself, in a host temp dir (the weak fallback)."""
    workdir = stack.enter_context(host_workdir(uid, code))
    argv = [*drop_argv(uid), python.executable, "-I", "-S", "-u", "main.py"]
    return Launch(argv, workdir, workdir, (), None)


def _rlimits(limits: SandboxLimits, uid: int | None, tasks: int) -> dict[int, tuple[int, int]]:
    """Per-process rlimits for the call's first process (inherited by all it starts).

    Each is clamped to our own hard limit: only lowering needs no CAP_SYS_RESOURCE (which root
    lacks in some containers, this one included). RLIMIT_NPROC counts every process of the
    uid: for a leased uid that is this call's tree; for our own uid (not root) it has to leave
    room for the processes we already have.
    """
    mib = 1 << 20
    nproc = tasks if uid is not None else tasks + count_pids(os.getuid())
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


def _decode(data: bytes) -> str:
    """UTF-8 text with invalid bytes and NUL replaced by U+FFFD (NUL truncates text elsewhere)."""
    return data.decode("utf-8", errors="replace").replace("\0", "\ufffd")


def _choose_isolation() -> Bwrap | None:
    """bwrap when a recent one is installed; else None (the fallback) if opted into; else refuse."""
    bwrap = find_bwrap()
    problem = _bwrap_problem(bwrap)
    if problem is None:
        return bwrap
    if os.environ.get(FALLBACK_ENV, "") == "rlimits":
        _say_once(
            f"{problem}. {FALLBACK_ENV}=rlimits: running model-written code with the WEAK "
            "fallback: rlimits and (as root) a private uid only, no namespaces. The code can read "
            "every world-readable file, reach the network and write world-writable dirs. "
            "Install bubblewrap for real isolation (docs/sandbox.md)."
        )
        return None
    message = _refusal(problem)
    _say_once(message)
    raise SandboxError(message)


def sandbox_refusal() -> str | None:
    """Why `run_sandboxed` refuses to run code here, in one line naming the fix; None if it runs
    (bubblewrap 0.8+ is installed, or the weak fallback is opted into)."""
    problem = _bwrap_problem(find_bwrap())
    if problem is None or os.environ.get(FALLBACK_ENV, "") == "rlimits":
        return None
    return _refusal(problem)


def _bwrap_problem(bwrap: Bwrap | None) -> str | None:
    """What is wrong with the installed bubblewrap, or None when it is recent enough."""
    if bwrap is not None and bwrap.version >= BWRAP_MIN_VERSION:
        return None
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed"
    wanted = ".".join(map(str, BWRAP_MIN_VERSION))
    return f"bubblewrap {'.'.join(map(str, bwrap.version))} is older than {wanted}"


def _refusal(problem: str) -> str:
    wanted = ".".join(map(str, BWRAP_MIN_VERSION))
    return (
        f"{problem}: refusing to run model-written code. Install bubblewrap {wanted}+ "
        "(`make sandbox-deps` as root, or `apt-get install bubblewrap`), or set "
        f"{FALLBACK_ENV}=rlimits to accept the weak fallback (docs/sandbox.md)."
    )


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
