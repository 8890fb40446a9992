"""The bubblewrap (`bwrap`) command line of one sandboxed call, and the interpreter it runs.

The code sees a read-only root holding only: the interpreter, its standard library (with any
site-packages inside it covered by an empty directory), the system's shared-library directories,
a private `/proc` (its own PID namespace), a minimal `/dev`, and two size-capped tmpfs mounts,
`/tmp` (which holds the working dir) and `/dev/shm`. Everything else of the host (its `/run`,
`/tmp`, `/dev/shm`, home dirs, this repo, `/etc`) is absent. With `network=True`, `/etc/hosts`,
`/etc/resolv.conf`, `/etc/nsswitch.conf` and `/etc/ssl` are added so names resolve.

Where this departs from the usual bwrap recipe, and why:
- bwrap runs as an unprivileged uid (a private one leased per call when we are root), never as root.
  Run as root, bwrap maps the code to host uid 0 with no capabilities, and bwrap 0.8 leaves
  `/proc/sys` writable (it only covers it when the directory itself is writable): run that way, such
  code wrote `/proc/sys/vm/swappiness` and opened `/proc/sys/kernel/core_pattern` for writing
  (`test_writes_outside_the_workdir_fail` fails), which is a known way out to host root. As an
  unprivileged uid both are EACCES.
- So the interpreter must be one that uid can reach: ours when every directory above it lets
  others through, else the system's `python3` (a pyenv interpreter under `/root`, mode 0700, is
  not reachable). `SandboxLimits.python` picks one explicitly.
- `--as-pid-1` with `/bin/sh` as PID 1 instead of bwrap's reaper (see `_INIT`), so the call's
  end leaves no zombie behind. The sandbox therefore holds a shell too (`shell=True` works).
- `--disable-userns` (bwrap 0.8+) rather than a seccomp filter: it sets the new user namespace's
  `max_user_namespaces` to 0, so `unshare(CLONE_NEWUSER)` inside fails with ENOSPC. Older bwrap is
  refused rather than run without it. The seccomp filter (`seccomp.py`) closes what no namespace
  covers: kernel keyrings, inotify, file locks, socket families other than Unix and IP, ...
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

__all__ = [
    "BWRAP_MIN_VERSION",
    "WORKDIR",
    "Bwrap",
    "Interpreter",
    "bwrap_argv",
    "find_bwrap",
    "find_interpreter",
    "reachable_by_others",
]

BWRAP_MIN_VERSION = (0, 8)
"""First bubblewrap with `--disable-userns` (and `--size` for tmpfs)."""
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
WORKDIR = "/tmp/work"
"""The code's working dir inside the sandbox (on the `/tmp` tmpfs, so one cap covers both)."""
_SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
_LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32")
_NETWORK_FILES = ("/etc/hosts", "/etc/resolv.conf", "/etc/nsswitch.conf", "/etc/ssl")
# PID 1 of the sandbox: runs the program and exits with its status (128+N for signal N). When it
# exits, the kernel kills and reaps every other process of the namespace before bwrap's monitor
# reaps it, so not even a zombie is left (bwrap's own init is orphaned when the monitor exits, and
# waits for the machine's init to reap it, seconds later on our machines: docs/benchmarks.md). The
# program keeps the real stderr; the shell's own goes to /dev/null, and the program runs in a
# subshell so the shell's "Killed" notice is written there rather than into the program's stderr.
_INIT = 'exec 3>&2 2>/dev/null; (exec "$@" 2>&3 3>&-); exit $?'
_PROBE = (
    "import json, os, sys, sysconfig\n"
    "v = sysconfig.get_config_var\n"
    "lib = os.path.join(v('LIBDIR') or '', v('INSTSONAME') or '')\n"
    "print(json.dumps({'executable': os.path.realpath(sys.executable),\n"
    "    'stdlib': sorted({sysconfig.get_path('stdlib'), sysconfig.get_path('platstdlib')}),\n"
    "    'libpython': os.path.realpath(lib) if v('Py_ENABLE_SHARED') and os.path.isfile(lib)\n"
    "        else None,\n"
    "    'site': sorted({sysconfig.get_path('purelib'), sysconfig.get_path('platlib')}),\n"
    "    'version': list(sys.version_info[:2])}))\n"
)


@dataclass(frozen=True)
class Bwrap:
    """An installed bubblewrap."""

    path: str
    """The `bwrap` executable."""
    version: tuple[int, ...]
    """Its version, e.g. (0, 8, 0)."""


@dataclass(frozen=True)
class Interpreter:
    """A Python interpreter and the host paths it needs inside the sandbox."""

    executable: str
    """The interpreter binary (real path; bound at the same path)."""
    binds: tuple[str, ...]
    """Files and directories bound read-only at the same path: stdlib, libpython."""
    hidden: tuple[str, ...]
    """Directories inside `binds` covered by an empty read-only dir (site-packages)."""
    version: tuple[int, int]
    """(major, minor)."""


@lru_cache(maxsize=1)
def find_bwrap() -> Bwrap | None:
    """The installed bwrap, or None when there is none on the system PATH."""
    path = shutil.which("bwrap", path=SAFE_PATH)
    if path is None:
        return None
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    version = tuple(int(g) for g in match.groups() if g is not None) if match else (0,)
    return Bwrap(path=path, version=version)


def reachable_by_others(path: str) -> bool:
    """Whether a uid with no rights of its own can reach `path` (every directory above has o+x)."""
    real = Path(os.path.realpath(path))
    try:
        return all(p.stat().st_mode & stat.S_IXOTH for p in [real, *real.parents])
    except OSError:
        return False


@lru_cache(maxsize=8)
def find_interpreter(explicit: str | None, for_others: bool) -> Interpreter | None:
    """The first usable of: `explicit`, our own interpreter, the system python3.

    `for_others`: the sandbox runs as a uid other than ours, so every path must be reachable
    without our rights.
    """
    candidates = [explicit] if explicit else [os.path.realpath(sys.executable), *_SYSTEM_PYTHONS]
    for candidate in candidates:
        if not os.access(candidate, os.X_OK):
            continue
        interpreter = _probe(candidate)
        if interpreter is None:
            continue
        needed = [interpreter.executable, *interpreter.binds]
        if not for_others or all(reachable_by_others(p) for p in needed):
            return interpreter
    return None


def _probe(executable: str) -> Interpreter | None:
    """Ask `executable` where its stdlib and libpython are."""
    try:
        proc = subprocess.run(
            [executable, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=30
        )
        info = json.loads(proc.stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    binds = [*info["stdlib"], *([info["libpython"]] if info["libpython"] else [])]
    binds = [b for b in binds if not _under_any(b, _LIBRARY_DIRS)]  # bound anyway
    roots = [*binds, *_LIBRARY_DIRS]
    hidden = [s for s in info["site"] if os.path.isdir(s) and _under_any(s, roots)]
    hidden += [
        s
        for root in info["stdlib"]
        if os.path.isdir(s := os.path.join(root, "site-packages")) and s not in hidden
    ]
    return Interpreter(
        executable=info["executable"],
        binds=tuple(binds),
        hidden=tuple(hidden),
        version=(info["version"][0], info["version"][1]),
    )


def _under_any(path: str, roots: list[str] | tuple[str, ...]) -> bool:
    real = os.path.realpath(path)
    return any(
        real == r or real.startswith(r.rstrip("/") + "/") for r in map(os.path.realpath, roots)
    )


def _library_args() -> list[str]:
    """Bind the shared-library dirs read-only; recreate those that are symlinks (merged /usr)."""
    args = []
    for path in _LIBRARY_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def bwrap_argv(
    bwrap: Bwrap,
    python: Interpreter,
    *,
    network: bool,
    disk_bytes: int,
    code_fd: int,
    status_fd: int,
    seccomp_fd: int | None,
) -> list[str]:
    """The full command: bwrap's options, then the interpreter on `WORKDIR/main.py`."""
    args = [bwrap.path, "--unshare-all", "--unshare-user", "--disable-userns"]
    args += ["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []
    args += ["--share-net"] if network else []
    args += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox"]
    args += ["--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "LANG", "C.UTF-8"]
    args += ["--setenv", "HOME", WORKDIR, "--json-status-fd", str(status_fd)]
    args += _library_args()
    args += ["--ro-bind", python.executable, python.executable]
    for path in python.binds:
        args += ["--ro-bind", path, path]
    for path in python.hidden:
        args += ["--tmpfs", path, "--remount-ro", path]
    for path in _NETWORK_FILES if network else ():
        args += ["--ro-bind-try", path, path]
    # no ptys: the devpts bwrap mounts draws on the kernel's one pool of them, which one call
    # emptied for every other (and read as a channel between concurrent calls)
    args += ["--proc", "/proc", "--dev", "/dev", "--ro-bind", "/dev/null", "/dev/pts/ptmx"]
    args += ["--size", str(disk_bytes), "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    args += ["--size", str(disk_bytes), "--tmpfs", "/tmp", "--dir", WORKDIR]
    args += ["--file", str(code_fd), f"{WORKDIR}/main.py", "--chdir", WORKDIR]
    shell = os.path.realpath("/bin/sh")
    args += ["--ro-bind", shell, shell, "--symlink", shell, "/bin/sh", "--as-pid-1"]
    args += ["--remount-ro", "/", "--", shell, "-c", _INIT, "sh"]
    return [*args, python.executable, "-I", "-S", "-u", "main.py"]
