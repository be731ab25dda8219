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
