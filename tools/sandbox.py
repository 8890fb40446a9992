"""Run model-written Python in a separate, limited, killable process.

Each call starts `python -I -S -u main.py` in a fresh temporary working directory (removed
afterwards) with a scrubbed environment (`PATH`, `LANG`, `HOME`=the working dir: no inherited
secrets), in a new session. A small launcher (`_sandbox_init.py`) applies, where the OS allows:

- a new **network namespace** (only a downed loopback: every connection fails) unless
  `network=True`; whether it was obtained is reported as `network_isolated`;
- a new **PID namespace** whose init reaps everything and whose exit makes the kernel kill every
  process the code left behind (fork bombs, daemonised children);
- when we are root, a **private unprivileged uid** leased per call (61000-61511, flock-guarded, so
  concurrent calls never share one), which is what makes `RLIMIT_NPROC` a per-call process limit
  and makes ordinary file permissions stop writes outside the working dir;
- rlimits: CPU seconds (SIGXCPU, then SIGKILL one second later), address space, processes, file
  size, open files, no core files; and `PR_SET_NO_NEW_PRIVS`.

The parent reads stdout and stderr up to `max_output_bytes` each; past that, or past
`wall_time_s`, it stops the sandbox: SIGTERM to the launcher (which kills the namespace's init),
then SIGKILL to the process group, then a `kill(-1)` sweep as the sandbox uid for anything left.

This is process isolation, **not a security boundary** like a VM or gVisor: the code shares the
kernel and can read every world-readable file (the repo, /etc, /proc listings of other processes);
it can write wherever world-writable (/tmp, /dev/shm: top-level entries it owns there are removed
after the call); without root (no private uid) it can write wherever our user can and
`RLIMIT_NPROC` counts all our user's processes. Memory is capped as address space
(RLIMIT_AS), not resident memory, as no cgroup is used. docs/sandbox.md records what was measured.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from agent_grpo.config import ConfigModel

__all__ = ["SandboxError", "SandboxLimits", "SandboxResult", "run_sandboxed"]

_LAUNCHER = Path(__file__).with_name("_sandbox_init.py")
_UID_RANGE = range(61000, 61512)
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_STOP_GRACE_S = 1.0
"""How long the launcher gets to tear its PID namespace down before the process-group SIGKILL."""
_EXIT_GRACE_S = 0.2
"""How long to keep reading after the launcher exits (only leftover writers hold the pipes)."""
_POLL_S = 0.05
_SWEEP_TIMEOUT_S = 5.0


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not an error of the code it runs)."""


class SandboxLimits(ConfigModel):
    """Resource limits for one sandboxed run."""

    wall_time_s: float = 5.0
    """Wall-clock seconds before the whole process tree is killed."""
    cpu_time_s: int = 5
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU at the limit, SIGKILL a second later."""
    memory_mb: int = 512
    """Address-space limit per process (RLIMIT_AS), in MiB; allocations past it fail."""
    max_output_bytes: int = 64_000
    """Most bytes kept of stdout and of stderr, each; producing more kills the run."""
    max_processes: int = 64
    """Most processes the sandbox uid may have at once (RLIMIT_NPROC)."""
    network: bool = False
    """Allow network access; False runs the code in an empty network namespace where possible."""
    max_file_mb: int = 64
    """Largest file the code may write (RLIMIT_FSIZE), in MiB."""
    python: str | None = None
    """Interpreter for the code; None picks one the sandbox uid can execute (stdlib only)."""


class SandboxResult(BaseModel):
    """What one sandboxed run produced and how it ended."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    stdout: str
    """Standard output (UTF-8, invalid bytes replaced), at most `max_output_bytes`."""
    stderr: str
    """Standard error, at most `max_output_bytes`."""
    exit_code: int | None
    """The code's exit status; None when a signal ended it."""
    timed_out: bool
    """Whether the wall-time limit ended the run."""
    killed_by: str | None
    """Name of the signal that ended the code (SIGKILL on timeout or overflow, SIGXCPU)."""
    output_truncated: bool
    """Whether stdout or stderr went past `max_output_bytes` (the run was then killed)."""
    duration_s: float
    """Wall-clock seconds from start to the last process reaped."""
    network_isolated: bool
    """Whether the code ran without network access (an empty network namespace)."""
    pid_namespace: bool
    """Whether the code ran in its own PID namespace (every leftover process killed at exit)."""
    uid: int
    """The uid the code ran as (a private unprivileged one when we are root)."""
    workdir: str
    """The working dir the code ran in (removed by the time the result is returned)."""


def run_sandboxed(
    code: str, *, limits: SandboxLimits | None = None, stdin: str = ""
) -> SandboxResult:
    """Run `code` as a Python program in a fresh limited process and collect its output."""
    limits = limits or SandboxLimits()
    with _lease_uid() as uid:
        workdir = Path(tempfile.mkdtemp(prefix="agent-grpo-sbx-"))
        try:
            (workdir / "main.py").write_text(code)
            if uid is not None:
                os.chown(workdir, uid, uid)
            return _run_in(workdir, uid, limits, stdin)
        finally:
            _remove_tree(workdir)
            if uid is not None:
                _remove_shared_tmp_files(uid)


def _run_in(workdir: Path, uid: int | None, limits: SandboxLimits, stdin: str) -> SandboxResult:
    """Start the launcher in `workdir`, collect output within the limits, and reap everything."""
    status_r, status_w = os.pipe()
    start = time.monotonic()
    try:
        proc = _start(workdir, _launcher_config(uid, limits, status_w), stdin)
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    status: dict[str, Any] = {}
    try:
        out, err, truncated = _collect(proc, start + limits.wall_time_s, limits.max_output_bytes)
        timed_out = not truncated and not _wait_exit(proc.pid, start + limits.wall_time_s)
        status = _read_status(status_r, status)
        _stop(proc, terminate_launcher=(timed_out or truncated) and bool(status.get("pid")))
    finally:
        _stop(proc, terminate_launcher=False)  # no-op unless something above raised
        if uid is not None:
            _sweep_uid(uid)
        status = _read_status(status_r, status)
        os.close(status_r)
    if status.get("error"):
        raise SandboxError(f"sandbox setup failed: {status['error']}")
    exit_code, signum = _code_exit(proc, status)
    if exit_code is None and signum is None:  # we killed the namespace before init could report
        signum = signal.SIGKILL
    return SandboxResult(
        stdout=out.decode("utf-8", errors="replace"),
        stderr=err.decode("utf-8", errors="replace"),
        exit_code=exit_code,
        timed_out=timed_out,
        killed_by=signal.Signals(signum).name if signum else None,
        output_truncated=truncated,
        duration_s=time.monotonic() - start,
        network_isolated=bool(status.get("net")),
        pid_namespace=bool(status.get("pid")),
        uid=os.geteuid() if uid is None else uid,
        workdir=str(workdir),
    )


def _start(workdir: Path, config: dict[str, Any], stdin: str) -> subprocess.Popen[bytes]:
    """Start the launcher: new session, scrubbed environment, stdin from an unlinked temp file."""
    with tempfile.TemporaryFile() as stdin_file:  # a file, not a pipe: no write can block us
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
        return subprocess.Popen(
            [sys.executable, "-I", "-S", str(_LAUNCHER), json.dumps(config)],
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env={"PATH": _SAFE_PATH, "LANG": "C.UTF-8", "HOME": str(workdir)},
            start_new_session=True,
            pass_fds=(config["status_fd"],),
        )


def _launcher_config(uid: int | None, limits: SandboxLimits, status_fd: int) -> dict[str, Any]:
    """The launcher's JSON config: who to run as, rlimits, isolation, interpreter."""
    mib = 1024 * 1024
    nproc = limits.max_processes
    if uid is None:  # RLIMIT_NPROC counts every process of our own uid, not just the sandbox's
        nproc += _count_pids(os.getuid())
    rlimits = {
        "RLIMIT_CPU": (limits.cpu_time_s, limits.cpu_time_s + 1),
        "RLIMIT_AS": (limits.memory_mb * mib, limits.memory_mb * mib),
        "RLIMIT_NPROC": (nproc, nproc),
        "RLIMIT_FSIZE": (limits.max_file_mb * mib, limits.max_file_mb * mib),
        "RLIMIT_NOFILE": (256, 256),
        "RLIMIT_CORE": (0, 0),
    }
    return {
        "mode": "run",
        "uid": uid,
        "gid": uid,
        "rlimits": rlimits,
        "isolate_net": not limits.network,
        "python": limits.python or _code_python(drops_privileges=uid is not None),
        "status_fd": status_fd,
    }


def _collect(proc: subprocess.Popen[bytes], deadline: float, cap: int) -> tuple[bytes, bytes, bool]:
    """Read stdout and stderr until EOF, the deadline, or either passing `cap` bytes."""
    assert proc.stdout is not None and proc.stderr is not None
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    truncated = False
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and not truncated:
            if _has_exited(proc.pid):
                deadline = min(deadline, time.monotonic() + _EXIT_GRACE_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in selector.select(min(remaining, _POLL_S)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                truncated = truncated or len(buffer) + len(chunk) > cap
                buffer += chunk[: cap - len(buffer)]
    return bytes(buffers[proc.stdout.fileno()]), bytes(buffers[proc.stderr.fileno()]), truncated


def _has_exited(pid: int) -> bool:
    """Whether our child `pid` has exited, without reaping it (so its pgid stays ours)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _wait_exit(pid: int, deadline: float) -> bool:
    """Wait (without reaping) until `pid` exits or the deadline passes; True if it exited."""
    while not _has_exited(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _stop(proc: subprocess.Popen[bytes], *, terminate_launcher: bool) -> None:
    """Kill everything the run started and reap the launcher."""
    if proc.returncode is not None:
        return
    if terminate_launcher:  # it kills the namespace's init, whose exit kills and reaps the rest
        proc.send_signal(signal.SIGTERM)
        _wait_exit(proc.pid, time.monotonic() + _STOP_GRACE_S)
    # The launcher is not reaped yet, so its pgid cannot have been reused by anyone else.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _read_status(fd: int, status: dict[str, Any]) -> dict[str, Any]:
    """Merge the launcher's JSON status lines available on `fd` into `status`."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 65536):
            data += chunk
    merged = dict(status)
    for line in data.decode().splitlines():
        merged.update(json.loads(line))
    return merged


def _code_exit(
    proc: subprocess.Popen[bytes], status: dict[str, Any]
) -> tuple[int | None, int | None]:
    """(exit code, signal number) of the code itself, from init's report or the returncode."""
    if status.get("pid"):
        return status.get("exit_code"), status.get("signal")
    code = proc.returncode
    return (code, None) if code is not None and code >= 0 else (None, -code if code else None)


@contextlib.contextmanager
def _lease_uid() -> Iterator[int | None]:
    """Hold a private unused uid for one run (None when we cannot switch uid: not root)."""
    if os.geteuid() != 0:
        yield None
        return
    lock_dir = Path(tempfile.gettempdir()) / "agent-grpo-sandbox-uids"
    lock_dir.mkdir(mode=0o700, exist_ok=True)
    if lock_dir.stat().st_uid != 0:
        raise SandboxError(f"{lock_dir} is not owned by root; refusing to use it")
    candidates = list(_UID_RANGE)
    random.shuffle(candidates)  # concurrent callers rarely contend for the same lock
    for uid in candidates:
        if _uid_has_account(uid):
            continue
        fd = os.open(lock_dir / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            _sweep_uid(uid)  # a crashed earlier holder may have left processes behind
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
    """SIGKILL every process of the sandbox uid (escapees of the process group) and wait."""
    config = json.dumps({"mode": "sweep", "uid": uid, "gid": uid})
    deadline = time.monotonic() + _SWEEP_TIMEOUT_S
    last_sweep = -1.0
    while _count_pids(uid):
        now = time.monotonic()
        if now > deadline:
            raise SandboxError(f"processes of sandbox uid {uid} survived SIGKILL sweeps")
        if now - last_sweep > 0.25:  # killed processes take a moment to finish exiting
            subprocess.run([sys.executable, "-I", "-S", str(_LAUNCHER), config], timeout=10)
            last_sweep = now
        time.sleep(0.01)


def _remove_tree(path: Path) -> None:
    """Remove the working dir even if the code made parts of it unreadable to its owner."""
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        for root, dirs, _ in os.walk(path):
            for name in dirs:
                with contextlib.suppress(OSError):
                    os.chmod(Path(root, name), 0o700)
        shutil.rmtree(path, ignore_errors=True)


def _remove_shared_tmp_files(uid: int) -> None:
    """Remove top-level entries the sandbox uid created in world-writable temp dirs."""
    for root in {tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"}:
        with contextlib.suppress(OSError):
            for entry in os.scandir(root):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid != uid:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        _remove_tree(Path(entry.path))
                    else:
                        os.unlink(entry.path)


@lru_cache(maxsize=2)
def _code_python(drops_privileges: bool) -> str:
    """An interpreter the code's uid can execute: ours unless it lives in a private dir."""
    candidates = [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]
    candidates += [p for p in [shutil.which("python3", path=_SAFE_PATH)] if p]
    for path in candidates:
        if not drops_privileges or _others_can_execute(path):
            return path
    raise SandboxError(
        "no Python interpreter is executable by an unprivileged uid; set SandboxLimits.python"
    )


def _others_can_execute(path: str) -> bool:
    """Whether a uid with no special rights can reach and execute `path` (e.g. not in /root)."""
    real = Path(os.path.realpath(path))
    if not real.is_file():
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in [real, *real.parents])
