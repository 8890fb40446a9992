"""`replay --html`: one self-contained HTML page (inline CSS and JS, nothing fetched when viewed).

The page embeds the selected records as JSON, grouped by step, and renders them in the browser:
a step picker (also settable as `page.html#step=N`), the step's group table (rewards and
advantages of each group's samples side by side) and every record's tokens coloured by
provenance. Each token carries a `title` tooltip with its id, provenance, logprobs, ratio and
advantage, so the page works with no JS tooltip library and can be checked from a DOM dump.
Values are computed here in Python (`replay.token_rows`), so the terminal and HTML views agree.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent_grpo.inspect.replay import DEFAULT_CLIP_EPS, PROVENANCE_STYLES, TokenRow, token_rows
from agent_grpo.trajectory import Provenance, TrajectoryRecord

__all__ = ["html_payload", "render_html", "write_html"]

_COLOURS = {
    Provenance.PROMPT: "#9e9e9e",
    Provenance.MODEL: "#2e7d32",
    Provenance.TEMPLATE: "#ad1457",
    Provenance.OBSERVATION: "#00838f",
    Provenance.PADDING: "#616161",
}
assert _COLOURS.keys() == PROVENANCE_STYLES.keys()


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


def _record_payload(record: TrajectoryRecord, tokenizer: Any, clip_eps: float) -> dict[str, Any]:
    return {
        "uid": record.uid,
        "group": record.group_id,
        "sample": record.index_in_group,
        "task": record.task_id,
        "reward": record.reward,
        "advantage": record.advantage,
        "success": record.success,
        "termination": f"{record.termination.kind} ({record.termination.reason})",
        "tool_errors": sum(c.error is not None for t in record.turns for c in t.tool_calls),
        "tokens": _tokens(token_rows(record, tokenizer, clip_eps)),
    }


def html_payload(
    records: Sequence[TrajectoryRecord], tokenizer: Any, clip_eps: float = DEFAULT_CLIP_EPS
) -> dict[str, Any]:
    """The JSON the page embeds: `{"clip_eps", "steps": {step: [record, ...]}}`."""
    steps: dict[str, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: (r.step, r.group_id, r.index_in_group)):
        steps.setdefault(str(record.step), []).append(_record_payload(record, tokenizer, clip_eps))
    return {"clip_eps": clip_eps, "steps": steps}


def _embed_json(data: Any) -> str:
    """JSON safe inside a <script> element: no `<` can close it or open a comment."""
    return json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")


_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #212121; }
.tokens { font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.6;
  border: 1px solid #ddd; padding: .6em; }
.tok { border-radius: 2px; cursor: default; }
.tok:nth-child(even) { background: rgba(0, 0, 0, .04); }
.tok:hover { outline: 1px solid #000; }
.clipped { background: #ffcdd2; outline: 1px solid #c62828; }
table { border-collapse: collapse; margin: .5em 0; }
td, th { border: 1px solid #ccc; padding: .2em .5em; text-align: right; }
.legend span { margin-right: 1em; }
#tip { position: fixed; display: none; background: #263238; color: #fff; padding: .4em .6em;
  font: 12px ui-monospace, monospace; white-space: pre; pointer-events: none; z-index: 10; }
"""

_JS = """
const DATA = JSON.parse(document.getElementById('data').textContent);
const fmt = (v, d = 4) => v === null || v === undefined ? '-' : Number(v).toFixed(d);
const el = (tag, attrs = {}, text = '') => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text) e.textContent = text;
  return e;
};
function tokenTitle(rec, i) {
  const t = rec.tokens, model = t.prov[i] === 'model';
  return `#${i} id=${t.id[i]} ${t.prov[i]}\\nsampler=${fmt(t.sampler[i])} old=${fmt(t.old[i])}` +
    ` ref=${fmt(t.ref[i])}\\nratio=${fmt(t.ratio[i])} adv=${model ? fmt(rec.advantage) : '-'}` +
    (t.clipped[i] ? ' CLIPPED' : '');
}
function groupTable(records) {
  const table = el('table', {id: 'groups'});
  const size = Math.max(...records.map(r => r.sample)) + 1;
  const head = el('tr');
  head.append(el('th', {}, 'group'));
  for (let i = 0; i < size; i++) head.append(el('th', {}, `sample ${i}: reward / adv`));
  table.append(head);
  const groups = {};
  for (const r of records) (groups[r.group] ||= []).push(r);
  for (const [gid, members] of Object.entries(groups)) {
    const row = el('tr', {'data-group': gid});
    row.append(el('td', {}, gid));
    for (let i = 0; i < size; i++) {
      const r = members.find(m => m.sample === i);
      row.append(el('td', {}, r ? `${fmt(r.reward, 3)} / ${fmt(r.advantage, 3)}` : ''));
    }
    table.append(row);
  }
  return table;
}
function recordView(rec) {
  const sec = el('section', {class: 'traj', 'data-uid': rec.uid});
  sec.append(el('h3', {}, `${rec.uid}  reward ${fmt(rec.reward, 3)}  adv ${fmt(rec.advantage, 3)}` +
    `  success ${rec.success}  ${rec.termination}  tool errors ${rec.tool_errors}`));
  const box = el('div', {class: 'tokens'});
  rec.tokens.id.forEach((id, i) => {
    const cls = 'tok p-' + rec.tokens.prov[i] + (rec.tokens.clipped[i] ? ' clipped' : '');
    const attrs = {class: cls, 'data-i': i, title: tokenTitle(rec, i)};
    box.append(el('span', attrs, rec.tokens.text[i]));
  });
  sec.append(box);
  return sec;
}
function show(step) {
  const records = DATA.steps[step] || [];
  document.getElementById('step').value = step;
  const main = document.getElementById('main');
  main.replaceChildren(el('h2', {}, `step ${step}: ${records.length} records`));
  if (records.length) main.append(groupTable(records));
  for (const rec of records) main.append(recordView(rec));
}
const picker = document.getElementById('step');
const steps = Object.keys(DATA.steps).sort((a, b) => a - b);
for (const s of steps) picker.append(el('option', {value: s}, s));
picker.addEventListener('change', () => { location.hash = 'step=' + picker.value; });
const fromHash = () => (location.hash.match(/step=(\\d+)/) || [])[1];
window.addEventListener('hashchange', () => show(fromHash() || picker.options[0].value));
show(fromHash() || (picker.options.length ? picker.options[0].value : '0'));
const tip = document.getElementById('tip');
document.addEventListener('mouseover', e => {
  if (!e.target.classList.contains('tok')) { tip.style.display = 'none'; return; }
  tip.textContent = e.target.title;
  tip.style.display = 'block';
});
document.addEventListener('mousemove', e => {
  tip.style.left = (e.clientX + 12) + 'px'; tip.style.top = (e.clientY + 12) + 'px';
});
"""


def _provenance_css() -> str:
    return "\n".join(f".p-{p.value} {{ color: {c}; }}" for p, c in _COLOURS.items())


def _legend() -> str:
    spans = "".join(f'<span class="p-{p.value}">{p.value}</span>' for p in _COLOURS)
    return f'<div class="legend">{spans}<span class="clipped">clipped</span></div>'


def render_html(
    records: Sequence[TrajectoryRecord],
    tokenizer: Any,
    *,
    clip_eps: float = DEFAULT_CLIP_EPS,
    title: str = "agent-grpo replay",
) -> str:
    """The whole page as a string."""
    from html import escape

    data = _embed_json(html_payload(records, tokenizer, clip_eps))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<style>{_CSS}{_provenance_css()}</style></head>
<body><h1>{escape(title)}</h1>
<label>step <select id="step"></select></label> {_legend()}
<p>ratio = exp(old - sampler); clipped: |ratio - 1| &gt; {clip_eps}</p>
<div id="main"></div><div id="tip"></div>
<script id="data" type="application/json">{data}</script>
<script>{_JS}</script>
</body></html>
"""


def write_html(
    path: str | Path,
    records: Sequence[TrajectoryRecord],
    tokenizer: Any,
    *,
    clip_eps: float = DEFAULT_CLIP_EPS,
    title: str = "agent-grpo replay",
) -> Path:
    """Write `render_html(...)` to `path`; return it."""
    path = Path(path)
    path.write_text(
        render_html(records, tokenizer, clip_eps=clip_eps, title=title), encoding="utf-8"
    )
    return path
