"""One cgroup per sandboxed call: whole-tree memory and process limits, a way to kill whatever
is left, and the peak memory and OOM kills of the call.

cgroup v2 is used where its root delegates both the `memory` and `pids` controllers (they are in
the root's `cgroup.subtree_control`); the call's cgroup is then a child of the v2 root. Otherwise
cgroup v1: a directory in the `memory` hierarchy and one in the `pids` hierarchy, each nested under
the cgroup we run in, so a limit someone set on us still bounds our sandboxes. Where neither can be
created (not root, a read-only cgroupfs), `find_layout()` returns None and the caller falls back to
per-process rlimits.

Where this departs from common practice, and why:
- v1 has no `cgroup.kill`. Leftover tasks are killed one by one through pidfds, and a pid is only
  signalled if it is still listed in our cgroup after its pidfd was opened: a pid the kernel reused
  for someone else's process is never signalled (see `_kill_listed`).
- A call's cgroup found left over is disposed of only if no live process (other than init and
  us) is the parent of a process in it (`live_caller`): a live call of a process that leased its
  uid elsewhere is left alone, and this call fails instead of killing it.
- The memory cap the caller asks for includes the call's files: its tmpfs lives in RAM, and the
  kernel charges tmpfs pages to the cgroup of the process that wrote them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

__all__ = [
    "CallCgroup",
    "CgroupLayout",
    "Mount",
    "choose_layout",
    "create_cgroup",
    "dispose_cgroup",
    "find_layout",
    "limit_writes",
    "live_caller",
    "parse_mountinfo",
    "parse_proc_cgroup",
]

CONTROLLERS = ("memory", "pids")
_DISPOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Mount:
    """One cgroup filesystem mount, from /proc/self/mountinfo."""

    point: Path
    """Where it is mounted."""
    root: str
    """The cgroup path (inside its hierarchy) that the mount shows at `point`."""
    version: Literal[1, 2]
    """1 for `cgroup`, 2 for `cgroup2`."""
    controllers: frozenset[str]
    """v1: the controllers bound to this hierarchy (from the super options); v2: empty."""


@dataclass(frozen=True)
class CgroupLayout:
    """Where this machine's per-call cgroups are created."""

    version: Literal[1, 2]
    """The cgroup version in use."""
    parents: Mapping[str, Path]
    """Parent directory per controller (`memory`, `pids`); the same directory under v2."""


@dataclass(frozen=True)
class CallCgroup:
    """The cgroup of one call, one directory per controller (one directory in all under v2)."""

    version: Literal[1, 2]
    """The cgroup version."""
    dirs: Mapping[str, Path]
    """Directory per controller."""

    def join(self, pid: int) -> None:
        """Move process `pid` (which has not forked yet) into this cgroup."""
        for directory in self._unique_dirs():
            (directory / "cgroup.procs").write_text(str(pid))

    def tasks(self) -> list[int]:
        """The processes in this cgroup now."""
        text = (self.dirs["pids"] / "cgroup.procs").read_text()
        return [int(line) for line in text.split()]

    def kill(self) -> None:
        """SIGKILL every process in this cgroup (atomically where v2 has `cgroup.kill`)."""
        kill_file = self.dirs["pids"] / "cgroup.kill"
        if self.version == 2 and kill_file.exists():
            kill_file.write_text("1")
            return
        for pid in self.tasks():
            _kill_listed(pid, self)

    def peak_memory_bytes(self) -> int | None:
        """Most memory the call's tree held at once (None where the kernel does not say)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        with contextlib.suppress(OSError, ValueError):
            return int((self.dirs["memory"] / name).read_text())
        return None

    def oom_kills(self) -> int:
        """How many processes the kernel killed for going past the memory limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError):
            fields = dict(
                line.split() for line in (self.dirs["memory"] / name).read_text().splitlines()
            )
            return int(fields.get("oom_kill", 0))
        return 0

    def _unique_dirs(self) -> list[Path]:
        return list(dict.fromkeys(self.dirs.values()))


def _kill_listed(pid: int, cgroup: CallCgroup) -> None:
    """SIGKILL `pid` if, once pinned by a pidfd, it is still one of `cgroup`'s processes.

    A process listed in our cgroup after the pidfd was opened is ours (only our call's processes
    can enter it). If the pidfd's process is still alive when signalled, it is that process;
    if it died meanwhile, the signal fails instead of reaching whoever got the pid next.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if pid in cgroup.tasks():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)


def parse_mountinfo(text: str) -> list[Mount]:
    """The cgroup and cgroup2 mounts listed in a /proc/self/mountinfo text."""
    mounts = []
    for line in text.splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        options = frozenset(tail[2].split(","))
        version: Literal[1, 2] = 2 if tail[0] == "cgroup2" else 1
        mounts.append(
            Mount(
                point=Path(_unescape(fields[4])),
                root=_unescape(fields[3]),
                version=version,
                controllers=frozenset(CONTROLLERS) & options if version == 1 else frozenset(),
            )
        )
    return mounts


def _unescape(field: str) -> str:
    """Undo mountinfo's octal escapes (`\\040` is a space)."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """Our cgroup path per v1 controller, and under "" our v2 path, from /proc/self/cgroup."""
    paths = {}
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


def choose_layout(
    mounts: list[Mount], membership: Mapping[str, str], read: Callable[[Path], str]
) -> CgroupLayout | None:
    """v2 if its root delegates memory and pids, else v1 nested under our own cgroups, else None."""
    for mount in mounts:
        if mount.version == 2 and mount.root == "/":
            with contextlib.suppress(OSError):
                delegated = set(read(mount.point / "cgroup.subtree_control").split())
                if delegated >= set(CONTROLLERS):
                    return CgroupLayout(2, {name: mount.point for name in CONTROLLERS})
    parents = {}
    for name in CONTROLLERS:
        v1 = next((m for m in mounts if m.version == 1 and name in m.controllers), None)
        ours = membership.get(name)
        if v1 is None or ours is None or not _is_under(ours, v1.root):
            return None
        parents[name] = v1.point / ours[len(v1.root) :].lstrip("/")
    return CgroupLayout(1, parents)


def _is_under(path: str, root: str) -> bool:
    return root == "/" or path == root or path.startswith(root.rstrip("/") + "/")


@lru_cache(maxsize=1)
def find_layout() -> CgroupLayout | None:
    """This machine's per-call cgroup layout, if we may create cgroups here."""
    try:
        mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
        membership = parse_proc_cgroup(Path("/proc/self/cgroup").read_text())
    except OSError:
        return None
    layout = choose_layout(mounts, membership, lambda path: path.read_text())
    if layout is None or not all(os.access(p, os.W_OK) for p in layout.parents.values()):
        return None
    return layout


def limit_writes(
    version: Literal[1, 2], memory_bytes: int, tasks: int
) -> list[tuple[str, str, str]]:
    """(controller, file, value) to write, in order, for a cap of `memory_bytes` and `tasks`.

    Swap is capped too where the kernel accounts it (the file exists), so a call cannot page its
    way past the memory cap. v1 refuses a memory+swap cap below the memory cap, hence the order.
    """
    if version == 2:
        return [
            ("memory", "memory.max", str(memory_bytes)),
            ("memory", "memory.swap.max", "0"),
            ("pids", "pids.max", str(tasks)),
        ]
    return [
        ("memory", "memory.limit_in_bytes", str(memory_bytes)),
        ("memory", "memory.memsw.limit_in_bytes", str(memory_bytes)),
        ("pids", "pids.max", str(tasks)),
    ]


def create_cgroup(layout: CgroupLayout, name: str, memory_bytes: int, tasks: int) -> CallCgroup:
    """Create the call's cgroup `name` with its limits (first disposing of a stale one)."""
    cgroup = CallCgroup(layout.version, {c: p / name for c, p in layout.parents.items()})
    if any(d.exists() for d in cgroup.dirs.values()):  # left by a process that crashed mid-call
        if cgroup.dirs["pids"].exists() and (owner := live_caller(cgroup)) is not None:
            raise RuntimeError(f"it holds a live call of process {owner}; left as it is")
        dispose_cgroup(cgroup)
    for directory in cgroup._unique_dirs():
        directory.mkdir()
    try:
        for controller, file, value in limit_writes(layout.version, memory_bytes, tasks):
            path = cgroup.dirs[controller] / file
            if path.exists() or not file.startswith(("memory.swap", "memory.memsw")):
                path.write_text(value)
    except BaseException:
        dispose_cgroup(cgroup)
        raise
    return cgroup


def live_caller(cgroup: CallCgroup) -> int | None:
    """The live process outside `cgroup`, other than init and us, whose child is in it: the
    caller of a call still running there (bwrap's monitor is its child, and dies with it).

    A caller that crashed leaves its children to init (or a subreaper: then the uid stays
    unusable until they exit); leftovers that are our own children are ours to dispose of.
    """
    tasks = set(cgroup.tasks())
    for pid in tasks:
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            if parent not in tasks and parent not in (0, 1, os.getpid()):
                return parent
    return None


def dispose_cgroup(cgroup: CallCgroup, timeout_s: float = _DISPOSE_TIMEOUT_S) -> None:
    """Kill everything left in the cgroup, wait until it is empty, and remove it."""
    deadline = time.monotonic() + timeout_s
    for directory in cgroup._unique_dirs():
        while directory.exists():
            try:
                if cgroup.dirs["pids"].exists() and cgroup.tasks():
                    cgroup.kill()
                else:
                    directory.rmdir()
                    continue
            except OSError:  # busy: tasks still exiting
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"cgroup {directory} still busy after {timeout_s} s")
            time.sleep(0.002)
