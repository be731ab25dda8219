"""The decode bound of stage 0's page: why the batch, and so the KV cache's memory, sets the throughput.

``minipaged.perf.simulate.decode_bound`` says how fast a decode step of OPT-13B could run on an
A100-40GB if it only read its bytes (the weights once, every request's K/V once) at peak
bandwidth; ``requests_that_fit`` counts, with the real caches, how many requests of a length the
paper's 12 GiB of KV cache hold. The numbers stage 0's page quotes, in both languages, and its
figure (in English, and in Chinese for the Chinese site) are computed here; so is the claim of
the home page's figure that both halves are the same memory.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from minipaged import PagedKVCache
from minipaged.perf.kernel_report import GPUS
from minipaged.perf.simulate import (
    OPT_13B_KV_BUDGET,
    OPT_13B_KV_BYTES_PER_TOKEN,
    OPT_13B_SLOTS,
    OPT_13B_WEIGHT_BYTES,
    decode_bend,
    decode_bound,
    requests_that_fit,
)

pytestmark = pytest.mark.common

DOCS = Path(__file__).resolve().parent.parent / "docs"
CONTEXT = 512  # tokens per request, as on stage 0's page and in its figure


def section(page: Path, anchor: str) -> str:
    """The text of one ``##`` section, found by its English title's anchor."""
    text = page.read_text(encoding="utf-8")
    if page.name.endswith(".zh.md"):
        start = text.index(f"{{#{anchor}}}")
    else:
        title = anchor.replace("-", " ").capitalize()
        start = text.index(f"## {title}")
    end = text.find("\n## ", start)
    return text[start:end if end >= 0 else None]


def quoted() -> list[str]:
    """Every number the section quotes, formatted as written there, computed."""
    one = decode_bound(1, CONTEXT)
    fits = {layout: requests_that_fit(CONTEXT, layout) for layout in ("max", "paged")}
    contiguous, paged = (decode_bound(fits[layout], CONTEXT) for layout in ("max", "paged"))
    ceiling = decode_bound(1, CONTEXT, weight_bytes=0).tokens_per_s
    return [
        f"{OPT_13B_WEIGHT_BYTES / 1e9:.0f} GB", f"{GPUS['A100-40GB'][0]:,} GB/s", f"{CONTEXT} token",
        f"{1e3 * one.step_s:.1f} ms", f"{one.tokens_per_s:.0f} tokens/s", f"{one.kv_bytes // 2**20} MiB",
        f"{decode_bend(CONTEXT):.0f}", f"{ceiling:,.0f} tokens/s", f"{OPT_13B_KV_BUDGET // 2**30} GiB",
        f"{fits['max']} ", f"{contiguous.tokens_per_s:.0f} tokens/s", f"{fits['paged']} ",
        f"{paged.tokens_per_s:,.0f} tokens/s", f"{paged.tokens_per_s / contiguous.tokens_per_s:.1f}",
        f"{paged.step_s / contiguous.step_s:.2f}", f"{1e3 * contiguous.step_s:.1f} ms", f"{1e3 * paged.step_s:.1f} ms",
    ]


def test_the_budget_is_the_papers_and_a_token_of_kv_is_what_a_real_cache_holds():
    cache = PagedKVCache(40, 1, 1, 40, 128, torch.float16)  # OPT-13B: 40 layers, 40 heads of 128; one slot
    assert OPT_13B_KV_BYTES_PER_TOKEN == sum(t.numel() * t.element_size() for t in cache.key_cache + cache.value_cache)
    assert OPT_13B_KV_BYTES_PER_TOKEN == 800 * 1024
    assert OPT_13B_SLOTS == 15_728  # the paper's 15.7K token slots


def test_a_step_reads_the_weights_once_and_every_requests_kv():
    bandwidth = GPUS["A100-40GB"][0] * 1e9
    for batch in (1, 2, 7, 100):
        bound = decode_bound(batch, CONTEXT)
        assert bound.kv_bytes == batch * CONTEXT * OPT_13B_KV_BYTES_PER_TOKEN
        assert bound.step_s == pytest.approx((OPT_13B_WEIGHT_BYTES + bound.kv_bytes) / bandwidth)
        assert bound.tokens_per_s == pytest.approx(batch / bound.step_s)
    one, two = decode_bound(1, CONTEXT), decode_bound(2, CONTEXT)
    assert two.step_s < 1.02 * one.step_s  # a second request adds under 2% to the step...
    assert two.tokens_per_s > 1.96 * one.tokens_per_s  # ...and nearly doubles the tokens
    assert one.kv_bytes / (one.kv_bytes + one.weight_bytes) < 0.02
    with pytest.raises(ValueError, match="batch"):
        decode_bound(0, CONTEXT)


def test_the_bound_bends_where_the_kv_read_matches_the_weights_read():
    bend = decode_bend(CONTEXT)
    ceiling = decode_bound(1, CONTEXT, weight_bytes=0).tokens_per_s
    assert round(bend) == 62
    assert ceiling == pytest.approx(3707, abs=0.5)
    at = decode_bound(round(bend), CONTEXT)
    assert at.kv_bytes == pytest.approx(at.weight_bytes, rel=0.01)
    assert at.tokens_per_s == pytest.approx(ceiling / 2, rel=0.01)
    throughputs = [decode_bound(b, CONTEXT).tokens_per_s for b in range(1, 4 * round(bend))]
    assert throughputs == sorted(throughputs) and throughputs[-1] < ceiling  # grows, never past the ceiling


def test_memory_sets_the_batch_before_the_bend():
    fits = {layout: requests_that_fit(CONTEXT, layout) for layout in ("max", "pow2", "oracle", "paged")}
    assert fits == {"max": 7, "pow2": 30, "oracle": 30, "paged": 30}  # max reserves 2,048 slots each
    assert fits["paged"] * CONTEXT <= OPT_13B_SLOTS < (fits["paged"] + 1) * CONTEXT
    assert OPT_13B_KV_BUDGET < OPT_13B_WEIGHT_BYTES and fits["paged"] < decode_bend(CONTEXT)  # the bend is out of reach
    contiguous, paged = decode_bound(7, CONTEXT), decode_bound(30, CONTEXT)
    assert (round(contiguous.tokens_per_s), round(paged.tokens_per_s)) == (376, 1209)
    assert (round(1e3 * contiguous.step_s, 1), round(1e3 * paged.step_s, 1)) == (18.6, 24.8)
    assert round(paged.tokens_per_s / contiguous.tokens_per_s, 1) == 3.2


@pytest.mark.parametrize("page", ["0_contiguous.md", "0_contiguous.zh.md"])
def test_stage0_quotes_the_computed_bound(page):
    text = section(DOCS / "stages" / page, "why-the-batch-decides-the-throughput")
    assert "decode_throughput.svg" in text
    missing = [number for number in quoted() if number not in text]
    assert not missing, f"{page} does not quote {missing}"


# The figure's words around its numbers, in each language; tests/test_doc_figures.py holds the
# committed figures to what scripts/doc_figures.py draws, curve included.
FIGURE_WORDS = {
    "decode_throughput.svg": ("({context} tokens of context each)", {"max": "contiguous, max: {batch} requests",
                                                                     "paged": "paged: {batch} requests"},
                              "bend at {bend:.0f}"),
    "decode_throughput.zh.svg": ("（每个请求 {context} token 上下文）", {"max": "连续 slab（max）：{batch} 个请求",
                                                                  "paged": "分页：{batch} 个请求"}, "拐点 {bend:.0f}"),
}


@pytest.mark.parametrize("figure", sorted(FIGURE_WORDS))
def test_stage0_figure_marks_the_batches_that_fit(figure):
    svg = (DOCS / "figures" / figure).read_text(encoding="utf-8")
    context, layouts, bend = FIGURE_WORDS[figure]
    assert context.format(context=CONTEXT) in svg
    for layout, label in layouts.items():
        batch = requests_that_fit(CONTEXT, layout)
        assert label.format(batch=batch) in svg
        point = decode_bound(batch, CONTEXT)
        assert f"{point.tokens_per_s:,.0f} tokens/s" in svg and f"{1e3 * point.step_s:.1f} ms" in svg
    assert bend.format(bend=decode_bend(CONTEXT)) in svg
    assert f"{decode_bound(1, CONTEXT, weight_bytes=0).tokens_per_s:,.0f} tokens/s" in svg  # the ceiling


def test_home_page_figure_draws_both_layouts_in_the_same_memory():
    svg = (DOCS / "figures" / "paged_memory.svg").read_text(encoding="utf-8")
    contiguous = int(re.search(r"contiguous, (\d+) slots", svg)[1])
    blocks, block_size, paged = map(int, re.search(r"paged, (\d+) blocks of (\d+) = (\d+) slots", svg).groups())
    assert contiguous == paged == blocks * block_size
    free = int(re.search(r"(\d+) free: too small", svg)[1])
    reserved = int(re.search(r"of (\d+) reserved slots hold K/V", svg)[1])
    assert free == contiguous - reserved and free < reserved // 3  # smaller than one more slab
    assert f"in the same {contiguous} slots" in (DOCS / "index.md").read_text(encoding="utf-8")
    assert f"The {free} free slots" in (DOCS / "index.md").read_text(encoding="utf-8")
    zh = (DOCS / "index.zh.md").read_text(encoding="utf-8")
    assert f"同样 {contiguous} 个槽位" in zh and f"空闲的 {free} 个槽位" in zh
