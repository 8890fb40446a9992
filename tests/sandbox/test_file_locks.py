"""No file locks and no dnotify in the sandbox: a lock on a file every call shares read-only (the
host's `/usr/lib`) would be one bit between concurrent calls, and would block host callers of
`flock`; dnotify would show another call (or the host) using the shared files."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator

import pytest

from agent_grpo.sandbox import runner as sandbox
from agent_grpo.sandbox.bwrap import find_bwrap
from agent_grpo.sandbox.runner import SandboxLimits, run_sandboxed

needs_bwrap = pytest.mark.skipif(
    find_bwrap() is None and os.geteuid() != 0, reason="bubblewrap missing"
)
SHARED = "/usr/lib"
"""A host dir every call sees read-only (bound whole by bwrap.py)."""

# Each lock call on the shared dir, and on a file of the call's own, prints its errno's name.
LOCKS = f"""\
import errno, fcntl, os, struct
def attempt(call):
    try:
        call()
        return "ok"
    except OSError as error:
        return errno.errorcode[error.errno]
shared = os.open({SHARED!r}, os.O_RDONLY)
own = os.open("own", os.O_RDWR | os.O_CREAT)
lock = struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0)
for fd in (shared, own):
    print(attempt(lambda: fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)),
          attempt(lambda: fcntl.lockf(own, fcntl.LOCK_EX | fcntl.LOCK_NB)),
          attempt(lambda: fcntl.fcntl(own, fcntl.F_GETLK, lock)),
          attempt(lambda: fcntl.fcntl(own, 37, lock)),  # F_OFD_SETLK
          attempt(lambda: fcntl.fcntl(fd, 1026, 0x80000001)))  # F_NOTIFY: DN_ACCESS, multishot
print(attempt(lambda: fcntl.fcntl(own, fcntl.F_SETFD, fcntl.FD_CLOEXEC)))
"""


@pytest.fixture(autouse=True)
def private_uid_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_UID_RANGE", range(62040, 62048))


@pytest.fixture
def host_holds_a_lock() -> Iterator[None]:
    """The host holds an exclusive flock on the shared dir, as a call wanting to signal would."""
    fd = os.open(SHARED, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        yield
    finally:
        os.close(fd)


@needs_bwrap
@pytest.mark.usefixtures("host_holds_a_lock")
def test_flock_fcntl_locks_and_dnotify_are_refused_inside() -> None:
    result = run_sandboxed(LOCKS, limits=SandboxLimits(wall_time_s=5))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "EPERM EPERM EPERM EPERM EPERM\n" * 2 + "ok\n"
