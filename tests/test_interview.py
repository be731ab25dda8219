"""The numbers of the interview page, computed by minipaged itself.

``docs/interview.md`` and ``docs/interview.zh.md`` answer "what is vLLM, and why does
PagedAttention raise throughput?" with numbers: model sizes, capacities, bandwidth bounds,
and figures from the benchmarks' results. Every number written on either page must be one
that this file computes (from the project's model configurations, models built on the meta
device, block managers, stage 0's decode bound in ``minipaged.perf.simulate`` and
bench/results/*.json), or one of the inputs it computes from, or
a figure of the vLLM paper or launch post that the references page quotes; and every
computed number must appear on both pages. A number that drifts, on either page, fails here.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from pathlib import Path

import pytest
import torch

from minipaged import BlockAllocator, BlockSpaceManager, PrefixCachingAllocator, PrefixCachingBlockSpaceManager
from minipaged.models import ModelConfig, build_model
from minipaged.models.parallel import shard_config
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

ROOT = Path(__file__).resolve().parent.parent
DOCS, RESULTS = ROOT / "docs", ROOT / "bench" / "results"
PAGES = (DOCS / "interview.md", DOCS / "interview.zh.md")

# Hugging Face configurations. OPT is GPT-2's architecture (learned positions, LayerNorm, biases,
# tied embeddings), so a GPT-2 of OPT-13B's shape has OPT-13B's KV cache.
OPT_13B = {"model_type": "gpt2", "n_embd": 5120, "n_head": 40, "n_layer": 40, "n_inner": 20480,
           "vocab_size": 50272, "n_positions": 2048}
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
             "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 128256}
LLAMA3_70B = {"model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
              "num_hidden_layers": 80, "intermediate_size": 28672, "vocab_size": 128256}
A100 = "A100-40GB"  # the GPU of stage 0's decode bound
CONTEXT = 512  # tokens per request, as in stage 0's decode bound
GiB, KiB = 2**30, 2**10

# Names whose digits are not numbers of the argument; link targets and heading ids too.
NAMES = re.compile(r"\]\([^)]*\)|\{#[^}]*\}|OPT-13B|Llama-3-8B|Llama-3-70B|A100-40GB|b?float16|[Ff][Pp]8"
                   r"|\bV[01]\b|[Ss]tage \d+|Figure \d+[ab]?|\bp99\b|30 seconds|2 minutes|30 秒版|2 分钟版")
NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")


def weight_bytes(hf: dict, dtype: torch.dtype) -> int:
    """The bytes of a model's parameters: the model built on the meta device, its tensors counted."""
    with torch.device("meta"):
        model = build_model(ModelConfig.from_hf(hf))
    return sum(p.numel() for p in model.parameters()) * torch.tensor([], dtype=dtype).element_size()


def result(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def two_figures(value: float) -> str:
    """Milliseconds as the benchmarks page writes them: two significant figures."""
    return f"{value:.2g}"


@cache
def computed() -> dict[str, str]:
    """Every number the page argues from, by what it is, as the page writes it."""
    n: dict[str, str] = {}
    opt = ModelConfig.from_hf(OPT_13B)
    per_token = opt.kv_bytes_per_token(torch.float16)
    assert per_token == 2 * opt.num_layers * opt.hidden_size * 2 == OPT_13B_KV_BYTES_PER_TOKEN
    n |= {"opt kv bytes": f"{per_token:,}", "opt kv KiB": f"{per_token // KiB}",
          "opt layers": f"{opt.num_layers}", "opt hidden": f"{opt.hidden_size:,}",
          "1,000 tokens": f"{1000:,}", "1,000 tokens MB": f"{1000 * per_token / 1e6:.1f}"}

    # Why a bigger batch: stage 0's decode bound. The weights are read once a step, the K/V once
    # per token of context; the cache is full with as many requests of CONTEXT tokens as blocks hold.
    assert OPT_13B_SLOTS == result("batch_capacity")["slots"]  # the budget every memory benchmark uses
    alone = decode_bound(1, CONTEXT, gpu=A100)
    full = decode_bound(requests_that_fit(CONTEXT, "paged"), CONTEXT, gpu=A100)
    assert full.batch * CONTEXT <= OPT_13B_SLOTS < (full.batch + 1) * CONTEXT
    n |= {"opt weights GB": f"{OPT_13B_WEIGHT_BYTES / 1e9:.0f}", "kv budget GiB": f"{OPT_13B_KV_BUDGET // GiB}",
          "slots": f"{OPT_13B_SLOTS:,}", "bandwidth": f"{GPUS[A100][0]:,}", "context": f"{CONTEXT}",
          "step alone ms": f"{alone.step_s * 1e3:.1f}", "tokens per second alone": f"{alone.tokens_per_s:.0f}",
          "kv read equals weights at": f"{math.ceil(decode_bend(1)):,}", "bend": f"{decode_bend(CONTEXT):.0f}",
          "full batch": f"{full.batch}", "full cache GB": f"{(full.weight_bytes + full.kv_bytes) / 1e9:.1f}",
          "full cache ms": f"{full.step_s * 1e3:.1f}", "full cache tokens per second": f"{full.tokens_per_s:,.0f}"}

    # Blocks of 16: the waste of one sequence, and the simulated utilisation.
    manager = BlockSpaceManager(BlockAllocator(4), block_size=16)
    manager.allocate("s", list(range(17)))
    n |= {"block size": "16", "most slots wasted": f"{len(manager.get_block_table('s')) * 16 - 17}"}
    utilisation = result("block_size")["utilisation"]
    for trace in ("ShareGPT", "Alpaca"):
        for size in (16, 256):
            n[f"{trace} {size}"] = f"{100 * utilisation[f'{trace}/{size}']['token']:.1f}"
    n["largest block size"] = "256"

    # Swap or recompute, as bench/swap_vs_recompute.py measured it.
    swap = result("swap_vs_recompute")
    n |= {"swap tokens": f"{swap['tokens']}", "swap block 1 ms": f"{swap['rows']['1']['swap_ms']:.1f}",
          "swap block 16 ms": f"{swap['rows']['16']['swap_ms']:.1f}",
          "recompute ms": f"{swap['rows']['16']['recompute_ms']:.0f}"}

    # Prefix caching: only full blocks are cached.
    cached = PrefixCachingBlockSpaceManager(PrefixCachingAllocator(16), block_size=16)
    system = list(range(100, 200))
    cached.allocate("first", system + [1, 2])
    cached.append_slot("first")  # the step that computed the prompt succeeded
    cached.free("first")
    n |= {"system prompt": f"{len(system)}", "cached tokens": f"{cached.allocate('next', system + [3, 4])}"}

    # GQA and FP8.
    llama8 = ModelConfig.from_hf(LLAMA3_8B)
    gqa, fp8 = llama8.kv_bytes_per_token(torch.float16), llama8.kv_bytes_per_token(torch.float8_e4m3fn)
    mha = ModelConfig.from_hf({**LLAMA3_8B, "num_key_value_heads": 32}).kv_bytes_per_token(torch.float16)
    n |= {"llama8 layers": f"{llama8.num_layers}", "llama8 kv heads": f"{llama8.num_kv_heads}",
          "llama8 head dim": f"{llama8.head_dim}", "llama8 query heads": f"{llama8.num_heads}",
          "gqa bytes": f"{gqa:,}", "gqa KiB": f"{gqa // KiB}", "mha KiB": f"{mha // KiB}", "fp8 KiB": f"{fp8 // KiB}",
          "tokens per GiB mha": f"{GiB // mha:,}", "tokens per GiB gqa": f"{GiB // gqa:,}",
          "tokens per GiB fp8": f"{GiB // fp8:,}", "capacity ratio": f"{mha // fp8}"}

    # Chunked prefill, as bench/chunked_prefill.py measured it.
    chunked = result("chunked_prefill")
    rows = chunked["rows"]
    whole, small, medium = rows["stage 9 (whole prompt)"], rows["stage 10, budget 64"], rows["stage 10, budget 256"]
    n |= {"decoding requests": f"{chunked['decoding_requests']}", "long prompt": f"{chunked['long_prompt']}",
          "whole step ms": two_figures(whole["worst_step_ms"]), "whole ttft ms": two_figures(whole["ttft_ms"]),
          "budget 64": "64", "budget 64 itl p99": two_figures(small["itl_p99_ms"]),
          "budget 64 ttft": two_figures(small["ttft_ms"]), "budget 256 itl p99": two_figures(medium["itl_p99_ms"]),
          "budget 256 ttft": two_figures(medium["ttft_ms"])}

    # Tensor parallelism: what one GPU holds.
    llama70 = ModelConfig.from_hf(LLAMA3_70B)
    weights70 = weight_bytes(LLAMA3_70B, torch.bfloat16)
    shard = shard_config(llama70, 8)
    kv = {row["tp"]: row for row in result("tensor_parallel")["kv"]}
    assert all(len(set(row["kv_bytes_per_token_per_worker"])) == 1 for row in kv.values())
    n |= {"tp": "8", "llama70 weights GB": f"{weights70 / 1e9:.1f}", "per GPU GB": f"{weights70 / 8 / 1e9:.1f}",
          "llama70 kv KiB": f"{llama70.kv_bytes_per_token(torch.bfloat16) // KiB}",
          "per GPU kv KiB": f"{shard.kv_bytes_per_token(torch.bfloat16) // KiB}",
          "KV heads per GPU": f"{shard.num_kv_heads}",
          "tiny tp 1": f"{kv[1]['kv_bytes_per_token_per_worker'][0]:,}",
          "tiny tp 2": f"{kv[2]['kv_bytes_per_token_per_worker'][0]:,}",
          "tiny tp 4": f"{kv[4]['kv_bytes_per_token_per_worker'][0]:,}",
          "tiny KV heads": f"{len({h for heads in kv[4]['heads_per_rank'] for h in heads})}"}
    assert kv[4]["kv_bytes_per_token_per_worker"][0] == kv[2]["kv_bytes_per_token_per_worker"][0]  # replicated

    # Speculative decoding, as bench/speculative.py measured it.
    (row,) = [r for r in result("speculative")["rows"] if (r["batch"], r["workload"], r["k"]) == (1, "repetitive", 4)]
    n |= {"draft tokens": "4", "tokens per forward": f"{row['tokens_per_forward']}", "speedup": f"{row['speedup']}",
          "batch": "1"}
    return n


# Figures of the vLLM paper and launch post, as the references and benchmarks pages quote them, and
# the explainer's two numbers that the page corrects.
QUOTED = {
    "references.md": ["2–4×", "24×", "20.4%", "38.2%", "96.3%", "20–26%", "208 KB", "200 MB"],
    "benchmarks.md": ["blocks of 16 to 128", "16 or 32", "for blocks of 16 to 64"],
}
# The words of the argument that are numbers: K and V (2), bytes of float16 (2), the one token a
# step makes, the bounds of min(1, p/q) and max(0, p − q), two all-reduces a layer, 1/tp.
INPUTS = {"0", "1", "2", "4", "16", "32", "64", "128"}


def quoted() -> set[str]:
    found = set()
    for page, figures in QUOTED.items():
        text = (DOCS / page).read_text(encoding="utf-8")
        for figure in figures:
            assert figure in text, f"{page} no longer quotes {figure!r}"
            found |= set(NUMBER.findall(figure))
    return found


def numbers(page: Path) -> list[str]:
    return NUMBER.findall(NAMES.sub(" ", " ".join(page.read_text(encoding="utf-8").split())))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_number_on_the_page_is_computed(page):
    allowed = set(computed().values()) | quoted() | INPUTS
    unknown = sorted(set(numbers(page)) - allowed)
    assert not unknown, f"{page.name}: numbers no test computes: {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_computed_number_is_on_the_page(page):
    written = set(numbers(page))
    missing = {name: value for name, value in computed().items() if value not in written}
    assert not missing, f"{page.name} does not give {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_explainers_numbers_are_corrected(page):
    n = computed()
    text = " ".join(page.read_text(encoding="utf-8").split())
    assert f"**{n['opt kv KiB']} KiB" in text and f"{n['opt kv bytes']}" in text
    assert "208 KB" in text and "200 MB" in text  # named, as what is corrected
    assert f"{n['1,000 tokens MB']} MB" in text
    assert f"2 × {n['opt layers']}" in text and f"× {n['opt hidden']} " in text and f"= {n['opt kv bytes']} " in text
    assert "**2–4" in text and "24" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_decode_bound_is_stage_0s(page):
    """Where both pages state the same quantity of the bound, they state the same figure."""
    n = computed()
    stage0 = (DOCS / "stages" / page.name.replace("interview", "0_contiguous")).read_text(encoding="utf-8")
    english = page.name == "interview.md"
    start = stage0.index("## Why the batch" if english else "{#why-the-batch-decides-the-throughput}")
    end = stage0.find("\n## ", start)
    figures = [f"{n['opt weights GB']} GB", f"{n['bandwidth']} GB/s", f"{n['step alone ms']} ms",
               f"{n['tokens per second alone']} tokens/s", f"{n['full cache ms']} ms",
               f"{n['full cache tokens per second']} tokens/s"]
    for text, name in ((page.read_text(encoding="utf-8"), page.name), (stage0[start:end], "stage 0")):
        missing = [figure for figure in figures if figure not in " ".join(text.split())]
        assert not missing, f"{name} does not state {missing}"


def test_the_check_refuses_a_wrong_number():
    page = PAGES[0].read_text(encoding="utf-8")
    allowed = set(computed().values()) | quoted() | INPUTS
    wrong = page.replace(f"{computed()['opt weights GB']} GB", "26.1 GB", 1)
    assert wrong != page and "26.1" in set(NUMBER.findall(NAMES.sub(" ", wrong))) - allowed
    assert computed()["opt weights GB"] not in set(NUMBER.findall(NAMES.sub(" ", wrong))) - allowed


def test_the_page_follows_the_glossary_in_the_navigation():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = config[config.index("\nnav:"):]
    glossary = nav.index("glossary.md")
    assert nav.index("interview.md") > glossary
    assert nav.index("interview.md") < nav.index("stages/0_contiguous.md")
    entry = re.search(r"- (.+): interview\.md", nav)
    assert entry, "interview.md has no title in the navigation"
    title = entry.group(1).strip().strip('"')
    assert re.search(rf'"{re.escape(title)}": "面试题', config)
    for home in ("index.md", "index.zh.md"):
        assert "(interview.md)" in (DOCS / home).read_text(encoding="utf-8"), home
