"""`replay --html`: one self-contained HTML page (inline CSS and JS, nothing fetched when viewed).

The page embeds the selected records as JSON, step by step and group by group, and renders one
step at a time in the browser (`agent_grpo.inspect.html_page` holds its CSS and script):

- above it, pass@k against k for each held-out evaluation the run recorded (base, warm start,
  final: `agent_grpo.inspect.pass_at_curves`), drawn as inline SVG; no chart when none did;
- a step picker that opens on the step asked for (`open_step`, or `page.html#step=N`);
- the step's group table, then each group's members side by side under the group's baseline
  (mean and std as the advantages used them, `agent_grpo.inspect.baseline`);
- per record: the verifier's verdict (expected and given answers), the reward components, the
  tool-call table, and every token coloured by provenance, or, with the heatmap toggle
  (`#heat=sampler|ratio|advantage`), model tokens shaded by sampler logprob, trainer/sampler
  ratio or advantage;
- model tokens the sampler gave less than `low_prob` underlined and listed, without hovering;
- the prompt tokens a record shares with one shown before it in the step (the system prompt of
  every task, the whole prompt of a group's later members) folded into a closed `<details>`.

Each token carries a `title` tooltip with its id, provenance, probability, logprobs, ratio and
advantage, so the page can be checked from a DOM dump. Values are computed here in Python
(`replay.token_rows`), so the terminal and HTML views agree.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from agent_grpo.controls import visible
from agent_grpo.inspect.baseline import GroupBaseline, group_baseline
from agent_grpo.inspect.html_page import PAGE_CSS, PAGE_JS
from agent_grpo.inspect.pass_at_curves import PassAtCurve
from agent_grpo.inspect.replay import DEFAULT_CLIP_EPS, PROVENANCE_STYLES, TokenRow, token_rows
from agent_grpo.trajectory.record import Provenance, TrajectoryRecord

__all__ = [
    "DEFAULT_LOW_PROB",
    "html_payload",
    "render_html",
    "shared_prompt_prefixes",
    "write_html",
]

DEFAULT_LOW_PROB = 0.1
"""Model tokens the sampler drew with probability below this are marked on the page."""

MIN_SHARED_TOKENS = 8
"""A shared prompt prefix shorter than this is a chat template's role header, not worth folding."""

_COLOURS = {
    Provenance.PROMPT: "#9e9e9e",
    Provenance.MODEL: "#2e7d32",
    Provenance.TEMPLATE: "#ad1457",
    Provenance.OBSERVATION: "#00838f",
    Provenance.PADDING: "#616161",
}
assert _COLOURS.keys() == PROVENANCE_STYLES.keys()

Baselines = Mapping[tuple[int, str], GroupBaseline]


def _jsonable(value: Any) -> Any:
    """`value` with each non-finite float as its name ('nan', 'inf', '-inf'): JSON has no NaN,
    and one `NaN` literal would make the page's `JSON.parse` reject the whole payload; and each
    string's control and invisible characters shown as escapes, as the terminal view shows
    them (`controls.visible`): a bidi override in a verifier's `given` reordered the fields
    after it on the page."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return visible(value)
    if isinstance(value, dict):
        return {_jsonable(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _tokens(rows: Sequence[TokenRow]) -> dict[str, list[Any]]:
    """Column-wise token arrays (smaller JSON than one object per token)."""
    return {
        "id": [r.token_id for r in rows],
        "text": [r.text for r in rows],
        "prov": [r.provenance.value for r in rows],
        "sampler": [_round(r.sampler) for r in rows],
        "old": [_round(r.old) for r in rows],
        "ref": [_round(r.ref) for r in rows],
        "ratio": [_round(r.ratio) for r in rows],
        "clipped": [int(r.clipped) for r in rows],
    }


def _tool_calls(record: TrajectoryRecord) -> list[dict[str, Any]]:
    """Every tool call of the record with its turn, as the terminal's tool-call table has it."""
    return [
        {
            "turn": turn.index,
            "name": call.name,
            "arguments": call.raw if call.arguments is None else json.dumps(call.arguments),
            "result": call.result,
            "error": call.error,
            "error_kind": call.error_kind,
        }
        for turn in record.turns
        for call in turn.tool_calls
    ]


def _prompt_length(record: TrajectoryRecord) -> int:
    """Number of leading `prompt` tokens."""
    for i, prov in enumerate(record.provenance):
        if prov is not Provenance.PROMPT:
            return i
    return len(record.provenance)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def shared_prompt_prefixes(records: Sequence[TrajectoryRecord]) -> list[tuple[int, str] | None]:
    """Per record, in the given order: (tokens, uid) when its first `tokens` prompt tokens are
    those of the earlier record `uid` (the longest such prefix, at least `MIN_SHARED_TOKENS`),
    else None. The first record with a given prompt is its first appearance: never folded."""
    seen: dict[tuple[int, ...], str] = {}  # each distinct prompt -> uid of its first record
    out: list[tuple[int, str] | None] = []
    for record in records:
        prompt = tuple(record.token_ids[: _prompt_length(record)])
        best = max(
            ((_common_prefix(prompt, other), uid) for other, uid in seen.items()),
            key=lambda found: found[0],
            default=(0, ""),
        )
        out.append(best if best[0] >= MIN_SHARED_TOKENS else None)
        seen.setdefault(prompt, record.uid)
    return out


def _record_payload(
    record: TrajectoryRecord, tokenizer: Any, clip_eps: float, shared: tuple[int, str] | None
) -> dict[str, Any]:
    return {
        "uid": record.uid,
        "group": record.group_id,
        "sample": record.index_in_group,
        "task": record.task_id,
        "reward": record.reward,
        "components": record.reward_components,
        "advantage": record.advantage,
        "success": record.success,
        "excluded": record.excluded,
        "verifier": record.verifier,
        "termination": f"{record.termination.kind} ({record.termination.reason})",
        "tool_errors": sum(c.error is not None for t in record.turns for c in t.tool_calls),
        "tool_calls": _tool_calls(record),
        "shared": None if shared is None else {"tokens": shared[0], "with": shared[1]},
        "tokens": _tokens(token_rows(record, tokenizer, clip_eps)),
        "branches": [
            {
                "branch": k,
                "parent": fork.parent,
                "fork_at": fork.fork_at,
                "reason": fork.reason,
                "tokens": _tokens(token_rows(record, tokenizer, clip_eps, k)),
            }
            for k, fork in enumerate(record.forks, start=1)
        ],
    }


def _group_payload(
    members: list[TrajectoryRecord], baseline: GroupBaseline, records: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "id": members[0].group_id,
        "caption": baseline.caption(),
        "mean": baseline.mean,
        "std": baseline.std if baseline.norm.scale == "group" else None,
        "records": records,
    }


def _step_payload(
    records: list[TrajectoryRecord], tokenizer: Any, clip_eps: float, baselines: Baselines
) -> list[dict[str, Any]]:
    """One step's groups (in order of first appearance, members by index), each with its
    baseline and its records' payloads."""
    groups: dict[str, list[TrajectoryRecord]] = {}
    for record in records:
        groups.setdefault(record.group_id, []).append(record)
    for members in groups.values():
        members.sort(key=lambda r: r.index_in_group)
    shared = iter(shared_prompt_prefixes([r for members in groups.values() for r in members]))
    out = []
    for group_id, members in groups.items():
        baseline = baselines.get((members[0].step, group_id)) or group_baseline(members)
        payloads = [_record_payload(r, tokenizer, clip_eps, next(shared)) for r in members]
        out.append(_group_payload(members, baseline, payloads))
    return out


def html_payload(
    records: Sequence[TrajectoryRecord],
    tokenizer: Any,
    clip_eps: float = DEFAULT_CLIP_EPS,
    *,
    low_prob: float = DEFAULT_LOW_PROB,
    open_step: int | None = None,
    baselines: Baselines | None = None,
    pass_at: Sequence[PassAtCurve] = (),
) -> dict[str, Any]:
    """The JSON the page embeds: `{"clip_eps", "low_prob", "open", "pass_at": [curve, ...],
    "steps": {step: [group, ...]}}`, each curve `{"label", "step", "points": [[k, pass@k],
    ...]}`, each group `{"id", "caption", "mean", "std", "records": [...]}`. A group missing
    from `baselines` gets the baseline of the records given (the GRPO default norm)."""
    by_step: dict[int, list[TrajectoryRecord]] = {}
    for record in sorted(records, key=lambda r: r.step):  # stable: groups keep the run's order
        by_step.setdefault(record.step, []).append(record)
    steps = {
        str(step): _step_payload(members, tokenizer, clip_eps, baselines or {})
        for step, members in by_step.items()
    }
    opened = None if open_step is None else str(open_step)
    curves = [{"label": c.label, "step": c.step, "points": c.points} for c in pass_at]
    return _jsonable(
        {"clip_eps": clip_eps, "low_prob": low_prob, "open": opened, "pass_at": curves,
         "steps": steps}
    )  # fmt: skip


def _embed_json(data: Any) -> str:
    """JSON safe inside a <script> element: no `<` can close it or open a comment."""
    return json.dumps(data, ensure_ascii=False, allow_nan=False).replace("<", "\\u003c")


def _provenance_css() -> str:
    return "\n".join(f".p-{p.value} {{ color: {c}; }}" for p, c in _COLOURS.items())


def _legend(low_prob: float) -> str:
    spans = "".join(f'<span class="p-{p.value}">{p.value}</span>' for p in _COLOURS)
    marks = f'<span class="clipped">clipped</span><span class="lowprob">p &lt; {low_prob}</span>'
    return f'<div class="legend">{spans}{marks}</div>'


_HEAT_MODES = {
    "provenance": "provenance",
    "sampler": "sampler logprob",
    "ratio": "trainer/sampler ratio",
    "advantage": "advantage",
}


def _heat_toggle() -> str:
    """Radio buttons choosing what colours the model tokens (the script keeps `#heat=` in sync)."""
    inputs = "".join(
        f'<label><input type="radio" name="heat" value="{mode}"{" checked" * (i == 0)}> '
        f"{label}</label>"
        for i, (mode, label) in enumerate(_HEAT_MODES.items())
    )
    return f'<fieldset id="heat"><legend>colour model tokens by</legend>{inputs}</fieldset>'


def render_html(
    records: Sequence[TrajectoryRecord],
    tokenizer: Any,
    *,
    clip_eps: float = DEFAULT_CLIP_EPS,
    title: str = "agent-grpo replay",
    low_prob: float = DEFAULT_LOW_PROB,
    open_step: int | None = None,
    baselines: Baselines | None = None,
    pass_at: Sequence[PassAtCurve] = (),
) -> str:
    """The whole page as a string (see `html_payload` for the arguments)."""
    payload = html_payload(
        records, tokenizer, clip_eps, low_prob=low_prob, open_step=open_step,
        baselines=baselines, pass_at=pass_at,
    )  # fmt: skip
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>{escape(title)}</title>
<style>{PAGE_CSS}{_provenance_css()}</style></head>
<body><h1>{escape(title)}</h1>
<div id="evals"></div>
<label>step <select id="step"></select></label> {_legend(low_prob)}
{_heat_toggle()}<p id="heat-legend"></p>
<p>ratio = exp(old - sampler); clipped: |ratio - 1| &gt; {clip_eps}</p>
<div id="main"></div><div id="tip"></div>
<script id="data" type="application/json">{_embed_json(payload)}</script>
<script>{PAGE_JS}</script>
</body></html>
"""


def write_html(
    path: str | Path, records: Sequence[TrajectoryRecord], tokenizer: Any, **options: Any
) -> Path:
    """Write `render_html(records, tokenizer, **options)` to `path` as UTF-8; return it."""
    path = Path(path)
    path.write_text(render_html(records, tokenizer, **options), encoding="utf-8")
    return path
