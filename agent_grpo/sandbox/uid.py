"""Private uids for sandboxed calls when we are root: one leased per call, switched to after exec,
and swept where no cgroup holds the call.

Where this departs from common practice, and why: the uid is dropped by util-linux `setpriv` after
exec rather than by `Popen(user=...)`, which disables vfork: forking a trainer holding 3 GB took
118 ms that way here, against 0.2 ms with vfork. The fallback's host working dir is removed by
`rm -rf` running as the code's own uid, so root never walks a tree the code could write.
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
    "SH",
    "count_pids",
    "drop_argv",
    "host_workdir",
    "lease_uid",
    "remove_as",
    "sweep_uid",
    "system_tool",
]

SH = "/bin/sh"
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
    trainer holding 3 GB took 118 ms here against 0.2 ms with vfork.
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
    lock_dir = Path(tempfile.gettempdir()) / "agent-grpo-sandbox-uids"
    lock_dir.mkdir(mode=0o700, exist_ok=True)
    if lock_dir.stat(follow_symlinks=False).st_uid != 0 or lock_dir.is_symlink():
        raise SandboxError(f"{lock_dir} is not a directory owned by root; refusing to use it")
    candidates = list(uids)
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
            if sweep:
                sweep_uid(uid)
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
