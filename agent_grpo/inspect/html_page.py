"""The replay page's stylesheet and script, inlined by `agent_grpo.inspect.html` (no network).

The script reads the JSON payload from `<script id="data">` and draws one step at a time. Its
state lives in the URL fragment, `#step=N&heat=MODE`, so a link (or a headless browser's
`--dump-dom`) opens exactly one view. Heatmap intensities, each in [-1, 1], per model token:

- `sampler`: 1 - p, p = exp(sampler logprob): white where the sampler was sure, red where the
  token was improbable;
- `ratio`: log(ratio) over the log of the clip bound on its side (log(1 + eps) above 1,
  |log(1 - eps)| below), clamped: full colour exactly where a token is flagged clipped; red where
  the trainer gives the token more probability than the sampler did, blue less;
- `advantage`: the record's advantage over the largest |advantage| of the step: green positive,
  red negative.

Each shaded token carries its intensity as `data-heat` (3 decimals), the number the colour's
alpha is made of, so a DOM dump shows what the eye sees.

The pass@k chart is inline SVG drawn by the script (no chart library): one line per evaluation,
k on the x axis from 1 to the largest recorded, pass@k on the y axis from 0 to 1. Each point
carries its recorded numbers as `data-k` and `data-value`, and the legend under the chart says
each curve's pass@1 and its last pass@k in words.
"""

from __future__ import annotations

__all__ = ["PAGE_CSS", "PAGE_JS"]

PAGE_CSS = r"""
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #212121; }
.tokens { font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.6;
  border: 1px solid #ddd; padding: .6em; }
.tok { border-radius: 2px; cursor: default; }
.tok:nth-child(even) { background: rgba(0, 0, 0, .04); }
.tok:hover { outline: 1px solid #000; }
.clipped { background: #ffcdd2; outline: 1px solid #c62828; }
.lowprob { text-decoration: underline wavy #d50000; text-underline-offset: 3px; }
.dim { opacity: .4; }
table { border-collapse: collapse; margin: .5em 0; }
td, th { border: 1px solid #ccc; padding: .2em .5em; text-align: right; vertical-align: top; }
table.tools td, table.tools th { text-align: left; }
table.tools td { font-family: ui-monospace, monospace; white-space: pre-wrap;
  word-break: break-word; }
td.error { color: #c62828; }
.legend span { margin-right: 1em; display: inline-block; }  /* a narrow screen wraps them */
.members { display: grid; gap: 1em; overflow-x: auto; }
.traj { min-width: 0; }
.verdict { padding: .3em .6em; border-left: 4px solid #9e9e9e; background: #fafafa; }
.verdict.ok { border-color: #2e7d32; }
.verdict.fail { border-color: #c62828; }
.verdict code { background: #eceff1; padding: 0 .3em; }
details.shared { display: inline; color: #757575; }
details.shared summary { display: inline; cursor: pointer; font-style: italic; }
#heat { display: inline-block; margin: .5em 0; }
.tokens, .verdict { overflow-wrap: anywhere; }
@media (max-width: 40em) {  /* a phone: the members of a group stack, each as wide as the screen */
  body { margin: .5em; }
  .members { grid-template-columns: minmax(0, 1fr) !important; }
  table { display: block; overflow-x: auto; max-width: 100%; }
}
#pass-at svg { width: 100%; max-width: 30em; height: auto; display: block; }
#pass-at .axis { stroke: #9e9e9e; }
#pass-at text { font-size: 11px; fill: #424242; }
#pass-at polyline { fill: none; stroke-width: 2; }
#pass-at li span.swatch { display: inline-block; width: 1em; height: .6em; margin-right: .4em; }
#tip { position: fixed; display: none; background: #263238; color: #fff; padding: .4em .6em;
  font: 12px ui-monospace, monospace; white-space: pre; pointer-events: none; z-index: 10; }
"""

PAGE_JS = r"""
const DATA = JSON.parse(document.getElementById('data').textContent);
const HEAT_LEGENDS = {
  provenance: '',
  sampler: 'model tokens: red = improbable under the sampler (alpha = 1 - p)',
  ratio: 'model tokens: red = trainer above sampler, blue = below; full colour at the clip bound',
  advantage: 'model tokens: green = positive advantage, red = negative; full colour at the ' +
    "step's largest |advantage|",
};
const PALETTES = {sampler: [[229, 57, 53], [229, 57, 53]], ratio: [[229, 57, 53], [30, 136, 229]],
  advantage: [[46, 125, 50], [198, 40, 40]]};
// Non-finite numbers arrive as their names: JSON has no NaN.
const num = v => v === null || v === undefined ? null :
  typeof v === 'string' ? Number(v.replace('inf', 'Infinity')) : v;
const fmt = (v, d = 4) => num(v) === null ? '-' : Number(num(v)).toFixed(d);
const el = (tag, attrs = {}, text = '') => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text) e.textContent = text;
  return e;
};
function params() {
  const out = {};
  for (const part of location.hash.slice(1).split('&')) {
    const [k, v] = part.split('=');
    if (k) out[k] = decodeURIComponent(v || '');
  }
  return out;
}
function setParams(update) {
  const p = {...params(), ...update};
  location.hash = Object.entries(p).map(([k, v]) => `${k}=${encodeURIComponent(v)}`).join('&');
}
const prob = lp => num(lp) === null ? null : Math.exp(num(lp));
function tokenTitle(rec, i) {
  const t = rec.tokens, model = t.prov[i] === 'model';
  const p = model && prob(t.sampler[i]) !== null ? ` p=${fmt(prob(t.sampler[i]))}` : '';
  return `#${i} id=${t.id[i]} ${t.prov[i]}${p}\nsampler=${fmt(t.sampler[i])} old=${fmt(t.old[i])}` +
    ` ref=${fmt(t.ref[i])}\nratio=${fmt(t.ratio[i])} adv=${model ? fmt(rec.advantage) : '-'}` +
    (t.clipped[i] ? ' CLIPPED' : '');
}
// Heat of token i of rec under mode, in [-1, 1]; null off model tokens or without a value.
function heat(mode, rec, i, advScale) {
  const t = rec.tokens;
  if (t.prov[i] !== 'model') return null;
  if (mode === 'sampler') return prob(t.sampler[i]) === null ? null : 1 - prob(t.sampler[i]);
  if (mode === 'ratio') {
    const ratio = num(t.ratio[i]);
    if (ratio === null || !(ratio > 0)) return null;
    const log = Math.log(ratio);
    const bound = Math.abs(Math.log(log >= 0 ? 1 + DATA.clip_eps : 1 - DATA.clip_eps));
    return Math.max(-1, Math.min(1, log / bound));
  }
  if (mode === 'advantage') {
    const adv = num(rec.advantage);
    return adv === null || !isFinite(adv) ? null : advScale > 0 ? adv / advScale : 0;
  }
  return null;
}
function heatColour(mode, v) {
  const [r, g, b] = PALETTES[mode][v >= 0 ? 0 : 1];
  return `rgba(${r}, ${g}, ${b}, ${Math.abs(v).toFixed(3)})`;
}
// SVG's namespace, read off a parsed <svg> rather than written out: the page holds no URL.
const SVG_NS = (() => {
  const probe = document.createElement('div');
  probe.innerHTML = '<svg></svg>';
  return probe.firstChild.namespaceURI;
})();
const svgEl = (tag, attrs = {}, text = '') => {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text) e.textContent = text;
  return e;
};
const CURVE_COLOURS = ['#1565c0', '#ef6c00', '#2e7d32', '#6a1b9a', '#c62828', '#00838f'];
// The chart's box in SVG units: the plot inside the margins, k = 1 at the left edge.
const CHART = {width: 360, height: 200, left: 40, right: 12, top: 10, bottom: 34};
// About 8 ticks, so the labels do not overlap, and the last k; counted, not filtered out of
// every k (a recorded k of 5e9 made an array too long to exist).
const kTicks = most => {
  if (!Number.isFinite(most)) return [];
  const ticks = [];
  for (let k = 1; k <= most; k += Math.ceil(most / 8)) ticks.push(k);
  return ticks[ticks.length - 1] === most ? ticks : [...ticks, most];
};
function passAtChart(curves) {
  const c = CHART, most = Math.max(...curves.flatMap(cv => cv.points.map(([k]) => k)));
  const x = k => c.left + (most === 1 ? 0.5 : (k - 1) / (most - 1)) * (c.width - c.left - c.right);
  const y = v => c.top + (1 - v) * (c.height - c.top - c.bottom);
  const svg = svgEl('svg', {viewBox: `0 0 ${c.width} ${c.height}`, role: 'img',
    'aria-label': 'pass@k against k'});
  svg.append(svgEl('line', {class: 'axis', x1: c.left, y1: y(0), x2: c.width - c.right, y2: y(0)}),
    svgEl('line', {class: 'axis', x1: c.left, y1: y(0), x2: c.left, y2: y(1)}));
  for (const v of [0, 0.5, 1])
    svg.append(svgEl('text', {x: c.left - 6, y: y(v) + 4, 'text-anchor': 'end'}, v.toFixed(1)));
  for (const k of kTicks(most))
    svg.append(svgEl('text', {x: x(k), y: y(0) + 14, 'text-anchor': 'middle'}, String(k)));
  svg.append(svgEl('text', {x: (c.left + c.width - c.right) / 2, y: c.height - 4,
    'text-anchor': 'middle'}, 'k (samples per task)'));
  curves.forEach((curve, i) => {
    const colour = CURVE_COLOURS[i % CURVE_COLOURS.length];
    const g = svgEl('g', {class: 'curve', 'data-label': curve.label, 'data-step': curve.step,
      stroke: colour, fill: colour});
    const line = curve.points.map(([k, v]) => `${x(k)},${y(v)}`).join(' ');
    g.append(svgEl('polyline', {points: line}));
    for (const [k, v] of curve.points) {
      const dot = svgEl('circle', {cx: x(k), cy: y(v), r: 3, 'data-k': k, 'data-value': v});
      dot.append(svgEl('title', {}, `${curve.label}: pass@${k} = ${fmt(v, 3)}`));
      g.append(dot);
    }
    svg.append(g);
  });
  return svg;
}
function passAtLegend(curves) {
  const list = el('ul');
  curves.forEach((curve, i) => {
    const [k1, v1] = curve.points[0], [kn, vn] = curve.points[curve.points.length - 1];
    const item = el('li', {'data-label': curve.label});
    item.append(el('span', {class: 'swatch',
      style: `background: ${CURVE_COLOURS[i % CURVE_COLOURS.length]}`}));
    const last = kn === k1 ? '' : `, pass@${kn} ${fmt(vn, 3)}`;
    item.append(`${curve.label} (step ${curve.step}): pass@${k1} ${fmt(v1, 3)}${last}`);
    list.append(item);
  });
  return list;
}
function showPassAt() {
  const curves = DATA.pass_at || [];
  if (!curves.length) return;  // a run without pass@k: no chart, not an empty one
  const sec = el('section', {id: 'pass-at'});
  sec.append(el('h2', {}, 'pass@k on held-out tasks'), passAtChart(curves), passAtLegend(curves));
  document.getElementById('evals').replaceChildren(sec);
}
function groupTable(groups) {
  const table = el('table', {id: 'groups'});
  // the samples recorded, not every index up to the largest (one of 1e9 hung the page)
  const samples = [...new Set(groups.flatMap(g => g.records.map(r => r.sample)))]
    .sort((a, b) => a - b);
  const head = el('tr');
  head.append(el('th', {}, 'group'));
  for (const i of samples) head.append(el('th', {}, `sample ${i}: reward / adv`));
  table.append(head);
  for (const group of groups) {
    const row = el('tr', {'data-group': group.id});
    row.append(el('td', {}, group.id));
    for (const i of samples) {
      const r = group.records.find(m => m.sample === i);
      row.append(el('td', {}, r ? `${fmt(r.reward, 3)} / ${fmt(r.advantage, 3)}` : ''));
    }
    table.append(row);
  }
  return table;
}
function code(cls, value) {
  return el('code', {class: cls}, value === null || value === undefined ? '(none)' : String(value));
}
function verdictView(rec) {
  const v = rec.verifier || {};
  const known = 'success' in v;
  const box = el('div', {class: 'verdict ' + (!known ? 'none' : v.success ? 'ok' : 'fail'),
    'data-success': known ? String(v.success) : ''});
  box.append(el('b', {}, 'verdict '));
  if (!Object.keys(v).length) {
    box.append(el('span', {class: 'v-outcome'}, `none: ${rec.termination}`));
    return box;
  }
  box.append(el('span', {class: 'v-outcome'}, known ? (v.success ? 'solved' : 'not solved') : '?'));
  box.append(' expected ', code('v-expected', v.expected), ' given ', code('v-given', v.given));
  if (v.detail) box.append(' ', el('span', {class: 'v-detail'}, v.detail));
  const shown = ['success', 'expected', 'given', 'detail'];
  for (const [k, value] of Object.entries(v).filter(([k]) => !shown.includes(k)))
    box.append(` ${k}=${typeof value === 'object' ? JSON.stringify(value) : value}`);
  const parts = Object.entries(rec.components || {}).map(([k, value]) => `${k} ${fmt(value, 3)}`);
  if (parts.length)
    box.append(el('div', {class: 'components'}, 'reward components: ' + parts.join(', ')));
  return box;
}
function toolTable(rec) {
  if (!rec.tool_calls.length) return el('p', {class: 'no-tools'}, 'no tool calls');
  const table = el('table', {class: 'tools'});
  const head = el('tr');
  for (const h of ['turn', 'tool', 'arguments', 'result / error']) head.append(el('th', {}, h));
  table.append(head);
  for (const call of rec.tool_calls) {
    const row = el('tr');
    row.append(el('td', {}, String(call.turn)), el('td', {}, call.name),
      el('td', {}, call.arguments));
    row.append(call.error === null
      ? el('td', {class: 'result'}, call.result || '')
      : el('td', {class: 'error'}, `[${call.error_kind}] ${call.error}`));
    table.append(row);
  }
  return table;
}
function isLow(rec, i) {
  const p = prob(rec.tokens.sampler[i]);
  return rec.tokens.prov[i] === 'model' && p !== null && p < DATA.low_prob;
}
function lowProbList(rec) {
  const low = rec.tokens.id.map((_, i) => i).filter(i => isLow(rec, i));
  const shown = low.slice(0, 20).map(i =>
    `${JSON.stringify(rec.tokens.text[i])} ${fmt(prob(rec.tokens.sampler[i]), 3)} (#${i})`);
  const more = low.length > 20 ? `, ... ${low.length - 20} more` : '';
  const text = `${low.length} model tokens with p < ${DATA.low_prob}`;
  return el('p', {class: 'lowprob-list', 'data-count': low.length},
    text + (low.length ? ': ' + shown.join(', ') + more : ''));
}
function tokenSpan(rec, i, mode, advScale) {
  const t = rec.tokens;
  let cls = 'tok p-' + t.prov[i] + (t.clipped[i] ? ' clipped' : '');
  if (isLow(rec, i)) cls += ' lowprob';
  const attrs = {'data-i': i, title: tokenTitle(rec, i)};
  if (mode !== 'provenance') {
    const v = heat(mode, rec, i, advScale);
    if (v === null) cls += ' dim';
    else Object.assign(attrs, {'data-heat': v.toFixed(3),
      style: `background-color: ${heatColour(mode, v)}`});
  }
  return el('span', {class: cls, ...attrs}, t.text[i]);
}
function tokensView(rec, mode, advScale) {
  const box = el('div', {class: 'tokens'});
  const shared = rec.shared ? rec.shared.tokens : 0;
  if (shared) {
    const fold = el('details', {class: 'shared'});
    fold.append(el('summary', {}, `[${shared} prompt tokens as in ${rec.shared.with}]`));
    for (let i = 0; i < shared; i++) fold.append(tokenSpan(rec, i, mode, advScale));
    box.append(fold);
  }
  for (let i = shared; i < rec.tokens.id.length; i++)
    box.append(tokenSpan(rec, i, mode, advScale));
  return box;
}
function recordView(rec, mode, advScale) {
  const sec = el('section', {class: 'traj', 'data-uid': rec.uid});
  sec.append(el('h4', {}, `${rec.uid}  reward ${fmt(rec.reward, 3)}  adv ${fmt(rec.advantage, 3)}` +
    `  success ${rec.success}  ${rec.termination}  tool errors ${rec.tool_errors}` +
    (rec.excluded ? `  excluded: ${rec.excluded}` : '')));
  sec.append(verdictView(rec), toolTable(rec), lowProbList(rec), tokensView(rec, mode, advScale));
  for (const b of rec.branches || []) {  // a forked episode: each branch is a training row
    sec.append(el('h5', {}, `branch ${b.branch}: from branch ${b.parent} at token ` +
      `${b.fork_at} (${b.reason})`));
    sec.append(tokensView({...rec, tokens: b.tokens, shared: null}, mode, advScale));
  }
  return sec;
}
function groupView(group, mode, advScale) {
  const sec = el('section', {class: 'group', 'data-group': group.id});
  sec.append(el('h3', {}, `group ${group.id}: ${group.caption}`));
  const members = el('div', {class: 'members',
    style: `grid-template-columns: repeat(${group.records.length}, minmax(28em, 1fr))`});
  for (const rec of group.records) members.append(recordView(rec, mode, advScale));
  sec.append(members);
  return sec;
}
function show() {
  const p = params();
  const step = p.step || DATA.open || picker.options[0]?.value || '0';
  const mode = p.heat in HEAT_LEGENDS ? p.heat : 'provenance';
  const groups = DATA.steps[step] || [];
  const records = groups.flatMap(g => g.records);
  picker.value = step;
  // The attribute too, so a DOM dump shows the choice.
  for (const radio of document.querySelectorAll('#heat input'))
    radio.toggleAttribute('checked', (radio.checked = radio.value === mode));
  const advScale = Math.max(0, ...records.map(r => Math.abs(num(r.advantage))).filter(isFinite));
  const legend = HEAT_LEGENDS[mode] + (mode === 'advantage' ? ` (${fmt(advScale, 3)})` : '');
  document.getElementById('heat-legend').textContent = legend;
  const main = document.getElementById('main');
  if (!(step in DATA.steps)) {
    main.replaceChildren(el('h2', {}, `step ${step} is not in this page; it holds steps ` +
      steps.join(', ')));
    return;
  }
  main.replaceChildren(el('h2', {}, `step ${step}: ${records.length} records`));
  if (records.length) main.append(groupTable(groups));
  for (const group of groups) main.append(groupView(group, mode, advScale));
}
const picker = document.getElementById('step');
const steps = Object.keys(DATA.steps).sort((a, b) => a - b);
for (const s of steps) picker.append(el('option', {value: s}, s));
picker.addEventListener('change', () => setParams({step: picker.value}));
for (const radio of document.querySelectorAll('#heat input'))
  radio.addEventListener('change', () => setParams({heat: radio.value}));
window.addEventListener('hashchange', show);
showPassAt();
show();
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
