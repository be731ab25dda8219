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
from matplotlib import font_manager  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minipaged import (  # noqa: E402
    BlockAllocator,
    BlockSpaceManager,
    ContiguousKVCache,
    CowBlockSpaceManager,
    PrefixCachingAllocator,
    PrefixCachingBlockSpaceManager,
    RefCountedBlockAllocator,
    Sampler,
    SamplingParams,
    Scheduler,
    SharingEngine,
    SwapBlockSpaceManager,
)
from minipaged.learn.viz import (  # noqa: E402
    plot_arena,
    plot_block_tables,
    plot_gather,
    plot_schedule,
    plot_split_kv,
)
from minipaged.perf.kernel_report import GPUS  # noqa: E402
from minipaged.perf.simulate import (  # noqa: E402
    OPT_13B_KV_BUDGET,
    OPT_13B_KV_BYTES_PER_TOKEN,
    OPT_13B_WEIGHT_BYTES,
    SimulatedRunner,
    decode_bend,
    decode_bound,
    requests_that_fit,
    simulated_engine,
)

OUT = ROOT / "docs" / "figures"
OWNER_COLORS = {"A": "#4c72b0", "B": "#dd8452", "C": "#55a868", "D": "#c44e52", None: "#eeeeee"}
# Over matplotlib's defaults, whatever a matplotlibrc says: the same code draws the same bytes (the ids
# of clip paths come from the salt, the file carries no date), so a test can redraw every figure and
# compare it with the committed one.
RC = {"svg.fonttype": "none", "svg.hashsalt": "minipaged", "font.size": 11, "font.family": "sans-serif",
      # the axes fill the figure (the saved file is cropped to what is drawn), so a figure
      # 7.2 inches wide is shown about 690 px wide, the width of a page's column
      "figure.subplot.left": 0.0, "figure.subplot.right": 1.0,
      "figure.subplot.bottom": 0.0, "figure.subplot.top": 1.0}
plt.rcdefaults()
plt.rcParams.update(RC)
# The Chinese figures' font: Debian's fonts-noto-cjk (`make browser` installs it). Latin letters and digits
# stay in DejaVu Sans, as in the English figures; only the Chinese characters fall back to it.
CJK_FAMILY = "Noto Sans CJK SC"


def _block(ax, x, y, w, h, label, color, text_color="white", edge="#333333", lw=1.0, dashed=False):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=edge, linewidth=lw,
                           linestyle="--" if dashed else "-"))
    ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", color=text_color, fontsize=10)


def cjk_font() -> str | None:
    """The Chinese figures' font family, registered with matplotlib; ``None`` where it is not installed."""
    if any(font.name == CJK_FAMILY for font in font_manager.fontManager.ttflist):
        return CJK_FAMILY
    for path in sorted(font_manager.findSystemFonts()):
        if Path(path).name == "NotoSansCJK-Regular.ttc":  # its faces: JP, KR, SC, TC, HK
            font_manager.fontManager.addfont(path)
            return CJK_FAMILY
    return None


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


def _slotted_block(ax, x, y, w, h, slots, filled, label, fontsize=10):
    """A block of ``slots`` token slots, the first ``filled`` of them holding K/V (shaded)."""
    for slot in range(slots):
        ax.add_patch(Rectangle((x + slot * w / slots, y), w / slots, h, linewidth=0.4,
                               facecolor="#9ecae1" if slot < filled else "white", edgecolor="white"))
    ax.add_patch(Rectangle((x, y), w, h, facecolor="none", edgecolor="#333333", linewidth=1.0))
    ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=fontsize, color="#111111")


def block_table():
    """Stage 2: a sequence of 41 tokens, block size 16, its logical blocks mapped to scattered physical ones."""
    pool = BlockAllocator(8)
    pool.allocate(8)
    for block in (7, 1, 3):  # other sequences finished and gave these back
        pool.free(block)
    manager = BlockSpaceManager(pool, block_size=16)
    manager.allocate("A", list(range(41)))
    table = manager.block_tables["A"]
    size = manager.block_size
    fills = {block: min(size, table.num_tokens - i * size) for i, block in enumerate(table.block_ids)}
    last = table.block_ids[-1]
    fig, ax = plt.subplots(figsize=(7.2, 2.6))
    ax.text(-0.3, 2.55, f"sequence A, {table.num_tokens} tokens, block size {size}: "
            f"block table {table.block_ids}", fontsize=10, va="center")
    for logical, physical in enumerate(table.block_ids):
        first, last_token = logical * size, logical * size + fills[physical] - 1
        _slotted_block(ax, logical * 2.0, 1.5, 1.8, 0.7, size, fills[physical],
                       f"logical {logical}\ntokens {first}–{last_token}", fontsize=9)
        ax.add_patch(FancyArrowPatch((logical * 2.0 + 0.9, 1.5), (physical * 0.9 + 0.42, 0.62),
                                     arrowstyle="-|>", mutation_scale=12, color="#333333"))
    for block in range(pool.num_total_blocks):
        if block in fills:
            _slotted_block(ax, block * 0.9, 0, 0.84, 0.6, size, fills[block], str(block))
        else:
            _block(ax, block * 0.9, 0, 0.84, 0.6, str(block), OWNER_COLORS[None], "#555555")
    ax.text(7.35, 0.3, "physical\nblocks", fontsize=9, va="center")
    ax.text(6.1, 1.85, f"block {last} holds\n{fills[last]} of {size} tokens", fontsize=9, va="center",
            color="#333333")
    ax.set_xlim(-0.4, 8.2)
    ax.set_ylim(-0.1, 2.75)
    ax.axis("off")
    _save(fig, "block_table.svg")


def copy_on_write():
    """Stage 3: two samples share a prompt of 6 tokens in blocks of 4 after a fork; the last block is
    half full, so the first sample to append copies it, and the full block stays shared."""
    manager = CowBlockSpaceManager(RefCountedBlockAllocator(6), block_size=4)
    manager.allocate("prompt", range(6))
    manager.fork("prompt", "sample 1")
    manager.fork("prompt", "sample 2")
    manager.free("prompt")
    colors = {"sample 1": "#1b9e77", "sample 2": "#d95f02"}
    table = manager.block_tables["sample 1"]
    last, held = table.block_ids[-1], table.num_tokens % manager.block_size
    fig, axes = plt.subplots(2, 1, figsize=(7.2, 4.6), height_ratios=[1, 1.3])
    plot_block_tables(manager, ax=axes[0], colors=colors,
                      title=f"after fork: both hold blocks {table.block_ids}; block {last} is "
                            f"filled {held} of {manager.block_size}")
    manager.append_slot("sample 1")
    copies = manager.take_copies()
    (source, destination), = copies
    plot_block_tables(manager, ax=axes[1], colors=colors, copies=copies, legend=True,
                      title=f"sample 1 appends a token: shared block {source} is copied to block {destination}")
    fig.tight_layout(h_pad=1.5)
    _save(fig, "copy_on_write.svg")


def engine_components():
    """Stage 7: which component calls which, through which public methods."""
    boxes = {  # name: centre
        "LLM": (1.2, 3.0), "LLMEngine": (5.0, 3.0), "Scheduler": (8.9, 4.9), "block manager": (13.2, 4.9),
        "allocator": (13.2, 6.9), "ModelRunner": (8.9, 1.1), "PagedKVCache": (13.2, 1.1), "Sampler": (5.0, 0.0),
    }
    # (from, to, label, where the label's centre is, relative to the arrow's middle)
    edges = [("LLM", "LLMEngine", "add_request\nstep", (0, 0.6)),
             ("LLMEngine", "Scheduler", "schedule\nfinish", (-0.9, 0.4)),
             ("Scheduler", "block manager", "allocate, append_slot\nswap_out, swap_in", (0, 0.8)),
             ("block manager", "allocator", "allocate, free", (1.25, 0)),
             ("LLMEngine", "ModelRunner", "execute", (0.75, 0.35)),
             ("ModelRunner", "block manager", "slot_mapping\nblock_tables_tensor", (-0.5, 0.25)),
             ("ModelRunner", "PagedKVCache", "write, copy_blocks\nswap", (0, -0.8)),
             ("LLMEngine", "Sampler", "logits", (-0.55, 0))]
    w, h = 2.6, 0.8
    fig, ax = plt.subplots(figsize=(7.2, 4.1))

    def border(center, toward):  # where the line from a box's centre toward a point leaves the box
        dx, dy = toward[0] - center[0], toward[1] - center[1]
        t = min((w / 2 + 0.1) / abs(dx) if dx else float("inf"), (h / 2 + 0.1) / abs(dy) if dy else float("inf"))
        return center[0] + t * dx, center[1] + t * dy

    for a, b, label, (ox, oy) in edges:
        start, end = border(boxes[a], boxes[b]), border(boxes[b], boxes[a])
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color="#555555"))
        middle = ((start[0] + end[0]) / 2 + ox, (start[1] + end[1]) / 2 + oy)
        ax.text(*middle, label, ha="center", va="center", fontsize=9, color="#333333", linespacing=1.1,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    for name, (x, y) in boxes.items():
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02", facecolor="#e8eaf6",
                                    edgecolor="#3f51b5"))
        ax.text(x, y, name, ha="center", va="center", fontsize=10.5)
    ax.set_xlim(-0.2, 15.6)
    ax.set_ylim(-0.5, 7.4)
    ax.axis("off")
    _save(fig, "engine_components.svg")


def contiguous_waste():
    """Stage 0: three requests in a 112-slot arena under ``pow2``: every kind of waste at once."""
    cache = ContiguousKVCache(num_slots=112, max_model_len=40, policy="pow2", num_layers=0)
    for rid, prompt, output, generated in [("A", 10, 14, 6), ("B", 20, 9, 4), ("C", 5, 20, 12)]:
        cache.allocate(rid, prompt, output)  # id, prompt, output, generated so far
        cache.append(rid, prompt + generated)
    fig, ax = plt.subplots(figsize=(6.9, 1.1))
    plot_arena(cache, next_reservation=cache.reservation(12, 20), ax=ax)
    ax.legend(handles=ax.get_legend().legend_handles, loc="upper center", bbox_to_anchor=(0.5, -0.55),
              ncol=5, frameon=False, fontsize=9)
    _save(fig, "contiguous_waste.svg")


def gather():
    """Stage 4: a sequence of 11 tokens in blocks of 4, its table built by a real block manager."""
    pool = BlockAllocator(6)
    manager = BlockSpaceManager(pool, block_size=4)
    for other in range(6):  # other sequences hold every block, then finish one by one
        manager.allocate(other, range(4))
    manager.free(5)
    manager.allocate("A", range(4))
    for freed, upto in ((1, 8), (3, 11)):
        manager.free(freed)
        while manager.block_tables["A"].num_tokens < upto:
            manager.append_slot("A")
    table = manager.block_tables["A"]
    fig, ax = plt.subplots(figsize=(7.2, 3.0))
    plot_gather(table.block_ids, seq_len=table.num_tokens, block_size=manager.block_size,
                num_blocks=pool.num_total_blocks, ax=ax)
    _save(fig, "gather.svg")


def split_kv():
    """Stage 5: the split-KV decode of one long sequence, with the kernels' own partition size."""
    try:  # Triton installs on Linux x86_64 only; elsewhere the committed figure stays as it is
        from minipaged.stage5_triton_attention import PARTITION_SIZE
    except ImportError:
        print("no Triton here: split_kv.svg left as it is")
        return
    with plt.rc_context({"svg.fonttype": "path"}):  # the formula's glyphs drawn, not left to the browser
        fig, ax = plt.subplots(figsize=(7.2, 2.6))
        plot_split_kv(seq_len=1900, partition_size=PARTITION_SIZE, tile=64, ax=ax)
        _save(fig, "split_kv.svg")


def schedule():
    """Stage 6: six requests, four blocks of 16: the real scheduler preempts the newest, by swapping."""
    engine = simulated_engine(4, 16, 64, preemption_mode="swap", num_cpu_blocks=16)
    scheduler = engine.scheduler
    for request_id, prompt in enumerate([5, 4, 6, 3, 5, 4]):
        engine.add_request(request_id, {"prompt_token_ids": [1] * prompt},
                           SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    history = []
    while engine.has_unfinished_requests():
        engine.step()
        history.append({group.request_id: group.seqs[0].status.value
                        for queue in (scheduler.waiting, scheduler.running, scheduler.swapped) for group in queue})
    fig, ax = plt.subplots(figsize=(6.2, 2.2))
    plot_schedule(history, labels={i: f"request {i}" for i in range(6)}, ax=ax)
    ax.set_ylabel("")
    ax.legend(handles=ax.get_legend().legend_handles, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=4,
              frameon=False, fontsize=10)
    _save(fig, "schedule.svg")


def parallel_sampling():
    """Stage 8: one request of 4 samples: one prefill, then forks that share the prompt's blocks."""
    manager = SwapBlockSpaceManager(RefCountedBlockAllocator(16), block_size=4)
    scheduler = Scheduler(manager, max_model_len=32)
    runner = SimulatedRunner()
    engine = SharingEngine(scheduler, runner, Sampler(), vocab_size=runner.vocab_size)
    request = engine.add_request("p", {"prompt_token_ids": [1, 0, 1, 1, 0, 0, 1, 0, 1, 1]},
                                 SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True))
    for _ in range(3):
        engine.step()
    rows = {f"sample {i}": seq.seq_id for i, seq in enumerate(request.seqs)}
    fig, ax = plt.subplots(figsize=(7.2, 3.5))
    plot_block_tables(manager, rows, num_blocks=8, ax=ax, legend=True)
    _save(fig, "parallel_sampling.svg")


def prefix_cache():
    """Stage 9: three requests with one system prompt: its full blocks are computed once, then found."""
    manager = PrefixCachingBlockSpaceManager(PrefixCachingAllocator(12), block_size=4)
    scheduler = Scheduler(manager, max_model_len=32)
    runner = SimulatedRunner()
    engine = SharingEngine(scheduler, runner, Sampler(), vocab_size=runner.vocab_size)
    system = [1, 0, 0, 1, 1, 1, 0, 1, 0, 0]  # 10 tokens: two full blocks of 4, and 2 more
    questions = [[1, 1, 0], [0, 1, 0, 0, 1], [0, 0, 1, 1]]
    requests = {}
    for i, question in enumerate(questions):
        requests[f"request {i}"] = engine.add_request(i, {"prompt_token_ids": system + question},
                                                      SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        engine.step()  # admitted: its prompt's full blocks are looked up
        engine.step()  # its first decode: its own full prompt blocks become findable
    rows = {name: r.seqs[0].seq_id for name, r in requests.items()}
    fig, ax = plt.subplots(figsize=(7.2, 3.1))
    plot_block_tables(manager, rows, ax=ax, legend=True)
    _save(fig, "prefix_cache.svg")


HOME_TOKENS = {"A": 14, "B": 30, "C": 7}  # the home figure's requests: the tokens each holds now
HOME_MAX_MODEL_LEN = 40  # the longest a request may become: the slab policy `max` reserves
HOME_BLOCKS, HOME_BLOCK_SIZE = 18, 8  # the paged half; the contiguous half has as many slots


def home_contiguous() -> ContiguousKVCache:
    """The home figure's contiguous half: its requests admitted in order under policy ``max``, each
    holding its tokens. The slabs do not depend on the output lengths, which nobody knows yet."""
    cache = ContiguousKVCache(HOME_BLOCKS * HOME_BLOCK_SIZE, HOME_MAX_MODEL_LEN, "max", num_layers=0)
    for name, tokens in HOME_TOKENS.items():
        cache.allocate(name, tokens, 0)
        cache.append(name, tokens)
    return cache


def paged_memory():
    """Home page: the same three requests in the same 144 slots, in contiguous slabs and in blocks of 8."""
    cache = home_contiguous()
    requests = HOME_TOKENS
    num_blocks, block_size = HOME_BLOCKS, HOME_BLOCK_SIZE
    slots = cache.num_slots
    fig, axes = plt.subplots(2, 1, figsize=(7.2, 3.0), gridspec_kw={"height_ratios": [1, 1.25]})
    ax = axes[0]
    for slab in cache.slabs.values():
        x, tokens, name = slab.start, slab.num_tokens, slab.request_id
        ax.add_patch(Rectangle((x, 0), tokens, 1, facecolor=OWNER_COLORS[name], edgecolor="none"))
        ax.add_patch(Rectangle((x + tokens, 0), slab.size - tokens, 1, facecolor=OWNER_COLORS[name],
                               alpha=0.25, edgecolor="none"))
        ax.add_patch(Rectangle((x, 0), slab.size, 1, facecolor="none", edgecolor="#333333"))
        ax.text(x + tokens / 2, 0.5, name, color="white", ha="center", va="center", fontsize=10)
    (x, free), = cache.holes()  # first fit packed the slabs from slot 0: one hole is left, at the end
    assert not cache.can_allocate(1, 0)
    ax.add_patch(Rectangle((x, 0), free, 1, facecolor=OWNER_COLORS[None], edgecolor="#333333"))
    ax.text((x + slots) / 2, 0.5, f"{free} free: too small\nfor a 4th slab", ha="center", va="center",
            fontsize=8, color="#555555")
    held = sum(slab.num_tokens for slab in cache.slabs.values())
    ax.set_title(f"contiguous, {slots} slots: one slab per request; {held} of "
                 f"{sum(slab.size for slab in cache.slabs.values())} reserved slots "
                 "hold K/V (pale: reserved, no K/V yet)", fontsize=9)
    ax.set_xlim(0, slots)
    ax.set_ylim(0, 1)
    ax.axis("off")

    ax = axes[1]
    pool = BlockAllocator(num_blocks)
    manager = BlockSpaceManager(pool, block_size=block_size)
    for name, tokens in requests.items():  # interleaved arrivals: tables are scattered
        manager.allocate(name, list(range(min(tokens, block_size))))
    for name, tokens in requests.items():
        for _ in range(tokens - min(tokens, block_size)):
            manager.append_slot(name)
    held = {block: (name, min(block_size, requests[name] - index * block_size))  # block: (owner, tokens in it)
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
    ax.set_title(f"paged, {pool.num_total_blocks} blocks of {block_size} = {pool.num_total_blocks * block_size} "
                 f"slots: {used} blocks in use, {pool.num_free_blocks} free for more requests\n"
                 f"block tables  {tables}", fontsize=9)
    ax.set_xlim(0, num_blocks * 8.5)
    ax.set_ylim(0, 1)
    ax.axis("off")
    fig.tight_layout()
    _save(fig, "paged_memory.svg")


def token_budget():
    """Stage 10: one token budget per step; decodes first, then a long prompt in chunks."""
    import torch

    from minipaged import LLM
    from minipaged.learn.viz import plot_token_budget

    torch.set_num_threads(1)
    llm = LLM("tiny", stage=10, block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    arrivals = {0: [("A", 5), ("B", 7)], 2: [("C", 40)], 3: [("D", 3)]}  # step: (request, prompt length)
    outputs, step = [], 0
    while step in arrivals or llm.engine.has_unfinished_requests() or step < max(arrivals):
        for name, length in arrivals.get(step, []):
            llm.engine.add_request(name, {"prompt_token_ids": list(range(20 * ord(name), 20 * ord(name) + length))},
                                   params)
        llm.engine.step()
        outputs.append(llm.engine.last_scheduler_output)
        step += 1
    fig, ax = plt.subplots(figsize=(7.2, 2.8), layout="constrained")
    plot_token_budget(outputs, 16, labels={"A": "A (5 tokens)", "B": "B (7)", "C": "C (40)", "D": "D (3)"}, ax=ax)
    _save(fig, "token_budget.svg")


def tensor_parallel():
    """Stage 11: the tiny model over 2 ranks; two requests' blocks, from a real block manager."""
    from minipaged.learn.viz import plot_tensor_parallel
    from minipaged.models import load_config, resolve_model_path

    manager = BlockSpaceManager(BlockAllocator(10), block_size=4)
    manager.allocate("A", list(range(4)))
    manager.allocate("B", list(range(4)))  # the two arrive together: their blocks interleave
    for name, more in (("A", 6), ("B", 2)):
        for _ in range(more):
            manager.append_slot(name)
    tables = {name: manager.get_block_table(name) for name in ("A", "B")}
    fig, ax = plt.subplots(figsize=(7.2, 3.9), layout="constrained")
    plot_tensor_parallel(load_config(resolve_model_path("tiny")), 2, tables, {"A": 10, "B": 6}, manager.block_size,
                         manager.num_total_blocks, ax=ax)
    _save(fig, "tensor_parallel.svg")


def speculative_step():
    """Stage 12: a request's first step with drafts: two kept, the third rejected, the slots rolled back."""
    import torch

    from minipaged import LLM
    from minipaged.learn.viz import plot_speculative_step

    torch.set_num_threads(1)
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    llm = LLM("tiny", block_size=4, num_gpu_blocks=64, speculative_config=config)
    engine, tokenizer = llm.engine, llm.tokenizer
    engine.add_request("A", {"prompt_token_ids": tokenizer.encode("Return the number of").ids},
                       SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    seq = engine.requests["A"].seqs[0]
    while True:  # greedy decoding until the proposer has drafts, and one step more
        before = list(seq.token_ids)
        engine.step()
        drafts = engine.last_scheduler_output.scheduled_spec_decode_tokens.get("A")
        if drafts:
            break
    kept = seq.token_ids[len(before):]
    fig, ax = plt.subplots(figsize=(7.2, 3.2), layout="constrained")
    plot_speculative_step(before, drafts, kept, llm.scheduler.block_manager.get_block_table(seq.seq_id), 4,
                          text=lambda token: tokenizer.decode([token]), ax=ax)
    _save(fig, "speculative_step.svg")


def fp8_kv_cache():
    """Stage 13: what a value becomes in e4m3 (its error against the bound), and what one byte a value buys."""
    import torch

    from minipaged.stage13_fp8_kv_cache import FP8_MAX, dequantize_fp8, fp8_rounding_bound, quantize_fp8

    x = torch.logspace(-4, float(torch.log10(torch.tensor(FP8_MAX))), 4001)
    error = (dequantize_fp8(quantize_fp8(x, 1.0), 1.0) - x).abs()
    fig, (left, right) = plt.subplots(1, 2, figsize=(7.2, 2.7), width_ratios=(1.5, 1), layout="constrained")
    left.loglog(x, (error / x).clamp(min=1e-5), lw=0.6, color="#4c72b0", label="|error| / value")
    left.loglog(x, fp8_rounding_bound(x, 1.0) / x, lw=1.4, color="#c44e52", label="the bound / value")
    left.axvline(2**-6, color="#888888", ls=":", lw=1)
    left.text(2**-6 * 1.2, 2e-5, "normals (≥ 2⁻⁶): 2⁻⁴ at most", fontsize=8.5, color="#444444")
    left.set_ylim(1e-5, 1.5)
    left.set_xlabel("value / scale", fontsize=9.5)
    left.set_title("a value stored in e4m3 and read back", fontsize=10)
    left.legend(fontsize=8.5, frameon=False, loc="upper right")
    left.tick_params(labelsize=8.5)
    fp8_slots = OPT_13B_KV_BUDGET // (OPT_13B_KV_BYTES_PER_TOKEN // 2)
    counts = {"contiguous\n(max)": requests_that_fit(1024, "max"), "paged\nfp16": requests_that_fit(1024, "paged"),
              "paged\nfp8": requests_that_fit(1024, "paged", num_slots=fp8_slots)}
    bars = right.bar(list(counts), list(counts.values()), color=["#999999", "#4c72b0", "#55a868"])
    right.bar_label(bars, fontsize=9)
    right.set_title("1,024-token requests in\nOPT-13B's 12 GiB of K/V", fontsize=10)
    right.tick_params(labelsize=8.5)
    right.set_ylim(0, max(counts.values()) * 1.2)
    for side in ("top", "right"):
        right.spines[side].set_visible(False)
    _save(fig, "fp8_kv_cache.svg")


def disaggregated_prefill():
    """Stage 14: a prompt's full blocks leave the producer's block table as files named by their hash, and
    enter the consumer's table under other block ids; the consumer computes only the last block."""
    import tempfile

    from minipaged import LLM
    from minipaged.stage14_kv_connector import prompt_block_hashes

    folder, size = tempfile.mkdtemp(), 4
    prompt = {"prompt_token_ids": list(range(101, 115))}  # 14 tokens: 3 full blocks travel, the 4th holds the last
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # still running after a step
    tables = {}
    for kv_role, other in (("kv_producer", 0), ("kv_consumer", 9)):
        llm = LLM("tiny", block_size=size, num_gpu_blocks=16, max_model_len=64, kv_transfer_config={
            "kv_role": kv_role, "kv_connector_extra_config": {"shared_storage_path": folder}})
        if other:  # another request already holds blocks here: the same K/V land in other block ids
            llm.engine.add_request("other", {"prompt_token_ids": list(range(1, 1 + other))}, params)
            llm.engine.step()
        request = llm.engine.add_request("r", prompt, params)
        llm.engine.step()
        tables[kv_role] = llm.scheduler.block_manager.get_block_table(request.seqs[0].seq_id)
    names = prompt_block_hashes(prompt["prompt_token_ids"], size)
    fig, ax = plt.subplots(figsize=(7.2, 2.9))
    w, gap, rows = 1.25, 0.35, {"kv_producer": 2.4, "kv_consumer": 0.0}
    for kv_role, y in rows.items():
        ax.text(-0.15, y + 0.3, "producer" if kv_role == "kv_producer" else "consumer", ha="right", va="center",
                fontsize=10)
        for i, block_id in enumerate(tables[kv_role]):
            filled = min(size, 14 - i * size)
            travels = i < len(names)
            label = f"block {block_id}" + ("" if travels or kv_role == "kv_producer" else "\ncomputed here")
            _slotted_block(ax, i * (w + gap), y, w, 0.6, size, filled, label, fontsize=8.5)
            if not travels and kv_role == "kv_consumer":
                ax.add_patch(Rectangle((i * (w + gap), y), w, 0.6, facecolor="none", edgecolor="#c44e52", lw=1.6))
    for i, digest in enumerate(names):
        x = i * (w + gap)
        _block(ax, x + 0.05, 1.25, w - 0.1, 0.5, f"{digest.hex()[:8]}…", "#55a868")
        ax.texts[-1].set_fontsize(8.5)
        for y0, y1 in ((2.4, 1.75), (1.25, 0.6)):
            ax.annotate("", (x + w / 2, y1), (x + w / 2, y0), arrowprops=dict(arrowstyle="->", color="#555555"))
    ax.text(-0.15, 1.5, "files, named\nby the hash", ha="right", va="center", fontsize=9)
    last = len(names) * (w + gap)
    ax.text(last + w + 0.2, 1.5, "save_kv_layer\n(in the forward, layer by layer)\nwait_for_save\n"
            "(after the forward)\n\nstart_load_kv\n(before the forward)", fontsize=8.5, va="center",
            color="#333333")
    ax.text(last + w / 2, 1.5, "the last token's\nblock: no file", ha="center", va="center", fontsize=8,
            color="#555555")
    ax.set_xlim(-1.4, last + w + 3.0)
    ax.set_ylim(-0.1, 3.1)
    ax.axis("off")
    _save(fig, "disaggregated_prefill.svg")


def hybrid_kv_cache():
    """Stage 15: a request's block tables, step by step, in a model with two full and two sliding layers."""
    from minipaged.learn.viz import plot_hybrid_block_tables
    from minipaged.stage15_hybrid_kv_cache import HybridKVCacheCoordinator
    from minipaged.stage15_kv_cache_groups import kv_cache_groups

    groups = kv_cache_groups([None, None, 8, 8], 4)  # window 8, blocks of 4
    coordinator = HybridKVCacheCoordinator(groups, 32)
    coordinator.allocate_slots("r", 0, 10)  # the prompt, 10 tokens
    tables, labels = [coordinator.block_ids("r")], ["prompt (10 tokens)"]
    for computed in range(10, 19):  # nine decode steps, each the slot of one more token
        coordinator.allocate_slots("r", computed, computed + 1)
        tables.append(coordinator.block_ids("r"))
        labels.append(f"decode, token {computed}")
    fig, ax = plt.subplots(figsize=(7.2, 4.4), layout="constrained")
    plot_hybrid_block_tables(tables, coordinator.null_block, groups, labels, ax=ax)
    _save(fig, "hybrid_kv_cache.svg")


DECODE_CONTEXT = 512  # tokens per request in stage 0's decode figure: about a ShareGPT request (161 + 338)
# Its words, in English and in Chinese (decode_throughput.zh.svg: the Chinese site shows it in its place).
DECODE_LABELS = {
    "en": {"does_not_fit": "does not fit: {context}-token requests need more\nK/V than the {budget} GiB left after "
                           "the weights",
           "curve": "batch ÷ step time; step = ({weights:.0f} GB of weights + batch × K/V) ÷ {bandwidth:,} GB/s",
           "ceiling": "ceiling {ceiling:,.0f} tokens/s: K/V alone",
           "bend": "bend at {bend:.0f}: K/V read = weights read\n{tokens:,.0f} tokens/s",
           "layouts": ("contiguous, max", "paged"),
           "point": "{name}: {batch} requests\n{tokens:,.0f} tokens/s, {ms:.1f} ms a step",
           "xlabel": "requests decoding together ({context} tokens of context each)",
           "ylabel": "tokens/s, at most"},
    "zh": {"does_not_fit": "装不下：{context} token 的请求需要的 K/V\n超过权重之外剩下的 {budget} GiB",
           "curve": "batch ÷ 每步时间；每步 = ({weights:.0f} GB 权重 + batch × K/V) ÷ {bandwidth:,} GB/s",
           "ceiling": "上限 {ceiling:,.0f} tokens/s：只读 K/V",
           "bend": "拐点 {bend:.0f}：读 K/V = 读权重\n{tokens:,.0f} tokens/s",
           "layouts": ("连续 slab（max）", "分页"),
           "point": "{name}：{batch} 个请求\n{tokens:,.0f} tokens/s，每步 {ms:.1f} ms",
           "xlabel": "同时 decode 的请求数（每个请求 {context} token 上下文）",
           "ylabel": "tokens/s 上界"},
}


def decode_throughput():
    """Stage 0's decode figure, in English and, where the Chinese font is installed, in Chinese."""
    _decode_throughput("en")
    family = cjk_font()
    if family is None:
        print(f"no {CJK_FAMILY} here: decode_throughput.zh.svg left as it is")
        return
    with plt.rc_context({"font.family": ["DejaVu Sans", family, "sans-serif"]}):
        _decode_throughput("zh")


def _decode_throughput(language):
    """Stage 0: OPT-13B's decode bound on an A100-40GB against the batch, and the batches its memory holds."""
    words = DECODE_LABELS[language]
    bend = decode_bend(DECODE_CONTEXT)
    curve = [decode_bound(b, DECODE_CONTEXT) for b in range(1, 2 * round(bend) + 1)]
    ceiling = decode_bound(1, DECODE_CONTEXT, weight_bytes=0).tokens_per_s  # were the weights free to read
    fits = {"max": requests_that_fit(DECODE_CONTEXT, "max"), "paged": requests_that_fit(DECODE_CONTEXT, "paged")}
    fig, ax = plt.subplots(figsize=(7.2, 3.3), layout="constrained")
    top = 1.12 * ceiling
    ax.axvspan(fits["paged"] + 0.5, curve[-1].batch, color=OWNER_COLORS[None], zorder=0)
    ax.text(0.72 * curve[-1].batch, 0.03 * top,
            words["does_not_fit"].format(context=DECODE_CONTEXT, budget=OPT_13B_KV_BUDGET // 2**30),
            ha="center", va="bottom", fontsize=9, color="#555555")
    ax.plot([c.batch for c in curve], [c.tokens_per_s for c in curve], color=OWNER_COLORS["A"], lw=2,
            label=words["curve"].format(weights=OPT_13B_WEIGHT_BYTES / 1e9, bandwidth=GPUS["A100-40GB"][0]))
    ax.axhline(ceiling, color="#333333", lw=0.8, ls="--")
    ax.text(1, ceiling, words["ceiling"].format(ceiling=ceiling), va="bottom", fontsize=9)
    at_bend = decode_bound(round(bend), DECODE_CONTEXT)
    ax.plot([at_bend.batch], [at_bend.tokens_per_s], "o", color="#333333", ms=5)
    ax.annotate(words["bend"].format(bend=bend, tokens=at_bend.tokens_per_s),
                (at_bend.batch, at_bend.tokens_per_s), xytext=(10, -6), textcoords="offset points", va="top",
                fontsize=9)
    for name, batch, color in zip(words["layouts"], fits.values(), (OWNER_COLORS["B"], OWNER_COLORS["C"]),
                                  strict=True):
        point = decode_bound(batch, DECODE_CONTEXT)
        ax.plot([batch, batch], [0, point.tokens_per_s], color=color, lw=1.2, ls=":")
        ax.plot([batch], [point.tokens_per_s], "o", color=color, ms=7)
        ax.annotate(words["point"].format(name=name, batch=batch, tokens=point.tokens_per_s, ms=1e3 * point.step_s),
                    (batch, point.tokens_per_s), xytext=(9, -4), textcoords="offset points", va="top", fontsize=9,
                    color=color)
    ax.set_xlim(0, curve[-1].batch)
    ax.set_ylim(0, top)
    ax.set_xlabel(words["xlabel"].format(context=DECODE_CONTEXT), fontsize=10)
    ax.set_ylabel(words["ylabel"], fontsize=10)
    ax.tick_params(labelsize=9.5)
    ax.legend(loc="upper left", bbox_to_anchor=(0, 0.93), fontsize=9, frameon=False)
    _save(fig, "decode_throughput.svg" if language == "en" else f"decode_throughput.{language}.svg")


# Every figure, in the order ``main`` draws them; each writes docs/figures/<its name>.svg (and its translations).
FIGURES = (paged_memory, contiguous_waste, decode_throughput, block_pool, block_table, copy_on_write, gather,
           split_kv, schedule, engine_components, parallel_sampling, prefix_cache, token_budget, tensor_parallel,
           speculative_step, fp8_kv_cache, disaggregated_prefill, hybrid_kv_cache)


def main():
    for draw in FIGURES:
        draw()
    print(f"wrote {len(list(OUT.glob('*.svg')))} figures to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
