"""The live page of ``minipaged serve``: the engine's queues and block map, drawn in a browser.

``snapshot(llm)`` reads the scheduler and the block manager through their public names and
returns JSON-ready data (the server calls it between steps, under the engine's lock); ``PAGE``
is the HTML page at ``GET /`` that polls ``GET /state`` and draws it.
"""

from __future__ import annotations


def snapshot(llm) -> dict:
    """The queues and the block map: which request holds which block."""
    scheduler, manager = llm.scheduler, llm.scheduler.block_manager
    owners: dict[int, list[str]] = {}
    queues = {}
    for name in ("waiting", "running", "swapped"):
        queues[name] = []
        for group in getattr(scheduler, name):
            if group.is_finished():  # done, and leaving at the next step
                continue
            queues[name].append({"id": str(group.request_id),
                                 "tokens": [len(s.output_token_ids) for s in group.seqs],
                                 "text": llm.engine.text(group.seqs[0].output_token_ids)[-80:]})
            if name == "running":
                for seq in group.seqs:
                    if seq.seq_id in manager.block_tables:
                        for block in manager.get_block_table(seq.seq_id):
                            owners.setdefault(block, []).append(str(group.request_id))
    return {"num_blocks": manager.num_total_blocks, "free_blocks": manager.num_free_blocks,
            "blocks": {str(b): sorted(set(o)) for b, o in owners.items()},
            "shared": [b for b, o in owners.items() if len(o) > 1], **queues,
            "stats": llm.stats}


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>minipaged — the engine, live</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
#blocks { display: grid; grid-template-columns: repeat(auto-fill, 28px); gap: 3px; margin: 1em 0; }
.block { width: 28px; height: 28px; border-radius: 3px; background: #eee; font-size: 9px;
         display: flex; align-items: center; justify-content: center; color: #fff; }
.shared { outline: 3px solid #222; }
td, th { padding: 2px 10px; text-align: left; }
</style></head>
<body>
<h1>minipaged, live</h1>
<p id="summary">connecting…</p>
<div id="blocks"></div>
<p>Each square is a physical KV block, coloured by the request that holds it (grey: free);
a black outline marks a block shared by several sequences.</p>
<table><thead><tr><th>queue</th><th>requests (tokens generated)</th></tr></thead><tbody id="queues"></tbody></table>
<h2>Streaming now</h2>
<table><tbody id="texts"></tbody></table>
<script>
const colour = id => `hsl(${(parseInt(id.replace(/\\D/g, '') || '0') * 47) % 360}, 60%, 45%)`;
async function refresh() {
  try {
    const s = await (await fetch('/state')).json();
    document.getElementById('summary').textContent =
      `${s.num_blocks - s.free_blocks} of ${s.num_blocks} blocks in use; ${s.running.length} running, ` +
      `${s.waiting.length} waiting, ${s.swapped.length} swapped; ${s.stats.preemptions} preemptions`;
    const grid = document.getElementById('blocks');
    grid.innerHTML = '';
    for (let b = 0; b < s.num_blocks; b++) {
      const cell = document.createElement('div');
      const owners = s.blocks[String(b)] || [];
      cell.className = 'block' + (s.shared.includes(b) ? ' shared' : '');
      if (owners.length) { cell.style.background = colour(owners[0]); cell.title = owners.join(', '); }
      cell.textContent = b;
      grid.appendChild(cell);
    }
    document.getElementById('queues').innerHTML = ['running', 'waiting', 'swapped'].map(q =>
      `<tr><td>${q}</td><td>${s[q].map(r => `${r.id} (${r.tokens.join('/')})`).join(', ')}</td></tr>`).join('');
    const rows = document.getElementById('texts');
    rows.innerHTML = '';
    for (const r of s.running) {  // textContent: the generated text is never parsed as HTML
      const tr = rows.insertRow(), id = tr.insertCell(), text = tr.insertCell();
      id.textContent = r.id; id.style.color = colour(r.id); text.textContent = '…' + r.text;
    }
  } catch (e) { document.getElementById('summary').textContent = 'the server is not answering'; }
}
setInterval(refresh, Number(new URLSearchParams(location.search).get('every')) || 500); refresh();
</script></body></html>
"""
