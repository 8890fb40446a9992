"""The seccomp filter bwrap installs in the sandbox: no kernel keyrings, no inotify or dnotify,
no file locks, unix sockets only (inet too with the network), no io_uring, userfaultfd, perf
events or BPF, and only the native syscall ABI.

Kernel keyrings belong to no namespace bwrap unshares. Each call's new user namespace gets fresh
keyrings, but the keys in them outlive the call until the kernel's key GC runs: without this filter,
a key one call left readable by its uid was read by the next call on the same uid (how long keys
linger: docs/benchmarks.md). So `add_key`, `request_key` and `keyctl` fail with EPERM, as under
Docker's default profile. inotify and fanotify watch inodes, not mounts: without this filter, a call
watching a stdlib file saw the host open it, so concurrent calls could signal each other through the
files they share read-only; `inotify_init`, `inotify_init1` and `fanotify_init` fail with EPERM too,
and so does fcntl's F_NOTIFY (dnotify, the older form of the same channel). File locks are the same
kind of channel: a lock on a shared read-only file (the interpreter, a stdlib module) is seen by
every call and by the host, and an exclusive one blocks host callers of `flock` on that file; so
`flock` and fcntl's record-lock commands fail with EPERM. Sockets are refused by allow-list: only
AF_UNIX may be created, and AF_INET and AF_INET6 too with `network=True` (socketpair: AF_UNIX);
every other family fails with EAFNOSUPPORT. Without the network, the call's own loopback is of no
use to it, and its socket buffers are kernel memory no memory limit sees (cgroup v1 charges TCP
buffers only with a limit of their own, and UDP never): a red team pinned 1.7 GB of host memory
in TCP and UDP queues on that loopback from a call whose cgroup recorded 10 MB. Families a
network namespace does not cover (AF_VSOCK: without this filter, a sandboxed call bound a vsock
port of the VM) or that talk to the kernel (netlink, packet, bluetooth, ...) are of no use to a
stdlib program, and a deny-list would miss the next family a kernel adds.
io_uring, `userfaultfd`, `perf_event_open` and `bpf` are open to unprivileged processes here
(`kernel.io_uring_disabled=0`, userfaultfd in user mode), of no use to a stdlib program, and common
paths of kernel exploits (Docker refuses them too).

Where this departs from common practice, and why: the filter is a few dozen classic-BPF
instructions written here, not generated with libseccomp, which has no binding for our
interpreter and would be a compiled dependency for a short list of rules. It checks the
architecture first, as every seccomp filter must: a syscall made through another ABI (i386
`int 0x80` on x86_64, x32) has other numbers and would slip past, so every such syscall fails
with ENOSYS. Argument checks compare the low 32 bits of an argument (both arches are
little-endian), which is all the kernel reads of an `int` family or an `unsigned int` command.
A refused file lock costs model-written code file-backed `sqlite3` and `dbm.gnu` databases,
which take locks (`sqlite3.connect(":memory:")` needs none).
"""

from __future__ import annotations

import errno
import platform
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ALLOWED_FAMILIES",
    "ALLOWED_PAIR_FAMILIES",
    "NETWORK_FAMILIES",
    "REFUSED_FCNTL",
    "NativeAbi",
    "blocked_syscalls_filter",
    "native_abi",
]

_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: load a 32-bit word of `struct seccomp_data`
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data; each argument takes 8 bytes
_ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW
_ERRNO = 0x00050000  # SECCOMP_RET_ERRNO | errno
_X32_BIT = 0x40000000

ALLOWED_FAMILIES = frozenset({socket.AF_UNIX})
"""The only family socket(2) may create without the network; any other fails with
EAFNOSUPPORT."""
NETWORK_FAMILIES = frozenset({socket.AF_UNIX, socket.AF_INET, socket.AF_INET6})
"""The families socket(2) may create with `network=True`."""
ALLOWED_PAIR_FAMILIES = frozenset({socket.AF_UNIX})
"""The only family socketpair(2) may create; any other fails with EAFNOSUPPORT."""
REFUSED_FCNTL = frozenset({5, 6, 7, 36, 37, 38, 1026})
"""fcntl(2) commands that fail with EPERM: the record locks (F_GETLK, F_SETLK, F_SETLKW and
their F_OFD_ forms; the same numbers on both arches) and F_NOTIFY (dnotify)."""


@dataclass(frozen=True)
class NativeAbi:
    """The machine's native syscall ABI, as seccomp sees it."""

    audit_arch: int
    """`AUDIT_ARCH_*` value the kernel reports for native syscalls."""
    blocked: Mapping[str, int]
    """Name and number of each syscall that fails with EPERM whatever its arguments."""
    x32_bit: bool
    """Whether syscall numbers with bit 30 set (x32) share this arch value and must be refused."""
    socket: int
    """Number of socket(2): allowed for `ALLOWED_FAMILIES` only."""
    socketpair: int
    """Number of socketpair(2): allowed for `ALLOWED_PAIR_FAMILIES` only."""
    fcntl: int
    """Number of fcntl(2): its `REFUSED_FCNTL` commands fail with EPERM."""
    flock: int
    """Number of flock(2), which fails with EPERM (with fcntl's locks: no file locks at all)."""


_IO_URING = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}
_ABIS = {
    "x86_64": NativeAbi(
        0xC000003E,
        {
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            **_IO_URING,
            "userfaultfd": 323,
            "perf_event_open": 298,
            "bpf": 321,
            "inotify_init": 253,
            "inotify_init1": 294,
            "fanotify_init": 300,
        },
        x32_bit=True,
        socket=41,
        socketpair=53,
        fcntl=72,
        flock=73,
    ),
    "aarch64": NativeAbi(
        0xC00000B7,
        {
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            **_IO_URING,
            "userfaultfd": 282,
            "perf_event_open": 241,
            "bpf": 280,
            "inotify_init1": 26,  # no inotify_init on aarch64
            "fanotify_init": 262,
        },
        x32_bit=False,
        socket=198,
        socketpair=199,
        fcntl=25,
        flock=32,
    ),
}

# A program is a list of instructions whose jump targets are labels (str) or next (0), resolved
# to offsets by `_assemble`; classic BPF only jumps forward, so each label follows its jumps.
_Target = str | int
_Instruction = tuple[int, _Target, _Target, int]


def native_abi(machine: str | None = None) -> NativeAbi | None:
    """The ABI of `machine` (default: this one), or None where we have no filter for it."""
    return _ABIS.get(machine or platform.machine())


def blocked_syscalls_filter(abi: NativeAbi, network: bool = False) -> bytes:
    """A `struct sock_filter[]` for bwrap's `--seccomp`: what the module docstring refuses;
    inet sockets only with `network`."""
    families = NETWORK_FAMILIES if network else ALLOWED_FAMILIES
    eperm, eafnosupport = _ERRNO | errno.EPERM, _ERRNO | errno.EAFNOSUPPORT
    program: list[_Instruction | str] = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 0, "enosys", abi.audit_arch),
        (_LD_W_ABS, 0, 0, _NR),
    ]
    if abi.x32_bit:
        program.append((_JGE_K, "enosys", 0, _X32_BIT))
    for number in [*abi.blocked.values(), abi.flock]:
        program.append((_JEQ_K, "eperm", 0, number))
    program += [
        (_JEQ_K, "socket", 0, abi.socket),
        (_JEQ_K, "socketpair", 0, abi.socketpair),
        (_JEQ_K, "fcntl", 0, abi.fcntl),
        (_RET_K, 0, 0, _ALLOW),
        "eperm",
        (_RET_K, 0, 0, eperm),
        "enosys",
        (_RET_K, 0, 0, _ERRNO | errno.ENOSYS),
        *_argument_rule("socket", 0, families, match=_ALLOW, otherwise=eafnosupport),
        *_argument_rule("socketpair", 0, ALLOWED_PAIR_FAMILIES, _ALLOW, eafnosupport),
        *_argument_rule("fcntl", 1, REFUSED_FCNTL, match=eperm, otherwise=_ALLOW),
    ]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in _assemble(program))


def _argument_rule(
    label: str, argument: int, values: frozenset[int], match: int, otherwise: int
) -> list[_Instruction | str]:
    """At `label`: return `match` if the argument's low 32 bits are one of `values`, else
    `otherwise` (each rule has its own returns: a jump back to the common ones is impossible)."""
    name = f"{label}-match"
    checks: list[_Instruction | str] = [(_JEQ_K, name, 0, value) for value in sorted(values)]
    return [
        label,
        (_LD_W_ABS, 0, 0, _ARG0 + 8 * argument),
        *checks,
        (_RET_K, 0, 0, otherwise),
        name,
        (_RET_K, 0, 0, match),
    ]


def _assemble(program: list[_Instruction | str]) -> list[tuple[int, int, int, int]]:
    """Drop the labels and turn each jump target into the count of instructions it skips."""
    at: dict[str, int] = {}
    instructions: list[_Instruction] = []
    for item in program:
        if isinstance(item, str):
            at[item] = len(instructions)
        else:
            instructions.append(item)

    def offset(target: _Target, pc: int) -> int:
        return at[target] - pc - 1 if isinstance(target, str) else target

    return [
        (op, offset(jt, pc), offset(jf, pc), k) for pc, (op, jt, jf, k) in enumerate(instructions)
    ]
