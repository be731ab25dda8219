"""Draw the documentation's diagrams as SVG files in docs/figures/, from minipaged's own classes.

The pictures are drawn from real allocators and block managers, so a diagram cannot say
something the code does not do. ``make docs-build`` runs this before building the site.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minipaged import BlockAllocator, BlockSpaceManager  # noqa: E402
from minipaged.stage3_copy_on_write import CowBlockSpaceManager, RefCountedBlockAllocator  # noqa: E402

OUT = ROOT / "docs" / "figures"
OWNER_COLORS = {"A": "#4c72b0", "B": "#dd8452", "C": "#55a868", "D": "#c44e52", None: "#eeeeee"}
plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "minipaged", "font.size": 11,
                     "font.family": "sans-serif"})


def _block(ax, x, y, w, h, label, color, text_color="white", edge="#333333", lw=1.0, dashed=False):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=edge, linewidth=lw,
                           linestyle="--" if dashed else "-"))
    ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", color=text_color, fontsize=10)


def _save(fig, name):
    OUT.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT / name, bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


def block_pool():
    """Stage 1: three requests take blocks from one pool; one returns one, the pool reuses it."""
    pool = BlockAllocator(8)
    owner = {}
    for name, count in [("A", 2), ("B", 1), ("C", 2), ("D", 1)]:
        for block in pool.allocate(count):
            owner[block] = name
    pool.free([b for b, n in owner.items() if n == "B"][0])
    owner = {b: n for b, n in owner.items() if not pool.is_free(b)}
    fig, ax = plt.subplots(figsize=(7.0, 1.35))
    for block in range(pool.num_total_blocks):
        name = owner.get(block)
        _block(ax, block, 0, 0.94, 1, f"{block}\n{name or 'free'}", OWNER_COLORS[name],
               "white" if name else "#555555")
    ax.set_xlim(-0.1, pool.num_total_blocks)
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"physical blocks: {pool.num_free_blocks} of {pool.num_total_blocks} free; "
                 "any free block serves any request", fontsize=10)
    ax.axis("off")
    _save(fig, "block_pool.svg")


def block_table():
    """Stage 2: a sequence of 41 tokens, block size 16, its logical blocks mapped to scattered physical ones."""
    pool = BlockAllocator(8)
    pool.allocate(8)
    for block in (7, 1, 3):  # other sequences finished and gave these back
        pool.free(block)
    manager = BlockSpaceManager(pool, block_size=16)
    manager.allocate("A", list(range(41)))
    table = manager.get_block_table("A")
    fig, ax = plt.subplots(figsize=(7.0, 2.6))
    ax.text(-0.3, 2.45, f"sequence A, 41 tokens: block table {list(table)}", fontsize=10, va="center")
    for logical, physical in enumerate(table):
        first, last = logical * 16, min(logical * 16 + 15, 40)
        _block(ax, logical * 2.0, 1.5, 1.8, 0.7, f"logical {logical}\ntokens {first}–{last}",
               OWNER_COLORS["A"])
        ax.add_patch(FancyArrowPatch((logical * 2.0 + 0.9, 1.5), (physical * 0.9 + 0.42, 0.62),
                                     arrowstyle="-|>", mutation_scale=12, color="#333333"))
    for block in range(8):
        used = block in table
        _block(ax, block * 0.9, 0, 0.84, 0.6, str(block), OWNER_COLORS["A" if used else None],
               "white" if used else "#555555")
    ax.text(7.35, 0.3, "physical\nblocks", fontsize=9, va="center")
    ax.text(6.1, 1.85, "the last block is\nfilled 9 of 16", fontsize=9, va="center", color="#333333")
    ax.set_xlim(-0.4, 8.2)
    ax.set_ylim(-0.1, 2.7)
    ax.axis("off")
    _save(fig, "block_table.svg")


def copy_on_write():
    """Stage 3: two samples share their blocks after fork; the first write to the shared last block copies it."""
    pool = RefCountedBlockAllocator(6)
    manager = CowBlockSpaceManager(pool, block_size=4)
    manager.allocate("s1", [1, 2, 3, 4, 5, 6])
    manager.fork("s1", "s2")
    before = {s: list(manager.get_block_table(s)) for s in ("s1", "s2")}
    counts_before = {b: pool.ref_count(b) for b in before["s1"]}
    manager.append_slot("s1")
    copies = manager.take_copies()
    after = {s: list(manager.get_block_table(s)) for s in ("s1", "s2")}
    counts_after = {b: pool.ref_count(b) for t in after.values() for b in t}
    fig, axes = plt.subplots(1, 2, figsize=(7.2, 2.9))
    panels = [(axes[0], "after fork:\nboth samples point to the same blocks", before, counts_before, set()),
              (axes[1], f"sample 1 appends a token:\nshared block {copies[0][0]} is copied to block "
               f"{copies[0][1]}", after, counts_after, {copies[0][1]})]
    for ax, title, tables, counts, copied in panels:
        blocks = sorted({b for t in tables.values() for b in t})
        x_of = {b: i * 1.7 for i, b in enumerate(blocks)}
        for row, seq in enumerate(("s1", "s2")):
            y = 2.35 if row == 0 else -0.35
            ax.text(-0.3, y, f"sample {row + 1}: {tables[seq]}", ha="right", va="center", fontsize=9.5)
            for block in tables[seq]:
                target = (x_of[block] + 0.75, 1.45 if row == 0 else 0.55)
                ax.add_patch(FancyArrowPatch((-0.25, y), target, arrowstyle="-|>", mutation_scale=10,
                                             color="#777777"))
        for block in blocks:
            color = "#8172b3" if counts[block] > 1 else ("#c44e52" if block in copied else OWNER_COLORS["A"])
            label = f"block {block}\nrefs {counts[block]}"
            _block(ax, x_of[block], 0.55, 1.5, 0.9, label, color)
        ax.set_title(title, fontsize=9.5)
        ax.set_xlim(-2.3, 3 * 1.7 + 0.1)
        ax.set_ylim(-0.7, 2.7)
        ax.axis("off")
    _save(fig, "copy_on_write.svg")


def engine_components():
    """Stage 7: which component calls which, through which public methods."""
    boxes = {  # name: (x, y) of the lower-left corner
        "LLM": (0.0, 2.2), "LLMEngine": (3.0, 2.2), "Scheduler": (6.0, 3.6), "block manager": (9.8, 3.6),
        "allocator": (9.8, 5.0), "ModelRunner": (6.0, 0.8), "PagedKVCache": (9.8, 0.8), "Sampler": (3.0, 0.0),
    }
    edges = [("LLM", "LLMEngine", "add_request\nstep"), ("LLMEngine", "Scheduler", "schedule\nfinish"),
             ("Scheduler", "block manager", "allocate, append_slot\nswap_out, swap_in"),
             ("block manager", "allocator", "allocate, free"), ("LLMEngine", "ModelRunner", "execute"),
             ("ModelRunner", "block manager", "slot_mapping\nblock_tables_tensor"),
             ("ModelRunner", "PagedKVCache", "write, copy_blocks\nswap"), ("LLMEngine", "Sampler", "logits")]
    w, h = 2.1, 0.6
    fig, ax = plt.subplots(figsize=(7.2, 3.9))

    def border(center, toward):  # where the line from a box's centre toward a point leaves the box
        dx, dy = toward[0] - center[0], toward[1] - center[1]
        t = min((w / 2 + 0.08) / abs(dx) if dx else float("inf"), (h / 2 + 0.08) / abs(dy) if dy else float("inf"))
        return center[0] + t * dx, center[1] + t * dy

    centers = {name: (x + w / 2, y + h / 2) for name, (x, y) in boxes.items()}
    for a, b, label in edges:
        start, end = border(centers[a], centers[b]), border(centers[b], centers[a])
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color="#555555"))
        middle = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
        if abs(start[1] - end[1]) < 0.01:  # a horizontal arrow: its label above it
            middle = (middle[0], middle[1] + 0.4)
        elif abs(start[0] - end[0]) < 0.01:  # a vertical arrow: its label beside it
            middle = (middle[0] + 0.75, middle[1])
        ax.text(*middle, label, ha="center", va="center",
                fontsize=8, color="#333333", bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    for name, (x, y) in boxes.items():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", facecolor="#e8eaf6",
                                    edgecolor="#3f51b5"))
        ax.text(x + w / 2, y + h / 2, name, ha="center", va="center", fontsize=10)
    ax.set_xlim(-0.1, 12.0)
    ax.set_ylim(-0.1, 5.7)
    ax.axis("off")
    _save(fig, "engine_components.svg")


def paged_memory():
    """Home page: the same three requests in contiguous slabs and in blocks."""
    requests = {"A": (14, 40), "B": (30, 40), "C": (7, 40)}  # tokens held, slab reserved (max_model_len)
    fig, axes = plt.subplots(2, 1, figsize=(7.2, 3.0), gridspec_kw={"height_ratios": [1, 1.25]})
    ax = axes[0]
    x = 0
    for name, (tokens, reserved) in requests.items():
        ax.add_patch(Rectangle((x, 0), tokens, 1, facecolor=OWNER_COLORS[name], edgecolor="none"))
        ax.add_patch(Rectangle((x + tokens, 0), reserved - tokens, 1, facecolor=OWNER_COLORS[name],
                               alpha=0.25, edgecolor="none"))
        ax.add_patch(Rectangle((x, 0), reserved, 1, facecolor="none", edgecolor="#333333"))
        ax.text(x + tokens / 2, 0.5, name, color="white", ha="center", va="center", fontsize=10)
        x += reserved
    ax.add_patch(Rectangle((x, 0), 20, 1, facecolor=OWNER_COLORS[None], edgecolor="#333333"))
    ax.text(x + 10, 0.5, "too small for\na 4th slab", ha="center", va="center", fontsize=8, color="#555555")
    held = sum(t for t, _ in requests.values())
    ax.set_title(f"contiguous: one slab of max_model_len per request; {held} of {x} reserved slots hold "
                 "K/V (pale: reserved, never used)", fontsize=9)
    ax.set_xlim(0, x + 20)
    ax.set_ylim(0, 1)
    ax.axis("off")

    ax = axes[1]
    pool = BlockAllocator(16)
    manager = BlockSpaceManager(pool, block_size=8)
    for name, (tokens, _) in requests.items():  # interleaved arrivals: tables are scattered
        manager.allocate(name, list(range(min(tokens, 8))))
    for name, (tokens, _) in requests.items():
        for _ in range(tokens - min(tokens, 8)):
            manager.append_slot(name)
    held = {block: (name, min(8, requests[name][0] - index * 8))  # block: (owner, tokens in it)
            for name in requests for index, block in enumerate(manager.get_block_table(name))}
    for block in range(pool.num_total_blocks):
        owner, filled = held.get(block, (None, 0))
        ax.add_patch(Rectangle((block * 8.5, 0), 8, 1, facecolor=OWNER_COLORS[owner], edgecolor="#333333"))
        if owner and filled < 8:
            ax.add_patch(Rectangle((block * 8.5 + filled, 0), 8 - filled, 1, facecolor="white", alpha=0.6,
                                   edgecolor="none"))
        ax.text(block * 8.5 + 4, 0.5, f"{block}\n{owner or ''}", ha="center", va="center", fontsize=8,
                color="white" if owner else "#777777")
    used = pool.num_total_blocks - pool.num_free_blocks
    tables = ", ".join(f"{n}: {list(manager.get_block_table(n))}" for n in requests)
    ax.set_title(f"paged, blocks of 8: {used} blocks in use, {pool.num_free_blocks} free for more requests\n"
                 f"block tables  {tables}", fontsize=9)
    ax.set_xlim(0, 16 * 8.5)
    ax.set_ylim(0, 1)
    ax.axis("off")
    fig.tight_layout()
    _save(fig, "paged_memory.svg")


def main():
    for draw in (block_pool, block_table, copy_on_write, engine_components, paged_memory):
        draw()
    print(f"wrote {len(list(OUT.glob('*.svg')))} figures to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
