"""Pictures for the tutorials and the docs (matplotlib is imported only when drawing)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minipaged.perf.simulate import KINDS, SimulationResult
from minipaged.stage0_contiguous import ContiguousKVCache

if TYPE_CHECKING:  # named in annotations only: matplotlib is imported when drawing
    from matplotlib.artist import Artist

COLORS = {
    "token": "#2b8cbe",
    "reserved": "#a6bddb",
    "internal": "#fdae6b",
    "external": "#e6550d",
    "free": "#f0f0f0",
}


def plot_arena(cache: ContiguousKVCache, next_reservation: int | None = None, ax=None, title=None):
    """Draw the arena as one row of slots, coloured by kind; label each slab by request.

    The legend sits to the right of the row; with several rows, keep it on the first.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 1.4), layout="constrained")
    for slab in cache.slabs.values():
        used = max(slab.need, slab.num_tokens)
        parts = [("token", slab.num_tokens), ("reserved", used - slab.num_tokens),
                 ("internal", slab.size - used)]
        x = slab.start
        for kind, width in parts:
            if width:
                ax.broken_barh([(x, width)], (0, 1), color=COLORS[kind])
            x += width
        ax.broken_barh([(slab.start, slab.size)], (0, 1), facecolor="none", edgecolor="black")
        ax.text(slab.start + slab.size / 2, 0.5, str(slab.request_id), ha="center", va="center", fontsize=10,
                bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none", alpha=0.85))
    for start, length in cache.holes():
        small = next_reservation is not None and length < next_reservation
        ax.broken_barh([(start, length)], (0, 1), color=COLORS["external" if small else "free"])
    ax.set_xlim(0, cache.num_slots)
    ax.set_yticks([])
    ax.set_xlabel("slot")
    if title:
        ax.set_title(title, loc="left")
    ax.legend(handles=[Patch(facecolor=COLORS[k], edgecolor="#aaaaaa" if k == "free" else COLORS[k], label=k)
                       for k in KINDS], loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False, fontsize=9)
    return ax


def plot_usage(results: list[SimulationResult], ax=None, labels=None):
    """A stacked bar per result: the share of memory per kind of slot."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
    labels = labels or [r.policy for r in results]
    bottom = [0.0] * len(results)
    for kind in KINDS:
        heights = [100 * r.fractions[kind] for r in results]
        ax.bar(labels, heights, bottom=bottom, color=COLORS[kind], label=kind, edgecolor="white")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for i, r in enumerate(results):
        ax.text(i, 100 * r.fractions["token"] / 2, f"{100 * r.fractions['token']:.1f}%",
                ha="center", va="center", color="white", fontweight="bold")
    ax.set_ylabel("share of KV memory (%)")
    ax.set_ylim(0, 100)
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1), frameon=False)
    return ax


SEQ_COLORS = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666"]


def plot_block_tables(manager, rows: dict | None = None, *, num_blocks: int | None = None, ax=None,
                      title=None, colors=None, copies=(), legend: bool = False):
    """Block tables (top, one row per sequence) over the physical blocks (bottom).

    ``rows`` maps a label to a sequence id of ``manager`` (default: every sequence, labelled
    by its id). A logical block shows the physical id it maps to, filled as far as it holds
    tokens. A physical block is coloured by the one sequence holding it, grey and hatched
    when several share it (its id on a white label, so the hatching never hides it), pale
    when free; when any block is shared, the number under each is its reference count. With
    a prefix-caching allocator, a block whose hash is known (findable by a later prompt) has
    a thick blue outline, and one that nobody holds (free, yet kept in the evictor) is white.
    ``copies`` — ``(source, destination)`` pairs, as copy-on-write queues them — are drawn
    as red arrows under the physical row, each destination outlined in red. ``colors`` maps
    labels to colours (to keep them across pictures). Only the first ``num_blocks`` physical
    blocks are drawn (default: all).
    """
    import matplotlib.pyplot as plt

    allocator = manager.allocator
    rows = {seq_id: seq_id for seq_id in manager.block_tables} if rows is None else rows
    num_blocks = num_blocks or manager.num_total_blocks
    labels = list(rows)
    color = {label: SEQ_COLORS[i % len(SEQ_COLORS)] for i, label in enumerate(labels)}
    color.update(colors or {})
    copies = [(int(s), int(d)) for s, d in copies]
    holders: dict[int, list] = {}
    for label in labels:
        for block_id in manager.block_tables[rows[label]].block_ids:
            holders.setdefault(block_id, []).append(label)
    hashed = set(getattr(allocator, "hash_of", {}))

    def refs(block_id):  # a plain allocator has no reference counts: count the holders drawn
        if hasattr(allocator, "ref_count"):
            return 0 if allocator.is_free(block_id) else allocator.ref_count(block_id)
        return len(holders.get(block_id, []))

    counted = hashed or any(refs(b) > 1 for b in range(num_blocks))
    width = max(num_blocks, *(len(manager.block_tables[s].block_ids) for s in rows.values()))
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.45 * len(labels) + 1.9 + (0.5 if copies else 0)), layout="constrained")
    copied = {d for _, d in copies}
    _draw_logical_rows(ax, manager, rows, color, holders, copied, num_blocks)
    _draw_physical_row(ax, allocator, num_blocks, color, holders, hashed, copied, refs if counted else None)
    _draw_copies(ax, copies)
    ax.set_xlim(-2.6, width + 0.1)
    ax.set_ylim(_BOTTOM - (1.4 if copies else 0.7), len(labels) + 0.35)
    ax.axis("off")
    if legend:
        _block_legend(ax, bool(hashed))
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return ax


_BOTTOM = -1.7  # the physical row's height in plot_block_tables
_LABEL_BOX: dict[str, Any] = {"boxstyle": "round,pad=0.18", "facecolor": "white", "edgecolor": "none"}
_RED, _BLUE, _SHARED_FACE = "#d62728", "#08519c", "#bdbdbd"
# light hatching, so that the ids stay legible
_HATCHING: dict[str, Any] = {"hatch": "//", "hatchcolor": "#8c8c8c", "hatch_linewidth": 0.6}


def _draw_logical_rows(ax, manager, rows, color, holders, copied, num_blocks) -> None:
    """One row per sequence: its logical blocks, filled as far as they hold tokens, each with a
    line down to the physical block it maps to."""
    from matplotlib.patches import Rectangle

    labels, block_size = list(rows), manager.block_size
    for row, label in enumerate(labels):
        y = len(labels) - 1 - row
        table = manager.block_tables[rows[label]]
        ax.text(-0.3, y + 0.4, str(label), ha="right", va="center", fontsize=10)
        for j, block_id in enumerate(table.block_ids):
            fill = min(block_size, table.num_tokens - j * block_size) / block_size
            shared = len(holders[block_id]) > 1
            ax.add_patch(Rectangle((j, y), 0.9, 0.8, facecolor="white", edgecolor=color[label], lw=1.2))
            ax.add_patch(Rectangle((j, y), 0.9 * fill, 0.8, facecolor=_SHARED_FACE if shared else color[label],
                                   alpha=0.7, lw=0, **(_HATCHING if shared else {})))
            if block_id in copied:
                ax.add_patch(Rectangle((j, y), 0.9, 0.8, facecolor="none", edgecolor=_RED, lw=2.2))
            ax.text(j + 0.45, y + 0.4, str(block_id), ha="center", va="center", fontsize=10,
                    bbox=_LABEL_BOX if shared else None)
            if block_id < num_blocks:  # behind the boxes
                ax.plot([j + 0.45, block_id + 0.45], [y, _BOTTOM + 0.8], color=color[label], alpha=0.4, lw=1,
                        zorder=0.5)
    longest = max((len(manager.block_tables[s].block_ids) for s in rows.values()), default=0)
    for j in range(longest):
        ax.text(j + 0.45, len(labels) - 0.1, str(j), ha="center", va="bottom", fontsize=9, color="#666666")
    ax.text(-0.3, len(labels) - 0.1, "logical block", ha="right", va="bottom", fontsize=9, color="#666666")


def _draw_physical_row(ax, allocator, num_blocks, color, holders, hashed, copied, refs) -> None:
    """The physical blocks: coloured by their holder, grey and hatched when shared, pale when
    free, outlined blue when named by a hash; under each, its references when ``refs`` is given."""
    from matplotlib.patches import Rectangle

    for block_id in range(num_blocks):
        owners = holders.get(block_id, [])
        free = allocator.is_free(block_id)
        face = "#f2f2f2" if free and block_id not in hashed else \
            "white" if not owners else color[owners[0]] if len(owners) == 1 else _SHARED_FACE
        ax.add_patch(Rectangle((block_id, _BOTTOM), 0.9, 0.8, facecolor=face, edgecolor="black", lw=0.6,
                               alpha=0.8, **(_HATCHING if len(owners) > 1 else {})))
        if block_id in hashed or block_id in copied:
            ax.add_patch(Rectangle((block_id, _BOTTOM), 0.9, 0.8, facecolor="none",
                                   lw=2.5 if block_id in hashed else 2.2,
                                   edgecolor=_BLUE if block_id in hashed else _RED))
        ax.text(block_id + 0.45, _BOTTOM + 0.4, str(block_id), ha="center", va="center", fontsize=10,
                bbox=_LABEL_BOX if len(owners) > 1 else None)
        if refs and (not free or block_id in hashed):
            ax.text(block_id + 0.45, _BOTTOM - 0.3, f"×{refs(block_id)}", ha="center", va="center", fontsize=9)
    ax.text(-0.3, _BOTTOM + 0.4, "physical", ha="right", va="center", fontsize=10)
    if refs:
        ax.text(-0.3, _BOTTOM - 0.3, "references", ha="right", va="center", fontsize=9)


def _draw_copies(ax, copies) -> None:
    """Each copy-on-write copy as a red arrow: down from the source, across, up into the destination."""
    from matplotlib.patches import FancyArrowPatch

    for source, destination in copies:
        x0, x1, y = source + 0.45, destination + (0.75 if destination > source else 0.15), _BOTTOM - 0.85
        ax.plot([x0, x0, x1], [_BOTTOM - 0.55, y, y], color=_RED, lw=1.5)
        ax.add_patch(FancyArrowPatch((x1, y), (x1, _BOTTOM - 0.02), arrowstyle="-|>", mutation_scale=12,
                                     color=_RED, lw=1.5, shrinkA=0, shrinkB=0))
        ax.text((source + destination) / 2 + 0.45, y - 0.08, f"copy {source} → {destination}", ha="center",
                va="top", fontsize=9, color=_RED)


def _block_legend(ax, hashed: bool) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=_SHARED_FACE, edgecolor="black", lw=0.6, label="shared", **_HATCHING),
               Patch(facecolor="#f2f2f2", edgecolor="black", lw=0.6, label="free")]
    if hashed:
        handles.append(Patch(facecolor="white", edgecolor=_BLUE, lw=2.5, label="named: findable by its hash"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 0), ncol=len(handles), frameon=False,
              fontsize=9, borderaxespad=0)


def plot_block_owners(history, ax=None, title=None):
    """Which request holds each physical block, step after step.

    ``history[step][block]`` is the id of the request holding ``block`` after ``step``, or
    ``-1`` when the block is free. One row per block, one column per step; each request has
    a colour, and its id is written on each stretch of steps in which it holds a block.
    Free blocks are white.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    grid = np.array(history).T  # (num_blocks, num_steps)
    num_blocks, num_steps = grid.shape
    palette = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
               "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f"]
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.16 * num_blocks + 1.0), layout="constrained")
    shown = np.ma.masked_less(grid, 0) % len(palette)
    ax.imshow(shown, cmap=ListedColormap(palette), vmin=0, vmax=len(palette) - 1, aspect="auto",
              interpolation="nearest", extent=(-0.5, num_steps - 0.5, num_blocks - 0.5, -0.5))
    for block in range(num_blocks):
        step = 0
        while step < num_steps:
            end = step
            while end + 1 < num_steps and grid[block, end + 1] == grid[block, step]:
                end += 1
            if grid[block, step] >= 0:
                ax.add_patch(plt.Rectangle((step - 0.5, block - 0.5), end - step + 1, 1, facecolor="none",
                                           edgecolor="white", lw=0.8))
                if end - step >= 2:
                    ax.text((step + end) / 2, block, str(grid[block, step]), ha="center", va="center", fontsize=8)
            step = end + 1
    ax.set_xlabel("step")
    ax.set_ylabel("physical block")
    ax.set_yticks(range(0, num_blocks, 4))
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return ax


def plot_gather(block_table, seq_len: int, block_size: int, num_blocks: int, ax=None, title=None,
                tile: int | None = None):
    """How a block table maps logical positions (bottom) to physical slots (top).

    Token ``t`` (the number in each cell) is read from slot ``t % block_size`` of block
    ``block_table[t // block_size]``. With ``tile``, the logical positions are grouped in tiles
    of that many tokens, as a kernel reads them; the last tile's positions past ``seq_len``
    are masked (hatched).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    block_table = [int(b) for b in block_table]
    width = num_blocks * block_size
    shown = -(-seq_len // tile) * tile if tile else seq_len
    left = (width - shown) / 2  # the logical row, centred under the cache
    top = 3.2  # the cache's row
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3), layout="constrained")
    for block_id in range(num_blocks):  # the physical cache, slot by slot
        for face, edge, z in (("#eeeeee", "none", 0), ("none", "black", 2)):
            ax.add_patch(Rectangle((block_id * block_size, top), block_size, 1, facecolor=face,
                                   edgecolor=edge, lw=1.2, zorder=z))
        ax.text(block_id * block_size + block_size / 2, top + 1.15, f"block {block_id}", ha="center",
                va="bottom", fontsize=9)
    for t in range(seq_len):
        color = SEQ_COLORS[(t // block_size) % len(SEQ_COLORS)]
        x_phys = block_table[t // block_size] * block_size + t % block_size
        for x, y in ((x_phys, top), (left + t, 0)):
            ax.add_patch(Rectangle((x, y), 1, 1, facecolor=color, edgecolor="white", lw=1, zorder=1))
            ax.text(x + 0.5, y + 0.5, str(t), ha="center", va="center", fontsize=9, color="white", zorder=3)
        ax.plot([x_phys + 0.5, left + t + 0.5], [top, 1], color=color, alpha=0.6, lw=0.9)
    for t in range(seq_len, shown):  # masked positions of the last tile
        ax.add_patch(Rectangle((left + t, 0), 1, 1, facecolor="white", edgecolor="#999999", hatch="///", lw=0.8))
    if tile:
        for k, start in enumerate(range(0, shown, tile)):
            x0, x1 = left + start + 0.08, left + start + tile - 0.08
            ax.plot([x0, x0, x1, x1], [-0.12, -0.3, -0.3, -0.12], color="black", lw=1)
            ax.text((x0 + x1) / 2, -0.4, f"tile {k}", ha="center", va="top", fontsize=9)
    ax.text(-0.3, top + 0.5, "physical\nslots", ha="right", va="center", fontsize=9)
    ax.text(left - 0.3, 0.5, "logical\nposition t", ha="right", va="center", fontsize=9)
    ax.set_xlim(-3.2, width + 0.2)
    ax.set_ylim(-1.0 if tile else -0.2, top + 2)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return ax


def plot_batched_gather(block_tables, seq_lens, block_size: int, ax=None, title=None):
    """Decode's gather of a whole batch: every sequence padded to the longest, and masked.

    One row per sequence, one cell per position of the padded batch, grouped in blocks; each
    block is labelled with the id read — the table's entry, or 0 where the entry lies past
    the sequence's blocks (such entries are never trusted). Hatched positions are masked out.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    tables = [[int(b) for b in row] for row in block_tables]
    lens = [int(n) for n in seq_lens]
    width = -(-max(lens) // block_size)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.5 * len(lens) + 1.0), layout="constrained")
    for i, n in enumerate(lens):
        y = len(lens) - 1 - i
        color = SEQ_COLORS[i % len(SEQ_COLORS)]
        for t in range(width * block_size):
            used = t < n
            ax.add_patch(Rectangle((t, y), 1, 0.8, facecolor=color if used else "white", alpha=0.35 if used else 1,
                                   edgecolor="#bbbbbb", hatch=None if used else "///", lw=0.6))
        for j in range(width):
            entry = tables[i][j]
            label = f"block {entry}" if j * block_size < n else f"{entry} → 0"
            ax.add_patch(Rectangle((j * block_size, y), block_size, 0.8, facecolor="none", edgecolor="black", lw=1.2))
            ax.text(j * block_size + block_size / 2, y + 0.4, label, ha="center", va="center", fontsize=9,
                    bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.8))
        ax.text(-0.3, y + 0.4, f"seq {i}, {n} tokens", ha="right", va="center", fontsize=9)
    for t in range(width * block_size):
        ax.text(t + 0.5, len(lens) - 0.05, str(t), ha="center", va="bottom", fontsize=9, color="#555555")
    ax.text(-0.3, len(lens) + 0.05, "position", ha="right", va="bottom", fontsize=9, color="#555555")
    ax.set_xlim(-4.5, width * block_size + 0.2)
    ax.set_ylim(-0.1, len(lens) + 0.5)
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return ax


def plot_online_softmax(scores, tile: int, running_max, alpha, outputs, exact, axes=None):
    """The online softmax, tile by tile: the running max, the rescaling factor, the running output.

    ``running_max[k]``, ``alpha[k]`` and ``outputs[k]`` (``acc / l``, a few of its dims) are the
    values after tile ``k``; ``exact`` is the softmax-weighted sum over all the scores.
    """
    import matplotlib.pyplot as plt

    scores = [float(s) for s in scores]
    n, tiles = len(scores), len(running_max)
    starts = [k * tile for k in range(tiles)]
    ends = [min(s + tile, n) for s in starts]
    if axes is None:
        _, axes = plt.subplots(3, 1, figsize=(7, 6), sharex=True, layout="constrained")
    ax = axes[0]
    ax.plot(range(n), scores, lw=0.6, color="#aaaaaa", label="scores $s_j$")
    ax.step(starts + [n], list(running_max) + [running_max[-1]], where="post", color="#d95f02", lw=2,
            label="running max $m$ after each tile")
    low, high = min(scores), max(scores)
    ax.set_ylim(low - 0.05 * (high - low), high + 0.45 * (high - low))
    ax.set_title("the running max $m$ rises whenever a tile holds a larger score", loc="left", fontsize=10)
    ax.legend(loc="upper left", fontsize=9, frameon=False, ncol=2)
    ax = axes[1]
    ax.bar([(s + e) / 2 for s, e in zip(starts, ends, strict=True)], alpha, width=0.8 * tile, color="#7570b3")
    for s, e, a in zip(starts, ends, alpha, strict=True):
        ax.text((s + e) / 2, a + 0.04, f"{a:.2f}" if a else "0", ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, 1.3)
    ax.set_ylabel(r"$\alpha = e^{m - m'}$", fontsize=10)
    ax.set_title(r"each tile rescales $\ell$ and acc by $\alpha$ (1: the max did not change)", loc="left", fontsize=10)
    ax = axes[2]
    outputs = [[float(x) for x in row] for row in outputs]
    for d in range(len(outputs[0])):
        color = SEQ_COLORS[d % len(SEQ_COLORS)]
        ax.plot(ends, [row[d] for row in outputs], "o-", color=color, lw=1.5, ms=4)
        ax.axhline(float(exact[d]), color=color, ls="--", lw=1)
        ax.text(ends[0] - tile * 0.15, outputs[0][d], f"dim {d}", ha="right", va="center", fontsize=9, color=color)
    ax.set_title(r"acc / $\ell$ after each tile reaches the exact output (dashed) at the last", loc="left",
                 fontsize=10)
    ax.set_xlabel("token", fontsize=10)
    ax.set_xticks(starts + [n])
    for ax in axes:
        for s in starts[1:]:
            ax.axvline(s, color="#cccccc", lw=0.6, ls=":", zorder=0)
        ax.tick_params(labelsize=9)
    return axes


def plot_split_kv(seq_len: int, partition_size: int, tile: int, ax=None):
    """Split-KV: partitions of the context, each a program producing (m, l, acc), then a reduce."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 2.6), layout="constrained")
    parts = -(-seq_len // partition_size)
    for p in range(parts):
        start, end = p * partition_size, min((p + 1) * partition_size, seq_len)
        color = SEQ_COLORS[p % len(SEQ_COLORS)]
        for t in range(start, end, tile):
            ax.add_patch(Rectangle((t, 2), min(tile, end - t), 0.8, facecolor=color, alpha=0.5,
                                   edgecolor="white"))
        mid = (start + end) / 2
        ax.text(mid, 2.95, f"program {p}\ntokens {start}–{end - 1}", ha="center", fontsize=9)
        half = 0.45 * min(partition_size, end - start)
        ax.add_patch(Rectangle((mid - half, 0.9), 2 * half, 0.5, facecolor=color, alpha=0.85))
        ax.text(mid, 1.15, f"$m_{p},\\ \\ell_{p},\\ \\mathrm{{acc}}_{p}$", ha="center", va="center",
                fontsize=10, color="white")
        ax.add_patch(FancyArrowPatch((mid, 2), (mid, 1.4), arrowstyle="->", mutation_scale=10))
        ax.add_patch(FancyArrowPatch((mid, 0.9), (seq_len / 2, 0.4), arrowstyle="->", mutation_scale=10))
    ax.text(seq_len / 2, 0.05, r"reduce:  $o = \sum_p e^{m_p - M}\,\mathrm{acc}_p \;/\; \sum_p e^{m_p - M}\,\ell_p$,"
            r"  $M = \max_p m_p$", ha="center", fontsize=10)
    ax.text(0, 3.75, f"one sequence of {seq_len} tokens, partitions of {partition_size}, tiles of {tile}",
            fontsize=9, color="#555555")
    ax.set_xlim(-seq_len * 0.01, seq_len * 1.01)
    ax.set_ylim(-0.15, 4.0)
    ax.axis("off")
    return ax


def plot_prefill_tiles(context: int, q_len: int, block_m: int, block_n: int, ax=None, title=None):
    """The prefill kernel's causal mask for a chunk of ``q_len`` queries after ``context`` tokens.

    Query ``i`` sits at absolute position ``context + i`` and sees keys ``pos <= context + i``.
    The grid lines are the tiles: ``block_m`` queries per program, ``block_n`` keys per step of
    its loop; a program stops at ``hi = context + (tile + 1) * block_m`` (or the sequence's
    end), so the key tiles to the right of that are never loaded.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    seq_len = context + q_len
    cols = -(-seq_len // block_n) * block_n
    rows = np.arange(q_len)[:, None]
    pos = np.arange(cols)[None, :]
    hi = np.minimum(seq_len, context + (rows // block_m + 1) * block_m)
    loaded = (pos // block_n) * block_n < hi  # the key tiles the loop visits
    grid = np.where(~loaded, 0, np.where((pos <= context + rows) & (pos < seq_len), 2, 1))
    colors = ["#e0e0e0", "#fdd0a2", "#3182bd"]
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.3), layout="constrained")
    ax.imshow(grid, cmap=ListedColormap(colors), vmin=0, vmax=2, aspect="auto", interpolation="nearest",
              extent=(0, cols, q_len, 0))
    for x in range(block_n, cols, block_n):
        ax.axvline(x, color="black", lw=0.8)
    for y in range(block_m, q_len, block_m):
        ax.axhline(y, color="black", lw=0.8)
    ax.axvline(context, color="#d95f02", lw=2, ls="--")
    ax.axvline(seq_len, color="black", lw=1.5)
    ax.text(context / 2, -2, "cached prefix", ha="center", va="bottom", fontsize=9, color="#d95f02")
    ax.text((context + seq_len) / 2, -2, "the chunk's own tokens", ha="center", va="bottom", fontsize=9)
    ax.text(seq_len, -2, "end", ha="center", va="bottom", fontsize=9)
    ax.set_xlabel(f"key position (absolute, 0 … {seq_len - 1})", fontsize=10)
    ax.set_ylabel(f"query i of the chunk (at position {context} + i)", fontsize=10)
    ax.set_xticks(range(0, cols + 1, block_n))
    ax.set_yticks(range(0, q_len + 1, block_m))
    ax.tick_params(labelsize=9)
    ax.legend(handles=[Patch(color=colors[2], label="visible: pos ≤ context + i"),
                       Patch(color=colors[1], label="loaded, masked out"),
                       Patch(color=colors[0], label="key tile never loaded")],
              loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=9, frameon=False)
    if title:
        ax.set_title(title, loc="left", fontsize=10, pad=18)
    return ax


STATUS_COLORS = {"waiting": "#dddddd", "running": "#1b9e77", "swapped": "#7570b3", "finished": "#ffffff"}


def plot_schedule(history: list[dict], labels: dict | None = None, ax=None, title=None):
    """A timeline: one row per sequence, one column per step, coloured by the sequence's status.

    ``history[step]`` maps a sequence id to its status name after that step
    (``"waiting"``, ``"running"``, ``"swapped"``, ``"finished"``); preemptions (running, then
    waiting or swapped) are marked with a cross.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    order = list(STATUS_COLORS)
    seq_ids = sorted({s for step in history for s in step})
    grid = np.full((len(seq_ids), len(history)), order.index("finished"))
    for t, step in enumerate(history):
        for row, seq_id in enumerate(seq_ids):
            grid[row, t] = order.index(step.get(seq_id, "waiting" if t == 0 else "finished"))
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.3 * len(seq_ids) + 1.2), layout="constrained")
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(list(STATUS_COLORS.values())),
              vmin=0, vmax=len(order) - 1)
    running = order.index("running")
    for row in range(len(seq_ids)):
        for t in range(1, len(history)):
            if grid[row, t - 1] == running and grid[row, t] in (order.index("waiting"), order.index("swapped")):
                ax.plot(t, row, "x", color="#d95f02", markersize=7, mew=2)
    labels = labels or {}
    ax.set_yticks(range(len(seq_ids)), [labels.get(s, str(s)) for s in seq_ids])
    ax.set_xlabel("step")
    ax.set_ylabel("request")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in STATUS_COLORS.items() if k != "finished"]
              + [plt.Line2D([], [], color="#d95f02", marker="x", ls="", label="preempted")],
              loc="upper left", bbox_to_anchor=(1, 1), frameon=False)
    if title:
        ax.set_title(title, loc="left")
    return ax


def plot_engine_steps(records: list[dict], num_blocks: int, title=None):
    """One engine run, step by step: the batch's tokens, the queues, the blocks in use.

    ``records[step]`` holds ``prefill`` and ``decode`` (the tokens the step computed),
    ``running``, ``waiting`` and ``swapped`` (sequences in each queue after it), ``blocks``
    (GPU blocks in use after it) and ``preempted`` (groups preempted in it).
    """
    import matplotlib.pyplot as plt
    import numpy as np

    steps = np.arange(1, len(records) + 1)
    column = {key: np.array([r[key] for r in records]) for key in records[0]}
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(7, 5.2), sharex=True, height_ratios=[1.3, 1, 1])
    ax1.bar(steps, column["decode"], width=1.0, color=COLORS["token"], edgecolor=COLORS["token"], lw=0.4,
            label="decode tokens (1 per sequence)")  # edges the colour of the bars: no seams between them
    ax1.bar(steps, column["prefill"], width=1.0, bottom=column["decode"], color="#fd8d3c", edgecolor="#fd8d3c",
            lw=0.4, label="prefill tokens (whole prompts)")
    ax1.set_ylabel("tokens\nin the step")
    ax1.legend(loc="upper right", frameon=False, fontsize=9)
    bottom = np.zeros(len(records))
    for key, label in (("running", "running"), ("swapped", "swapped out"), ("waiting", "waiting")):
        color = {"running": STATUS_COLORS["running"], "swapped": "#b2abd2", "waiting": "#bbbbbb"}[key]
        ax2.fill_between(steps, bottom, bottom + column[key], step="mid", color=color, label=label, lw=0)
        bottom = bottom + column[key]
    ax2.set_ylabel("sequences")
    ax2.legend(loc="upper right", frameon=False, fontsize=9)
    ax3.step(steps, column["blocks"], where="mid", color="#444444", label="blocks in use")
    ax3.axhline(num_blocks, color="#999999", lw=0.8, ls="--", label=f"all {num_blocks} blocks")
    hit = column["preempted"] > 0
    ax3.plot(steps[hit], column["blocks"][hit], "x", color="#d62728", mew=2, label="a preemption")
    ax3.set_ylim(0, num_blocks * 1.3)
    ax3.set_ylabel("GPU blocks")
    ax3.set_xlabel("engine step")
    ax3.legend(loc="lower left", frameon=False, fontsize=9, ncol=3)
    ax3.set_xlim(0.5, len(records) + 0.5)
    if title:
        ax1.set_title(title, loc="left")
    fig.align_ylabels()
    fig.tight_layout()
    return fig


def plot_token_budget(outputs: list, budget: int, labels: dict | None = None, ax=None, title=None):
    """Stage 10's steps: one bar per step, one segment per request, the tokens it computed in it.

    ``outputs``: the ``SchedulerOutput`` of each step, in order. A decode (its new token fed
    back from the step before) is a plain segment; a prompt's chunk is hatched and labelled
    with its size; a request preempted in a step is marked with a cross above its bar. The
    dashed line is the token budget.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ids = list(dict.fromkeys(r for out in outputs for r in out.num_scheduled_tokens))
    color = {r: SEQ_COLORS[i % len(SEQ_COLORS)] for i, r in enumerate(ids)}
    labels = labels or {}
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3), layout="constrained")
    for step, out in enumerate(outputs, start=1):
        cached = out.scheduled_cached_reqs
        decodes = {r for r, new in zip(cached.req_ids, cached.new_token_ids, strict=True) if new}
        bottom = 0
        for req_id, n in out.num_scheduled_tokens.items():
            chunk = req_id not in decodes
            ax.bar(step, n, bottom=bottom, width=0.8, color=color[req_id], edgecolor="white", lw=0.6,
                   hatch="///" if chunk else None, alpha=0.75 if chunk else 1.0)
            if chunk and n >= budget / 6:
                ax.text(step, bottom + n / 2, str(n), ha="center", va="center", fontsize=8, color="black")
            bottom += n
        for k, _ in enumerate(out.preempted_req_ids):
            ax.plot(step, bottom + 0.04 * budget * (k + 1), "x", color="#d62728", mew=2, ms=7)
    ax.axhline(budget, color="#555555", ls="--", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens computed")
    ax.set_xlim(0.4, len(outputs) + 0.6)
    ax.set_ylim(0, budget * 1.25)
    handles: list[Artist] = [Patch(facecolor=color[r], label=str(labels.get(r, r))) for r in ids]
    handles += [Patch(facecolor="white", edgecolor="#555555", hatch="///", label="prompt chunk"),
                plt.Line2D([], [], color="#555555", ls="--", label=f"budget ({budget})")]
    if any(out.preempted_req_ids for out in outputs):
        handles.append(plt.Line2D([], [], color="#d62728", marker="x", ls="", mew=2, label="preempted"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1, 1), frameon=False, fontsize=9)
    if title:
        ax.set_title(title, loc="left")
    return ax


def plot_tensor_parallel(config, tp: int, block_tables: dict, seq_lens: dict, block_size: int, num_blocks: int,
                         ax=None, title=None):
    """Stage 11: what the driver keeps and what each of ``tp`` ranks holds of ``config``'s model.

    The driver (top) keeps the scheduler, the one block manager and the sampler; its block tables
    (``block_tables``: request -> block ids, ``seq_lens``: request -> tokens) serve every rank. Each
    rank (a box below) holds its share of the heads, the MLP columns and the vocabulary (from
    ``shard_config`` and ``kv_heads_of_rank``, what the workers are built from) and a KV cache of
    ``num_blocks`` blocks under the same ids, each row one of its KV heads, each block coloured by
    the request whose tokens it holds (filled as far as they go). Arrows: the step's inputs go
    down to every rank, the all-reduces run between the ranks, rank 0 sends the logits back.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

    from minipaged.models.parallel import kv_heads_of_rank, padded_vocab_size, shard_config

    shard = shard_config(config, tp)
    names = list(block_tables)
    color = {name: SEQ_COLORS[i % len(SEQ_COLORS)] for i, name in enumerate(names)}
    filled: dict[int, tuple[str, int]] = {}  # block -> (request, tokens it holds)
    for name in names:
        for i, block in enumerate(block_tables[name]):
            filled[int(block)] = (name, min(block_size, seq_lens[name] - i * block_size))
    if ax is None:
        _, ax = plt.subplots(figsize=(7.2, 3.9), layout="constrained")
    width, gap = 100.0, 6.0
    box = (width - gap * (tp - 1)) / tp
    kv_rows = shard.num_kv_heads
    rank_h = 10.2 + 1.5 * kv_rows
    top = rank_h + 9.0

    def frame(x, y, w, h, face, edge):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.4,rounding_size=1.2", facecolor=face,
                                    edgecolor=edge, linewidth=1.0))

    frame(0, top, width, 7.2, "#e8eaf6", "#3f51b5")
    ax.text(1.5, top + 5.6, "driver: scheduler, the one block manager, sampler", fontsize=9, va="center",
            weight="bold")
    tables = "   ".join(f"{n}: {list(map(int, block_tables[n]))}" for n in names)
    ax.text(1.5, top + 3.5, f"block tables (the same ids on every rank)   {tables}", fontsize=8, va="center")
    ax.text(1.5, top + 1.4, "each step sends: token ids, positions, slot mapping, block tables, lengths, "
            "block moves", fontsize=8, va="center", color="#333333")
    per_rank_heads = shard.num_heads
    mlp = shard.intermediate_size
    vocab = padded_vocab_size(config.vocab_size, tp) // tp
    for rank in range(tp):
        x = rank * (box + gap)
        frame(x, 0, box, rank_h, "#f7f7f7", "#555555")
        heads = kv_heads_of_rank(config, rank, tp)
        q0 = rank * per_rank_heads
        kv = (f"KV head {heads[0]}" if len(heads) == 1 else f"KV heads {heads[0]}–{heads[-1]}")
        if config.num_kv_heads < tp:
            kv += " (replicated)"
        lines = [f"rank {rank}",
                 f"query heads {q0}–{q0 + per_rank_heads - 1} of {config.num_heads}; {kv} of {config.num_kv_heads}",
                 f"MLP columns {rank * mlp}–{(rank + 1) * mlp - 1} of {config.intermediate_size}",
                 f"vocabulary rows {rank * vocab}–{min((rank + 1) * vocab, config.vocab_size) - 1}"
                 f" of {config.vocab_size}",
                 f"KV cache per layer ({num_blocks}, {block_size}, {kv_rows}, {config.head_dim}): block ids"]
        for k, line in enumerate(lines):
            ax.text(x + 1.2, rank_h - 1.3 - 1.55 * k, line, fontsize=8.5 if k == 0 else 7.5, va="center",
                    weight="bold" if k == 0 else "normal")
        cell = (box - 9.5) / num_blocks
        for row, head in enumerate(heads):
            y = 0.7 + 1.5 * (kv_rows - 1 - row)
            ax.text(x + 1.2, y + 0.6, f"head {head}", fontsize=7, va="center")
            for block in range(num_blocks):
                bx = x + 8.0 + block * cell
                owner, tokens = filled.get(block, (None, 0))
                ax.add_patch(Rectangle((bx, y), cell * 0.92, 1.2, facecolor="#eeeeee", edgecolor="#999999",
                                       linewidth=0.5))
                if owner is not None:
                    ax.add_patch(Rectangle((bx, y), cell * 0.92 * tokens / block_size, 1.2, facecolor=color[owner],
                                           edgecolor="none"))
                if row == 0:
                    ax.text(bx + cell * 0.46, y + 1.75, str(block), fontsize=6, ha="center", va="center",
                            color="#555555")
        ax.add_patch(FancyArrowPatch((x + box * 0.5, top - 0.5), (x + box * 0.5, rank_h + 0.5), arrowstyle="-|>",
                                     mutation_scale=10, color="#3f51b5"))
    ax.text(box * 0.5 + 1.2, (top + rank_h) / 2, "StepInputs", fontsize=7.5, va="center", color="#3f51b5")
    ax.add_patch(FancyArrowPatch((box * 0.25, rank_h + 0.5), (box * 0.25, top - 0.5), arrowstyle="-|>",
                                 mutation_scale=10, color="#d95f02"))
    ax.text(box * 0.25 - 1.0, (top + rank_h) / 2, "logits (rank 0)", fontsize=7.5, va="center", ha="right",
            color="#d95f02")
    for rank in range(tp - 1):  # each rank with the next: the collectives join them all
        start, end = rank * (box + gap) + box * 0.78, (rank + 1) * (box + gap) + box * 0.22
        ax.add_patch(FancyArrowPatch((start, rank_h + 0.5), (end, rank_h + 0.5), arrowstyle="<|-|>",
                                     connectionstyle="arc3,rad=-0.25", mutation_scale=9, color="#1b9e77"))
        ax.text((start + end) / 2, rank_h + 0.8 + 0.125 * (end - start),
                f"all-reduce ×{2 * config.num_layers + 1} a step\nall-gather ×1 (logits)", fontsize=7.5,
                ha="center", va="bottom", color="#1b9e77", linespacing=1.1)
    handles = [Rectangle((0, 0), 1, 1, facecolor=color[n], label=f"{n} ({seq_lens[n]} tokens)") for n in names]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(names), frameon=False,
              fontsize=8)
    ax.set_xlim(-1, width + 1)
    ax.set_ylim(-0.6, top + 7.9)
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return ax


def plot_speculative_step(token_ids, drafts, kept, block_table, block_size: int, text=None, first=None, ax=None,
                          title=None):
    """Stage 12: one request's step with drafts, drawn from what the engine did.

    ``token_ids``: the request's tokens before the step (all computed but the last); ``drafts``: the
    drafts scheduled with it (``scheduled_spec_decode_tokens``); ``kept``: the tokens the
    verification appended; ``block_table``: its block ids after the step; ``text``: a token's label
    (default: its id); ``first``: the first position drawn (default: the start of the block before
    the one of the last token).

    Top row, the step's input: the last token and the drafts, after tokens computed before. Under
    each draft, the target's verdict: kept (✓), rejected (✗), never looked at (–, it followed a
    rejected one). Then the tokens the request keeps: the accepted drafts and one token of the
    target's own (a bonus when every draft is kept). Bottom row, the request's slots, block by
    block: K/V from earlier steps, written by this step and kept, written by this step and rolled
    back (past the tokens: never read, and overwritten as the sequence grows), and free slots.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    token_ids, drafts, kept = list(token_ids), list(drafts), list(kept)
    n, d = len(token_ids), len(drafts)
    accepted = 0
    while accepted < min(d, len(kept)) and drafts[accepted] == kept[accepted]:
        accepted += 1
    own = n + accepted if len(kept) > accepted else None  # the target's token, unless a stop came first
    label = text or str
    first = max(0, ((n - 1) // block_size - 1) * block_size) if first is None else first
    last = n + d - 1 + (accepted == d)  # the last draft's position, or the bonus token's
    slots_end = ((last - 1) // block_size + 1) * block_size  # the end of the last block drawn
    computed_after = n + accepted if own is not None else n + len(kept) - 1
    if ax is None:
        _, ax = plt.subplots(figsize=(7.2, 3.2), layout="constrained")
    grey, blue, orange, green, purple, red = "#d9d9d9", "#6baed6", "#fd8d3c", "#41ab5d", "#807dba", _RED

    def cell(x, y, face, word="", edge="#555555", hatch=None, color="#111111", size=7.5, w=0.92, h=0.8):
        ax.add_patch(Rectangle((x - w / 2, y), w, h, facecolor=face, edgecolor=edge, linewidth=0.7, hatch=hatch))
        if word:
            ax.text(x, y + h / 2, word, ha="center", va="center", fontsize=size, color=color)

    def short(token):
        word = label(token).replace("\n", "⏎").replace(" ", "␣")
        return word if len(word) <= 7 else word[:6] + "…"

    rows = {"position": 4.25, "the step's input": 3.3, "verdict": 2.45, "kept": 1.45, "slots (K/V)": 0.0}
    for name, y in rows.items():
        ax.text(first - 0.7, y + (0.4 if name != "position" else 0.1), name, ha="right", va="center", fontsize=8,
                weight="bold" if name != "position" else "normal", color="#333333")
    for pos in range(first, last + 1):
        ax.text(pos, rows["position"] + 0.1, str(pos), ha="center", va="center", fontsize=6.5, color="#555555")
    for pos in range(first, n):  # the tokens before the step; the last one is this step's first input
        if pos == n - 1:
            cell(pos, rows["the step's input"], blue, short(token_ids[pos]))
        else:
            cell(pos, rows["the step's input"], grey, short(token_ids[pos]), edge="#aaaaaa", color="#555555")
    for j, token in enumerate(drafts):
        pos = n + j
        cell(pos, rows["the step's input"], orange, short(token))
        mark, colour = ("✓", green) if j < accepted else ("✗", red) if j == accepted else ("–", "#999999")
        ax.text(pos, rows["verdict"] + 0.4, mark, ha="center", va="center", fontsize=12, color=colour, weight="bold")
    for j, token in enumerate(kept):
        pos = n + j
        cell(pos, rows["kept"], green if j < accepted else purple, short(token), color="white")
    if own is not None:
        why = ("a bonus token:\nevery draft kept" if accepted == d
               else "the target's token in\nthe rejected draft's place")
        ax.text(own + 0.6, rows["kept"] + 0.4, why, ha="left", va="center", fontsize=7, color=purple, linespacing=1.0)
    arrow_y = rows["position"] + 0.45
    ax.annotate("", xy=(n - 1.45, arrow_y), xytext=(n + d - 0.55, arrow_y),
                arrowprops={"arrowstyle": "<->", "color": "#333333", "lw": 0.8})
    ax.text(n + (d - 1) / 2, arrow_y + 0.12, f"one forward pass: the last token and {d} drafts, {1 + d} tokens of "
            "the budget", ha="center", va="bottom", fontsize=7, color="#333333")
    written = range(n - 1, n + d)  # the K/V this step wrote
    for pos in range(first, slots_end):
        if pos < n - 1:
            cell(pos, rows["slots (K/V)"], "#9ecae1", edge="#777777")
        elif pos in written and pos < computed_after:
            cell(pos, rows["slots (K/V)"], green, edge="#777777")
        elif pos in written:
            cell(pos, rows["slots (K/V)"], "#fcbba1", edge=red, hatch="///")
        else:
            cell(pos, rows["slots (K/V)"], "white", edge="#bbbbbb")
    for start in range(first, slots_end, block_size):
        index = start // block_size
        x0, x1 = start - 0.5, start + block_size - 0.5
        ax.add_patch(Rectangle((x0, -0.05), x1 - x0, 0.9, facecolor="none", edgecolor="#333333", linewidth=1.3))
        name = f"block {int(block_table[index])}" if index < len(block_table) else "no block yet"
        ax.text((x0 + x1) / 2, -0.32, f"logical {index} → {name}", ha="center", va="center", fontsize=7,
                color="#333333")
    ax.plot([computed_after - 0.5] * 2, [-0.1, 0.95], color="#333333", lw=1.4)
    ax.text(computed_after - 0.5, 1.02, f"num_computed_tokens: {computed_after}", ha="center", va="bottom", fontsize=7,
            color="#333333")
    handles = [Patch(facecolor="#9ecae1", edgecolor="#777777", label="K/V from earlier steps"),
               Patch(facecolor=green, edgecolor="#777777", label="written, kept"),
               Patch(facecolor="#fcbba1", edgecolor=red, hatch="///", label="written, rolled back"),
               Patch(facecolor=orange, edgecolor="#555555", label="draft"),
               Patch(facecolor=purple, edgecolor="#555555", label="the target's own token")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(handles), frameon=False,
              fontsize=7.5, handlelength=1.4, columnspacing=1.2)
    ax.set_xlim(first - 3.7, max(slots_end, last + 1) + 1.6)
    ax.set_ylim(-0.55, 5.15)
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return ax


def plot_hybrid_block_tables(tables, null_block: int, groups=None, labels=None, ax=None, title=None):
    """Stage 15: one request's block table in each KV cache group, step after step.

    ``tables[k]``: the request's block ids in each group after step ``k`` (one list per group, as
    ``HybridKVCacheCoordinator.block_ids`` gives them); ``null_block``: the coordinator's null block;
    ``groups``: the ``KVCacheGroupSpec`` of each group, to name them (default: "group g"); ``labels``:
    a label per step (default: "step k").

    One row per step, top to bottom, the groups' tables side by side, each entry its block id in
    the group's colour, outlined in black in the step that took it. An entry that the window gave
    back holds the null block: hatched grey, outlined in red in the step that gave it back. At the
    right of each row, the blocks the request holds (the null block is nobody's).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    tables = [[list(map(int, group)) for group in step] for step in tables]
    num_groups = len(tables[0])
    labels = labels or [f"step {k}" for k in range(len(tables))]
    names = [f"group {g}" for g in range(num_groups)] if groups is None else [
        ("full attention" if getattr(g.spec, "sliding_window", None) is None else f"window {g.spec.sliding_window}")
        + f" · layers {', '.join(map(str, g.layer_ids))}" for g in groups]
    widths = [max(len(step[g]) for step in tables) for g in range(num_groups)]
    gap = 1.2
    starts = [sum(widths[:g]) + gap * g for g in range(num_groups)]
    right = starts[-1] + widths[-1]
    if ax is None:
        _, ax = plt.subplots(figsize=(7.2, 0.36 * len(tables) + 1.3), layout="constrained")
    null_face = "#f2f2f2"
    for k, step in enumerate(tables):
        y = len(tables) - 1 - k
        before = tables[k - 1] if k else [[] for _ in range(num_groups)]
        ax.text(-0.3, y + 0.4, str(labels[k]), ha="right", va="center", fontsize=9)
        for g, blocks in enumerate(step):
            color = SEQ_COLORS[g % len(SEQ_COLORS)]
            for j, block_id in enumerate(blocks):
                x = starts[g] + j
                earlier = before[g][j] if j < len(before[g]) else None
                if block_id == null_block:
                    given_back = earlier is not None and earlier != null_block
                    ax.add_patch(Rectangle((x, y), 0.9, 0.8, facecolor=null_face, edgecolor=_RED if given_back
                                           else "#bbbbbb", lw=2.0 if given_back else 0.6, **_HATCHING))
                    continue
                taken = earlier != block_id
                ax.add_patch(Rectangle((x, y), 0.9, 0.8, facecolor=color, alpha=0.7, lw=0))
                ax.add_patch(Rectangle((x, y), 0.9, 0.8, facecolor="none", edgecolor="black" if taken else color,
                                       lw=1.6 if taken else 0.8))
                ax.text(x + 0.45, y + 0.4, str(block_id), ha="center", va="center", fontsize=9)
        held = sum(b != null_block for blocks in step for b in blocks)
        ax.text(right + 0.3, y + 0.4, f"{held} held", ha="left", va="center", fontsize=9, color="#444444")
    for g in range(num_groups):
        ax.text(starts[g], len(tables) + 0.45, names[g], ha="left", va="bottom", fontsize=9,
                color=SEQ_COLORS[g % len(SEQ_COLORS)], weight="bold")
        for j in range(widths[g]):
            ax.text(starts[g] + j + 0.45, len(tables) - 0.1, str(j), ha="center", va="bottom", fontsize=8,
                    color="#666666")
    ax.text(-0.3, len(tables) - 0.1, "logical block", ha="right", va="bottom", fontsize=8, color="#666666")
    handles = [Patch(facecolor="white", edgecolor="black", lw=1.6, label="taken in this step"),
               Patch(facecolor=null_face, edgecolor="#bbbbbb", lw=0.6, label=f"the null block ({null_block})",
                     **_HATCHING),
               Patch(facecolor=null_face, edgecolor=_RED, lw=2.0, label="given back in this step", **_HATCHING)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 0), ncol=len(handles), frameon=False,
              fontsize=9, borderaxespad=0)
    ax.set_xlim(-3.2, right + 2.6)
    ax.set_ylim(-0.1, len(tables) + 1.1)
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return ax
