"""The live page of ``minipaged serve``: the engine's queues and block map, drawn in a browser.

``PAGE`` is the HTML page at ``GET /`` that polls ``GET /state`` and draws it: the GPU block
map (each request in its own colour, keyed by its arrival number), the CPU swap pool, the
queues, each request's block table and the end of its text. ``GET /state`` answers
``EngineClient.snapshot()``, read between steps under the engine's lock;
``minipaged.serving.engine_client.snapshot`` says what it holds.
"""

from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>minipaged — the engine, live</title>
<style>
* { box-sizing: border-box; }
html, body { margin: 0; height: 100%; }
body { font: 13px/1.35 system-ui, sans-serif; color: #222; padding: 10px 14px;
       display: flex; flex-direction: column; gap: 8px; }
header { display: flex; gap: 18px; align-items: baseline; flex-wrap: wrap; }
h1 { font-size: 18px; margin: 0; }
h2 { font-size: 13px; margin: 0 0 4px; }
main { flex: 1; min-height: 0; display: grid; gap: 12px;
       grid-template-columns: minmax(0, 1.05fr) minmax(0, 1fr); }
.col { display: flex; flex-direction: column; gap: 8px; min-height: 0; }
.panel { border: 1px solid #ddd; border-radius: 4px; padding: 6px 8px; min-height: 0;
         display: flex; flex-direction: column; }
.panel > p { margin: 4px 0 0; color: #555; font-size: 12px; }
.area { flex: 1; min-height: 0; overflow: hidden; }
#gpu { flex: 3; } #cpu { flex: 0 0 132px; } #detail { flex: 2; }
#queues-panel { flex: 1; } #texts-panel { flex: 1; }
.scroll { flex: 1; min-height: 0; overflow: auto; }
.map { display: grid; gap: 1px; }
.block { background: #e4e4e4; border-radius: 2px; font-size: 9px; color: #999; overflow: hidden;
         display: flex; align-items: center; justify-content: center; cursor: pointer; }
.block.shared { box-shadow: inset 0 0 0 2px #111; }
.block.dim { opacity: 0.25; }
table { border-collapse: collapse; width: 100%; table-layout: fixed; }
td, th { padding: 2px 6px; text-align: left; white-space: nowrap; overflow: hidden;
         text-overflow: ellipsis; }
th { font-weight: 600; color: #555; font-size: 12px; }
tbody tr:hover { background: #f3f3f3; cursor: pointer; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 5px; }
.text { border-left: 4px solid; padding-left: 6px; direction: rtl; text-align: left; }
.text > span { direction: ltr; unicode-bidi: embed; }
#hover { color: #333; min-height: 1.4em; }
.seq { margin: 4px 0 2px; font-weight: 600; }
.chips { display: flex; flex-wrap: wrap; gap: 3px; }
.chip { border: 1px solid #ccc; border-radius: 3px; padding: 0 4px; font: 11px ui-monospace, monospace; }
.chip.shared { border: 2px solid #111; }
.muted { color: #777; }
</style></head>
<body>
<header><h1>minipaged, live</h1><span id="summary">connecting…</span></header>
<main>
<div class="col">
  <section class="panel" id="gpu"><h2>GPU KV cache</h2>
    <div class="area" id="gpu-area"><div class="map" id="blocks"></div></div>
    <p id="gpu-legend"></p></section>
  <section class="panel" id="cpu"><h2 id="cpu-title">CPU swap pool</h2>
    <div class="area" id="cpu-area"><div class="map" id="cpu-blocks"></div></div>
    <p id="cpu-legend"></p></section>
  <section class="panel" id="detail"><h2>Block table <span id="detail-title" class="muted"></span></h2>
    <div id="hover"></div><div class="scroll" id="table"></div></section>
</div>
<div class="col">
  <section class="panel" id="queues-panel"><h2>Requests</h2><div class="scroll"><table>
    <colgroup><col style="width:26%"><col style="width:15%"><col style="width:34%"><col style="width:25%"></colgroup>
    <thead><tr><th>request</th><th>queue</th><th>tokens per sequence</th><th>blocks</th></tr></thead>
    <tbody id="queues"></tbody></table></div></section>
  <section class="panel" id="texts-panel"><h2>Streaming now</h2><div class="scroll"><table>
    <colgroup><col style="width:22%"><col style="width:7%"><col></colgroup>
    <tbody id="texts"></tbody></table></div></section>
</div>
</main>
<script>
// Every string from the server goes in through textContent: generated text is never parsed as HTML.
const GREY = '#e4e4e4';
const LIGHT = [44, 58, 33];
// Golden-angle hues keyed on the request's arrival number: neighbours differ by 137.5 degrees.
const colour = index => `hsl(${(index * 137.508) % 360}, 65%, ${LIGHT[((index % 3) + 3) % 3]}%)`;
const el = (tag, text, cls) => {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
};
let state = null, pinned = null, hovered = null, hoverText = '';
const maps = {};  // pool -> {per, cells, elements, drawn}

// The largest cells that fit the area; when even the smallest cannot show one block each,
// a cell stands for `per` blocks (a power of two).
function layout(numBlocks, area, minPitch, maxPitch) {
  const W = area.clientWidth, H = area.clientHeight;
  for (let per = 1; ; per *= 2) {
    const cells = Math.ceil(numBlocks / per);
    let pitch = Math.min(maxPitch, Math.floor(Math.sqrt(W * H / Math.max(cells, 1))));
    while (pitch >= minPitch && Math.floor(W / pitch) * Math.floor(H / pitch) < cells) pitch--;
    if (pitch >= minPitch || per >= numBlocks) {
      pitch = Math.max(pitch, 2);
      return {per, cells, pitch, cols: Math.max(1, Math.floor(W / pitch)), W, H, numBlocks};
    }
  }
}

function buildMap(pool, grid, area, numBlocks, minPitch, maxPitch) {
  const L = layout(numBlocks, area, minPitch, maxPitch), old = maps[pool];
  if (old && old.per === L.per && old.pitch === L.pitch && old.cols === L.cols && old.numBlocks === numBlocks)
    return old;
  grid.replaceChildren();
  grid.style.gridTemplateColumns = `repeat(${L.cols}, ${L.pitch - 1}px)`;
  grid.style.gridAutoRows = `${L.pitch - 1}px`;
  L.elements = [];
  L.drawn = [];
  for (let c = 0; c < L.cells; c++) {
    const cell = el('div', undefined, 'block');
    cell.dataset.cell = c;
    cell.dataset.pool = pool;
    if (L.per === 1 && L.pitch >= 24) cell.textContent = c;
    grid.appendChild(cell);
    L.elements.push(cell);
    L.drawn.push('');
  }
  maps[pool] = L;
  return L;
}

function requests() {
  return state ? [...state.running, ...state.swapped, ...state.waiting] : [];
}

// block -> [{request, seq, logical}] for one pool, from the block tables.
function holders(pool) {
  const out = new Map();
  for (const r of requests())
    for (const [i, s] of r.seqs.entries())
      if (s.where === pool)
        s.block_table.forEach((b, logical) => {
          if (!out.has(b)) out.set(b, []);
          out.get(b).push({r, i, s, logical});
        });
  return out;
}

function drawMap(pool, data, L, shown) {
  const index = new Map(requests().map(r => [r.id, r.index]));
  const shared = new Set(data.shared);
  for (let c = 0; c < L.cells; c++) {
    const first = c * L.per, last = Math.min(first + L.per, data.num_blocks);
    const count = new Map(), runs = [];  // runs: [owner or null, blocks] in block order
    let used = 0, isShared = false;
    for (let b = first; b < last; b++) {
      const owners = data.blocks[b], key = owners ? owners[0] : null;
      if (runs.length && runs[runs.length - 1][0] === key) runs[runs.length - 1][1]++;
      else runs.push([key, 1]);
      if (!owners) continue;
      used++;
      isShared = isShared || shared.has(b);
      for (const o of new Set(owners)) count.set(o, (count.get(o) || 0) + 1);
    }
    let background = GREY, title = '', top = null;
    if (used) {  // one block: its holder's colour; several: a stripe per block, left to right
      top = [...count.entries()].sort((a, b) => b[1] - a[1])[0][0];
      const paint = o => (o === null ? GREY : colour(index.get(o) ?? 0));
      let x = 0;
      const stops = runs.map(([o, n]) => {
        const from = x;
        x += 100 * n / (last - first);
        return `${paint(o)} ${from.toFixed(2)}% ${x.toFixed(2)}%`;
      });
      background = runs.length === 1 ? paint(runs[0][0]) : `linear-gradient(to right, ${stops.join(', ')})`;
      title = [...count.keys()].join(', ');
    }
    const cls = 'block' + (isShared ? ' shared' : '') + (shown && used && !count.has(shown) ? ' dim' : '');
    const key = background + '|' + title + '|' + cls;
    if (L.drawn[c] === key) continue;
    const cell = L.elements[c];
    cell.style.background = background;
    cell.style.color = used ? '#fff' : '';
    cell.title = title;
    cell.className = cls;
    cell.dataset.owner = top || '';
    L.drawn[c] = key;
  }
}

function cellInfo(pool, cell) {
  const L = maps[pool], data = pool === 'gpu' ? state : state.cpu;
  const first = Number(cell.dataset.cell) * L.per, last = Math.min(first + L.per, data.num_blocks) - 1;
  const name = first === last ? `block ${first}` : `blocks ${first}–${last}`;
  const held = holders(pool), parts = [];
  for (let b = first; b <= last; b++)
    for (const h of held.get(b) || [])
      parts.push(`${h.r.id} seq ${h.i} logical ${h.logical}` + (first === last ? '' : ` → ${b}`));
  const where = pool === 'gpu' ? 'GPU' : 'CPU';
  return `${where} ${name}: ` + (parts.length ? parts.slice(0, 6).join('; ') +
    (parts.length > 6 ? `; +${parts.length - 6} more` : '') : 'free');
}

function drawDetail() {
  const shown = hovered || pinned, box = document.getElementById('table');
  document.getElementById('hover').textContent = hoverText;
  const r = requests().find(q => q.id === shown);
  box.replaceChildren();
  if (!r) {
    document.getElementById('detail-title').textContent = '';
    box.appendChild(el('p', 'Hover over a block or a request to see its block table; click to keep it.',
                       'muted'));
    return;
  }
  const queue = ['running', 'swapped', 'waiting'].find(q => state[q].includes(r));
  const title = document.getElementById('detail-title');
  title.textContent = `${r.id}: ${queue}, ${r.seqs.length} sequence${r.seqs.length > 1 ? 's' : ''} ` +
    `(n=${r.width}), prompt ${r.prompt_tokens} tokens` + (shown === pinned ? ' · kept (click to release)' : '');
  title.style.color = colour(r.index);
  r.seqs.forEach((s, i) => {
    const pool = s.where ? s.where.toUpperCase() : 'no blocks';
    box.appendChild(el('div', `seq ${i} (id ${s.seq_id}, ${s.status}): ${s.num_tokens} tokens ` +
      `(${s.tokens} generated), ${s.block_table.length} blocks on ${pool}`, 'seq'));
    const chips = el('div', undefined, 'chips');
    const poolShared = new Set(s.where === 'cpu' ? state.cpu.shared : state.shared);
    s.block_table.forEach((b, logical) => {
      const chip = el('span', `${logical}→${b}`, 'chip' + (poolShared.has(b) ? ' shared' : ''));
      chip.title = poolShared.has(b) ? 'shared with another sequence' : '';
      chips.appendChild(chip);
    });
    box.appendChild(chips);
    if (s.text) box.appendChild(el('div', '…' + s.text, 'muted'));
  });
  box.appendChild(el('p', 'logical → physical; a thick border: a block shared with another sequence ' +
                    '(copy-on-write copies it when a sequence writes to it).', 'muted'));
}

function draw(s) {
  state = s;
  const waiting = s.waiting.length, running = s.running.length, swapped = s.swapped.length;
  document.getElementById('summary').textContent =
    `${s.num_blocks - s.free_blocks} of ${s.num_blocks} blocks in use; ${running} running, ` +
    `${waiting} waiting, ${swapped} swapped; ${s.stats.num_preemptions} preemptions`;
  const shown = hovered || pinned;
  const G = buildMap('gpu', document.getElementById('blocks'), document.getElementById('gpu-area'),
                     s.num_blocks, 7, 44);
  drawMap('gpu', s, G, shown);
  document.getElementById('gpu-legend').textContent =
    `${s.num_blocks.toLocaleString('en')} blocks of ${s.block_size} tokens; ` +
    (G.per === 1 ? 'each cell is one block' : `each cell is ${G.per} blocks, in stripes left to right`) +
    ', coloured by the request holding it (grey: free); dark inner border: shared by several sequences' +
    (shown ? `; faded: not held by ${shown}.` : '.');
  const cpuArea = document.getElementById('cpu-area'), cpuGrid = document.getElementById('cpu-blocks');
  if (s.cpu) {
    const C = buildMap('cpu', cpuGrid, cpuArea, s.cpu.num_blocks, 5, 18);
    drawMap('cpu', s.cpu, C, shown);
    document.getElementById('cpu-title').textContent =
      `CPU swap pool: ${s.cpu.num_blocks - s.cpu.free_blocks} of ${s.cpu.num_blocks} blocks used`;
    const holding = s.swapped.map(r => `${r.id} (${r.cpu_blocks})`).join(', ');
    document.getElementById('cpu-legend').textContent =
      (holding ? `holding the blocks of ${holding}` : 'empty: no request is swapped out') +
      (C.per === 1 ? '; each cell is one block.' : `; each cell is ${C.per} blocks.`);
  } else {
    cpuGrid.replaceChildren();
    delete maps.cpu;
    document.getElementById('cpu-title').textContent = 'CPU swap pool: none';
    document.getElementById('cpu-legend').textContent =
      'This engine has no swap space: a preempted request is recomputed.';
  }
  const rows = document.getElementById('queues');
  rows.replaceChildren();
  for (const q of ['running', 'swapped', 'waiting'])
    for (const r of s[q]) {
      const tr = rows.insertRow(), id = tr.insertCell();
      tr.dataset.request = r.id;
      id.title = r.id;
      const sw = el('span', undefined, 'swatch');
      sw.style.background = colour(r.index);
      id.append(sw, r.id);
      id.style.color = colour(r.index);
      tr.insertCell().textContent = q;
      tr.insertCell().textContent = r.tokens.join(' · ') + (r.width > r.tokens.length ? ` (n=${r.width})` : '');
      tr.insertCell().textContent = r.gpu_blocks ? `${r.gpu_blocks} on GPU` :
        r.cpu_blocks ? `${r.cpu_blocks} on CPU` : '—';
    }
  const texts = document.getElementById('texts');
  texts.replaceChildren();
  for (const r of s.running)
    r.seqs.forEach((seq, i) => {
      if (seq.status === 'finished' && r.seqs.length === 1) return;
      const tr = texts.insertRow(), id = tr.insertCell(), which = tr.insertCell(), text = tr.insertCell();
      tr.dataset.request = r.id;
      id.textContent = r.id;
      id.title = r.id;
      which.textContent = r.seqs.length > 1 ? `#${i}` : '';  // the sample of an n > 1 request
      which.style.padding = '2px 2px';
      id.style.color = which.style.color = colour(r.index);
      text.className = 'text';
      text.style.borderColor = colour(r.index);
      text.appendChild(el('span', '…' + seq.text));
    });
  drawDetail();
}

function select(target, pin) {
  const cell = target.closest('.block'), row = target.closest('tr[data-request]');
  let id = null;
  if (cell && state) {
    id = cell.dataset.owner || null;
    hoverText = cellInfo(cell.dataset.pool, cell);
  } else if (row) {
    id = row.dataset.request;
    hoverText = '';
  } else return false;
  if (pin) pinned = (pinned === id ? null : id);
  else hovered = id;
  return true;
}
document.addEventListener('mouseover', e => {
  if (!select(e.target, false) && (hovered || hoverText)) { hovered = null; hoverText = ''; }
  if (state) draw(state);
});
document.addEventListener('click', e => { if (select(e.target, true) && state) draw(state); });
window.addEventListener('resize', () => { if (state) draw(state); });

async function refresh() {
  try {
    draw(await (await fetch('/state')).json());
  } catch (e) { document.getElementById('summary').textContent = 'the server is not answering'; }
}
setInterval(refresh, Number(new URLSearchParams(location.search).get('every')) || 500); refresh();
</script></body></html>
"""
