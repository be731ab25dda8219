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


def plot_gather(block_table, seq_len: int, block_size: int, num_blocks: int, ax=None, title=None):
    """How a block table drives the gather: physical slots (top) to contiguous K/V rows (bottom)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    block_table = [int(b) for b in block_table]
    width = num_blocks * block_size
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.8))
    for block_id in range(num_blocks):  # the physical cache, slot by slot
        ax.add_patch(Rectangle((block_id * block_size, 2), block_size, 1, facecolor="#eeeeee",
                               edgecolor="black", lw=0.8))
        ax.text(block_id * block_size + block_size / 2, 3.25, f"block {block_id}", ha="center", fontsize=7)
    for t in range(seq_len):
        logical = t // block_size
        color = SEQ_COLORS[logical % len(SEQ_COLORS)]
        x_phys = block_table[logical] * block_size + t % block_size
        x_cont = t * width / max(seq_len, 1) * 0.6 + width * 0.2
        w_cont = width / max(seq_len, 1) * 0.6
        ax.add_patch(Rectangle((x_phys, 2), 1, 1, facecolor=color, alpha=0.8))
        ax.add_patch(Rectangle((x_cont, 0), w_cont, 1, facecolor=color, alpha=0.8, edgecolor="white"))
        ax.plot([x_phys + 0.5, x_cont + w_cont / 2], [2, 1], color=color, alpha=0.35, lw=0.8)
    ax.text(width * 0.2 - 1, 0.5, "gathered K/V", ha="right", va="center", fontsize=8)
    ax.set_xlim(-width * 0.02, width * 1.02)
    ax.set_ylim(-0.3, 3.6)
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left")
    return ax


def plot_split_kv(seq_len: int, partition_size: int, tile: int, ax=None):
    """Split-KV: partitions of the context, each a program producing (m, l, acc), then a reduce."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3))
    parts = -(-seq_len // partition_size)
    for p in range(parts):
        start, end = p * partition_size, min((p + 1) * partition_size, seq_len)
        color = SEQ_COLORS[p % len(SEQ_COLORS)]
        for t in range(start, end, tile):
            ax.add_patch(Rectangle((t, 2), min(tile, end - t), 0.8, facecolor=color, alpha=0.5,
                                   edgecolor="white"))
        mid = (start + end) / 2
        ax.text(mid, 2.95, f"program {p}\ntokens {start}-{end - 1}", ha="center", fontsize=8)
        half = 0.45 * min(partition_size, end - start)
        ax.add_patch(Rectangle((mid - half, 0.9), 2 * half, 0.5, facecolor=color, alpha=0.8))
        ax.text(mid, 1.15, f"m{p}, l{p}, acc{p}", ha="center", va="center", fontsize=8, color="white")
        ax.add_patch(FancyArrowPatch((mid, 2), (mid, 1.4), arrowstyle="->", mutation_scale=10))
        ax.add_patch(FancyArrowPatch((mid, 0.9), (seq_len / 2, 0.35), arrowstyle="->", mutation_scale=10))
    ax.text(seq_len / 2, 0.1, "reduce: out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p",
            ha="center", fontsize=9)
    ax.set_xlim(-seq_len * 0.02, seq_len * 1.02)
    ax.set_ylim(-0.2, 3.6)
    ax.axis("off")
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
        _, ax = plt.subplots(figsize=(10, 0.35 * len(seq_ids) + 1.2))
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
    ax.legend(handles=[Patch(color=c, label=k) for k, c in STATUS_COLORS.items() if k != "finished"]
              + [plt.Line2D([], [], color="#d95f02", marker="x", ls="", label="preempted")],
              loc="upper left", bbox_to_anchor=(1, 1), frameon=False)
    if title:
        ax.set_title(title, loc="left")
    return ax
