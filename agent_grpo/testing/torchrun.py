"""Launching torchrun from a test: on a timeout or any error it kills torchrun and every process
below it, so no worker outlives a failed test."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["free_port", "kill_tree", "run_torchrun"]


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_torchrun(
    args: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`torchrun --nproc_per_node 2 ARGS` on 127.0.0.1, output captured; on a timeout, an
    interrupt or any other error, torchrun and all its workers are killed (`kill_tree`)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"]
    launcher += ["--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    launcher += ["--master_port", str(free_port())]
    env = {**env, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        launcher + args,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_tree(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_tree(proc: subprocess.Popen[str]) -> None:
    """SIGKILL `proc` and every process below it, then reap `proc`.

    torchrun starts each worker in a session of its own, so killing the launcher's process group
    misses them, and a SIGKILLed launcher cannot stop them itself: list the tree first (from
    /proc), then kill each process by id.
    """
    for pid in [*descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.communicate()


def descendants(pid: int) -> list[int]:
    """Ids of every live process below `pid` (Linux /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)": state, ppid
            parent = int(fields[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found
