"""The --html page, loaded in real headless Chromium and checked by reading its DOM: the verdict,
the tool-call table, the heatmap, low-probability tokens, the folded shared prompt, a group side
by side, the step picker, tooltips, the pass@k curves of the run's evaluations."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from agent_grpo.evaluation.heldout import EvalResult, pass_at_curve
from agent_grpo.inspect.html import (
    DEFAULT_LOW_PROB,
    MIN_SHARED_TOKENS,
    render_html,
    shared_prompt_prefixes,
    write_html,
)
from agent_grpo.inspect.pass_at_curves import PassAtCurve, run_pass_at_curves
from agent_grpo.inspect.replay import add_replay_parser
from agent_grpo.rollout.summary import summarize_trajectories
from agent_grpo.run_dir.writer import RunWriter
from agent_grpo.testing.records import calculator_record
from agent_grpo.trainer.checkpoint import TrainerState
from agent_grpo.trajectory.record import Provenance, TrajectoryRecord

ROOT = Path(__file__).resolve().parents[2]
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
WRONG = {"expected": "4", "given": "5", "success": False, "detail": "5 is not 4"}


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
    """Step 0: one group of two. Step 1: one group of two, the first with a nasty observation
    and a clipped first model token, the second with a failed tool call and a wrong answer."""
    step0 = [
        calculator_record(
            tokenizer, group_id="s0-t0", index=i, reward=float(i), advantage=2.0 * i - 1
        )
        for i in range(2)
    ]
    step1 = [
        calculator_record(
            tokenizer, step=1, group_id="s1-t0", old_shift={0: 0.5}, observation=NASTY
        ),
        calculator_record(tokenizer, step=1, group_id="s1-t0", index=1, reward=0.0, advantage=-0.5,
                    success=False, tool_error=True),
    ]  # fmt: skip
    # Whole, not split into tokens: only an unescaped page breaks on it.
    step1[0].termination.reason = NASTY
    step1[1].verifier = dict(WRONG)
    return step0 + step1


@pytest.fixture(scope="module")
def page(records: list[TrajectoryRecord], tokenizer: Any, tmp_path_factory: Any) -> Path:
    out = tmp_path_factory.mktemp("html") / "replay.html"
    return write_html(out, records, tokenizer, clip_eps=0.2, title="run-x")


EVALUATIONS = {"base": [(4, 0), (4, 1)], "warm start": [(4, 1), (4, 2)], "final": [(4, 3), (4, 4)]}
"""A training run's three evaluations, each task as (samples, correct)."""
EVAL_STEPS = {"base": 0, "warm start": 0, "final": 2}


def _evaluation(counts: list[tuple[int, int]]) -> EvalResult:
    """The EvalResult of tasks given as (samples, correct), its pass@k as `evaluate` computes it."""
    curve = pass_at_curve(counts)
    return EvalResult(
        tasks=len(counts), samples_per_task=max(curve), pass_at_k=curve[max(curve)],
        pass_at=curve, summary=summarize_trajectories([]),
    )  # fmt: skip


CURVES = [
    PassAtCurve(label, EVAL_STEPS[label], tuple(_evaluation(counts).pass_at.items()))
    for label, counts in EVALUATIONS.items()
]


def _training_run(root: Path, config_text: str, records: list[TrajectoryRecord]) -> RunWriter:
    """A training run directory as the trainer leaves one: `records` at step 0, the base and
    warm-start evaluations in every checkpoint's `state.json`, the final one as the last metrics
    row."""
    run = RunWriter.create(root, run_id="trained", config_text=config_text)
    run.write_trajectories(0, records)
    evals = {label: _evaluation(counts) for label, counts in EVALUATIONS.items()}
    state = TrainerState(step=0, eval_before=evals["base"], eval_warm_start=evals["warm start"])
    for step in (0, 2):
        folder = run.checkpoint_dir(step)
        folder.mkdir()
        (folder / "state.json").write_text(
            state.model_copy(update={"step": step}).model_dump_json()
        )
        run.record_checkpoint(folder)
        run.write_metrics(step, {"reward_mean": 0.5})  # a step's row: no evaluation in it
    run.write_metrics(2, evals["final"].row())
    return run


def _payload(html: str) -> dict[str, Any]:
    data = html.split('<script id="data" type="application/json">')[1].split("</script>")[0]
    return dict(json.loads(data))


@pytest.fixture(scope="module")
def curve_page(records: list[TrajectoryRecord], tokenizer: Any, tmp_path_factory: Any) -> Path:
    out = tmp_path_factory.mktemp("html") / "curves.html"
    return write_html(out, records, tokenizer, clip_eps=0.2, title="run-x", pass_at=CURVES)


# A DOM dump, parsed into a tree


VOID = {"input", "meta", "br", "img", "hr", "link"}


@dataclass
class Node:
    """One element of the dumped DOM."""

    tag: str
    attrs: dict[str, str]
    children: list[Node | str] = field(default_factory=list)

    @property
    def classes(self) -> list[str]:
        return self.attrs.get("class", "").split()

    @property
    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text for c in self.children)

    def iter(self) -> Iterator[Node]:
        yield self
        for child in self.children:
            if isinstance(child, Node):
                yield from child.iter()

    def find_all(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> list[Node]:
        return [
            n
            for n in self.iter()
            if (tag is None or n.tag == tag)
            and (cls is None or cls in n.classes)
            and all(n.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]

    def find(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> Node:
        found = self.find_all(tag, cls, **attrs)
        assert found, f"no <{tag} class={cls} {attrs}>"
        return found[0]

    def rows(self) -> list[list[str]]:
        """A table's rows as cell texts."""
        return [
            [c.text for c in tr.find_all() if c.tag in ("td", "th")] for tr in self.find_all("tr")
        ]

    def tokens(self) -> list[Node]:
        return self.find_all("span", "tok")


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.root = Node("#root", {})
        self._open = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self._open[-1].children.append(node)
        if tag not in VOID:
            self._open.append(node)

    def handle_endtag(self, tag: str) -> None:
        if any(n.tag == tag for n in self._open[1:]):
            while self._open.pop().tag != tag:
                pass

    def handle_data(self, data: str) -> None:
        self._open[-1].children.append(data)


def _dump_dom(chromium: str, url: str, tmp_path: Path) -> Node:
    flags = [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", url]
    result = subprocess.run([chromium, *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    builder = _TreeBuilder()
    builder.feed(result.stdout)
    return builder.root


def _record(dom: Node, uid: str) -> Node:
    return dom.find("section", "traj", data_uid=uid)


def _model_positions(record: TrajectoryRecord) -> list[int]:
    return [i for i, p in enumerate(record.provenance) if p is Provenance.MODEL]


# The payload, in Python


def test_page_is_self_contained_and_escapes_script_breakers(
    records: list[TrajectoryRecord], tokenizer: Any
) -> None:
    html = render_html(records, tokenizer)
    assert "http://" not in html and "https://" not in html and " src=" not in html
    data = html.split('<script id="data" type="application/json">')[1].split("</script>")[0]
    assert NASTY not in data  # the embedded `</script>` would end the JSON early
    payload = json.loads(data)["steps"]["1"][0]["records"][0]
    assert payload["uid"] == "s1-t0/0" and NASTY in payload["termination"]


def test_non_finite_rewards_keep_the_payload_valid_json(tokenizer: Any) -> None:
    broken = calculator_record(tokenizer, reward=float("nan"), advantage=0.0)
    broken.reward_components["verifier"] = float("-inf")
    html = render_html([broken], tokenizer)
    data = html.split('<script id="data" type="application/json">')[1].split("</script>")[0]

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON: the page's JSON.parse would fail")

    record = json.loads(data, parse_constant=refuse)["steps"]["0"][0]["records"][0]
    assert record["reward"] == "nan" and record["components"] == {"verifier": "-inf"}


def test_shared_prompt_prefixes_fold_after_the_first_appearance(tokenizer: Any) -> None:
    first = calculator_record(tokenizer, group_id="a")
    prompt = sum(p is Provenance.PROMPT for p in first.provenance)
    assert prompt > 12 >= MIN_SHARED_TOKENS

    def changed_at(i: int, group_id: str) -> TrajectoryRecord:
        ids = list(first.token_ids)
        ids[i] += 1
        return first.model_copy(update={"token_ids": ids, "group_id": group_id})

    sibling = first.model_copy(update={"index_in_group": 1})
    late, early = changed_at(12, "b"), changed_at(MIN_SHARED_TOKENS - 1, "c")
    again = late.model_copy(update={"index_in_group": 1})
    assert shared_prompt_prefixes([first, sibling, late, early, again]) == [
        None,  # its first appearance
        (prompt, "a/0"),  # a group's later member shares the whole prompt
        (12, "a/0"),  # another task shares the first 12 (the system prompt, in a real run)
        None,  # shorter than MIN_SHARED_TOKENS: a role header
        (prompt, "b/0"),  # the longest earlier match wins
    ]


def test_pass_at_curves_are_the_evaluations_the_run_recorded(tmp_path: Path) -> None:
    curves = run_pass_at_curves(_training_run(tmp_path, "steps: 2\n", []))
    assert curves == CURVES
    # By hand: 0 and 1 of 4 samples correct; pass@k of the second is 1 - C(3, k) / C(4, k).
    assert curves[0].points == ((1, 0.125), (2, 0.25), (3, 0.375), (4, 0.5))


def test_an_eval_run_has_its_one_curve(tmp_path: Path) -> None:
    run = RunWriter.create(tmp_path, run_id="eval", config_text="eval: {samples: 4}\n")
    run.write_metrics(0, _evaluation(EVALUATIONS["final"]).row())
    assert run_pass_at_curves(run) == [PassAtCurve("eval", 0, CURVES[-1].points)]


def test_a_run_without_pass_at_has_no_curve(
    tmp_path: Path, tokenizer: Any, records: list[TrajectoryRecord]
) -> None:
    # Evaluations recorded before pass@k was: no `pass_at` in state.json, no eval_pass_at_<k>.
    run = RunWriter.create(tmp_path, run_id="old", config_text="steps: 1\n")
    old = _evaluation([(1, 1)]).model_dump(mode="json")
    del old["pass_at"]
    folder = run.checkpoint_dir(0)
    folder.mkdir()
    (folder / "state.json").write_text(json.dumps({"step": 0, "eval_before": old}))
    run.record_checkpoint(folder)
    run.write_metrics(1, {"eval_pass_at_k": 1.0, "eval_success_rate": 1.0})
    assert run_pass_at_curves(run) == []
    assert run_pass_at_curves(RunWriter.create(tmp_path, run_id="none")) == []
    assert (
        _payload(render_html(records, tokenizer, pass_at=run_pass_at_curves(run)))["pass_at"] == []
    )


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_replay_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli_html_holds_every_step_and_opens_on_the_one_asked_for(
    tmp_path: Path, tokenizer: Any, embedded_model_dir: Path, records: list[TrajectoryRecord]
) -> None:
    config = f"model: {{name_or_path: {embedded_model_dir}}}\nalgo: {{scale: none}}\n"
    run = RunWriter.create(tmp_path, run_id="r", config_text=config)
    for step in (0, 1):
        run.write_trajectories(step, [r for r in records if r.step == step])
    out = tmp_path / "page.html"
    assert _cli(["replay", str(run.path), "--html", str(out), "--step", "1", "--sample", "1"]) == 0
    data = out.read_text().split('<script id="data" type="application/json">')[1]
    payload = json.loads(data.split("</script>")[0])
    assert payload["open"] == "1" and sorted(payload["steps"]) == ["0", "1"]
    [group] = payload["steps"]["1"]
    assert [r["uid"] for r in group["records"]] == ["s1-t0/1"]
    # The baseline is the whole group's under the run's `algo.scale: none`: no std divided by.
    assert group["caption"] == "advantage = r - mean (Dr. GRPO) over 2 of 2 counted: mean 0.5000"
    assert group["std"] is None
    assert _cli(["replay", str(run.path), "--html", str(out), "--step", "7"]) == 1


def test_cli_html_draws_the_runs_pass_at_curves(
    tmp_path: Path, embedded_model_dir: Path, records: list[TrajectoryRecord]
) -> None:
    config = f"steps: 2\nmodel: {{name_or_path: {embedded_model_dir}}}\n"
    run = _training_run(tmp_path, config, [r for r in records if r.step == 0])
    out = tmp_path / "page.html"
    assert _cli(["replay", str(run.path), "--html", str(out)]) == 0
    assert _payload(out.read_text())["pass_at"] == [
        {"label": c.label, "step": c.step, "points": [list(point) for point in c.points]}
        for c in CURVES
    ]


# The page, in Chromium


def test_chromium_renders_step_tokens_tooltips_and_groups(
    chromium: str, page: Path, records: list[TrajectoryRecord], tokenizer: Any, tmp_path: Path
) -> None:
    dom = _dump_dom(chromium, page.as_uri() + "#step=1", tmp_path)
    assert [o.attrs["value"] for o in dom.find_all("option")] == ["0", "1"]
    assert dom.find("h2").text == "step 1: 2 records"
    step1 = [r for r in records if r.step == 1]
    assert f"terminated ({NASTY})" in _record(dom, "s1-t0/0").find("h4").text  # text, not markup
    assert len(dom.tokens()) == sum(len(r.token_ids) for r in step1)
    first = _record(dom, "s1-t0/0").tokens()
    # The nasty observation came through as text: the decoded tokens are the record's text.
    assert "".join(t.text for t in first) == tokenizer.decode(step1[0].token_ids)
    assert NASTY in "".join(t.text for t in first)
    model_start = step1[0].turns[0].token_start
    clipped = first[model_start]
    assert clipped.classes == ["tok", "p-model", "clipped"]
    title = clipped.attrs["title"]
    assert f"#{model_start} id={step1[0].token_ids[model_start]} model p=0.9048" in title
    assert "sampler=-0.1000 old=0.4000 ref=-0.1100" in title
    assert "ratio=1.6487 adv=0.5000 CLIPPED" in title
    assert "sampler=- old=- ref=-" in first[0].attrs["title"] and "adv=-" in first[0].attrs["title"]
    assert dom.find("table", id="groups").rows() == [
        ["group", "sample 0: reward / adv", "sample 1: reward / adv"],
        ["s1-t0", "1.000 / 0.500", "0.000 / -0.500"],
    ]


def test_chromium_shows_verdict_tool_table_and_low_probability_tokens(
    chromium: str, page: Path, records: list[TrajectoryRecord], tmp_path: Path
) -> None:
    dom = _dump_dom(chromium, page.as_uri() + "#step=1", tmp_path)
    solved, wrong = _record(dom, "s1-t0/0"), _record(dom, "s1-t0/1")
    verdict = solved.find("div", "verdict")
    assert verdict.classes == ["verdict", "ok"] and verdict.attrs["data-success"] == "true"
    assert verdict.find(cls="v-expected").text == "4" and verdict.find(cls="v-given").text == "4"
    assert "reward components: verifier 1.000" in verdict.text
    verdict = wrong.find("div", "verdict")
    assert (
        verdict.classes == ["verdict", "fail"]
        and verdict.find(cls="v-outcome").text == "not solved"
    )
    assert verdict.find(cls="v-expected").text == "4" and verdict.find(cls="v-given").text == "5"
    assert verdict.find(cls="v-detail").text == WRONG["detail"]
    assert solved.find("table", "tools").rows() == [
        ["turn", "tool", "arguments", "result / error"],
        ["0", "add", '{"a": 2, "b": 2}', NASTY],  # the tool's output, as text
    ]
    errors = wrong.find("table", "tools")
    assert errors.rows()[1] == ["0", "add", '{"a": 2, "b": 2}', "[raised] division by zero"]
    assert errors.find("td", "error").text == "[raised] division by zero"
    # Low-probability tokens are marked in the text itself and listed: no hover needed.
    record = next(r for r in records if r.uid == "s1-t0/0")
    sampler = record.sampler_logprobs
    low = [i for i in _model_positions(record) if math.exp(sampler[i]) < DEFAULT_LOW_PROB]  # type: ignore[arg-type]
    assert low, "the fixture must have low-probability tokens"
    spans = solved.tokens()
    assert [int(s.attrs["data-i"]) for s in spans if "lowprob" in s.classes] == low
    listing = solved.find("p", "lowprob-list")
    assert listing.attrs["data-count"] == str(len(low))
    assert listing.text.startswith(f"{len(low)} model tokens with p < {DEFAULT_LOW_PROB}: ")
    p = math.exp(sampler[low[0]])  # type: ignore[arg-type]
    assert f"{json.dumps(spans[low[0]].text)} {p:.3f} (#{low[0]})" in listing.text


def _heat(dom: Node, uid: str) -> dict[int, str]:
    """data-heat of each shaded token of record `uid`, by token index."""
    spans = _record(dom, uid).tokens()
    return {int(s.attrs["data-i"]): s.attrs["data-heat"] for s in spans if "data-heat" in s.attrs}


def test_chromium_heatmap_shades_model_tokens(
    chromium: str, page: Path, records: list[TrajectoryRecord], tmp_path: Path
) -> None:
    record = next(r for r in records if r.uid == "s1-t0/0")
    model = _model_positions(record)
    plain = _dump_dom(chromium, page.as_uri() + "#step=1", tmp_path)
    assert _heat(plain, "s1-t0/0") == {}  # provenance colours by default
    # sampler: 1 - p, p = exp(-0.1 * (j + 1)) for model token j
    dom = _dump_dom(chromium, page.as_uri() + "#step=1&heat=sampler", tmp_path)
    expected = {i: f"{1 - math.exp(-0.1 * (j + 1)):.3f}" for j, i in enumerate(model)}
    assert _heat(dom, "s1-t0/0") == expected
    assert dom.find("input", value="sampler").attrs.get("checked") == ""
    assert "checked" not in dom.find("input", value="provenance").attrs
    shaded = _record(dom, "s1-t0/0").tokens()
    assert all(("dim" in s.classes) == (i not in model) for i, s in enumerate(shaded))
    assert shaded[model[0]].attrs["style"] == "background-color: rgba(229, 57, 53, 0.095)"
    # ratio: the clipped token (ratio e^0.5, past the clip bound) is full colour, the rest 0
    dom = _dump_dom(chromium, page.as_uri() + "#step=1&heat=ratio", tmp_path)
    assert _heat(dom, "s1-t0/0") == {i: "1.000" if j == 0 else "0.000" for j, i in enumerate(model)}
    # advantage: +0.5 and -0.5 over the step's largest |advantage| 0.5, green and red
    dom = _dump_dom(chromium, page.as_uri() + "#step=1&heat=advantage", tmp_path)
    assert set(_heat(dom, "s1-t0/0").values()) == {"1.000"}
    assert set(_heat(dom, "s1-t0/1").values()) == {"-1.000"}
    first = _record(dom, "s1-t0/1").tokens()[model[0]]
    assert first.attrs["style"] == "background-color: rgba(198, 40, 40, 1.000)"
    assert "(0.500)" in dom.find("p", id="heat-legend").text


def test_chromium_folds_the_shared_prompt_and_shows_a_group_side_by_side(
    chromium: str, page: Path, records: list[TrajectoryRecord], tmp_path: Path
) -> None:
    dom = _dump_dom(chromium, page.as_uri() + "#step=1", tmp_path)
    prompt = sum(p is Provenance.PROMPT for p in records[2].provenance)
    group = dom.find("section", "group", data_group="s1-t0")
    assert group.find("h3").text == (
        "group s1-t0: advantage = (r - mean) / std over 2 of 2 counted: mean 0.5000 "
        "std 0.7071 (unbiased)"
    )
    members = group.find("div", "members")
    assert [s.attrs["data-uid"] for s in members.find_all("section", "traj")] == [
        "s1-t0/0",
        "s1-t0/1",
    ]
    assert "repeat(2," in members.attrs["style"]
    assert _record(dom, "s1-t0/0").find_all("details") == []  # first appearance: in full
    fold = _record(dom, "s1-t0/1").find("details", "shared")
    assert "open" not in fold.attrs
    assert fold.find("summary").text == f"[{prompt} prompt tokens as in s1-t0/0]"
    assert len(fold.tokens()) == prompt


def test_chromium_opens_on_the_step_asked_for(
    chromium: str, records: list[TrajectoryRecord], tokenizer: Any, tmp_path: Path
) -> None:
    page = write_html(tmp_path / "at1.html", records, tokenizer, open_step=1)
    assert _dump_dom(chromium, page.as_uri(), tmp_path).find("h2").text == "step 1: 2 records"
    dom = _dump_dom(chromium, page.as_uri() + "#step=0", tmp_path)  # the URL still wins
    assert dom.find("h2").text == "step 0: 2 records"


def test_chromium_default_step_is_the_first(chromium: str, page: Path, tmp_path: Path) -> None:
    dom = _dump_dom(chromium, page.as_uri(), tmp_path)
    assert dom.find("h2").text == "step 0: 2 records"
    assert dom.find("table", id="groups").rows()[1] == ["s0-t0", "0.000 / -1.000", "1.000 / 1.000"]
    assert dom.find("div", id="evals").children == []  # no pass@k recorded: no chart


def test_chromium_draws_pass_at_against_k_for_each_evaluation(
    chromium: str, curve_page: Path, tmp_path: Path
) -> None:
    dom = _dump_dom(chromium, curve_page.as_uri(), tmp_path)
    chart = dom.find("section", id="pass-at")
    drawn = chart.find_all("g", "curve")
    assert [(g.attrs["data-label"], g.attrs["data-step"]) for g in drawn] == [
        ("base", "0"), ("warm start", "0"), ("final", "2"),
    ]  # fmt: skip
    dots = []
    for g, curve in zip(drawn, CURVES, strict=True):
        circles = g.find_all("circle")
        points = [(int(c.attrs["data-k"]), float(c.attrs["data-value"])) for c in circles]
        assert points == list(curve.points)  # the recorded numbers, each a point
        at = [(float(c.attrs["cx"]), float(c.attrs["cy"])) for c in circles]
        through = " ".join(f"{c.attrs['cx']},{c.attrs['cy']}" for c in circles)
        assert g.find("polyline").attrs["points"] == through  # the line joins the points
        dots += [(k, v, x, y) for (k, v), (x, y) in zip(points, at, strict=True)]
    # Drawn where they belong: one x per k, rising with k; one y per value, higher for more.
    xs = sorted({(k, x) for k, _, x, _ in dots})
    assert [k for k, _ in xs] == [1, 2, 3, 4] and all(a[1] < b[1] for a, b in pairwise(xs))
    ys = sorted({(v, y) for _, v, _, y in dots})
    assert len({v for v, _ in ys}) == len(ys) and all(a[1] > b[1] for a, b in pairwise(ys))
    assert [li.text for li in chart.find_all("li")] == [
        "base (step 0): pass@1 0.125, pass@4 0.500",
        "warm start (step 0): pass@1 0.375, pass@4 1.000",
        "final (step 2): pass@1 0.875, pass@4 1.000",
    ]
    assert dom.find("div", id="main").find("h2").text == "step 0: 2 records"  # the rest as before


# Live page, over the DevTools protocol

Evaluate = Callable[[str], Awaitable[Any]]
Call = Callable[..., Awaitable[dict[str, Any]]]


async def _session(ws_url: str, actions: Callable[[Call, Evaluate], Awaitable[Any]]) -> Any:
    """Connect to the page, wait for its script to draw the step, run `actions`."""
    import websockets

    async with websockets.connect(ws_url, max_size=None) as ws:
        ids = iter(range(1, 10_000))

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

        for _ in range(100):
            if await evaluate("!!document.querySelector('span.tok')"):
                break
            await asyncio.sleep(0.05)
        return await actions(call, evaluate)


def _in_browser(
    chromium: str, url: str, tmp_path: Path, actions: Callable[[Call, Evaluate], Awaitable[Any]]
) -> Any:
    """Open `url` in headless Chromium (1400 x 900) and run `actions` on it over CDP."""
    pytest.importorskip("websockets")
    import httpx

    profile = tmp_path / "profile-live"
    flags = [*CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
             "--window-size=1400,900"]  # fmt: skip
    browser = subprocess.Popen(
        [chromium, *flags, url], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            assert time.monotonic() < deadline, "chromium did not open its debugging port"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        return asyncio.run(_session(ws_url, actions))
    finally:
        browser.kill()
        browser.wait()


def test_chromium_hover_shows_js_tooltip(
    chromium: str, page: Path, records: list[TrajectoryRecord], tmp_path: Path
) -> None:
    index = next(r for r in records if r.step == 1).turns[0].token_start
    selector = json.dumps(f'span.tok[data-i="{index}"]')

    async def hover(call: Call, evaluate: Evaluate) -> tuple[str, str]:
        box = await evaluate(
            f"(() => {{ const e = document.querySelector({selector});"
            "e.scrollIntoView(); const r = e.getBoundingClientRect();"
            "return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        await call("Input.dispatchMouseEvent", type="mouseMoved", x=box[0], y=box[1])
        return tuple(await evaluate("[tip.textContent, getComputedStyle(tip).display]"))

    text, display = _in_browser(chromium, page.as_uri() + "#step=1", tmp_path, hover)
    assert display == "block"
    assert "ratio=1.6487 adv=0.5000 CLIPPED" in text and f"#{index} id=" in text


LAYOUT = """(() => {
  const box = e => { const r = e.getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; };
  const [a, b] = document.querySelectorAll('.group .traj');
  const low = document.querySelector('.tok.lowprob');
  const folded = document.querySelector('details.shared .tok');
  return {a: box(a), b: box(b), foldedShown: folded.checkVisibility(),
          open: folded.closest('details').open,
          decoration: getComputedStyle(low).textDecorationLine,
          decorationStyle: getComputedStyle(low).textDecorationStyle};
})()"""


def test_chromium_layout_side_by_side_folded_and_underlined(
    chromium: str, page: Path, tmp_path: Path
) -> None:
    """What the eye sees: the two members in one row, the folded prompt not drawn, low-probability
    tokens underlined; then the heatmap toggle clicked, as a person would."""

    async def look(call: Call, evaluate: Evaluate) -> tuple[dict[str, Any], Any]:
        layout = await evaluate(LAYOUT)
        await evaluate("document.querySelector('#heat input[value=ratio]').click()")
        for _ in range(100):
            heat = await evaluate(
                "[location.hash, document.querySelectorAll('[data-heat]').length]"
            )
            if heat[1]:
                break
            await asyncio.sleep(0.05)
        return layout, heat

    layout, heat = _in_browser(chromium, page.as_uri() + "#step=1", tmp_path, look)
    (ax, ay, aw, _), (bx, by, _, _) = layout["a"], layout["b"]
    assert ay == by and bx >= ax + aw  # side by side, not stacked
    assert layout["open"] is False and layout["foldedShown"] is False  # folded: not drawn
    assert layout["decoration"] == "underline" and layout["decorationStyle"] == "wavy"
    assert heat[0] == "#step=1&heat=ratio" and heat[1] > 0


def test_chromium_says_a_step_the_page_does_not_hold_is_not_there(
    chromium: str, page: Path, tmp_path: Path
) -> None:
    dom = _dump_dom(chromium, page.as_uri() + "#step=7", tmp_path)
    assert dom.find("h2").text == "step 7 is not in this page; it holds steps 0, 1"
    assert dom.find_all("table", id="groups") == []


PHONE = """(() => {
  const width = document.documentElement.clientWidth;
  const out = [...document.querySelectorAll('body *')]
    .filter(e => !e.closest('#groups'))  // the group table scrolls inside itself
    .filter(e => { const r = e.getBoundingClientRect(); return r.left < 0 || r.right > width; })
    .map(e => `${e.tagName}.${e.className}`);
  const cards = [...document.querySelectorAll('.group .traj')].map(e => e.getBoundingClientRect());
  return {width, out, scroll: document.documentElement.scrollWidth,
          stacked: cards.length === 2 && cards[1].top >= cards[0].bottom};
})()"""


@pytest.mark.parametrize("shown", ["page", "curve_page"])
def test_chromium_at_phone_width_every_card_fits_the_screen(
    chromium: str, shown: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """At 390 px (a phone), the members of a group stack, each as wide as the screen, and
    nothing reaches past its right edge, the pass@k chart included."""
    page: Path = request.getfixturevalue(shown)

    async def look(call: Call, evaluate: Evaluate) -> Any:
        await call("Emulation.setDeviceMetricsOverride", width=390, height=844,
                   deviceScaleFactor=3, mobile=True)  # fmt: skip
        await evaluate("new Promise(r => requestAnimationFrame(() => r(0)))")
        return await evaluate(PHONE)

    seen = _in_browser(chromium, page.as_uri() + "#step=1", tmp_path, look)
    assert seen["width"] == 390
    assert seen["out"] == [] and seen["scroll"] <= 390 and seen["stacked"], seen


def test_chromium_renders_a_page_of_hostile_numbers_and_text(
    chromium: str, tokenizer: Any, tmp_path: Path
) -> None:
    # a sample index of 1e9 hung the page (a column per index up to it), a pass@k of k = 5e9
    # blanked it (an array of every k), and a bidi override in a verdict reordered the fields
    # after it: now the recorded samples are the columns, ticks are counted, the override shown
    record = calculator_record(tokenizer, group_id="g", index=10**9, success=False)
    record.verifier = {"given": "\u202e4 :rewsna dilav", "detail": "ok"}
    curves = [PassAtCurve("final", 1, ((1, 0.5), (5_000_000_000, 1.0)))]
    page = write_html(tmp_path / "p.html", [record], tokenizer, clip_eps=0.2, title="r",
                      pass_at=curves)  # fmt: skip
    assert "\u202e" not in page.read_text() and "\\\\u202e4 :rewsna dilav" in page.read_text()
    dom = _dump_dom(chromium, page.as_uri(), tmp_path)
    heads = [th.text for th in dom.find("table", id="groups").find_all("th")]
    assert heads == ["group", "sample 1000000000: reward / adv"]
    ticks = dom.find("section", id="pass-at").find_all("circle")
    assert [c.attrs["data-k"] for c in ticks] == ["1", "5000000000"]


def test_a_k_no_page_can_draw_is_no_point() -> None:
    from agent_grpo.inspect.pass_at_curves import row_points

    # 400 digits reach the page's JavaScript as Infinity, and its tick loop never ended
    row = {"eval_pass_at_1": 0.25, f"eval_pass_at_{'9' * 400}": 0.5, "eval_pass_at_2": "x"}
    assert row_points(row) == ((1, 0.25),)
