"""Sockets in the sandbox: only AF_UNIX can be created, and AF_INET and AF_INET6 too with the
network (socketpair: AF_UNIX); every other family the kernel knows fails with EAFNOSUPPORT,
AF_VSOCK (which no network namespace covers) included."""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import struct
from pathlib import Path

import pytest

from agent_grpo.sandbox import runner as sandbox
from agent_grpo.sandbox.bwrap import find_bwrap
from agent_grpo.sandbox.runner import SandboxLimits, run_sandboxed
from agent_grpo.sandbox.seccomp import (
    ALLOWED_FAMILIES,
    NETWORK_FAMILIES,
    blocked_syscalls_filter,
    native_abi,
)

FAMILIES = range(64)
"""Every family number up to 64: more than any kernel's AF_MAX so far (46 in Linux 6.18)."""
TYPES = (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW, socket.SOCK_SEQPACKET)
ALLOW, EPERM_RET = 0x7FFF0000, 0x00050000 | errno.EPERM
EAFNOSUPPORT_RET = 0x00050000 | errno.EAFNOSUPPORT
needs_bwrap = pytest.mark.skipif(
    find_bwrap() is None and os.geteuid() != 0, reason="bubblewrap missing"
)

# Each family's socket(2) and socketpair(2) with each type: "ok" or the errno's name.
PROBE = """\
import ctypes, errno, json
libc = ctypes.CDLL(None, use_errno=True)
pair = (ctypes.c_int * 2)()
def outcome(fd):
    return "ok" if fd >= 0 else errno.errorcode[ctypes.get_errno()]
seen = {}
for family in range(64):
    for kind in (1, 2, 3, 5):
        seen[f"socket {family} {kind}"] = outcome(libc.socket(family, kind, 0))
        seen[f"socketpair {family} {kind}"] = outcome(libc.socketpair(family, kind, 0, pair))
print(json.dumps(seen))
"""


@pytest.fixture(autouse=True)
def private_uid_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_UID_RANGE", range(62032, 62040))


def test_the_probe_covers_every_family_the_kernel_headers_list() -> None:
    header = Path("/usr/include/x86_64-linux-gnu/bits/socket.h")
    if not header.exists():
        pytest.skip("no glibc socket header here")
    af_max = re.search(r"#define PF_MAX\s+(\d+)", header.read_text())
    assert af_max is not None and int(af_max.group(1)) < len(FAMILIES)


@needs_bwrap
@pytest.mark.parametrize("network", [False, True], ids=["isolated", "network"])
def test_only_unix_sockets_and_with_the_network_inet_ones_can_be_created_inside(
    network: bool,
) -> None:
    # without the network an inet socket reaches only the call's own loopback, whose buffers no
    # memory limit counted: a red team held 1.7 GB of host memory in them
    result = run_sandboxed(PROBE, limits=SandboxLimits(wall_time_s=10, network=network))
    assert result.exit_code == 0, result.stderr
    seen = json.loads(result.stdout)
    created = {key for key, outcome in seen.items() if outcome == "ok"}
    families = NETWORK_FAMILIES if network else ALLOWED_FAMILIES
    refused = {key: outcome for key, outcome in seen.items() if not kernel_decides(key, families)}
    assert {key: outcome for key, outcome in refused.items() if outcome != "EAFNOSUPPORT"} == {}
    assert {"socket 1 1", "socket 1 2", "socketpair 1 1"} <= created
    inet = {"socket 2 1", "socket 2 2"} | ({"socket 10 1"} if socket.has_ipv6 else set())
    assert inet <= created if network else not inet & created


def kernel_decides(key: str, families: frozenset[int]) -> bool:
    """Whether the filter lets the call through (an allowed family) for the kernel to judge."""
    call, family, _ = key.split()
    allowed = families if call == "socket" else {socket.AF_UNIX}
    return int(family) in allowed


def test_filter_verdicts_for_socket_socketpair_fcntl_and_flock_on_both_arches() -> None:
    for machine in ("x86_64", "aarch64"):
        abi = native_abi(machine)
        assert abi is not None
        program = blocked_syscalls_filter(abi)
        networked = blocked_syscalls_filter(abi, network=True)

        def verdict(nr: int, *args: int, arch: int = abi.audit_arch, prog: bytes = program) -> int:
            return run_bpf(prog, arch, nr, args)

        for family in FAMILIES:
            wanted = ALLOW if family in ALLOWED_FAMILIES else EAFNOSUPPORT_RET
            assert verdict(abi.socket, family, 1) == wanted, (machine, family)
            wanted = ALLOW if family in NETWORK_FAMILIES else EAFNOSUPPORT_RET
            assert verdict(abi.socket, family, 1, prog=networked) == wanted, (machine, family)
            wanted = ALLOW if family == socket.AF_UNIX else EAFNOSUPPORT_RET
            assert verdict(abi.socketpair, family, 1) == wanted, (machine, family)
        assert verdict(abi.socket, (1 << 32) | socket.AF_VSOCK) == EAFNOSUPPORT_RET
        for command in (5, 6, 7, 36, 37, 38, 1026):  # F_[OFD_]{GET,SET}LK[W], F_NOTIFY
            assert verdict(abi.fcntl, 3, command) == EPERM_RET, (machine, command)
        for command in (0, 1, 2, 3, 4, 1030):  # F_DUPFD, F_GETFD, F_SETFD, ..., F_DUPFD_CLOEXEC
            assert verdict(abi.fcntl, 3, command) == ALLOW, (machine, command)
        assert verdict(abi.flock, 3, 2) == EPERM_RET


def run_bpf(program: bytes, arch: int, nr: int, args: tuple[int, ...] = ()) -> int:
    """What a classic-BPF seccomp program returns for a syscall (the few opcodes we emit)."""
    code = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    data = {0: nr, 4: arch}
    for i, value in enumerate(args):  # little-endian: the low word first
        data[16 + 8 * i], data[20 + 8 * i] = value & 0xFFFFFFFF, value >> 32
    accumulator, pc = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        if op == 0x06:  # ret
            return int(k)
        if op == 0x20:  # ld [k]
            accumulator = data.get(k, 0)
            pc += 1
            continue
        taken = accumulator == k if op == 0x15 else accumulator >= k  # jeq / jge
        pc += 1 + (jt if taken else jf)
