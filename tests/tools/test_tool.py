"""agent_grpo.tools.tool: schema from signature, validation, timeouts, errors, size caps."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field

from agent_grpo.tools.tool import (
    Tool,
    arun_tool_call,
    check_tool_name,
    format_tool_result,
    result_to_text,
    run_tool_call,
    tool,
)
from agent_grpo.trajectory.record import ToolCallRecord

TIMEOUT_SLACK_S = 0.5


@tool
def add(a: int, b: Annotated[int, Field(description="Second addend.")] = 2) -> int:
    """Add two integers.

    This paragraph is not part of the description.

    Args:
        a (int): First addend,
            on two lines.
        b: Ignored, the Annotated description wins.

    Returns:
        The sum.
    """
    return a + b


@tool(name="lookup", timeout_s=2.0, max_output_chars=50)
async def lookup_async(key: str, limit: int | None = None) -> dict[str, Any]:
    """Look a key up."""
    await asyncio.sleep(0)
    return {"key": key, "limit": limit}


def test_schema_from_signature_is_the_openai_function_form() -> None:
    assert add.json_schema() == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "First addend, on two lines."},
                    "b": {"type": "integer", "description": "Second addend.", "default": 2},
                },
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    }


def test_decorator_forms_and_tool_fields() -> None:
    assert isinstance(add, Tool) and isinstance(lookup_async, Tool)
    assert (add.name, add.is_async, add.timeout_s, add.max_output_chars) == ("add", False, 10, 8000)
    assert (lookup_async.name, lookup_async.is_async, lookup_async.timeout_s) == ("lookup", True, 2)
    assert add(3, b=4) == 7  # still callable directly
    params = lookup_async.json_schema()["function"]["parameters"]
    assert params["required"] == ["key"]
    assert params["properties"]["limit"]["anyOf"] == [{"type": "integer"}, {"type": "null"}]


def test_arguments_need_annotations_and_names() -> None:
    def unannotated(x):
        return x

    def star(*xs: int) -> int:
        return 0

    with pytest.raises(TypeError, match="needs a type annotation"):
        tool(unannotated)
    with pytest.raises(TypeError, match="must be a named argument"):
        tool(star)


def test_valid_call_returns_text_and_latency() -> None:
    record = run_tool_call(add, {"a": 40}, raw="<tool_call>...")
    assert record.result == "42" and record.error is None and record.error_kind is None
    assert record.raw == "<tool_call>..." and record.arguments == {"a": 40}
    assert record.latency_s > 0
    assert format_tool_result(record) == "42"


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"a": "forty"}, "argument 'a': Input should be a valid integer"),
        ({}, "missing required argument 'a'"),
        ({"a": 1, "c": 3}, "unexpected argument 'c'"),
        ({"a": [1]}, "argument 'a': Input should be a valid integer"),
    ],
)
def test_invalid_arguments_name_the_field(arguments: dict[str, Any], expected: str) -> None:
    record = run_tool_call(add, arguments)
    assert record.error_kind == "invalid_arguments" and record.result is None
    assert expected in (record.error or "")
    text = format_tool_result(record)
    assert text.startswith("Error: ") and "Expected arguments: a (integer, required)" in text


def test_non_object_arguments_are_invalid() -> None:
    record = run_tool_call(add, [1, 2])  # type: ignore[arg-type]
    assert record.error_kind == "invalid_arguments" and "must be a JSON object" in (
        record.error or ""
    )
    assert record.arguments is None


def test_lax_validation_coerces_numeric_strings() -> None:
    assert run_tool_call(add, {"a": "3", "b": 4}).result == "7"


def test_async_tool_in_sync_and_async_callers() -> None:
    expected = '{"key": "k", "limit": 3}'
    assert run_tool_call(lookup_async, {"key": "k", "limit": 3}).result == expected
    assert asyncio.run(arun_tool_call(lookup_async, {"key": "k", "limit": 3})).result == expected
    assert asyncio.run(arun_tool_call(add, {"a": 1, "b": 1})).result == "2"


def test_run_tool_call_from_a_running_loop_and_its_worker_threads() -> None:
    async def main() -> list[ToolCallRecord]:
        in_thread = await asyncio.to_thread(run_tool_call, lookup_async, {"key": "t"})
        on_loop = run_tool_call(lookup_async, {"key": "l"})  # blocks the loop, but works
        return [in_thread, on_loop]

    records = asyncio.run(main())
    assert [r.result for r in records] == [
        '{"key": "t", "limit": null}',
        '{"key": "l", "limit": null}',
    ]


def test_raising_tool_reports_type_and_message() -> None:
    @tool
    def explode(x: int) -> str:
        """Fail."""
        raise ValueError(f"bad x={x}")

    @tool
    def leave() -> str:
        """Call sys.exit, which must not escape either."""
        raise SystemExit(3)

    record = run_tool_call(explode, {"x": 7})
    assert record.error_kind == "raised"
    assert record.error == "tool explode raised ValueError: bad x=7"
    assert format_tool_result(record) == "Error: tool explode raised ValueError: bad x=7"
    assert run_tool_call(leave, {}).error_kind == "raised"
    assert asyncio.run(arun_tool_call(explode, {"x": 1})).error_kind == "raised"


def _timed_run(t: Tool) -> tuple[ToolCallRecord, float]:
    start = time.perf_counter()
    record = run_tool_call(t, {})
    return record, time.perf_counter() - start


def _timed_arun(t: Tool) -> tuple[ToolCallRecord, float]:
    """Time inside the loop: asyncio.run's own teardown waits for the abandoned task."""

    async def main() -> tuple[ToolCallRecord, float]:
        start = time.perf_counter()
        record = await arun_tool_call(t, {})
        return record, time.perf_counter() - start

    return asyncio.run(main())


def _assert_timed_out(record: ToolCallRecord, elapsed: float, *, timeout_s: float) -> None:
    assert record.error_kind == "timeout" and record.result is None
    assert f"timed out after {timeout_s:g} s" in (record.error or "")
    assert timeout_s <= elapsed < timeout_s + TIMEOUT_SLACK_S


def test_hanging_sync_tool_is_abandoned_at_its_timeout() -> None:
    release = threading.Event()

    @tool(timeout_s=0.3)
    def hang() -> str:
        """Block until released."""
        release.wait(30)
        return "late"

    try:
        for run in (_timed_run, _timed_arun):
            _assert_timed_out(*run(hang), timeout_s=0.3)
    finally:
        release.set()


def test_hanging_async_tools_time_out_even_when_swallowing_cancellation() -> None:
    @tool(timeout_s=0.3)
    async def stubborn() -> str:
        """Ignore the first cancellation."""
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(1.0)
        return "late"

    @tool(timeout_s=0.3)
    async def blocks_its_loop() -> str:
        """Block the event loop without awaiting."""
        time.sleep(1.0)
        return "late"

    _assert_timed_out(*_timed_run(stubborn), timeout_s=0.3)
    _assert_timed_out(*_timed_arun(stubborn), timeout_s=0.3)
    # Only the thread-based runner can abandon a coroutine that never yields to its loop.
    _assert_timed_out(*_timed_run(blocks_its_loop), timeout_s=0.3)


def test_oversized_result_is_an_error_naming_length_and_limit() -> None:
    @tool(max_output_chars=10)
    def chatty(n: int) -> str:
        """Return n characters."""
        return "x" * n

    assert run_tool_call(chatty, {"n": 10}).result == "x" * 10
    record = run_tool_call(chatty, {"n": 11})
    assert record.error_kind == "oversized" and record.result is None
    assert "returned 11 characters; the limit is 10" in (record.error or "")
    # JSON of a dict is measured too: {"key": "kkkk...", "limit": null} is over 50 characters.
    assert run_tool_call(lookup_async, {"key": "k" * 40}).error_kind == "oversized"


def test_result_to_text() -> None:
    class Point(BaseModel):
        x: int

    assert result_to_text("é") == "é"
    assert result_to_text({"a": [1, "é"]}) == '{"a": [1, "é"]}'
    assert result_to_text(None) == "null"
    assert result_to_text(Point(x=1)) == '{"x":1}'
    assert result_to_text(3.5) == "3.5"
    assert result_to_text(range(2)) == "range(0, 2)"  # anything else: str()


def test_format_tool_result_never_doubles_the_error_prefix() -> None:
    record = ToolCallRecord(name="x", error="Error: unknown tool x", error_kind="unknown_tool")
    assert format_tool_result(record) == "Error: unknown tool x"
    assert format_tool_result(ToolCallRecord(name="x", result="")) == ""


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "it is empty"),
        ("n" * 65, "65 characters long"),
        ("<|im_end|>", "holds '<'"),
        ("<｜tool▁sep｜>", "holds '<'"),
        ("[TOOL_CALLS]", "holds '['"),
        ("two words", "holds ' '"),
        ("line\nbreak", "holds '\\n'"),
        ('say"hi"', "holds '\"'"),
        ("a>b", "holds '>'"),
        ("é", "holds 'é'"),
    ],
)
def test_a_tool_name_that_could_read_as_template_text_is_refused(name: str, why: str) -> None:
    with pytest.raises(ValueError) as error:
        check_tool_name(name)
    message = str(error.value)
    assert "\n" not in message and message.startswith("tool name ") and why in message


def test_tool_refuses_such_a_name_where_the_tool_is_made() -> None:
    def fn(x: int) -> int:
        """Identity."""
        return x

    with pytest.raises(ValueError) as error:
        tool(name="<|im_end|>")(fn)
    assert str(error.value).startswith("tool name '<|im_end|>' cannot be used: it holds '<'")


def test_names_of_letters_digits_and_punctuation_are_fine() -> None:
    for name in ("calculator", "http_get", "notes.read", "v2-search", "A" * 64):
        check_tool_name(name)
