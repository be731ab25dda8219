"""The decode bound of stage 0's page: why the batch, and so the KV cache's memory, sets the throughput.

``minipaged.perf.simulate.decode_bound`` says how fast a decode step of OPT-13B could run on an
A100-40GB if it only read its bytes (the weights once, every request's K/V once) at peak
bandwidth; ``requests_that_fit`` counts, with the real caches, how many requests of a length the
paper's 12 GiB of KV cache hold. The numbers stage 0's page quotes, in both languages, and its
figure (in English, and in Chinese for the Chinese site) are computed here; so is the claim of
the home page's figure that both halves are the same memory. On the page, each number must stand
in its sentence (``FRAGMENTS``), and once the fragments are taken out of the section no number
may be left, so none goes unchecked.
"""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import pytest
import torch
from helpers_page_numbers import NUMBER, assert_refuses_mutants, mutants, normalised, section_problems

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


def numbers() -> dict[str, str]:
    """Every number the section argues from, by what it is, as the section writes it, computed."""
    one = decode_bound(1, CONTEXT)
    fits = {layout: requests_that_fit(CONTEXT, layout) for layout in ("max", "paged")}
    contiguous, paged = (decode_bound(fits[layout], CONTEXT) for layout in ("max", "paged"))
    defaults = inspect.signature(requests_that_fit).parameters
    return {
        "weights_gb": f"{OPT_13B_WEIGHT_BYTES / 1e9:.0f}", "bandwidth": f"{GPUS['A100-40GB'][0]:,}",
        "context": f"{CONTEXT}", "alone_ms": f"{1e3 * one.step_s:.1f}", "alone_tps": f"{one.tokens_per_s:.0f}",
        "alone_kv_mib": f"{one.kv_bytes // 2**20}",
        "alone_kv_share": f"{math.ceil(100 * one.kv_bytes / (one.kv_bytes + one.weight_bytes))}",  # "under N%"
        "bend": f"{decode_bend(CONTEXT):.0f}",
        "ceiling_tps": f"{decode_bound(1, CONTEXT, weight_bytes=0).tokens_per_s:,.0f}",
        "budget_gib": f"{OPT_13B_KV_BUDGET // 2**30}", "slab": f"{defaults['max_model_len'].default:,}",
        "block_size": f"{defaults['block_size'].default}",
        "max_batch": f"{fits['max']}", "max_tps": f"{contiguous.tokens_per_s:,.0f}",
        "max_ms": f"{1e3 * contiguous.step_s:.1f}",
        "paged_batch": f"{fits['paged']}", "paged_tps": f"{paged.tokens_per_s:,.0f}",
        "paged_ms": f"{1e3 * paged.step_s:.1f}",
        "tps_ratio": f"{paged.tokens_per_s / contiguous.tokens_per_s:.1f}",
        "step_ratio": f"{paged.step_s / contiguous.step_s:.2f}",
    }


# Where each number stands in the section, in each language: a fragment of its sentence, with the
# number's unit and the words it is a number of, {name} standing for numbers()[name]. The batches
# the vLLM paper measured are its figures, as docs/references.md quotes them (PAPER).
FRAGMENTS = {
    "en": [
        "reads {weights_gb} GB of weights once", "at the A100-40GB's {bandwidth} GB/s",
        "one request of {context} tokens takes at least {alone_ms} ms a step, {alone_tps} tokens/s, "
        "and its {alone_kv_mib} MiB of K/V are under {alone_kv_share}% of the bytes",
        "the bound bends there ({bend} requests of {context} tokens) and levels off toward {ceiling_tps} tokens/s",
        "the {budget_gib} GiB left after the weights hold less K/V than the weights' {weights_gb} GB",
        "Reserving {slab} slots per request (contiguous, `max`) lets {max_batch} requests run: "
        "{max_tps} tokens/s at most",
        "let {paged_batch} run: {paged_tps} tokens/s, {tps_ratio} times as much, for a step only {step_ratio} "
        "times as long ({paged_ms} ms instead of {max_ms} ms)",
        "requests of {context} tokens each", "the batches that the {budget_gib} GiB left to the KV cache hold",
        "{max_batch} in contiguous slabs of {slab} slots (policy `max`), {paged_batch} in blocks of {block_size}",
        "The vLLM paper measured 7.00 and 30.42 requests at once on ShareGPT (its Figure 13)",
    ],
    "zh": [
        "{weights_gb} GB 的权重", "A100-40GB 的带宽是 {bandwidth} GB/s",
        "只跑一个 {context} token 的请求时，一步至少要 {alone_ms} ms，也就是 {alone_tps} tokens/s，"
        "而这个请求 {alone_kv_mib} MiB 的 K/V 还不到读取总量的 {alone_kv_share}%",
        "曲线在这里拐弯（{context} token 的请求，{bend} 个），之后逐渐逼近 {ceiling_tps} tokens/s",
        "剩下的 {budget_gib} GiB 装的 K/V 比 {weights_gb} GB 的权重还少",
        "给每个请求预留 {slab} 个槽位（`max` 策略），只能同时跑 {max_batch} 个请求，最多 {max_tps} tokens/s",
        "能跑 {paged_batch} 个，{paged_tps} tokens/s，是前者的 {tps_ratio} 倍，"
        "而每一步只长了 {step_ratio} 倍（从 {max_ms} ms 到 {paged_ms} ms）",
        "每个请求 {context} token", "留给 KV cache 的 {budget_gib} GiB 能装下的 batch",
        "连续 slab 每段 {slab} 个槽位（`max` 策略）时是 {max_batch} 个，{block_size} token 一块的分块方式是 "
        "{paged_batch} 个",
        "vLLM 论文在 ShareGPT 上实测同时运行的请求数是 7.00 和 30.42（论文图 13）",
    ],
}
PAPER = "7.00, 9.81, 13.62 and 30.42"  # Figure 13, as docs/references.md quotes it
# Names whose digits are not numbers of the argument; link targets too.
NAMES = re.compile(r"\]\([^)]*\)|\{#[^}]*\}|OPT-13B|A100-40GB|Figure \d+|图 \d+")


def problems(text: str, lang: str) -> list[str]:
    """What is wrong with the section's numbers: a fragment not found as computed, or a number (in
    digits, or a multiple in words) that no fragment accounts for."""
    n = numbers()
    return section_problems(text, [fragment.format(**n) for fragment in FRAGMENTS[lang]], NAMES)


STAGE0 = {"en": DOCS / "stages" / "0_contiguous.md", "zh": DOCS / "stages" / "0_contiguous.zh.md"}
ANCHOR = "why-the-batch-decides-the-throughput"


def stage0_section(lang: str) -> str:
    return normalised(section(STAGE0[lang], ANCHOR))


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


@pytest.mark.parametrize("lang", sorted(STAGE0))
def test_stage0_quotes_the_computed_bound_each_number_in_its_sentence(lang):
    text = stage0_section(lang)
    assert "decode_throughput.svg" in text
    found = problems(text, lang)
    assert not found, f"{STAGE0[lang].name}:\n" + "\n".join(found)


def test_the_papers_batches_are_the_ones_the_references_quote():
    assert PAPER in " ".join((DOCS / "references.md").read_text(encoding="utf-8").split())
    assert all(set(NUMBER.findall(re.sub(r"\{[^}]*\}", " ", NAMES.sub(" ", f)))) <= set(NUMBER.findall(PAPER))
               for fragments in FRAGMENTS.values() for f in fragments)  # a fragment's own numbers are the paper's


@pytest.mark.parametrize("lang", sorted(STAGE0))
def test_the_check_refuses_a_changed_or_swapped_number(lang):
    """Each fragment with one computed number off by a digit, or with two of its numbers traded."""
    assert_refuses_mutants({ANCHOR: stage0_section(lang)}, lambda by_section: problems(by_section[ANCHOR], lang),
                           mutants(((ANCHOR, template) for template in FRAGMENTS[lang]), numbers()), 25, lang)


@pytest.mark.parametrize(("lang", "number", "wrong"), [
    ("en", "lets 7 requests run", "lets 8 requests run"),
    ("en", "30 in blocks of 16", "31 in blocks of 16"),
    ("en", "Reserving 2,048 slots", "Reserving 2,049 slots"),
    ("en", "under 2% of the bytes", "under 3% of the bytes"),
    ("en", "measured 7.00 and 30.42", "measured 7.00 and 31.42"),
    ("en", "at most.", "at most, twice the first."),
    ("zh", "只能同时跑 7 个请求", "只能同时跑 9 个请求"),
    ("zh", "是 30 个", "是 31 个"),
    ("zh", "不到读取总量的 2%", "不到读取总量的 3%"),
    ("zh", "3.2 倍", "3.2 倍，每个请求多读 8 MiB"),
    ("zh", "3.2 倍", "两倍"),
], ids=["batch-en", "blocks-en", "slab-en", "share-en", "paper-en", "extra-words-en",
        "batch-zh", "blocks-zh", "share-zh", "extra-zh", "words-zh"])
def test_the_check_refuses_these_edits(lang, number, wrong):
    text = stage0_section(lang)
    assert text.count(number) == 1
    assert problems(text.replace(number, wrong), lang)


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
