"""The --html page, loaded in real headless Chromium: tokens, tooltips, group table, step picker."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from test_store import make_record

from agent_grpo.inspect.html import render_html, write_html
from agent_grpo.trajectory import TrajectoryRecord

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
NASTY = "</script><b>not bold</b><!-- x"


@pytest.fixture(scope="module")
def chromium() -> str:
    """Path of Debian's chromium, installed by scripts/install-chromium.sh when missing."""
    if shutil.which("chromium") is None:
        script = ROOT / "scripts/install-chromium.sh"
        result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600)
        if result.returncode != 0 or shutil.which("chromium") is None:
            pytest.skip(f"chromium not installed and {script.name} failed: {result.stderr[-300:]}")
    return str(shutil.which("chromium"))


@pytest.fixture(scope="module")
def records(tokenizer: Any) -> list[TrajectoryRecord]:
    """Two steps: step 0 has one group of two, step 1 one group with a nasty observation."""
    step0 = [
        make_record(tokenizer, group_id="s0-t0", index=i, reward=float(i), advantage=2.0 * i - 1)
        for i in range(2)
    ]
    step1 = [
        make_record(tokenizer, step=1, group_id="s1-t0", old_shift={0: 0.5}, observation=NASTY),
        make_record(tokenizer, step=1, group_id="s1-t0", index=1, reward=0.0, advantage=-0.5),
    ]
    # Whole, not split into tokens: only an unescaped page breaks on it.
    step1[0].termination.reason = NASTY
    return step0 + step1


@pytest.fixture(scope="module")
def page(records: list[TrajectoryRecord], tokenizer: Any, tmp_path_factory: Any) -> Path:
    out = tmp_path_factory.mktemp("html") / "replay.html"
    return write_html(out, records, tokenizer, clip_eps=0.2, title="run-x")


class _DomSummary(HTMLParser):
    """Collects token spans (attrs + text), option values, group-table rows and headings."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[dict[str, str]] = []
        self.options: list[str] = []
        self.rows: list[list[str]] = []
        self.headings: list[str] = []
        self._open: list[tuple[str, dict[str, str]]] = []
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._open.append((tag, {k: v or "" for k, v in attrs}))
        self._text.append("")
        if tag == "tr":
            self.rows.append([])

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            (open_tag, attrs), text = self._open.pop(), self._text.pop()
            if self._text:
                self._text[-1] += text
            if open_tag == tag:
                break
        if tag == "span" and "tok" in attrs.get("class", "").split():
            self.tokens.append({**attrs, "text": text})
        elif tag == "option":
            self.options.append(attrs["value"])
        elif tag in ("td", "th") and self.rows:
            self.rows[-1].append(text)
        elif tag in ("h2", "h3"):
            self.headings.append(text)

    def handle_data(self, data: str) -> None:
        if self._text:
            self._text[-1] += data


def _dump_dom(chromium: str, url: str, tmp_path: Path) -> _DomSummary:
    flags = [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", url]
    result = subprocess.run([chromium, *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = _DomSummary()
    summary.feed(result.stdout)
    return summary


def test_page_is_self_contained_and_escapes_script_breakers(
    records: list[TrajectoryRecord], tokenizer: Any
) -> None:
    html = render_html(records, tokenizer)
    assert "http://" not in html and "https://" not in html and " src=" not in html
    data = html.split('<script id="data" type="application/json">')[1].split("</script>")[0]
    assert NASTY not in data  # the embedded `</script>` would end the JSON early
    payload = json.loads(data)["steps"]["1"][0]
    assert payload["uid"] == "s1-t0/0" and NASTY in payload["termination"]


def test_chromium_renders_step_tokens_tooltips_and_groups(
    chromium: str, page: Path, records: list[TrajectoryRecord], tokenizer: Any, tmp_path: Path
) -> None:
    dom = _dump_dom(chromium, page.as_uri() + "#step=1", tmp_path)
    assert dom.options == ["0", "1"]
    assert dom.headings[0] == "step 1: 2 records"
    assert f"terminated ({NASTY})" in dom.headings[1]  # as text, not markup
    step1 = [r for r in records if r.step == 1]
    assert len(dom.tokens) == sum(len(r.token_ids) for r in step1)
    first = dom.tokens[: len(step1[0].token_ids)]
    # The nasty observation came through as text: the decoded tokens are the record's text.
    assert "".join(t["text"] for t in first) == tokenizer.decode(step1[0].token_ids)
    assert NASTY in "".join(t["text"] for t in first)
    model_start = step1[0].turns[0].token_start
    clipped = first[model_start]
    assert clipped["class"].split() == ["tok", "p-model", "clipped"]
    title = clipped["title"]
    assert f"#{model_start} id={step1[0].token_ids[model_start]} model" in title
    assert "sampler=-0.1000 old=0.4000 ref=-0.1100" in title
    assert "ratio=1.6487 adv=0.5000 CLIPPED" in title
    assert "sampler=- old=- ref=-" in first[0]["title"] and "adv=-" in first[0]["title"]
    assert dom.rows[0] == ["group", "sample 0: reward / adv", "sample 1: reward / adv"]
    assert dom.rows[1] == ["s1-t0", "1.000 / 0.500", "0.000 / -0.500"]


def test_chromium_default_step_is_the_first(chromium: str, page: Path, tmp_path: Path) -> None:
    dom = _dump_dom(chromium, page.as_uri(), tmp_path)
    assert dom.headings[0] == "step 0: 2 records"
    assert dom.rows[1] == ["s0-t0", "0.000 / -1.000", "1.000 / 1.000"]


async def _hover_tooltip(ws_url: str, selector: str) -> tuple[str, str]:
    """Move the mouse over `selector` via CDP; return (tooltip text, its display)."""
    import websockets

    async with websockets.connect(ws_url, max_size=None) as ws:
        ids = iter(range(1, 1000))

        async def call(method: str, **params: Any) -> dict[str, Any]:
            msg_id = next(ids)
            await ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
            while True:
                reply = json.loads(await ws.recv())
                if reply.get("id") == msg_id:
                    return reply.get("result", {})

        async def evaluate(expr: str) -> Any:
            result = await call("Runtime.evaluate", expression=expr, returnByValue=True)
            return result["result"].get("value")

        for _ in range(100):  # wait for the page script to build the token spans
            if await evaluate(f"!!document.querySelector({json.dumps(selector)})"):
                break
            await asyncio.sleep(0.05)
        box = await evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            "e.scrollIntoView(); const r = e.getBoundingClientRect();"
            "return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        await call("Input.dispatchMouseEvent", type="mouseMoved", x=box[0], y=box[1])
        tip = await evaluate("[tip.textContent, getComputedStyle(tip).display]")
        return tip[0], tip[1]


def test_chromium_hover_shows_js_tooltip(
    chromium: str, page: Path, records: list[TrajectoryRecord], tmp_path: Path
) -> None:
    pytest.importorskip("websockets")
    profile = tmp_path / "profile"
    flags = [*CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0"]
    browser = subprocess.Popen(
        [chromium, *flags, page.as_uri() + "#step=1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            assert time.monotonic() < deadline, "chromium did not open its debugging port"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        import httpx

        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        index = next(r for r in records if r.step == 1).turns[0].token_start
        text, display = asyncio.run(_hover_tooltip(ws_url, f'span.tok[data-i="{index}"]'))
    finally:
        browser.kill()
        browser.wait()
    assert display == "block"
    assert "ratio=1.6487 adv=0.5000 CLIPPED" in text and f"#{index} id=" in text
