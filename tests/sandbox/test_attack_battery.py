"""The sandbox's attack battery: each hostile program is contained, and afterwards the host holds
no process, file, IPC object or cgroup of the sandbox uid, and the sentinel files and dirs are as
they were (`host_unchanged`, applied to every test).

docs/sandbox.md's table maps each attack to the test that contains it.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent_grpo.sandbox import runner as sandbox
from agent_grpo.sandbox.bwrap import WORKDIR, find_bwrap
from agent_grpo.sandbox.cgroup import (
    Mount,
    choose_layout,
    find_layout,
    limit_writes,
    parse_mountinfo,
    parse_proc_cgroup,
)
from agent_grpo.sandbox.runner import SandboxError, SandboxLimits, SandboxResult, run_sandboxed
from agent_grpo.sandbox.seccomp import blocked_syscalls_filter, native_abi
from agent_grpo.tools.python import PYTHON_LIMITS, format_sandbox_result, python
from agent_grpo.tools.tool import format_tool_result, run_tool_call

# It checks host-wide state after each attack (shared memory, processes and files of the
# sandbox's uids, /tmp): another worker's Ray object store or temp files would be counted.
pytestmark = pytest.mark.serial

IS_ROOT = os.geteuid() == 0
TEST_UIDS = range(62000, 62016)
"""A uid range only these tests lease, so "nothing of this uid is left" cannot see other users."""
TEARDOWN_SLACK_S = 2.5
"""Wall time allowed past the limit for killing and reaping (generous: CI boxes are shared)."""
FAST = SandboxLimits(wall_time_s=2.0)
REPO = Path(__file__).resolve().parents[2]
HAS_BWRAP = find_bwrap() is not None
HAS_CGROUP = find_layout() is not None

# As root, `make` installs bubblewrap, so its absence is a failure there, not a skip.
needs_bwrap = pytest.mark.skipif(not HAS_BWRAP and not IS_ROOT, reason="bubblewrap missing")
needs_root = pytest.mark.skipif(not IS_ROOT, reason="private uids and cgroups need root")
needs_cgroup = pytest.mark.skipif(not HAS_CGROUP, reason="no writable cgroup here")


@pytest.fixture(autouse=True)
def private_uid_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_UID_RANGE", TEST_UIDS)


# --- the host, before and after -------------------------------------------------------------


def _sentinel_state(path: Path, *, full: bool) -> tuple[int, ...]:
    """Mode and owner; with `full`, also mtime and content (or listing)."""
    st = path.lstat()
    if not full:  # /tmp and the repo: other processes may legitimately add files there
        return st.st_mode, st.st_uid, st.st_gid
    content = path.read_bytes() if path.is_file() else "\0".join(sorted(os.listdir(path))).encode()
    return st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, hash(content)


def _ipc_objects() -> list[tuple[str, int]]:
    """(kind:id, owner uid) of every SysV IPC object in our IPC namespace."""
    objects = []
    for kind in ("shm", "msg", "sem"):
        lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        header = lines[0].split()
        for line in lines[1:]:
            fields = dict(zip(header, line.split(), strict=False))
            ident = fields.get("shmid") or fields.get("msqid") or fields.get("semid")
            objects.append((f"{kind}:{ident}", int(fields["uid"])))
    return objects


def _shmem_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1])
    raise AssertionError("no Shmem in /proc/meminfo")


def _test_uid_processes() -> list[str]:
    """'pid state' of every process (zombies included) whose real uid is a test uid."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        uid = int(status.split("\nUid:")[1].split()[0])
        if uid in TEST_UIDS:
            found.append(f"{entry.name} {status.split(chr(10) + 'State:')[1].split()[0]}")
    return found


def _test_uid_files() -> list[str]:
    """Entries owned by a test uid in the host's world-writable and runtime dirs."""
    found = []
    for root in ("/tmp", "/var/tmp", "/dev/shm", "/run", "/run/lock", "/tmp/ray"):
        try:
            entries = list(os.scandir(root))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid in TEST_UIDS:
                    found.append(entry.path)
            except OSError:
                continue
    return found


def _test_uid_cgroups() -> list[str]:
    layout = find_layout()
    if layout is None:
        return []
    return [
        str(parent / f"agent-grpo-sbx-{uid}")
        for parent in layout.parents.values()
        for uid in TEST_UIDS
        if (parent / f"agent-grpo-sbx-{uid}").exists()
    ]


@pytest.fixture
def sentinel_dir() -> Iterator[Path]:
    """A root-owned 0755 host dir holding a file: the kind of dir an escape would chmod or fill."""
    path = Path(tempfile.mkdtemp(prefix="agent-grpo-test-sentinel-"))
    path.chmod(0o755)
    (path / "keep").write_text("host data")
    yield path
    (path / "keep").unlink()
    path.rmdir()


@pytest.fixture(autouse=True)
def host_unchanged(sentinel_dir: Path) -> Iterator[None]:
    """Every test: the host is as it was before, and nothing of the sandbox uids is left."""
    full = {sentinel_dir: True, sentinel_dir / "keep": True, Path("/tmp"): False, REPO: False}
    full[REPO / "README.md"] = True
    before = {str(p): _sentinel_state(p, full=f) for p, f in full.items()}
    yield
    assert _test_uid_processes() == []
    assert _test_uid_files() == []
    assert _test_uid_cgroups() == []
    assert [i for i, uid in _ipc_objects() if uid in TEST_UIDS] == []
    assert {str(p): _sentinel_state(p, full=f) for p, f in full.items()} == before


def run_contained(code: str, limits: SandboxLimits = FAST, stdin: str = "") -> SandboxResult:
    """Run `code` in the real sandbox, checking it ended within its wall time."""
    start = time.monotonic()
    result = run_sandboxed(code, limits=limits, stdin=stdin)
    assert time.monotonic() - start < limits.wall_time_s + TEARDOWN_SLACK_S
    assert result.isolation == "bwrap"
    if IS_ROOT:
        assert result.uid in TEST_UIDS and result.cgroup is not None
    return result


# --- basic behaviour -------------------------------------------------------------------------


@needs_bwrap
def test_output_exit_code_and_stdin() -> None:
    code = "import sys\nprint(input()[::-1])\nprint('warn', file=sys.stderr)\nsys.exit(3)"
    result = run_contained(code, stdin="abc\n")
    assert (result.stdout, result.stderr, result.exit_code) == ("cba\n", "warn\n", 3)
    assert not result.timed_out and result.killed_by is None and not result.output_truncated
    assert result.workdir == WORKDIR and result.network_isolated


@needs_bwrap
def test_infinite_loop_is_killed_at_the_wall_time() -> None:
    result = run_contained("print('started')\nwhile True:\n    pass", SandboxLimits(wall_time_s=1))
    assert result.timed_out and result.killed_by == "SIGKILL" and result.exit_code is None
    assert result.stdout == "started\n"  # unbuffered: output before the kill survives
    assert result.duration_s >= 1.0


@needs_bwrap
def test_cpu_limit_sends_sigxcpu() -> None:
    result = run_contained("while True:\n    pass", SandboxLimits(wall_time_s=20.0, cpu_time_s=1))
    assert result.killed_by == "SIGXCPU" and not result.timed_out
    assert result.stderr == ""  # the sandbox's init shell adds no "CPU time limit" notice


@needs_bwrap
def test_daemonised_child_does_not_outlive_the_program() -> None:
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('done')"
    result = run_contained(code, SandboxLimits(wall_time_s=10.0))
    assert result.stdout == "done\n" and result.exit_code == 0 and not result.timed_out
    assert result.duration_s < 3.0  # did not wait for the sleeping child


# --- the rows of the table -----------------------------------------------------------


@needs_bwrap
def test_concurrent_calls_share_no_tmp_so_a_symlink_reaches_nothing(sentinel_dir: Path) -> None:
    """Row 1: one call leaves a 0777 /tmp/x with a file, the other plants a symlink in it."""
    leave = (
        "import os, time\n"
        "os.mkdir('/tmp/x'); os.chmod('/tmp/x', 0o777)\n"
        "open('/tmp/x/file', 'w').write('left')\n"
        "time.sleep(1.0)\n"
        "print(sorted(os.listdir('/tmp/x')))\n"
    )
    plant = (
        "import os, time\n"
        "for _ in range(50):\n"
        "    if os.path.exists('/tmp/x'):\n"
        "        print('saw the other call')\n"
        "    time.sleep(0.01)\n"
        "for target in (input(), '/tmp/x'):\n"
        "    try:\n"
        "        os.symlink(target, '/tmp/x/link'); print('linked')\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__)\n"
        "os.makedirs('/tmp/x', exist_ok=True); os.chmod('/tmp/x', 0o777)\n"
        "os.symlink(input(), '/tmp/x/link')\n"
        "print(os.path.exists('/tmp/x/link/keep'))\n"
    )
    results: dict[str, SandboxResult] = {}
    target = str(sentinel_dir)
    threads = [
        threading.Thread(target=lambda: results.update(leave=run_contained(leave))),
        threading.Thread(
            target=lambda: results.update(plant=run_contained(plant, stdin=f"{target}\n{target}\n"))
        ),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results["leave"].stdout == "['file']\n"
    # The other call's /tmp/x never appears; the host dir is not even visible to link through.
    assert results["plant"].stdout == "FileNotFoundError\nFileNotFoundError\nFalse\n"
    assert results["leave"].uid != results["plant"].uid or not IS_ROOT
    assert not Path("/tmp/x/file").exists()  # host_unchanged checks the sentinel's mode


IPC_CODE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
size = int(input()) << 20
for i in range(3):
    ident = libc.shmget(0x5A4E5400 + i, ctypes.c_size_t(size), 0o1000 | 0o666)
    addr = libc.shmat(ident, None, 0)
    ctypes.memset(addr, 1, size)  # resident, charged to the call
    libc.shmdt(addr)  # held by no process now: past any per-process limit
queue = libc.msgget(0x5A4E5410, 0o1000 | 0o666)
message = ctypes.create_string_buffer(b"\\x01\\0\\0\\0\\0\\0\\0\\0hello")
print(libc.msgsnd(queue, message, 5, 0))
print(len(open('/proc/sysvipc/shm').read().splitlines()) - 1, 'segments')
print(len(open('/proc/sysvipc/msg').read().splitlines()) - 1, 'queue')
"""


@needs_bwrap
def test_sysv_shared_memory_and_queues_die_with_the_call() -> None:
    """Row 2: 3 x 300 MB of SysV shm and a message queue, never removed by the program."""
    shm_keys = {f"{0x5A4E5400 + i}" for i in range(3)}
    shmem_before = _shmem_kb()
    result = run_contained(IPC_CODE, SandboxLimits(wall_time_s=10, memory_mb=1024), stdin="300\n")
    assert result.stdout == "0\n3 segments\n1 queue\n", result.stderr
    assert result.peak_memory_bytes is None or result.peak_memory_bytes > 900 << 20
    host_keys = {line.split()[0] for line in Path("/proc/sysvipc/shm").read_text().splitlines()}
    assert not shm_keys & host_keys
    # The call held 900 MB of Shmem. Its IPC namespace is freed shortly after its last process
    # (a kernel work item); half of it is the margin for other jobs on a shared machine.
    deadline = time.monotonic() + 3.0
    while _shmem_kb() > shmem_before + 450_000 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _shmem_kb() <= shmem_before + 450_000, "the sandbox's shared memory outlived it"


@needs_bwrap
def test_sysv_shared_memory_counts_against_the_memory_cap() -> None:
    """Row 2 within the default cap: detached segments are still charged to the call."""
    result = run_contained(IPC_CODE, SandboxLimits(wall_time_s=10), stdin="300\n")
    if HAS_CGROUP:
        assert result.memory_limit_hit and result.killed_by == "SIGKILL"


@needs_bwrap
def test_files_in_run_lock_and_tmp_ray_do_not_reach_the_host() -> None:
    """Row 3: files left in /run/lock and /tmp/ray."""
    name = f"agent-grpo-test-{os.getpid()}"
    code = (
        "import os\n"
        f"for path in ('/run/lock/{name}', '/tmp/ray/{name}'):\n"
        "    try:\n"
        "        os.makedirs(os.path.dirname(path), exist_ok=True)\n"
        "        open(path, 'w').write('x'); print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__, path)\n"
    )
    result = run_contained(code)
    assert result.stdout == f"OSError /run/lock/{name}\nwrote /tmp/ray/{name}\n"
    assert not Path(f"/run/lock/{name}").exists() and not Path(f"/tmp/ray/{name}").exists()


CHILDREN = """
import os, select, time
count, size = map(int, input().split())
r, w = os.pipe()
alive = set()
for i in range(count):
    pid = os.fork()
    if pid == 0:
        block = bytearray(size << 20)
        for at in range(0, len(block), 4096):
            block[at] = 1
        os.write(w, bytes([i]))
        time.sleep(30)
        os._exit(0)
    alive.add(pid)
os.close(w)
pids, ready, deadline = sorted(alive), set(), time.monotonic() + 4
while alive - ready and time.monotonic() < deadline:  # until each holds its block or is dead
    if select.select([r], [], [], 0.05)[0]:
        ready |= {pids[i] for i in os.read(r, 64)}
    alive = {p for p in alive if os.waitpid(p, os.WNOHANG)[0] == 0}
print(len(alive & ready), f'holding {size} MB;', count - len(alive), 'killed')
"""


@needs_bwrap
@needs_cgroup
def test_memory_cap_covers_the_whole_tree() -> None:
    """Row 4: 6 children each touching 400 MB; the cap is for all of them together."""
    result = run_contained(CHILDREN, SandboxLimits(wall_time_s=15), stdin="6 400\n")
    cap = (512 + 64) << 20  # memory_mb + disk_mb: files in the tmpfs are RAM too
    holding, *_, killed, _ = result.stdout.split()
    assert result.memory_limit_hit and int(holding) <= 1 and int(killed) >= 5, result.stdout
    assert result.peak_memory_bytes is not None and result.peak_memory_bytes <= cap


@needs_bwrap
def test_disk_is_capped_by_the_tmpfs_size() -> None:
    """Row 5: filling the working dir, /tmp and /dev/shm stops at `disk_mb` each."""
    code = (
        "import errno, os\n"
        "for where in ('.', '/tmp', '/dev/shm'):\n"
        "    written = 0\n"
        "    try:\n"
        "        with open(where + '/fill', 'wb') as f:\n"
        "            while True:\n"
        "                f.write(b'x' * (1 << 20)); f.flush(); written += 1\n"
        "    except OSError as e:\n"
        "        print(where, written <= 32, errno.errorcode[e.errno])\n"
        "    os.remove(where + '/fill')\n"
    )
    result = run_contained(code, SandboxLimits(disk_mb=32))
    # ENOSPC where the tmpfs fills up; EFBIG where RLIMIT_FSIZE (also disk_mb) comes first.
    lines = result.stdout.splitlines()
    assert [line.rsplit(" ", 1)[0] for line in lines] == [". True", "/tmp True", "/dev/shm True"]
    assert all(line.endswith(("ENOSPC", "EFBIG")) for line in lines)


@needs_bwrap
def test_no_pty_can_be_opened() -> None:
    """The devpts bwrap mounts draws on the kernel's one pool of ptys: one call that opened
    ptys until ENOSPC left none for any other call (or container) on the machine, and the
    pool's count is a channel between concurrent calls."""
    code = (
        "import os\n"
        "for open_one in (os.openpty, lambda: os.open('/dev/pts/ptmx', os.O_RDWR),\n"
        "                 lambda: os.open('/dev/ptmx', os.O_RDWR)):\n"
        "    try:\n"
        "        open_one(); print('opened')\n"
        "    except OSError as error:\n"
        "        print(type(error).__name__)\n"
    )
    result = run_contained(code)
    assert result.stdout.split() == ["PermissionError"] * 3, result.stderr


@needs_bwrap
def test_host_unix_sockets_are_unreachable() -> None:
    """Row 6: a world-writable Unix socket file on the host, and an abstract one."""
    path = Path(tempfile.gettempdir(), f"agent-grpo-test-{os.getpid()}.sock")
    abstract = f"\0agent-grpo-test-{os.getpid()}"
    servers = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)]
    try:
        servers[0].bind(str(path))
        path.chmod(0o777)
        servers[1].bind(abstract)
        for server in servers:
            server.listen()
            server.settimeout(0.2)
        code = (
            "import socket\n"
            "for address in (input(), '\\0' + input()):\n"
            "    try:\n"
            "        socket.socket(socket.AF_UNIX).connect(address); print('connected')\n"
            "    except OSError as e:\n"
            "        print(type(e).__name__)\n"
        )
        result = run_contained(code, stdin=f"{path}\n{abstract[1:]}\n")
        assert result.stdout == "FileNotFoundError\nConnectionRefusedError\n"
        for server in servers:
            with pytest.raises(TimeoutError):
                server.accept()
    finally:
        for server in servers:
            server.close()
        path.unlink()


@needs_bwrap
def test_host_processes_and_their_cmdlines_are_invisible() -> None:
    """Row 7: a secret in another process's argv; the sandbox sees only its own processes."""
    secret = f"agent-grpo-secret-{os.getpid()}"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", secret])
    try:
        code = (
            "import os\n"
            "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
            "text = b''.join(open(f'/proc/{p}/cmdline', 'rb').read() for p in pids)\n"
            "print(pids, input().encode() in text)\n"
        )
        result = run_contained(code, stdin=f"{secret}\n")
        assert result.stdout == "[1, 2] False\n"  # the init shell and the program
    finally:
        holder.kill()
        holder.wait()


@needs_bwrap
@needs_root
def test_deep_directory_tree_leaves_the_uid_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 8: a 1,500-deep tree made unreadable; the next call on the same uid still works."""
    monkeypatch.setattr(sandbox, "_UID_RANGE", range(TEST_UIDS[0], TEST_UIDS[0] + 1))
    code = (
        "import os\n"
        "for i in range(1500):\n"
        "    os.mkdir('d'); os.chdir('d')\n"
        "os.chdir('/tmp/work')\n"
        "os.chmod('d', 0)\n"
        "print('built')\n"
    )
    first = run_contained(code, SandboxLimits(wall_time_s=10))
    second = run_contained("import os\nprint(os.listdir('.'))")
    assert first.stdout == "built\n" and second.stdout == "['main.py']\n"
    assert first.uid == second.uid == TEST_UIDS[0]


@needs_bwrap
def test_no_new_user_namespaces_or_mounts_inside() -> None:
    """Row 9: `unshare -r` (a user namespace with all capabilities) and other namespaces."""
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for flag in (0x10000000, 0x10000000 | 0x20000, 0x20000, 0x40000000):\n"
        "    print(libc.unshare(flag), os.strerror(ctypes.get_errno()))\n"
        "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
    )
    result = run_contained(code)
    assert result.stdout.splitlines() == [
        "-1 No space left on device",  # --disable-userns: max_user_namespaces is 0 inside
        "-1 No space left on device",
        "-1 Operation not permitted",  # no CAP_SYS_ADMIN for a mount namespace
        "-1 Operation not permitted",
        "0000000000000000",
    ]


@needs_bwrap
def test_repo_home_and_host_mount_table_are_not_visible() -> None:
    """Row 10: the repo's files and the host's mount table."""
    code = (
        "import os\n"
        "for path in (input(), '/etc/passwd', '/root', '/home', '/run', '/sys', '/var'):\n"
        "    print(path, os.path.exists(path))\n"
        "points = [line.split()[1] for line in open('/proc/self/mounts')]\n"
        "print(sorted(set(p.split('/')[1] for p in points)))\n"
        "print(sorted(os.listdir('/')))\n"
    )
    result = run_contained(code, stdin=f"{REPO / 'README.md'}\n")
    lines = result.stdout.splitlines()
    assert lines[:7] == [
        f"{REPO / 'README.md'} False",
        "/etc/passwd False",
        "/root False",
        "/home False",
        "/run False",
        "/sys False",
        "/var False",
    ]
    top = set(eval(lines[7]))  # top-level dirs of every mount point the sandbox has
    assert top <= {"", "usr", "lib", "lib64", "lib32", "proc", "dev", "tmp", "bin", "root"}
    assert set(eval(lines[8])) <= top | {"bin", "lib", "lib64", "lib32"}


@needs_bwrap
@needs_root
def test_without_a_cgroup_memory_is_capped_per_process_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not isolated where no cgroup can be made: each process gets `memory_mb`, not the tree."""
    monkeypatch.setattr(sandbox, "find_layout", lambda: None)
    monkeypatch.setattr(sandbox, "_said", set())
    limits = SandboxLimits(wall_time_s=15, memory_mb=200)
    result = run_sandboxed(CHILDREN, limits=limits, stdin="3 150\n")
    assert result.cgroup is None and result.peak_memory_bytes is None
    assert result.stdout == "3 holding 150 MB; 0 killed\n"  # 450 MB for a 200 MB limit


@needs_bwrap
def test_what_the_sandbox_still_sees_kernel_info_and_system_libraries() -> None:
    """Not isolated: system-wide /proc files, read-only /proc/sys, the shared-library dirs."""
    code = (
        "import os\n"
        "print(open('/proc/version').read().split()[2] == input())\n"
        "print('MemTotal' in open('/proc/meminfo').read())\n"
        "print(open('/proc/sys/kernel/pid_max').read().strip().isdigit())\n"
        "print(len(os.listdir('/usr/lib')) > 0)\n"
        "print(open('/proc/sys/kernel/hostname').read().strip())\n"
    )
    result = run_contained(code, stdin=f"{os.uname().release}\n")
    assert result.stdout == "True\nTrue\nTrue\nTrue\nsandbox\n"


KEYS_LEAVE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
key = libc.syscall(248, b"user", b"agent-grpo-test-key", b"hunter2", 7, -4)  # add_key to @u
print(key, os.strerror(ctypes.get_errno()))
print(libc.syscall(250, 5, key, 0x3F3F0000), os.strerror(ctypes.get_errno()))  # let the uid read
"""
KEYS_FIND = """
import ctypes, mmap
print([line.split()[-2] for line in open('/proc/keys') if 'agent-grpo' in line])
# The same keyctl through the i386 entry point (int 0x80), where it has another number: 288.
code = bytes.fromhex("b820010000" "bb00000000" "b9fcffffff" "31d2" "cd80" "c3")
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
print(ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))())
"""


@needs_bwrap
@needs_root
@pytest.mark.skipif(native_abi() is None or os.uname().machine != "x86_64", reason="x86_64 only")
def test_kernel_keyrings_are_closed_so_nothing_crosses_to_the_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the filter, a key one call left readable was read by the next call on its uid."""
    monkeypatch.setattr(sandbox, "_UID_RANGE", range(TEST_UIDS[2], TEST_UIDS[2] + 1))
    left = run_contained(KEYS_LEAVE)
    found = run_contained(KEYS_FIND)
    assert left.stdout == "-1 Operation not permitted\n-1 Operation not permitted\n"
    assert found.stdout == "[]\n-38\n"  # nothing listed; i386 syscalls get ENOSYS
    assert left.uid == found.uid


@needs_bwrap
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64 syscall numbers")
def test_inotify_io_uring_userfaultfd_perf_and_bpf_are_refused() -> None:
    """inotify would let a call see others (and the host) open the files they share read-only."""
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for nr in (253, 294, 300, 425, 426, 427, 323, 298, 321):\n"
        "    libc.syscall(nr, 0, 0, 0, 0, 0)\n"
        "    print(os.strerror(ctypes.get_errno()))\n"
    )
    assert run_contained(code).stdout == "Operation not permitted\n" * 9


# --- the rest of the battery -----------------------------------------------------------------


@needs_bwrap
def test_proc_1_environ_and_host_env_secrets_do_not_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"hunter2-{os.getpid()}"
    monkeypatch.setenv("AGENT_GRPO_TEST_SECRET", secret)
    code = (
        "import os\n"
        "print(sorted(os.environ), os.environ['HOME'] == os.getcwd())\n"
        "secret = input().encode()\n"
        "blobs = [open(f'/proc/{p}/environ', 'rb').read() for p in ('1', 'self')]\n"
        "print(any(secret in blob for blob in blobs))\n"
    )
    result = run_contained(code, stdin=f"{secret}\n")
    assert result.stdout == "['HOME', 'LANG', 'PATH', 'PWD'] True\nFalse\n"


@needs_bwrap
def test_writes_outside_the_workdir_fail() -> None:
    swappiness = Path("/proc/sys/vm/swappiness").read_text()
    code = (
        "import errno\n"
        f"for path in ('/etc/agent-grpo-test', '/usr/lib/agent-grpo-test', '/agent-grpo-test',\n"
        f"             {str(REPO / 'agent-grpo-test')!r}, '/proc/sys/vm/swappiness'):\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('100')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print(errno.errorcode[e.errno])\n"
        "open('ok', 'w').write('x'); print('wrote ok')\n"
    )
    result = run_contained(code)
    assert result.stdout.splitlines() == [
        "ENOENT",  # no /etc in the sandbox, and no way to make one: the root is read-only
        "EROFS",
        "EROFS",
        "ENOENT",  # nor the repo
        "EACCES",  # /proc/sys belongs to host root, and the code is an unprivileged uid
        "wrote ok",
    ]
    assert Path("/proc/sys/vm/swappiness").read_text() == swappiness
    assert not Path("/etc/agent-grpo-test").exists() and not (REPO / "agent-grpo-test").exists()


@needs_bwrap
def test_signals_cannot_reach_the_parent_or_host_processes() -> None:
    code = (
        "import os, signal\n"
        "for pid in (os.getppid(), int(input()), -1):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL); print('sent', pid == os.getppid())\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__)\n"
        "print('alive')\n"
    )
    result = run_contained(code, stdin=f"{os.getpid()}\n")
    # The parent seen inside is the sandbox's init shell, which ignores signals from inside.
    assert result.stdout == "sent True\nProcessLookupError\nProcessLookupError\nalive\n"
    assert result.exit_code == 0


@needs_bwrap
def test_fork_bomb_is_capped_and_fully_reaped() -> None:
    count_forks = (
        "import os, time\n"
        "n = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(60)\n"
        "    n += 1\n"
        "print(n)\n"
    )
    if IS_ROOT:  # the program plus 7 children
        assert run_contained(count_forks, SandboxLimits(max_processes=8)).stdout == "7\n"
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run_contained(bomb, SandboxLimits(wall_time_s=1.0, max_processes=16))
    assert result.timed_out and result.killed_by == "SIGKILL"


@needs_bwrap
def test_allocating_8_gb_fails_inside_the_program() -> None:
    result = run_contained("x = bytearray(8 * 1024**3)")
    assert result.exit_code == 1 and "MemoryError" in result.stderr and not result.timed_out


@needs_bwrap
def test_printing_100_mb_is_cut_at_the_cap_and_killed() -> None:
    code = "for _ in range(100):\n    print('x' * 1_000_000)"  # 100 MB, 1 MB at a time
    limits = SandboxLimits(wall_time_s=10.0)
    result = run_contained(code, limits)
    assert result.output_truncated and result.killed_by == "SIGKILL" and not result.timed_out
    assert result.stdout == "x" * limits.max_output_bytes
    assert result.duration_s < 3.0  # killed at the cap, not at the wall time


@needs_bwrap
def test_invalid_utf8_and_nul_in_output_become_replacement_characters() -> None:
    code = (
        "import sys\n"
        "sys.stdout.buffer.write(b'a\\x00b\\xff\\xfec\\xe2\\x82')\n"  # NUL, bad bytes, a cut char
        "print('\\0', file=sys.stderr)\n"
    )
    result = run_contained(code)
    assert result.stdout == "a\ufffdb\ufffd\ufffdc\ufffd" and result.stderr == "\ufffd\n"
    assert "\0" not in format_sandbox_result(result, FAST)


@dataclass
class TcpServer:
    """A host server on 127.0.0.1 that says hello to whoever connects."""

    port: int
    """Its port."""
    accepted: int = 0
    """Connections it accepted."""


@pytest.fixture
def tcp_server() -> Iterator[TcpServer]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(5)
    state = TcpServer(port=server.getsockname()[1])

    def accept_one() -> None:
        try:
            conn, _ = server.accept()
            state.accepted += 1
            conn.sendall(b"hello")
            conn.close()
        except OSError:
            pass

    thread = threading.Thread(target=accept_one, daemon=True)
    thread.start()
    yield state
    server.close()


CONNECT = (
    "import socket\n"
    "s = socket.create_connection(('127.0.0.1', int(input())), timeout=3)\n"
    "print(s.recv(5).decode())\n"
)


@needs_bwrap
def test_network_is_unreachable_when_isolated(tcp_server: TcpServer) -> None:
    result = run_contained(CONNECT, stdin=f"{tcp_server.port}\n")
    # No inet socket at all (seccomp.py): the host's 127.0.0.1 is another namespace anyway, and
    # the call's own loopback would hold socket buffers no memory limit counts
    assert result.network_isolated and tcp_server.accepted == 0
    assert result.exit_code == 1 and "Address family not supported" in result.stderr
    udp = "import socket\nsocket.socket(type=socket.SOCK_DGRAM).sendto(b'x', ('1.1.1.1', 53))"
    assert "Address family not supported" in run_contained(udp).stderr


@needs_bwrap
def test_network_allowed_reaches_the_server(tcp_server: TcpServer) -> None:
    limits = SandboxLimits(wall_time_s=5.0, network=True)
    result = run_contained(CONNECT, limits, stdin=f"{tcp_server.port}\n")
    assert (result.stdout, result.network_isolated) == ("hello\n", False)


@needs_bwrap
def test_concurrent_calls_share_nothing() -> None:
    code = (
        "import os, time\n"
        "token = input()\n"
        "for path in ('/tmp/token', 'token', '/dev/shm/token'):\n"
        "    open(path, 'w').write(token)\n"
        "time.sleep(0.5)\n"
        "print(sorted(open(p).read() for p in ('/tmp/token', 'token', '/dev/shm/token')))\n"
    )
    results: dict[int, SandboxResult] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: results.update({i: run_contained(code, stdin=f"{i}\n")})
        )
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {i: r.stdout for i, r in results.items()} == {i: f"{[str(i)] * 3}\n" for i in range(4)}
    if IS_ROOT:
        assert len({r.uid for r in results.values()}) == 4


@needs_bwrap
@needs_root
@needs_cgroup
def test_a_stale_cgroup_left_by_a_crash_is_emptied_before_reuse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uid = TEST_UIDS[1]
    monkeypatch.setattr(sandbox, "_UID_RANGE", range(uid, uid + 1))
    layout = find_layout()
    assert layout is not None
    stale = [parent / f"agent-grpo-sbx-{uid}" for parent in layout.parents.values()]
    for path in stale:
        path.mkdir(exist_ok=True)
    sleeper = subprocess.Popen(["/usr/bin/setpriv", f"--reuid={uid}", "--", "sleep", "60"])
    for path in stale:
        (path / "cgroup.procs").write_text(str(sleeper.pid))
    result = run_contained("print(1)")
    assert result.stdout == "1\n" and sleeper.wait(timeout=5) == -9


# --- refusing without bubblewrap, and the opt-in fallback ------------------------------------


def test_without_bwrap_the_sandbox_refuses_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
    monkeypatch.delenv(sandbox.FALLBACK_ENV, raising=False)
    monkeypatch.setattr(sandbox, "_said", set())
    with caplog.at_level(logging.ERROR, logger=sandbox.__name__):
        for _ in range(2):
            with pytest.raises(SandboxError, match=f"refusing.*{sandbox.FALLBACK_ENV}=rlimits"):
                run_sandboxed("print(1)")
    assert len(caplog.records) == 1 and "bubblewrap" in caplog.records[0].getMessage()


def test_opted_in_fallback_runs_code_and_removes_its_dir_without_following_links(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, sentinel_dir: Path
) -> None:
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
    monkeypatch.setenv(sandbox.FALLBACK_ENV, "rlimits")
    monkeypatch.setattr(sandbox, "_said", set())
    code = (
        "import os\n"
        "os.symlink(input(), 'link')\n"
        "os.makedirs('deep/' * 300)\n"
        "os.chmod('deep', 0)\n"
        "print(os.getuid() != 0)\n"
    )
    with caplog.at_level(logging.ERROR, logger=sandbox.__name__):
        result = run_sandboxed(code, limits=FAST, stdin=f"{sentinel_dir}\n")
        run_sandboxed("pass", limits=FAST)
    assert result.isolation == "rlimits" and result.stdout == "True\n", result.stderr
    assert not result.network_isolated and not Path(result.workdir).exists()
    assert [r.getMessage().split(".")[0] for r in caplog.records] == [
        "bubblewrap (bwrap) is not installed"
    ]


# --- pure parts ------------------------------------------------------------------------------


def run_bpf(program: bytes, arch: int, nr: int) -> int:
    """What a classic-BPF seccomp program returns for a syscall (the few opcodes we emit)."""
    code = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    data, accumulator, pc = {0: nr, 4: arch}, 0, 0
    while True:
        op, jt, jf, k = code[pc]
        if op == 0x06:  # ret
            return k
        if op == 0x20:  # ld [k]
            accumulator = data[k]
            pc += 1
            continue
        taken = accumulator == k if op == 0x15 else accumulator >= k  # jeq / jge
        pc += 1 + (jt if taken else jf)


BLOCKED = ["add_key", "request_key", "keyctl", "io_uring_setup", "io_uring_enter",
           "io_uring_register", "userfaultfd", "perf_event_open", "bpf", "inotify_init1",
           "fanotify_init"]  # fmt: skip


def test_seccomp_filter_refuses_keyrings_and_foreign_abis_on_both_arches() -> None:
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    for machine, read_nr in (("x86_64", 0), ("aarch64", 63)):
        abi = native_abi(machine)
        assert abi is not None
        program = blocked_syscalls_filter(abi)
        verdicts = {name: run_bpf(program, abi.audit_arch, nr) for name, nr in abi.blocked.items()}
        wanted = [*BLOCKED, *(["inotify_init"] if machine == "x86_64" else [])]
        assert verdicts == dict.fromkeys(wanted, eperm)
        assert run_bpf(program, abi.audit_arch, read_nr) == allow
        assert run_bpf(program, 0x40000003, 288) == enosys  # i386's keyctl
    x86 = native_abi("x86_64")
    assert x86 is not None
    assert run_bpf(blocked_syscalls_filter(x86), x86.audit_arch, 0x40000000 | 250) == enosys  # x32
    assert native_abi("riscv64") is None


V1_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_CGROUP = "8:pids:/\n4:memory:/process_api/e40\n1:cpu:/\n0::/\n"
V2_MOUNTINFO = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_cgroup_layout_v1_nests_under_our_cgroups_when_v2_delegates_nothing() -> None:
    mounts = parse_mountinfo(V1_MOUNTINFO)
    assert [(str(m.point), m.version, sorted(m.controllers)) for m in mounts] == [
        ("/sys/fs/cgroup/memory", 1, ["memory"]),
        ("/sys/fs/cgroup/pids", 1, ["pids"]),
        ("/sys/fs/cgroup/unified", 2, []),
    ]
    layout = choose_layout(mounts, parse_proc_cgroup(V1_CGROUP), lambda _: "hugetlb\n")
    assert layout is not None and layout.version == 1
    assert {k: str(v) for k, v in layout.parents.items()} == {
        "memory": "/sys/fs/cgroup/memory/process_api/e40",
        "pids": "/sys/fs/cgroup/pids",
    }


def test_cgroup_layout_prefers_v2_when_its_root_delegates_memory_and_pids() -> None:
    mounts = parse_mountinfo(V2_MOUNTINFO)
    layout = choose_layout(mounts, {"": "/user.slice"}, lambda _: "cpu io memory pids\n")
    assert layout is not None and layout.version == 2
    assert set(map(str, layout.parents.values())) == {"/sys/fs/cgroup"}
    assert choose_layout(mounts, {"": "/"}, lambda _: "cpu io memory\n") is None
    bound_elsewhere = [Mount(Path("/x"), "/docker/abc", 1, frozenset({"memory", "pids"}))]
    assert choose_layout(bound_elsewhere, {"memory": "/other", "pids": "/other"}, str) is None


def test_cgroup_limits_set_memory_before_memory_plus_swap() -> None:
    assert limit_writes(1, 600, 66) == [
        ("memory", "memory.limit_in_bytes", "600"),
        ("memory", "memory.memsw.limit_in_bytes", "600"),
        ("pids", "pids.max", "66"),
    ]
    assert limit_writes(2, 600, 66) == [
        ("memory", "memory.max", "600"),
        ("memory", "memory.swap.max", "0"),
        ("pids", "pids.max", "66"),
    ]


# --- the python tool -------------------------------------------------------------------------


@needs_bwrap
def test_python_tool_reports_output_errors_and_timeouts() -> None:
    assert python.timeout_s > PYTHON_LIMITS.wall_time_s
    record = run_tool_call(python, {"code": "print(6 * 7)"})
    assert format_tool_result(record) == "42"
    record = run_tool_call(python, {"code": "print('a')\n1 / 0"})
    text = format_tool_result(record)
    assert text.startswith("a\n[stderr]\nTraceback") and text.endswith("[exit status 1]")
    assert 'File "main.py", line 2' in text and "ZeroDivisionError" in text
    assert format_tool_result(run_tool_call(python, {"code": "pass"})) == "(no output)"
    record = run_tool_call(python, {"code": "print('x' * 100_000)"})
    assert record.error is None and len(record.result or "") <= python.max_output_chars


def test_format_sandbox_result_notes() -> None:
    base = SandboxResult(
        stdout="out\n", stderr="", exit_code=None, timed_out=False, killed_by=None,
        output_truncated=False, memory_limit_hit=False, peak_memory_bytes=None, duration_s=1.0,
        isolation="bwrap", network_isolated=True, cgroup=1, uid=1, workdir="/tmp/work",
    )  # fmt: skip
    limits = SandboxLimits(wall_time_s=2, cpu_time_s=3, max_output_bytes=9, memory_mb=100)
    cases = [
        ({"timed_out": True, "killed_by": "SIGKILL"}, "[timed out after 2 s; program killed]"),
        ({"killed_by": "SIGXCPU"}, "[CPU time limit of 3 s reached; program killed]"),
        (
            {"output_truncated": True, "killed_by": "SIGKILL"},
            "[output cut at 9 bytes per stream; program killed]",
        ),
        (
            {"memory_limit_hit": True, "killed_by": "SIGKILL"},
            "[memory limit of 100 MiB reached; a process was killed]",
        ),
        ({"killed_by": "SIGSEGV"}, "[killed by SIGSEGV]"),
        ({"exit_code": 2}, "[exit status 2]"),
    ]
    for update, note in cases:
        result = base.model_copy(update=update)
        assert format_sandbox_result(result, limits) == f"out\n{note}"
