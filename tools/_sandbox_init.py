"""Launcher run by `agent_grpo.tools.sandbox` as `python -I -S _sandbox_init.py CONFIG_JSON`.

It is a separate program, not a `preexec_fn`, because the rollout calls the sandbox from threads:
running Python between fork and exec in a threaded parent can deadlock on a lock another thread
held at the fork. Here we are a fresh single-threaded process, so namespaces, rlimits and the
privilege drop are done in plain sequence.

Process tree, when a new PID namespace is available:

    launcher (host PID ns, root)  -- waits; on SIGTERM kills `init`, which ends the namespace
      init   (PID 1 of a new PID ns, root)  -- reaps orphans, reports the code's exit status
        code (sandbox uid, rlimits applied) -- execs `python -I -S -u main.py`

When `init` exits the kernel kills and reaps every process left in the namespace, so a fork bomb
or a daemonised child cannot outlive the call. Without a PID namespace the launcher execs the code
directly and the parent kills its process group instead.

Status goes to the parent as JSON lines on the inherited `status_fd`, which is closed before the
code starts, so the code cannot forge it: `{"net": bool, "pid": bool, "error": str|null}` first,
then `{"exit_code": int}` or `{"signal": int}` from `init`.
"""

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38

libc = ctypes.CDLL(None, use_errno=True)


def write_status(fd: int, **fields: object) -> None:
    """Send one JSON status line to the parent."""
    os.write(fd, (json.dumps(fields) + "\n").encode())


def enter_namespaces(want_net: bool) -> tuple[bool, bool]:
    """Unshare PID (and network) namespaces; returns (net, pid) as actually obtained."""
    extra = 0 if os.geteuid() == 0 else CLONE_NEWUSER  # unprivileged: via a user namespace
    attempts = [(want_net, True), (want_net, False), (False, True)]
    for net, pid in attempts:
        flags = (CLONE_NEWNET if net else 0) | (CLONE_NEWPID if pid else 0)
        if flags and libc.unshare(flags | extra) == 0:
            if extra:
                map_own_ids()
            return net, pid
    return False, False


def map_own_ids() -> None:
    """In a fresh user namespace, map our uid/gid to themselves so files keep their owner."""
    uid, gid = os.getuid(), os.getgid()
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")


def exec_code(config: dict) -> None:
    """Apply rlimits, drop to the sandbox uid, and exec the interpreter on main.py."""
    for name, (soft, hard) in config["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if config["uid"] is not None:
        os.setgroups([])
        os.setgid(config["gid"])
        os.setuid(config["uid"])
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # setuid binaries (su, ping) cannot elevate
    os.execv(config["python"], [config["python"], "-I", "-S", "-u", "main.py"])


def run_init(config: dict, status_fd: int) -> None:
    """PID 1 of the sandbox: start the code, reap everything, report the code's status."""
    # If the launcher dies, so do we (and with us the namespace). It can only die before this
    # line from the parent's process-group SIGKILL, which reaches us too.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    code_pid = os.fork()
    if code_pid == 0:
        exec_code(config)
    while True:
        pid, status = os.wait()
        if pid == code_pid:
            break
    if os.WIFSIGNALED(status):
        write_status(status_fd, signal=os.WTERMSIG(status))
    else:
        write_status(status_fd, exit_code=os.WEXITSTATUS(status))
    os._exit(0)  # the kernel now kills whatever the code left running in the namespace


def run_launcher(config: dict) -> None:
    """Enter namespaces, then either supervise a PID-namespace init or exec the code directly."""
    status_fd = config["status_fd"]
    os.set_inheritable(status_fd, False)  # closed by exec: the code never holds it
    net, pid = enter_namespaces(config["isolate_net"])
    write_status(status_fd, net=net, pid=pid, error=None)
    if not pid:
        exec_code(config)
    # SIGTERM (the parent's "stop now") stays blocked and is polled for, so we only ever kill
    # init while it is unreaped: its pid cannot have been reused by then.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    init_pid = os.fork()
    if init_pid == 0:
        run_init(config, status_fd)
    while os.waitpid(init_pid, os.WNOHANG) == (0, 0):
        if signal.sigtimedwait({signal.SIGTERM}, 0.02) is not None:
            os.kill(init_pid, signal.SIGKILL)
    os._exit(0)


def run_sweep(config: dict) -> None:
    """Kill every process of the sandbox uid: `kill(-1)` as that uid reaches exactly those."""
    os.setgroups([])
    os.setgid(config["gid"])
    os.setuid(config["uid"])
    with contextlib.suppress(ProcessLookupError):  # nothing left to kill
        os.kill(-1, signal.SIGKILL)


def main() -> None:
    """Dispatch on the config's mode; report a setup failure instead of a traceback."""
    config = json.loads(sys.argv[1])
    if config["mode"] == "sweep":
        run_sweep(config)
        return
    try:
        run_launcher(config)
    except Exception as error:
        write_status(config["status_fd"], net=False, pid=False, error=repr(error))
        os._exit(1)


if __name__ == "__main__":
    main()
