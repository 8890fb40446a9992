"""Tests for the process sandbox and the `python` tool: each hostile program is contained in its
limits and leaves no process and no file behind."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_grpo.tool import format_tool_result, run_tool_call
from agent_grpo.tools import sandbox
from agent_grpo.tools.python import PYTHON_LIMITS, format_sandbox_result, python
from agent_grpo.tools.sandbox import SandboxLimits, SandboxResult, run_sandboxed

IS_ROOT = os.geteuid() == 0
TEST_UIDS = range(62000, 62016)
"""A uid range only these tests lease, so "no process of this uid" cannot see other users."""
TEARDOWN_SLACK_S = 2.5
"""Wall time allowed past the limit for killing and reaping (generous: CI boxes are shared)."""
FAST = SandboxLimits(wall_time_s=1.0)


@pytest.fixture(autouse=True)
def private_uid_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_UID_RANGE", TEST_UIDS)


def _pids_left(result: SandboxResult) -> list[int]:
    """Processes (zombies included) of the run's uid, or with its working dir as HOME."""
    home = f"HOME={result.workdir}".encode()
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            mine = IS_ROOT and entry.stat().st_uid == result.uid
            if mine or home in (entry / "environ").read_bytes().split(b"\0"):
                left.append(int(entry.name))
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return left


def run_contained(code: str, limits: SandboxLimits = FAST, **kwargs: str) -> SandboxResult:
    """Run `code` and check it ended within its wall time and left nothing behind."""
    start = time.monotonic()
    result = run_sandboxed(code, limits=limits, **kwargs)
    assert time.monotonic() - start < limits.wall_time_s + TEARDOWN_SLACK_S
    assert_left_nothing(result)
    return result


def assert_left_nothing(result: SandboxResult) -> None:
    assert result.workdir.startswith(tempfile.gettempdir())
    assert not Path(result.workdir).exists()
    assert _pids_left(result) == []


def test_output_exit_code_and_stdin() -> None:
    code = "import sys\nprint(input()[::-1])\nprint('warn', file=sys.stderr)\nsys.exit(3)"
    result = run_contained(code, stdin="abc\n")
    assert (result.stdout, result.stderr, result.exit_code) == ("cba\n", "warn\n", 3)
    assert not result.timed_out and result.killed_by is None and not result.output_truncated


def test_infinite_loop_is_killed_at_the_wall_time() -> None:
    result = run_contained("print('started')\nwhile True:\n    pass")
    assert result.timed_out and result.killed_by == "SIGKILL" and result.exit_code is None
    assert result.stdout == "started\n"  # unbuffered: output before the kill survives
    assert result.duration_s >= FAST.wall_time_s


def test_cpu_limit_sends_sigxcpu() -> None:
    limits = SandboxLimits(wall_time_s=20.0, cpu_time_s=1)
    result = run_contained("while True:\n    pass", limits)
    assert result.killed_by == "SIGXCPU" and not result.timed_out


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
    limits = SandboxLimits(wall_time_s=5.0, max_processes=8)
    if IS_ROOT:  # the limit counts the sandbox uid's processes: the program plus 7 children
        assert run_contained(count_forks, limits).stdout == "7\n"
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run_contained(bomb, SandboxLimits(wall_time_s=1.0, max_processes=16))
    assert result.timed_out and result.killed_by == "SIGKILL"


def test_daemonised_child_does_not_outlive_the_program() -> None:
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('done')"
    result = run_sandboxed(code, limits=SandboxLimits(wall_time_s=10.0))
    if not result.pid_namespace and not IS_ROOT:
        for pid in _pids_left(result):
            os.kill(pid, signal.SIGKILL)
        pytest.skip("no PID namespace and no private uid: a setsid() child escapes (documented)")
    assert_left_nothing(result)
    assert result.stdout == "done\n" and result.exit_code == 0 and not result.timed_out
    assert result.duration_s < 3.0  # did not wait for the sleeping child


def test_allocating_8_gb_fails_inside_the_program() -> None:
    result = run_contained("x = bytearray(8 * 1024**3)")
    assert result.exit_code == 1 and "MemoryError" in result.stderr and not result.timed_out


def test_printing_100_mb_is_cut_at_the_cap_and_killed() -> None:
    code = "for _ in range(100):\n    print('x' * 1_000_000)"  # 100 MB, 1 MB at a time
    limits = SandboxLimits(wall_time_s=10.0)
    result = run_contained(code, limits)
    assert result.output_truncated and result.killed_by == "SIGKILL" and not result.timed_out
    assert result.stdout == "x" * limits.max_output_bytes
    assert result.duration_s < 3.0  # killed at the cap, not at the wall time


@pytest.fixture
def tcp_server() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(5)

    def accept_one() -> None:
        try:
            conn, _ = server.accept()
            conn.sendall(b"hello")
            conn.close()
        except OSError:
            pass

    thread = threading.Thread(target=accept_one, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    server.close()


CONNECT = (
    "import socket\n"
    "s = socket.create_connection(('127.0.0.1', int(input())), timeout=3)\n"
    "print(s.recv(5).decode())\n"
)


def test_network_is_unreachable_when_isolated(tcp_server: int) -> None:
    result = run_contained(CONNECT, stdin=f"{tcp_server}\n")
    if not result.network_isolated:
        pytest.skip("no network namespace on this OS: the sandbox reports network_isolated=False")
    assert result.exit_code == 1 and "Network is unreachable" in result.stderr
    assert result.pid_namespace


def test_network_allowed_reaches_the_server(tcp_server: int) -> None:
    limits = SandboxLimits(wall_time_s=5.0, network=True)
    result = run_contained(CONNECT, limits, stdin=f"{tcp_server}\n")
    assert (result.stdout, result.network_isolated) == ("hello\n", False)


def test_environment_is_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_GRPO_TEST_SECRET", "hunter2")
    result = run_contained(
        "import os\nprint(sorted(os.environ), os.environ['HOME'] == os.getcwd())"
    )
    assert result.stdout == "['HOME', 'LANG', 'PATH'] True\n"


@pytest.mark.skipif(not IS_ROOT, reason="writes outside are only stopped with a private uid")
def test_writes_outside_the_workdir_are_denied_and_tmp_litter_removed() -> None:
    target = Path(tempfile.mkdtemp(prefix="agent-grpo-test-target-"))
    litter = Path(tempfile.gettempdir(), f"agent-grpo-test-litter-{os.getpid()}")
    try:
        target.chmod(0o755)  # root-owned, readable by all, writable by root only
        code = (
            "import sys\n"
            f"for path in ({str(target / 'x')!r}, '/etc/agent-grpo-test', {str(litter)!r}, 'ok'):\n"
            "    try:\n"
            "        open(path, 'w').write('x')\n"
            "        print('wrote', path)\n"
            "    except OSError as e:\n"
            "        print(type(e).__name__, path)\n"
        )
        result = run_contained(code)
        assert result.stdout.splitlines() == [
            f"PermissionError {target / 'x'}",
            "PermissionError /etc/agent-grpo-test",
            f"wrote {litter}",  # world-writable /tmp is writable, but cleaned up afterwards
            "wrote ok",
        ]
        assert list(target.iterdir()) == [] and not litter.exists()
        assert not Path("/etc/agent-grpo-test").exists()
    finally:
        target.rmdir()


def test_concurrent_runs_get_distinct_uids() -> None:
    results: list[SandboxResult] = []
    threads = [
        threading.Thread(target=lambda: results.append(run_contained("print(1)"))) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.stdout for r in results] == ["1\n"] * 4
    if IS_ROOT:
        assert len({r.uid for r in results}) == 4 and all(r.uid in TEST_UIDS for r in results)


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
        output_truncated=False, duration_s=1.0, network_isolated=True, pid_namespace=True,
        uid=1, workdir="/tmp/w",
    )  # fmt: skip
    limits = SandboxLimits(wall_time_s=2, cpu_time_s=3, max_output_bytes=9)
    cases = [
        ({"timed_out": True, "killed_by": "SIGKILL"}, "[timed out after 2 s; program killed]"),
        ({"killed_by": "SIGXCPU"}, "[CPU time limit of 3 s reached; program killed]"),
        (
            {"output_truncated": True, "killed_by": "SIGKILL"},
            "[output cut at 9 bytes per stream; program killed]",
        ),
        ({"killed_by": "SIGSEGV"}, "[killed by SIGSEGV]"),
        ({"exit_code": 2}, "[exit status 2]"),
    ]
    for update, note in cases:
        result = base.model_copy(update=update)
        assert format_sandbox_result(result, limits) == f"out\n{note}"
