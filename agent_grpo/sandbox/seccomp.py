"""The seccomp filter bwrap installs in the sandbox: no kernel keyrings, no inotify, no io_uring,
userfaultfd, perf events or BPF, and only the native syscall ABI.

Kernel keyrings belong to no namespace bwrap unshares. Each call's new user namespace gets fresh
keyrings, but the keys in them outlive the call until the kernel's key GC runs: measured here, a
key one call left readable by its uid was read by the next call on the same uid, 30-50 ms later.
So `add_key`, `request_key` and `keyctl` fail with EPERM, as under Docker's default profile.
inotify and fanotify watch inodes, not mounts: measured here, a call watching a stdlib file saw
the host open it, so concurrent calls could signal each other through the files they share
read-only; `inotify_init`, `inotify_init1` and `fanotify_init` fail with EPERM too. So do
io_uring, `userfaultfd`, `perf_event_open` and `bpf`: open to unprivileged processes here
(`kernel.io_uring_disabled=0`, userfaultfd in user mode), of no use to a stdlib program, and
common paths of kernel exploits (Docker refuses them too).

Where this departs from common practice, and why: the filter is a score of classic-BPF
instructions written here, not generated with libseccomp, which has no binding for our
interpreter and would be a compiled dependency for a deny-list of a dozen syscalls. It checks the
architecture first, as every seccomp filter must: a syscall made through another ABI (i386
`int 0x80` on x86_64, x32) has other numbers and would slip past, so every such syscall fails
with ENOSYS.
"""

from __future__ import annotations

import errno
import platform
import struct
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["NativeAbi", "blocked_syscalls_filter", "native_abi"]

_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: load a 32-bit word of `struct seccomp_data`
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_NR, _ARCH = 0, 4  # offsets of `nr` and `arch` in struct seccomp_data
_ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW
_ERRNO = 0x00050000  # SECCOMP_RET_ERRNO | errno
_X32_BIT = 0x40000000


@dataclass(frozen=True)
class NativeAbi:
    """The machine's native syscall ABI, as seccomp sees it."""

    audit_arch: int
    """`AUDIT_ARCH_*` value the kernel reports for native syscalls."""
    blocked: Mapping[str, int]
    """Name and number of each syscall that fails with EPERM."""
    x32_bit: bool
    """Whether syscall numbers with bit 30 set (x32) share this arch value and must be refused."""


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
    ),
}


def native_abi(machine: str | None = None) -> NativeAbi | None:
    """The ABI of `machine` (default: this one), or None where we have no filter for it."""
    return _ABIS.get(machine or platform.machine())


def blocked_syscalls_filter(abi: NativeAbi) -> bytes:
    """A `struct sock_filter[]` for bwrap's `--seccomp`: `abi.blocked` EPERM, other ABIs ENOSYS."""
    blocked = list(abi.blocked.values())
    # Layout: 0 load arch; 1 arch check; 2 load nr; [x32 check]; one check per blocked number;
    # then ALLOW, EPERM, ENOSYS. Jump offsets count instructions after the jump.
    checks = int(abi.x32_bit) + len(blocked)
    allow_at = 3 + checks
    eperm_at, enosys_at = allow_at + 1, allow_at + 2
    program = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 0, enosys_at - 2, abi.audit_arch),
        (_LD_W_ABS, 0, 0, _NR),
    ]
    if abi.x32_bit:
        program.append((_JGE_K, enosys_at - len(program) - 1, 0, _X32_BIT))
    for number in blocked:
        program.append((_JEQ_K, eperm_at - len(program) - 1, 0, number))
    program += [
        (_RET_K, 0, 0, _ALLOW),
        (_RET_K, 0, 0, _ERRNO | errno.EPERM),
        (_RET_K, 0, 0, _ERRNO | errno.ENOSYS),
    ]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
