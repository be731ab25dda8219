"""Pictures for the tutorials and the docs (matplotlib is imported only when drawing)."""

from __future__ import annotations

from minipaged.simulate import KINDS, SimulationResult
from minipaged.stage0_contiguous import ContiguousKVCache

COLORS = {
    "token": "#2b8cbe",
    "reserved": "#a6bddb",
    "internal": "#fdae6b",
    "external": "#e6550d",
    "free": "#f0f0f0",
}


def plot_arena(cache: ContiguousKVCache, next_reservation: int | None = None, ax=None, title=None):
    """Draw the arena as one row of slots, coloured by kind; label each slab by request."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.4))
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
        ax.text(slab.start + slab.size / 2, 0.5, str(slab.request_id), ha="center", va="center")
    for start, length in cache.holes():
        small = next_reservation is not None and length < next_reservation
        ax.broken_barh([(start, length)], (0, 1), color=COLORS["external" if small else "free"])
    ax.set_xlim(0, cache.num_slots)
    ax.set_yticks([])
    ax.set_xlabel("slot")
    if title:
        ax.set_title(title, loc="left")
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in KINDS],
              ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.6), frameon=False)
    return ax


def plot_usage(results: list[SimulationResult], ax=None, labels=None):
    """A stacked bar per result: the share of memory per kind of slot."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
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


def plot_block_tables(manager, ax=None, title=None, seq_ids=None, colors=None):
    """Each sequence's logical blocks (top rows) and the physical blocks they map to (bottom).

    Logical blocks show the physical id they map to and how full they are; physical
    blocks are coloured by their owner, hatched and marked ``xN`` when N sequences share
    them, grey when free. ``colors`` maps sequence ids to colours (to keep them across
    pictures).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    seq_ids = list(manager.block_tables) if seq_ids is None else list(seq_ids)
    num_blocks, block_size = manager.num_total_blocks, manager.block_size
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6, 0.45 * num_blocks + 2), 1.0 + 0.55 * len(seq_ids) + 1.2))
    owners: dict[int, list] = {}
    for seq_id in seq_ids:
        for block_id in manager.block_tables[seq_id].block_ids:
            owners.setdefault(block_id, []).append(seq_id)
    color = {s: SEQ_COLORS[i % len(SEQ_COLORS)] for i, s in enumerate(seq_ids)}
    color.update(colors or {})
    bottom = -1.6
    for row, seq_id in enumerate(seq_ids):
        y = len(seq_ids) - 1 - row
        table = manager.block_tables[seq_id]
        ax.text(-0.4, y + 0.4, str(seq_id), ha="right", va="center")
        for j, block_id in enumerate(table.block_ids):
            fill = min(block_size, table.num_tokens - j * block_size) / block_size
            ax.add_patch(Rectangle((j, y), 0.9, 0.8, facecolor="white", edgecolor=color[seq_id]))
            ax.add_patch(Rectangle((j, y), 0.9 * fill, 0.8, facecolor=color[seq_id], alpha=0.35))
            ax.text(j + 0.45, y + 0.4, str(block_id), ha="center", va="center", fontsize=8)
            ax.plot([j + 0.45, block_id + 0.45], [y, bottom + 0.8], color=color[seq_id], alpha=0.4, lw=1)
    for block_id in range(num_blocks):
        holders = owners.get(block_id, [])
        face = "#eeeeee" if not holders else color[holders[0]] if len(holders) == 1 else "#bbbbbb"
        ax.add_patch(Rectangle((block_id, bottom), 0.9, 0.8, facecolor=face, edgecolor="black",
                               hatch="//" if len(holders) > 1 else None, lw=0.6))
        label = f"x{len(holders)}" if len(holders) > 1 else str(block_id)
        ax.text(block_id + 0.45, bottom + 0.4, label, ha="center", va="center", fontsize=7)
    ax.text(-0.4, bottom + 0.4, "physical", ha="right", va="center")
    ax.set_xlim(-2.5, max(num_blocks, 1) + 0.5)
    ax.set_ylim(bottom - 0.3, len(seq_ids) + 0.1)
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left")
    return ax
