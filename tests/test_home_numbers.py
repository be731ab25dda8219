"""The numbers of the home page's story, computed by minipaged itself, each in its own sentence.

``docs/index.md`` tells the story in one page; ``docs/index.zh.md`` retells it in six sections and
corrects the explainer it started from: the KV cache of a token of OPT-13B, of 1,000 tokens, of
a request of 2,048; the paper's budget of token slots; the slab ``pow2`` reserves for 100
tokens; the default block size; the figure's slots. Each is computed here (from the project's
model configuration, stage 0's cache, ``minipaged.perf.simulate`` and the constants
scripts/doc_figures.py draws the home figure from) and must stand in its section as a fragment
of its sentence; once every fragment is taken out, no number may be left, so none goes
unchecked. A number a fragment writes literally is a figure of the vLLM paper, its launch post
or the explainer, as docs/references.md quotes it (``QUOTED``), or an input of the argument
(``INPUTS``).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from functools import cache
from pathlib import Path

import pytest
import torch
from helpers_page_numbers import NUMBER, assert_refuses_mutants, mutants, normalised, section_problems

from minipaged.common.config import EngineConfig
from minipaged.models import ModelConfig
from minipaged.perf.simulate import OPT_13B_KV_BUDGET, OPT_13B_SLOTS, OPT_13B_WEIGHT_BYTES
from minipaged.stage0_contiguous import ContiguousKVCache

pytestmark = pytest.mark.common

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = {"en": DOCS / "index.md", "zh": DOCS / "index.zh.md"}
# OPT is GPT-2's architecture; a GPT-2 of OPT-13B's shape has OPT-13B's KV cache.
OPT_13B = {"model_type": "gpt2", "n_embd": 5120, "n_head": 40, "n_layer": 40, "n_inner": 20480,
           "vocab_size": 50272, "n_positions": 2048}
MiB = 2**20
WORDS = {"en": {2: "two", 3: "three", 4: "four", 5: "five"}, "zh": {2: "两", 3: "三", 4: "四", 5: "五"}}


def figure_constants() -> dict:
    """The constants scripts/doc_figures.py draws the home figure from, read without running it."""
    tree = ast.parse((ROOT / "scripts" / "doc_figures.py").read_text(encoding="utf-8"))
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(ast.unparse(t).startswith(("HOME_", "(HOME_")) for t in node.targets):
            names = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            values = ast.literal_eval(node.value)
            found |= dict(zip(names, values if len(names) > 1 else [values], strict=True))
    return found


@cache
def computed() -> dict[str, str]:
    """Every number the story argues from, by what it is, as the pages write it."""
    opt = ModelConfig.from_hf(OPT_13B)
    fp16 = torch.tensor([], dtype=torch.float16).element_size()
    per_token = opt.kv_bytes_per_token(torch.float16)
    assert per_token == 2 * opt.hidden_size * opt.num_layers * fp16
    longest = opt.max_position_embeddings
    assert OPT_13B_SLOTS == OPT_13B_KV_BUDGET // per_token
    assert OPT_13B_WEIGHT_BYTES > 16e9  # "a 16 GB card cannot even hold the model"
    n = {"hidden": f"{opt.hidden_size:,}", "layers": f"{opt.num_layers}", "fp16_bytes": f"{fp16}",
         "kv_bytes": f"{per_token:,}", "kv_kib": f"{per_token // 2**10}", "thousand": f"{1000:,}",
         "thousand_mib": f"{1000 * per_token / MiB:.0f}", "longest": f"{longest:,}",
         "longest_mib": f"{longest * per_token / MiB:,.0f}", "weights_gb": f"{OPT_13B_WEIGHT_BYTES / 1e9:.0f}",
         "budget_gib": f"{OPT_13B_KV_BUDGET // 2**30}", "slots": f"{OPT_13B_SLOTS:,}",
         "slots_k": f"{OPT_13B_SLOTS / 1000:.1f}"}

    # pow2: the explainer's request of 100 tokens, in the slab stage 0's policy reserves for it.
    pow2 = ContiguousKVCache(longest, longest, "pow2", num_layers=0)
    n |= {"pow2_tokens": "100", "pow2_slab": f"{pow2.reservation(100, 0)}"}

    # Blocks: the engine's default size; the home figure's, and its two halves in the same memory.
    (default,) = [f.default for f in dataclasses.fields(EngineConfig) if f.name == "block_size"]
    home = figure_constants()
    contiguous = ContiguousKVCache(home["HOME_BLOCKS"] * home["HOME_BLOCK_SIZE"], home["HOME_MAX_MODEL_LEN"], "max",
                                   num_layers=0)
    for name, tokens in home["HOME_TOKENS"].items():  # as the script places them
        contiguous.allocate(name, tokens, 0)
        contiguous.append(name, tokens)
    slabs = list(contiguous.slabs.values())
    reserved = sum(s.size for s in slabs)
    n |= {"default_block": f"{default}", "home_block": f"{home['HOME_BLOCK_SIZE']}",
          "home_slots": f"{contiguous.num_slots}", "home_slab": f"{home['HOME_MAX_MODEL_LEN']}",
          "home_reserved": f"{reserved}", "home_held": f"{sum(s.num_tokens for s in slabs)}",
          "home_free": f"{contiguous.num_slots - reserved}"}
    names = list(home["HOME_TOKENS"])  # the figure's requests, named and counted in words
    n |= {"en_requests": WORDS["en"][len(names)], "zh_requests": WORDS["zh"][len(names)],
          "en_names": ", ".join(names[:-1]) + " and " + names[-1], "zh_names": "、".join(names)}
    return n


# Where each number stands: per section (its heading's anchor, or its title where it has none),
# fragments of its sentence, {name} standing for computed()[name].
FRAGMENTS: dict[str, dict[str, list[str]]] = {
    "en": {
        "The story in one page": [
            "fixed-size **blocks** ({default_block} tokens by default)",
            "in blocks of {home_block} tokens",
            "the same {en_requests} requests, {en_names}, twice, at one moment, in the same {home_slots} slots",
            "a slab as long as the longest request may become ({home_slab} slots)",
            "only {home_held} of the {home_reserved} reserved slots hold K/V", "The {home_free} free slots at the end",
        ],
    },
    "zh": {
        "kv-cache-size": [
            "{kv_kib} KB，而不是 208 KB", "每个 token 的 KV cache 大约 208 KB",
            "2 (K 和 V) × {hidden} (hidden size) × {layers} (层) × {fp16_bytes} 字节 (fp16) "
            "= {kv_bytes} B ≈ {kv_kib} KB",
            "论文给出的 {kv_kib} KB（准确地说是 {kv_kib} KiB）",
            "{thousand} 个 token 的缓存大约是 {thousand_mib} MiB，而不是原文说的 200 MB",
            "一个 {longest} token 的请求要 {longest_mib} MiB",
            "OPT-13B 光权重就有 {weights_gb} GB，16 GB 的卡连模型都放不下",
            "一张 40 GB 的 A100：权重占 {weights_gb} GB，留给 KV cache {budget_gib} GB，"
            "总共只有约 {slots_k}K 个 token 槽位（{budget_gib} GiB / {kv_kib} KiB = {slots}）",
        ],
        "three-kinds-of-waste": ["{pow2_tokens} 个 token 却分到 {pow2_slab} 个槽位，正是 stage 0 的 `pow2` 预留策略"],
        "blocks-and-block-tables": [
            "默认 {default_block} 个 token 一块", "每块 {home_block} 个 token",
            "同样{zh_requests}个请求 {zh_names}，在同样 {home_slots} 个槽位里画了两遍", "slab（{home_slab} 个槽位）",
            "预留的 {home_reserved} 个槽位里只有 {home_held} 个存着 K/V", "末尾空闲的 {home_free} 个槽位",
        ],
        "sharing": ["（`n > 1`）"],
        "scheduling": ["“最高 24 倍”出自 vLLM 发布时的博客", "FasterTransformer 和 Orca 的 2–4 倍"],
    },
}
# The sections of the story, each held whole: no number in them that no fragment accounts for.
STORY = {"en": ["The story in one page"],
         "zh": ["the-story-in-one-page", "prefill-and-decode", "kv-cache-size", "three-kinds-of-waste",
                "blocks-and-block-tables", "sharing", "scheduling", "in-one-sentence"]}
# Figures of the vLLM paper (its Table 1), its launch post and the explainer, as the references quote them.
QUOTED = ["208 KB", "200 MB", "one A100 with 40 GB", "12 GB for the KV cache", "24×", "2–4×"]
# The argument's own inputs: K and V, a card of 16 GB, more than one sample, the explainer's 100 tokens.
INPUTS = {"2", "16", "1", "100"}

LIST_ITEM = re.compile(r"^[ \t]*\d+\. ", re.MULTILINE)  # "1. the cache is cut ...": an item's number
HEADING = re.compile(r"^(#{2,3}) (?:\d+\. )?(.*?)(?: \{#([\w-]+)\})?[ \t]*$", re.MULTILINE)
NAMES = re.compile(r"\]\([^)]*\)|OPT-13B|\bfp16\b|\bpow2\b|§\d+|\bV[01]\b|[Ss]tages? \d+"
                   r"|30 seconds|2 minutes|30 秒版|2 分钟版")


def sections(text: str) -> dict[str, str]:
    """The page's ``##`` and ``###`` sections by anchor (by title where there is none), the
    numbers of headings ("### 2.") and of list items left out."""
    found = list(HEADING.finditer(text))
    ends = [m.start() for m in found[1:]] + [len(text)]
    return {m.group(3) or m.group(2): normalised(m.group(2) + "\n" + LIST_ITEM.sub(" ", text[m.end():end]))
            for m, end in zip(found, ends, strict=True)}


def problems(by_section: dict[str, str], lang: str) -> list[str]:
    """A fragment not found in its section as computed, or a number no fragment accounts for."""
    n, found = computed(), []
    for name in STORY[lang]:
        fragments = [f.format(**n) for f in FRAGMENTS[lang].get(name, [])]
        found += section_problems(by_section[name], fragments, NAMES, f"{name}: ")
    return found


@pytest.mark.parametrize("lang", sorted(PAGES))
def test_every_number_of_the_story_stands_in_its_own_sentence(lang):
    by_section = sections(PAGES[lang].read_text(encoding="utf-8"))
    assert set(STORY[lang]) | set(FRAGMENTS[lang]) <= set(by_section)
    found = problems(by_section, lang)
    assert not found, f"{PAGES[lang].name}:\n" + "\n".join(found)


def test_a_fragments_own_numbers_are_quoted_figures_or_inputs():
    references = " ".join((DOCS / "references.md").read_text(encoding="utf-8").split())
    allowed = set(INPUTS)
    for figure in QUOTED:
        assert figure in references, f"references.md no longer quotes {figure!r}"
        allowed |= set(NUMBER.findall(figure))
    for lang, per in FRAGMENTS.items():
        for name, fragments in per.items():
            for fragment in fragments:
                unknown = set(NUMBER.findall(NAMES.sub(" ", re.sub(r"\{[^}]*\}", " ", fragment)))) - allowed
                assert not unknown, f"{lang} {name}: {fragment!r} writes {unknown}, which nothing quotes"


@pytest.mark.parametrize("lang", sorted(PAGES))
def test_the_check_refuses_a_changed_or_swapped_number(lang):
    """Each fragment with one computed number off by a digit, or two of its numbers traded."""
    templates = ((name, template) for name, fragments in FRAGMENTS[lang].items() for template in fragments)
    assert_refuses_mutants(sections(PAGES[lang].read_text(encoding="utf-8")), lambda wrong: problems(wrong, lang),
                           mutants(templates, computed()), {"en": 6, "zh": 25}[lang], lang)


@pytest.mark.parametrize(("lang", "number", "wrong"), [
    ("zh", "781 MiB", "782 MiB"),
    ("zh", "1,600 MiB", "1,560 MiB"),
    ("zh", "= 15,728", "= 15,729"),
    ("zh", "16 GB 的卡", "24 GB 的卡"),
    ("zh", "分到 128 个槽位", "分到 100 个槽位"),
    ("zh", "默认 16 个 token", "默认 32 个 token"),
    ("zh", "原文说的 200 MB；", "原文说的 200 MB，差了 5%；"),
    ("zh", "好几倍的请求", "好三倍的请求"),
    ("en", "(16 tokens by default)", "(32 tokens by default)"),
    ("en", "one contiguous slab", "one contiguous slab of 2,048 slots"),
], ids=["thousand", "longest", "slots", "card", "pow2", "block-zh", "extra-zh", "words-zh", "block-en", "extra-en"])
def test_the_check_refuses_these_edits(lang, number, wrong):
    by_section = sections(PAGES[lang].read_text(encoding="utf-8"))
    (name,) = [name for name in STORY[lang] if number in by_section[name]]
    assert problems({**by_section, name: by_section[name].replace(number, wrong, 1)}, lang)
