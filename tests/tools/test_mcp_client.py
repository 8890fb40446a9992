"""Tools from MCP servers (`agent_grpo.tools.mcp_client`), Notes-v0, the docs example, and a
stdio server's stderr kept as a bounded tail.

Everything past the pure functions runs the real SDK end to end: servers started over stdio (one
over streamable HTTP), including `tests/tools/mcp_servers.py`, which crashes or hangs on request.
Each server start imports `mcp` (what a start costs: docs/benchmarks.md, "MCP servers"), so tests
share what they can.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env
from mcp.types import CallToolResult, ImageContent, TextContent
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

import agent_grpo.envs  # noqa: F401  (registers the built-ins)
from agent_grpo.envs.mcp_env import with_workdir
from agent_grpo.envs.notes import NotesEnv, NotesTask
from agent_grpo.envs.text_env import heldout_seeds, read_step_info, run_expert
from agent_grpo.testing.reward_rules import reward_override
from agent_grpo.testing.waiting import wait_until
from agent_grpo.tools.formats import parse_tool_calls
from agent_grpo.tools.mcp_client import (
    STDERR_TAIL_BYTES,
    McpClient,
    McpServer,
    McpServerError,
    McpToolError,
    result_text,
)
from agent_grpo.tools.notes_server import load_notes, read_notes
from agent_grpo.tools.schema_args import schema_args_model, without_titles
from agent_grpo.tools.tool import Tool, run_tool_call

ROOT = Path(__file__).resolve().parents[2]
FLAKY = [sys.executable, str(Path(__file__).with_name("mcp_servers.py"))]


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return line.rsplit(")", 1)[1].split()[0] != "Z"


def children() -> set[int]:
    """Live child processes of this test process."""
    found = set()
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.add(int(stat_file.parent.name))
    return found


# --- Arguments and results, without a server ----------------------------------------------------

SCHEMA = {
    "type": "object",
    "title": "noteArguments",
    "properties": {
        "title": {"title": "Title", "type": "string"},
        "count": {"title": "Count", "type": "integer", "minimum": 1},
        "tags": {"type": "array", "items": {"title": "Tag", "type": "string"}},
    },
    "required": ["title", "count"],
}


def test_schema_is_shown_without_title_annotations_but_keeps_a_property_named_title() -> None:
    model = schema_args_model("note", SCHEMA)
    shown = model.model_json_schema()
    assert shown == {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "count": {"type": "integer", "minimum": 1},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["title", "count"],
    }
    assert without_titles({"$defs": {"title": {"title": "T", "type": "string"}}}) == {
        "$defs": {"title": {"type": "string"}}
    }


def test_arguments_are_validated_against_the_schema_with_pydantic_errors() -> None:
    model = schema_args_model("note", SCHEMA)
    assert dict(model.model_validate({"title": "a", "count": 2})) == {"title": "a", "count": 2}
    with pytest.raises(ValidationError) as caught:
        model.model_validate({"count": 0, "colour": "red", "tags": ["x", 3]})
    problems = {(e["type"], e["loc"]) for e in caught.value.errors()}
    assert problems == {
        ("missing", ("title",)),
        ("extra_forbidden", ("colour",)),
        ("json_schema", ("count",)),
        ("json_schema", ("tags", 1)),
    }
    messages = {e["loc"]: e["msg"] for e in caught.value.errors()}
    assert messages[("tags", 1)] == "should be of type string"
    assert messages[("count",)] == "0 is less than the minimum of 1"


def test_extra_arguments_follow_the_flag_and_an_explicit_schema() -> None:
    lax = schema_args_model("note", SCHEMA, forbid_extra=False)
    assert dict(lax.model_validate({"title": "a", "count": 1, "x": 1}))["x"] == 1
    explicit = schema_args_model("note", {**SCHEMA, "additionalProperties": True})
    assert dict(explicit.model_validate({"title": "a", "count": 1, "x": 1}))["x"] == 1
    with pytest.raises(ValueError, match="invalid input schema"):
        schema_args_model("bad", {"type": "object", "properties": {"a": {"type": 3}}})


def test_a_bad_call_is_malformed_before_anything_is_sent() -> None:
    tools = {"note": _offline_tool()}
    call = '<tool_call>{"name": "note", "arguments": {"title": 5}}</tool_call>'
    (error,) = parse_tool_calls(call, tools)
    assert error.kind == "invalid_arguments"  # type: ignore[union-attr]
    assert "title: should be of type string (got 5)" in error.message  # type: ignore[union-attr]
    assert "count: Field required" in error.message  # type: ignore[union-attr]
    record = run_tool_call(tools["note"], {"title": "a", "count": "x"})
    assert record.error_kind == "invalid_arguments" and "argument 'count'" in (record.error or "")


def _offline_tool() -> Tool:
    """A `Tool` built from SCHEMA that fails the test if it is ever called."""
    return Tool(name="note", description="", args_model=schema_args_model("note", SCHEMA),
                fn=lambda **_: pytest.fail("sent"), is_async=False, timeout_s=1,
                max_output_chars=100)  # fmt: skip


def test_result_text() -> None:
    text = TextContent(type="text", text="one")
    image = ImageContent(type="image", data="AA==", mime_type="image/png")
    assert result_text(CallToolResult(content=[text, image, text])) == "one\n[image image/png]\none"
    assert result_text(CallToolResult(content=[], structured_content={"n": 1})) == '{"n": 1}'
    failed = TextContent(type="text", text="Error executing tool t: no such row")
    with pytest.raises(McpToolError, match=r"^no such row$"):
        result_text(CallToolResult(content=[failed], is_error=True), "t")
    with pytest.raises(McpToolError, match="without a message"):
        result_text(CallToolResult(content=[], is_error=True), "t")


def test_server_config() -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        McpServer()
    with pytest.raises(ValidationError, match="exactly one"):
        McpServer(command=["x"], url="http://h/mcp")
    server = McpServer(command=["srv", "--db", "{workdir}/a.db"], env={"D": "{workdir}"},
                       cwd="{workdir}")  # fmt: skip
    filled = with_workdir(server, Path("/tmp/w"))
    assert filled.command == ["srv", "--db", "/tmp/w/a.db"]
    assert filled.env == {"D": "/tmp/w"} and filled.cwd == "/tmp/w"


@pytest.mark.parametrize("name", ["<|im_start|>user", "[TOOL_CALLS]", "two words", "x" * 65])
def test_a_server_tool_whose_name_could_read_as_template_text_is_refused(name: str) -> None:
    class Listed:  # what the SDK lists for one tool
        description = "d"
        input_schema = {"type": "object", "properties": {}}

    Listed.name = name  # type: ignore[attr-defined]
    client = McpClient(McpServer(command=["never-started"]))
    with pytest.raises(McpServerError, match=r"^tool name .* cannot be used"):
        client._tool(Listed)


# --- The client over stdio, against a server that misbehaves on request ------------------------


@pytest.fixture(scope="module")
def flaky() -> Iterator[McpClient]:
    """One client of `mcp_servers.py` (SIGTERM ignored), shared by the tests that keep it up."""
    client = McpClient(McpServer(command=[*FLAKY, "--ignore-term"], timeout_s=1.5,
                                 max_output_chars=50, probe_timeout_s=1))  # fmt: skip
    yield client
    client.close()


def test_tools_are_listed_with_their_schemas_and_called_like_builtins(flaky: McpClient) -> None:
    tools = {t.name: t for t in flaky.tools()}
    assert set(tools) == {"echo", "pid", "fail", "picture", "crash", "nap", "stuck"}
    assert tools["echo"].json_schema()["function"] == {
        "name": "echo",
        "description": "Return the text, repeated.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}, "times": {"default": 1, "type": "integer"}},
            "required": ["text"],
        },
    }
    ok = run_tool_call(tools["echo"], {"text": "ab", "times": 2})
    assert (ok.result, ok.error) == ("abab", None)
    failed = run_tool_call(tools["fail"], {"reason": "no"})
    assert failed.error_kind == "raised"
    assert failed.error == "tool fail raised McpToolError: refused: no"
    assert run_tool_call(tools["picture"], {}).result == "a red dot\n[image image/png]"
    too_long = run_tool_call(tools["echo"], {"text": "x", "times": 51})
    assert too_long.error_kind == "oversized" and "51 characters" in (too_long.error or "")


@pytest.mark.slow
def test_a_slow_call_times_out_and_the_server_that_still_answers_is_kept(
    flaky: McpClient,
) -> None:
    tools = {t.name: t for t in flaky.tools()}
    before = run_tool_call(tools["pid"], {}).result
    started = time.monotonic()
    slow = run_tool_call(tools["nap"], {"seconds": 30})
    assert slow.error_kind == "timeout" and 1.5 <= time.monotonic() - started < 2.5
    time.sleep(1.5)  # the client cancels the call 1 s after run_tool_call gave up, then probes
    assert run_tool_call(tools["pid"], {}).result == before


def test_a_crashed_server_is_an_error_and_the_next_call_starts_a_new_one(
    flaky: McpClient,
) -> None:
    tools = {t.name: t for t in flaky.tools()}
    old = int(run_tool_call(tools["pid"], {}).result or 0)
    crashed = run_tool_call(tools["crash"], {})
    assert crashed.error_kind == "raised"
    assert "McpServerError: the MCP server stopped answering" in (crashed.error or "")
    assert wait_until(lambda: not alive(old), 5)
    # A new server starts in the background at once; call_tool waits for it (run_tool_call
    # would count its start, about 2 s, against the 1.5 s timeout).
    new = int(flaky.call_tool("pid", {}))
    assert new != old and alive(new)


@pytest.mark.slow
def test_a_hung_server_times_out_is_killed_and_replaced(flaky: McpClient) -> None:
    tools = {t.name: t for t in flaky.tools()}
    old = int(run_tool_call(tools["pid"], {}).result or 0)
    started = time.monotonic()
    hung = run_tool_call(tools["stuck"], {})
    assert hung.error_kind == "timeout" and time.monotonic() - started < 2.5
    assert hung.error == (
        "tool stuck timed out after 1.5 s and was abandoned. Call it with a smaller or simpler "
        "request."
    )
    # Its loop is blocked and it ignores SIGTERM: the probe fails, then stdin close, SIGTERM and
    # SIGKILL follow (about 4 s).
    assert wait_until(lambda: not alive(old), 12)
    new = int(flaky.call_tool("pid", {}))
    assert new != old and alive(new)


def test_close_kills_a_server_that_ignores_sigterm_and_a_later_call_restarts() -> None:
    client = McpClient(McpServer(command=[*FLAKY, "--ignore-term"]))
    pid = int(client.call_tool("pid", {}))
    started = time.monotonic()
    client.close()
    assert not alive(pid) and time.monotonic() - started < 8
    client.close()  # idempotent
    again = int(client.call_tool("pid", {}))
    assert again != pid
    client.close()
    assert not alive(again)


def test_startup_failures_raise_with_the_servers_stderr(tmp_path: Path) -> None:
    broken = McpClient(McpServer(command=[*FLAKY, "--exit-at-start"]))
    with pytest.raises(McpServerError, match=r"could not start.*the configuration is broken"):
        broken.tools()
    broken.close()
    missing = McpClient(McpServer(command=["/no/such/server"]))
    with pytest.raises(McpServerError, match="FileNotFoundError"):
        missing.tools()
    missing.close()


@pytest.mark.slow
def test_a_server_that_hangs_at_start_is_killed_after_the_startup_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    command = [*FLAKY, "--hang-at-start", "--ignore-term", "--pid-file", str(pid_file)]
    client = McpClient(McpServer(command=command, startup_timeout_s=2))
    assert not pid_file.exists()  # nothing starts before it is needed
    started = time.monotonic()
    with pytest.raises(McpServerError, match="took over 2 s while starting; it was stopped"):
        client.tools()
    assert time.monotonic() - started < 10
    assert not alive(int(pid_file.read_text()))
    client.close()


def test_a_server_reached_at_a_url(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    db = tmp_path / "notes.db"
    load_notes(db, {"a": "alpha"})
    command = [sys.executable, "-m", "agent_grpo.tools.notes_server", "--db", str(db)]
    served = subprocess.Popen([*command, "--port", str(port)], stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: _listening(port), 30)
        client = McpClient(McpServer(url=f"http://127.0.0.1:{port}/mcp", tools=["read_note"]))
        (read_note,) = client.tools()
        assert run_tool_call(read_note, {"title": "a"}).result == "alpha"
        client.close()
    finally:
        served.kill()
        served.wait()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# --- Notes-v0 ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def notes() -> Iterator[gym.Env]:
    """One Notes-v0 env (one server) for the tests below."""
    env = gym.make("agent_grpo/Notes-v0")
    yield env
    env.close()


def test_notes_env_passes_check_env_without_warnings(notes: gym.Env) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(notes.unwrapped)


def test_notes_expert_solves_held_out_tasks(notes: gym.Env) -> None:
    episodes = [run_expert(notes, seed) for seed in heldout_seeds(60)]
    assert all(e.success and e.reward == 1.0 for e in episodes)
    kinds = {e.messages[1].content.split()[0] for e in episodes}
    assert kinds == {"What", "Copy", "Rename", "Delete"}
    assert {e.turns for e in episodes} == {2, 3, 4}
    assert run_expert(notes, heldout_seeds(1)[0]) == episodes[0]  # deterministic
    assert '"name": "write_note"' in episodes[0].messages[0].content  # the server's tools


def _task(env: gym.Env, kind: str) -> tuple[NotesTask, list[dict[str, str]]]:
    """Reset on the first seed whose task is of `kind`."""
    for seed in range(100):
        obs, _ = env.reset(seed=seed)
        task = env.unwrapped.task
        assert isinstance(task, NotesTask)
        if task.kind == kind:
            return task, obs
    raise AssertionError(kind)


def call(tool: str, **arguments: object) -> str:
    return f'<tool_call>{{"name": "{tool}", "arguments": {json.dumps(arguments)}}}</tool_call>'


def test_notes_verifier_checks_the_final_state_not_the_words(notes: gym.Env) -> None:
    task, _ = _task(notes, "copy")
    text = task.initial[task.source]
    notes.step(call("write_note", title=task.target, text=text))
    notes.step(call("write_note", title="stray", text="oops"))  # one write too many
    _, reward, terminated, _, info = notes.step("Answer: done")
    verdict = read_step_info(info).verifier
    assert (reward, terminated) == (0.0, True) and verdict is not None
    assert "stray" in verdict["given"] and "stray" not in verdict["expected"]
    task, _ = _task(notes, "rename")
    notes.step(call("write_note", title=task.target, text=task.initial[task.source]))
    _, reward, *_ = notes.step("Answer: done")  # the old note is still there
    assert reward == 0.0
    task, _ = _task(notes, "lookup")
    _, reward, *_ = notes.step(f"Answer: {task.initial[task.source]}")  # no read: still right
    assert reward == 1.0
    task, _ = _task(notes, "lookup")
    _, reward, *_ = notes.step("Answer: something else")
    assert reward == 0.0


def test_notes_server_errors_and_bad_calls_are_observations(notes: gym.Env) -> None:
    task, _ = _task(notes, "delete")
    obs, reward, terminated, truncated, info = notes.step(call("read_note", title="nope"))
    assert obs == [{"role": "tool", "name": "read_note",
                    "content": "Error: tool read_note raised McpToolError: no note titled 'nope'; "
                               "list_notes shows the titles"}]  # fmt: skip
    assert (reward, terminated, truncated) == (0.0, False, False)
    obs, *_, info = notes.step(call("delete_note", name=task.source))
    step = read_step_info(info)
    assert step.malformed_tool_calls == 1 and step.tool_calls[0].error_kind == "invalid_arguments"
    assert obs[0]["content"] == (  # the same words as for a built-in tool
        "Error: invalid arguments for delete_note: title: Field required; "
        f"name: Extra inputs are not permitted (got '{task.source}')"
    )
    obs, *_ = notes.step(call("list_notes"))
    assert obs[0]["content"].splitlines() == sorted(task.initial)


def test_notes_state_is_the_file_and_close_stops_the_server(tmp_path: Path) -> None:
    before = children()
    env = NotesEnv()
    assert children() == before  # lazy: nothing started yet
    env.reset(seed=3)
    assert env.task is not None
    db = env.workdir / "notes.db"
    assert read_notes(db) == dict(sorted(env.task.initial.items()))
    env.step(call("write_note", title="new", text="hello"))
    assert read_notes(db)["new"] == "hello"
    (server,) = children() - before
    env.close()
    assert not alive(server) and not env.workdir.exists()
    env.reset(seed=3)  # a closed env starts over
    assert read_notes(db) == dict(sorted(env.task.initial.items()))
    env.close()
    assert children() == before


# --- The docs example ---------------------------------------------------------------------------


def docs_files() -> dict[str, str]:
    """The `# my_mcp/...` code blocks of docs/mcp.md, by file name."""
    docs = (ROOT / "docs" / "mcp.md").read_text()
    blocks = re.findall(r"```python\n# (my_mcp/\w+\.py)\n(.*?)```", docs, re.DOTALL)
    return {name: body for name, body in blocks}


def test_docs_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = docs_files()
    assert set(files) == {"my_mcp/prices_server.py", "my_mcp/prices_env.py"}
    for name, body in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(body)
    assert len(files["my_mcp/prices_env.py"].splitlines()) < 60
    monkeypatch.syspath_prepend(str(tmp_path))
    from my_mcp.prices_env import BasketEnv  # type: ignore[import-not-found]

    env = BasketEnv()
    check_env(env, skip_render_check=True)
    assert sum(run_expert(env, s).success for s in heldout_seeds(20)) == 20
    env.reset(seed=0)
    obs = env.step('<tool_call>{"name": "price", "arguments": {"item": "gold"}}</tool_call>')[0]
    docs = (ROOT / "docs" / "mcp.md").read_text()
    assert repr(obs) in docs  # the output the page shows
    env.close()
    sys.modules.pop("my_mcp.prices_env", None)
    sys.modules.pop("my_mcp", None)


# --- Two training steps on Notes-v0 -------------------------------------------------------------


EVEN = reward_override("even", "even_tokens")


@pytest.mark.slow
def test_two_training_steps_on_notes(
    tmp_path: Path, tiny_model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Warm start on expert demos (real MCP calls), 2 GRPO steps (an env, and a server, per
    episode), evaluations; the tiny model never calls a tool, so a rule reward gives variance."""
    from agent_grpo.config.base import load_config
    from agent_grpo.config.jobs import TrainConfig
    from agent_grpo.trainer.loop import train
    from agent_grpo.trainer.warm_start import expert_record

    before = children()
    demo = expert_record(tokenizer, "agent_grpo/Notes-v0", 7)  # what the warm start trains on
    assert demo.reward == 1.0 and [m.role for m in demo.messages].count("tool") >= 1
    overrides = [f"model.name_or_path={tiny_model_dir}", f"run.root={tmp_path}", "run.name=notes",
                 "env.id=agent_grpo/Notes-v0", "rollout.max_context_tokens=1024",
                 "run.tensorboard=false", "eval.tasks=1", EVEN]  # fmt: skip
    run = train(load_config(TrainConfig, ROOT / "configs/calculator-tiny.yaml", overrides))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)
    assert all(r["error_fraction"] == 0.0 and r["trajectories"] == 4 for r in steps)
    records = (run / "trajectories" / "step_000000.jsonl").read_text().splitlines()
    assert all("write_note" in json.loads(r)["messages"][0]["content"] for r in records)
    assert children() == before  # every server stopped


# ---- A stdio MCP server's stderr is kept as a bounded tail (the last `STDERR_TAIL_BYTES`), which
# still ends the error message when the server fails: a file kept everything.

NOISY = [sys.executable, str(Path(__file__).with_name("noisy_mcp_server.py"))]
LAST_LINE = "noisy server: cannot open its database, giving up"
NOISE_MB = 32


def largest_open_file() -> int:
    """Size in bytes of the largest regular file this process holds open (0 if none)."""
    sizes = [0]
    for fd in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            sizes.append(st.st_size)
    return max(sizes)


def test_a_noisy_servers_stderr_is_a_bounded_tail_that_ends_the_failure_message() -> None:
    client = McpClient(McpServer(command=[*NOISY, str(NOISE_MB)]))
    before = largest_open_file()
    try:
        with pytest.raises(McpServerError, match="could not start") as failed:
            client.tools()
        assert str(failed.value).endswith(f"noise \n{LAST_LINE}")
        assert largest_open_file() <= max(before, STDERR_TAIL_BYTES)  # no file holds the noise
        tail = client.stderr_tail()
        assert tail.endswith(LAST_LINE + "\n") and len(tail.encode()) == STDERR_TAIL_BYTES
    finally:
        client.close()
