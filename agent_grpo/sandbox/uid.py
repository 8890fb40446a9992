"""Private uids for sandboxed calls when we are root: one leased per call, switched to after exec,
and swept where no cgroup holds the call.

A lease is an `flock` on a file per uid in one machine-wide dir, `/run/agent-grpo/sandbox-uids`
(`/run` is root's, and the same for every process whatever its `$TMPDIR`; where it is missing or
read-only, `/tmp/agent-grpo-sandbox-uids`). Locks in per-`$TMPDIR` dirs let two processes lease
the same uid, and the second disposed of the first's cgroup as stale, killing its call. When
every uid is leased, a call waits for one (up to `LEASE_WAIT_S`) rather than failing.

Where this departs from common practice, and why: the uid is dropped by util-linux `setpriv` after
exec rather than by `Popen(user=...)`, which disables vfork, so every call would copy the page
tables of a trainer holding gigabytes (the cost: docs/benchmarks.md). The fallback's host working
dir is removed by `rm -rf` running as the code's own uid, so root never walks a tree the code could
write.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

from agent_grpo.sandbox.bwrap import SAFE_PATH
from agent_grpo.sandbox.errors import SandboxError

__all__ = [
    "LEASE_DIRS",
    "LEASE_WAIT_S",
    "SH",
    "count_pids",
    "drop_argv",
    "host_workdir",
    "lease_dir",
    "lease_uid",
    "remove_as",
    "sweep_uid",
    "system_tool",
]

SH = "/bin/sh"
LEASE_DIRS = (Path("/run/agent-grpo/sandbox-uids"), Path("/tmp/agent-grpo-sandbox-uids"))
"""Where uid leases are locked: the first whose parent can be made; the same for every process."""
LEASE_WAIT_S = 60.0
"""Longest wait for a free uid when all are leased (a call holds one for its wall time)."""
_SWEEP_TIMEOUT_S = 5.0


@lru_cache(maxsize=4)
def system_tool(name: str) -> str:
    """The path of a system tool the sandbox needs (util-linux `setpriv`)."""
    path = shutil.which(name, path=SAFE_PATH)
    if path is None:
        raise SandboxError(f"`{name}` (util-linux) is not installed; the sandbox needs it")
    return path


def drop_argv(uid: int | None) -> list[str]:
    """util-linux `setpriv`: become the leased uid (no groups, no new privileges), then exec.

    The uid is dropped after exec, not by Popen(user=...): that disables vfork, and forking a
    large trainer without vfork is far slower (docs/benchmarks.md).
    """
    if uid is None:
        return []
    ids = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return [system_tool("setpriv"), *ids, "--no-new-privs", "--"]


@contextlib.contextmanager
def lease_uid(uids: range, *, sweep: bool) -> Iterator[int | None]:
    """Hold a private unused uid of `uids` for one call (None when we are not root).

    `sweep`: first kill whatever a crashed earlier holder left running as that uid (when a
    cgroup holds each call, disposing of the uid's stale cgroup does that instead).
    """
    if os.geteuid() != 0:
        yield None
        return
    lock_dir = lease_dir()
    candidates = [uid for uid in uids if not _uid_has_account(uid)]
    deadline = time.monotonic() + LEASE_WAIT_S
    while (leased := _try_lease(lock_dir, candidates)) is None:
        if time.monotonic() > deadline:
            raise SandboxError(f"all {len(candidates)} sandbox uids stayed in use {LEASE_WAIT_S} s")
        time.sleep(0.01)
    uid, fd = leased
    try:
        if sweep:
            sweep_uid(uid)
        yield uid
    finally:
        os.close(fd)


def lease_dir() -> Path:
    """The machine-wide dir of lease locks (made if missing), checked to be root's own."""
    for path in LEASE_DIRS:
        with contextlib.suppress(OSError):
            path.parent.mkdir(mode=0o755, exist_ok=True)
            path.mkdir(mode=0o700, exist_ok=True)
            break
    else:
        raise SandboxError(f"cannot make a lease dir for sandbox uids in any of {LEASE_DIRS}")
    for directory in (path.parent, path):
        if directory.is_symlink() or directory.stat().st_uid != 0:
            raise SandboxError(f"{directory} is not a directory owned by root; refusing to use it")
    return path


def _try_lease(lock_dir: Path, candidates: list[int]) -> tuple[int, int] | None:
    """The first free uid of `candidates` (shuffled) and the fd holding its lock, or None."""
    for uid in random.sample(candidates, len(candidates)):  # concurrent callers rarely collide
        fd = os.open(lock_dir / str(uid), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    return None


def _uid_has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def count_pids(uid: int) -> int:
    """Live (non-zombie) processes owned by `uid`, from /proc."""
    count = 0
    for entry in os.scandir("/proc"):
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                state = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
                count += state != "Z"
    return count


def sweep_uid(uid: int) -> None:
    """SIGKILL every process of a leased uid (used only where no cgroup holds the call).

    `kill(-1)` issued as that uid reaches exactly its processes, atomically with respect to fork.
    """
    deadline = time.monotonic() + _SWEEP_TIMEOUT_S
    while count_pids(uid):
        if time.monotonic() > deadline:
            raise SandboxError(f"processes of sandbox uid {uid} survived SIGKILL sweeps")
        subprocess.run([*drop_argv(uid), SH, "-c", "kill -9 -1"], env={}, timeout=10)
        time.sleep(0.01)


@contextlib.contextmanager
def host_workdir(uid: int | None, code: str) -> Iterator[str]:
    """Fallback only: a host temp dir holding main.py, removed afterwards as the code's own uid."""
    path = tempfile.mkdtemp(prefix="agent-grpo-sbx-")
    try:
        Path(path, "main.py").write_text(code)
        if uid is not None:
            for p in (path, os.path.join(path, "main.py")):
                os.chown(p, uid, uid, follow_symlinks=False)
        yield path
    finally:
        remove_as(uid, path)


def remove_as(uid: int | None, path: str) -> None:
    """`rm -rf` the dir as `uid` (the code's own rights): root never walks a tree the code wrote.

    `chmod -R` first restores rights the code took away from itself; neither follows symlinks,
    and both iterate (no recursion limit on deep trees).
    """
    script = 'chmod -R u+rwX -- "$0" 2>/dev/null; rm -rf -- "$0"'
    argv = [*drop_argv(uid), SH, "-c", script, path]
    subprocess.run(argv, env={"PATH": SAFE_PATH}, timeout=60)
    if os.path.lexists(path):
        raise SandboxError(f"could not remove the sandbox working dir {path}")
