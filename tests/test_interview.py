"""The numbers of the interview page, computed by minipaged itself, each in its own sentence.

``docs/interview.md`` and ``docs/interview.zh.md`` answer "what is vLLM, and why does
PagedAttention raise throughput?" with numbers: model sizes, capacities, bandwidth bounds, and
figures from the benchmarks' results. ``computed()`` computes them (from the project's model
configurations, models built on the meta device, block managers, stage 0's decode bound in
``minipaged.perf.simulate`` and bench/results/*.json). ``FRAGMENTS`` says, section by section
and in both languages, where each one stands: a short fragment of the page with the number's
unit and the words it is a number of. A fragment must appear in its section as computed, so a
number that drifts, or two numbers that trade places, fail; once every fragment is taken out
of its section, no number may be left (digits, or a multiple written in words such as "two to
four times", 两到四倍), so none goes unchecked. A number a fragment writes literally is a
figure of the vLLM paper or launch post that the references or benchmarks page quotes, or one
of the few inputs of the argument (``INPUTS``).
"""

from __future__ import annotations

import json
import math
import re
import string
from functools import cache
from pathlib import Path

import pytest
import torch
from helpers_page_numbers import NUMBER, assert_refuses_mutants, mutants, normalised, section_problems

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
WORDS = {"en": {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"},
         "zh": {1: "一", 2: "两", 3: "三", 4: "四", 5: "五", 6: "六", 7: "七", 8: "八"}}

# Names whose digits are not numbers of the argument; link targets and heading ids too.
NAMES = re.compile(r"\]\([^)]*\)|\{#[^}]*\}|OPT-13B|Llama-3-8B|Llama-3-70B|Gemma \d|A100-40GB|b?float16|[Ff][Pp]8"
                   r"|Qwen2\.5-0\.5B|\bV[01]\b|[Ss]tages? \d+(?: (?:to|到) \d+)?|Figure \d+[ab]?|\bp99\b"
                   r"|30 seconds|2 minutes|30 秒版|2 分钟版")


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
    n |= {"opt_kv_bytes": f"{per_token:,}", "opt_kv_kib": f"{per_token // KiB}",
          "opt_layers": f"{opt.num_layers}", "opt_hidden": f"{opt.hidden_size:,}",
          "thousand": f"{1000:,}", "thousand_mb": f"{1000 * per_token / 1e6:.1f}"}

    # Why a bigger batch: stage 0's decode bound. The weights are read once a step, the K/V once
    # per token of context; the cache is full with as many requests of CONTEXT tokens as blocks hold.
    assert OPT_13B_SLOTS == result("batch_capacity")["slots"]  # the budget every memory benchmark uses
    alone = decode_bound(1, CONTEXT, gpu=A100)
    full = decode_bound(requests_that_fit(CONTEXT, "paged"), CONTEXT, gpu=A100)
    assert full.batch * CONTEXT <= OPT_13B_SLOTS < (full.batch + 1) * CONTEXT
    n |= {"weights_gb": f"{OPT_13B_WEIGHT_BYTES / 1e9:.0f}", "kv_budget_gib": f"{OPT_13B_KV_BUDGET // GiB}",
          "slots": f"{OPT_13B_SLOTS:,}", "bandwidth": f"{GPUS[A100][0]:,}", "context": f"{CONTEXT}",
          "alone_ms": f"{alone.step_s * 1e3:.1f}", "alone_tps": f"{alone.tokens_per_s:.0f}",
          "bend_tokens": f"{math.ceil(decode_bend(1)):,}", "bend_requests": f"{decode_bend(CONTEXT):.0f}",
          "full_batch": f"{full.batch}", "full_gb": f"{(full.weight_bytes + full.kv_bytes) / 1e9:.1f}",
          "full_ms": f"{full.step_s * 1e3:.1f}", "full_tps": f"{full.tokens_per_s:,.0f}"}

    # How many requests run at once (bench/batch_capacity.py), ShareGPT-like at its highest rate,
    # paged against the three contiguous policies: a multiple the page writes in words.
    capacity = result("batch_capacity")["results"]
    rate = max((key for key in capacity if key.startswith("ShareGPT/")), key=lambda k: float(k.split("/")[1]))
    running = capacity[rate]
    contiguous = [running[policy] for policy in ("max", "pow2", "oracle")]
    low, high = round(running["paged"] / max(contiguous)), round(running["paged"] / min(contiguous))
    n |= {"paged_batch": f"{running['paged']:.2f}", "contiguous_least": f"{min(contiguous):.2f}",
          "contiguous_most": f"{max(contiguous):.2f}", "en_times_low": WORDS["en"][low].capitalize(),
          "en_times_high": WORDS["en"][high], "zh_times_low": WORDS["zh"][low], "zh_times_high": WORDS["zh"][high]}

    # Blocks of 16: the waste of one sequence, and the simulated utilisation.
    manager = BlockSpaceManager(BlockAllocator(4), block_size=16)
    manager.allocate("s", list(range(17)))
    n |= {"block_size": "16", "most_wasted": f"{len(manager.get_block_table('s')) * 16 - 17}"}
    utilisation = result("block_size")["utilisation"]
    n["largest_block"] = f"{max(int(key.split('/')[1]) for key in utilisation)}"
    for trace in ("ShareGPT", "Alpaca"):
        for size in ("16", n["largest_block"]):
            n[f"{trace.lower()}_{size}"] = f"{100 * utilisation[f'{trace}/{size}']['token']:.1f}"
    n["sharegpt_largest"], n["alpaca_largest"] = n.pop(f"sharegpt_{n['largest_block']}"), n.pop(
        f"alpaca_{n['largest_block']}")

    # What paging costs on a CPU (bench/attention_kernels.py): stage 4's gather-then-attend
    # reference against contiguous SDPA, at the largest case the CPU run measures.
    kernels = result("attention_kernels")
    assert kernels["device"].startswith("CPU")  # the page says it is a CPU's figure
    row = max(kernels["rows"], key=lambda r: r["batch"] * r["context"])
    n |= {"kernel_batch": f"{row['batch']}", "kernel_context": f"{row['context']}",
          "reference_ms": two_figures(row["ms"]["ref"]), "sdpa_ms": two_figures(row["ms"]["sdpa"]),
          "reference_ratio": f"{row['ms']['ref'] / row['ms']['sdpa']:.1f}"}

    # Swap or recompute, as bench/swap_vs_recompute.py measured it.
    swap = result("swap_vs_recompute")
    n |= {"swap_tokens": f"{swap['tokens']}", "swap_1_ms": f"{swap['rows']['1']['swap_ms']:.1f}",
          "swap_16_ms": f"{swap['rows']['16']['swap_ms']:.1f}",
          "recompute_ms": f"{swap['rows']['16']['recompute_ms']:.0f}"}

    # Prefix caching: only full blocks are cached.
    cached = PrefixCachingBlockSpaceManager(PrefixCachingAllocator(16), block_size=16)
    system = list(range(100, 200))
    cached.allocate("first", system + [1, 2])
    cached.append_slot("first")  # the step that computed the prompt succeeded
    cached.free("first")
    n |= {"system_prompt": f"{len(system)}", "cached_tokens": f"{cached.allocate('next', system + [3, 4])}"}

    # GQA and FP8.
    llama8 = ModelConfig.from_hf(LLAMA3_8B)
    gqa, fp8 = llama8.kv_bytes_per_token(torch.float16), llama8.kv_bytes_per_token(torch.float8_e4m3fn)
    mha = ModelConfig.from_hf({**LLAMA3_8B, "num_key_value_heads": 32}).kv_bytes_per_token(torch.float16)
    n |= {"llama8_layers": f"{llama8.num_layers}", "llama8_kv_heads": f"{llama8.num_kv_heads}",
          "llama8_head_dim": f"{llama8.head_dim}", "llama8_query_heads": f"{llama8.num_heads}",
          "gqa_bytes": f"{gqa:,}", "gqa_kib": f"{gqa // KiB}", "mha_kib": f"{mha // KiB}", "fp8_kib": f"{fp8 // KiB}",
          "per_gib_mha": f"{GiB // mha:,}", "per_gib_gqa": f"{GiB // gqa:,}", "per_gib_fp8": f"{GiB // fp8:,}",
          "capacity_ratio": f"{mha // fp8}"}
    bound = result("batch_capacity")["memory_bound"]  # stage 13, measured where memory sets the batch
    busiest = bound[max(bound, key=lambda key: float(key.split("/")[1]))]
    drift = result("fp8_kv_cache")["results"]["tiny"]["fp8, calibrated"]
    n |= {"fp8_paged_batch": f"{busiest['paged']:.2f}", "fp8_batch": f"{busiest['paged_fp8']:.2f}",
          "fp8_batch_ratio": f"{busiest['paged_fp8'] / busiest['paged']:.2f}",
          "fp8_mean_drift": f"{drift['mean_token_logprob_drift']:.3f}"}

    # Chunked prefill, as bench/chunked_prefill.py measured it; the V0-against-V1 answer uses it too.
    chunked = result("chunked_prefill")
    rows = chunked["rows"]
    budgets = sorted(int(m[1]) for key in rows if (m := re.fullmatch(r"stage 10, budget (\d+)", key)))
    small, medium = budgets[0], budgets[1]
    whole, at_small, at_medium = rows["stage 9 (whole prompt)"], rows[f"stage 10, budget {small}"], rows[
        f"stage 10, budget {medium}"]
    assert two_figures(whole["ttft_ms"]) == two_figures(whole["worst_step_ms"])  # "and so does" its first token
    chunk = small - chunked["decoding_requests"]  # what the decodes leave of the small budget
    assert at_small["steps"] == math.ceil(chunked["long_prompt"] / chunk)
    n |= {"decoding": f"{chunked['decoding_requests']}", "long_prompt": f"{chunked['long_prompt']}",
          "whole_step_ms": two_figures(whole["worst_step_ms"]), "budget_small": f"{small}",
          "small_itl_p99": two_figures(at_small["itl_p99_ms"]), "small_ttft": two_figures(at_small["ttft_ms"]),
          "small_worst_step": two_figures(at_small["worst_step_ms"]), "chunk": f"{chunk}",
          "small_steps": f"{at_small['steps']}", "budget_medium": f"{medium}",
          "medium_itl_p99": two_figures(at_medium["itl_p99_ms"]), "medium_ttft": two_figures(at_medium["ttft_ms"])}

    # Tensor parallelism: what one GPU holds.
    llama70 = ModelConfig.from_hf(LLAMA3_70B)
    weights70 = weight_bytes(LLAMA3_70B, torch.bfloat16)
    shard = shard_config(llama70, 8)
    kv = {row["tp"]: row for row in result("tensor_parallel")["kv"]}
    assert all(len(set(row["kv_bytes_per_token_per_worker"])) == 1 for row in kv.values())
    assert kv[4]["kv_bytes_per_token_per_worker"][0] == kv[2]["kv_bytes_per_token_per_worker"][0]  # replicated
    n |= {"tp": "8", "llama70_gb": f"{weights70 / 1e9:.1f}", "per_gpu_gb": f"{weights70 / 8 / 1e9:.1f}",
          "llama70_kv_kib": f"{llama70.kv_bytes_per_token(torch.bfloat16) // KiB}",
          "per_gpu_kv_kib": f"{shard.kv_bytes_per_token(torch.bfloat16) // KiB}",
          "en_kv_heads_per_gpu": WORDS["en"][shard.num_kv_heads],
          "zh_kv_heads_per_gpu": WORDS["zh"][shard.num_kv_heads],
          "tiny_tp1": f"{kv[1]['kv_bytes_per_token_per_worker'][0]:,}",
          "tiny_tp2": f"{kv[2]['kv_bytes_per_token_per_worker'][0]:,}",
          "tiny_tp4": f"{kv[4]['kv_bytes_per_token_per_worker'][0]:,}",
          "tiny_kv_heads": f"{len({h for heads in kv[4]['heads_per_rank'] for h in heads})}"}

    # Continuous batching against paging (bench/throughput.py): the engine's tokens per second over
    # transformers' static `generate` and over its continuous batching, from the smallest batch to the
    # largest, on a CPU with a cache that holds every request of a batch at its longest.
    throughput = result("throughput")
    assert throughput["device"] == "cpu"
    batches = [r["batch"] for r in throughput["rows"]]
    static, continuous = [r["ratio"] for r in throughput["rows"]], [r["ratio_cb"] for r in throughput["rows"]]
    n |= {"tput_batch_low": f"{min(batches)}", "tput_batch_high": f"{max(batches)}",
          "static_low": f"{min(static):.1f}", "static_high": f"{max(static):.1f}",
          "cb_low": f"{min(continuous):.1f}", "cb_high": f"{max(continuous):.1f}"}

    # Speculative decoding, as bench/speculative.py measured it.
    (row,) = [r for r in result("speculative")["rows"] if (r["batch"], r["workload"], r["k"]) == (1, "repetitive", 4)]
    n |= {"drafts": "4", "tokens_per_forward": f"{row['tokens_per_forward']}", "speedup": f"{row['speedup']}",
          "spec_batch": "1"}

    # Disaggregated prefill, as bench/disaggregated.py measured it.
    disagg = result("disaggregated")
    one, split = disagg["summary"]["one engine, 1 thread"], disagg["summary"]["producer + consumer"]
    n |= {"disagg_decodes": f"{disagg['decodes']}", "disagg_burst": f"{disagg['burst']}",
          "disagg_prompt": f"{disagg['prompt_len']}", "disagg_quiet": f"{one['itl_no_burst_ms']:,.0f}",
          "disagg_one_p99": f"{one['itl_p99_ms']:,.0f}", "disagg_split_p99": f"{split['itl_p99_ms']:,.0f}",
          "disagg_moved": f"{disagg['bytes_per_request']['measured']:,.0f}"}

    # A hybrid KV cache: a long request on a 48-layer model, five sliding layers (window 128) to one full.
    from minipaged.stage15_hybrid_kv_cache import HybridKVCacheCoordinator
    from minipaged.stage15_kv_cache_groups import group_size, kv_cache_groups

    groups = kv_cache_groups(([128] * 5 + [None]) * 8, 16)
    coordinator = HybridKVCacheCoordinator(groups, 4000)
    coordinator.allocate_slots("r", 0, 8192)
    coordinator.allocate_slots("r", 8192, 8193)  # the slot of its next token, the windows' blocks given back
    held = sum(b != coordinator.null_block for m in coordinator.managers for b in m.req_to_blocks["r"])
    hybrid, every = held * group_size(groups), -(-8193 // 16) * 48
    n |= {"h_layers": "48", "h_tokens": f"{8192:,}", "h_layer_blocks": f"{hybrid:,}", "h_every": f"{every:,}",
          "h_ratio": f"{every / hybrid:.1f}"}
    return n


# Where each number stands: per section (its heading id, "" for the text above the first), the
# fragments of the English and of the Chinese page, {name} standing for computed()[name].
FRAGMENTS: dict[str, dict[str, list[str]]] = {
    "": {
        "en": ["its 24× set beside what it compares"],
        "zh": ["它引用的 24 倍也注明了是跟谁比"],
    },
    "in-30-seconds": {
        "en": ["fixed blocks of {block_size} tokens", "the paper measures 2–4× the throughput"],
        "zh": ["每块 {block_size} 个 token", "论文里吞吐是 FasterTransformer 和 Orca 的 2–4 倍"],
    },
    "in-2-minutes": {
        "en": ["2 × {opt_layers} layers × {opt_hidden} hidden × 2 bytes = {opt_kv_bytes} bytes, "
               "{opt_kv_kib} KiB per token",
               "so {thousand} tokens take {thousand_mb} MB", "the weights take {weights_gb} GB",
               "about {kv_budget_gib} GiB is left for K/V: {slots} token slots", "only 20.4–38.2% of such memory",
               "blocks of {block_size} tokens",
               "96.3% of the memory holds K/V in the paper, {sharegpt_16}% in this project's simulation",
               "{en_times_low} to {en_times_high} times as many requests decode together",
               "runs {paged_batch} ShareGPT-like requests at once on average in paged memory, "
               "against {contiguous_least} to {contiguous_most} in contiguous slabs",
               "Figure 13: vLLM 30.42, Orca 7.00 to 13.62", "2–4× FasterTransformer and Orca at the same latency",
               '**{opt_kv_kib} KiB per token** ({opt_kv_bytes} bytes), not "about 208 KB"',
               "{thousand} tokens are {thousand_mb} MB, not 200 MB", 'The "24×"', "is **2–4×**"],
        "zh": ["2 × {opt_layers} 层 × {opt_hidden} hidden × 2 字节 = {opt_kv_bytes} 字节，也就是 {opt_kv_kib} KiB",
               "{thousand} 个 token 就是 {thousand_mb} MB", "权重占掉 {weights_gb} GB",
               "留给 K/V 的大约 {kv_budget_gib} GiB，一共 {slots} 个 token 槽位", "只有 20.4–38.2% 的显存",
               "切成 {block_size} 个 token 一块", "论文里 96.3% 的显存存着 K/V，本项目的模拟里是 {sharegpt_16}%",
               "能同时 decode 的请求数是连续预留时的{zh_times_low}到{zh_times_high}倍",
               "分页平均同时跑 {paged_batch} 个类 ShareGPT 请求，"
               "连续预留只有 {contiguous_least} 到 {contiguous_most} 个",
               "Figure 13 里，vLLM 是 30.42 个，Orca 是 7.00 到 13.62 个",
               "同样延迟下是 FasterTransformer 和 Orca 的 2–4 倍",
               "每个 token 是 **{opt_kv_kib} KiB**（{opt_kv_bytes} 字节），不是“约 208 KB”",
               "{thousand} 个 token 是 {thousand_mb} MB，不是 200 MB", "“24 倍”", "结论是 **2–4 倍**"],
    },
    "why-does-a-bigger-batch-raise-throughput": {
        "en": ["{weights_gb} GB for OPT-13B", "{bandwidth} GB/s",
               "one request of {context} tokens takes at least {alone_ms} ms a step, "
               "so it gets at most {alone_tps} tokens/s",
               "{opt_kv_kib} KiB per token of context",
               "only at {bend_tokens} tokens of context in the batch ({bend_requests} requests of {context} tokens)",
               "more than the {slots} slots",
               "{full_batch} of them in blocks of {block_size}, a step reads {full_gb} GB, at least {full_ms} ms, "
               "and gives each of the {full_batch} a token: {full_tps} tokens/s"],
        "zh": ["float16 权重是 {weights_gb} GB", "{bandwidth} GB/s",
               "只跑一个 {context} token 的请求，一步至少 {alone_ms} ms，最多 {alone_tps} tokens/s",
               "上下文每个 token {opt_kv_kib} KiB",
               "加起来到 {bend_tokens} 个 token（{context} token 的请求要 {bend_requests} 个）",
               "一共只有 {slots} 个槽位",
               "用 {block_size} token 一块的分块方式把 cache 装满，能放下 {full_batch} 个这样的请求，这时一步读 "
               "{full_gb} GB，至少 {full_ms} ms，{full_batch} 个请求各拿到一个 token，合计 {full_tps} tokens/s"],
    },
    "continuous-batching-against-paging": {
        "en": ["The launch post's up to 24× is against Hugging Face Transformers with static batching",
               "up to 3.5× over Text Generation Inference",
               "The paper's 2–4× is against Orca, which already batches per iteration",
               "makes {static_low}–{static_high}× the tokens per second of transformers' static `generate` at batch "
               "{tput_batch_low} to {tput_batch_high}, but only {cb_low}–{cb_high}× those of transformers' own "
               "continuous batching"],
        "zh": ["发布博客里最高 24 倍的对手是用静态批处理的 Hugging Face Transformers",
               "对当时已经在做连续批处理的 Text Generation Inference 是最高 3.5 倍",
               "论文的 2–4 倍对手是 Orca，而 Orca 本来就按 iteration 组 batch",
               "batch {tput_batch_low} 到 {tput_batch_high} 时，引擎每秒生成的 token 是 "
               "transformers 静态 `generate` 的 {static_low}–{static_high} 倍，"
               "但只是 transformers 自带的连续批处理（它的 cache 也分页）的 {cb_low}–{cb_high} 倍"],
    },
    "why-blocks-of-16": {
        "en": ["Why blocks of {block_size}?", "{most_wasted} slots at block size {block_size}",
               "{sharegpt_16}% and {alpaca_16}% at block size {block_size}, "
               "but {sharegpt_largest}% and {alpaca_largest}% at {largest_block}",
               "16 to 128 best end to end on ShareGPT and 16 or 32 on Alpaca", "vLLM's default of {block_size}"],
        "zh": ["为什么块是 {block_size}？", "块大小 {block_size} 时最多空 {most_wasted} 个槽位",
               "块大小 {block_size} 时存着 K/V 的显存分别是 {sharegpt_16}% 和 {alpaca_16}%，"
               "到 {largest_block} 就只剩 {sharegpt_largest}% 和 {alpaca_largest}%",
               "ShareGPT 上 16 到 128 最好，Alpaca 上 16 或 32 最好", "vLLM 默认取 {block_size}"],
    },
    "what-does-paging-cost-inside-the-kernel": {
        "en": ["at 20–26% higher latency than FasterTransformer's",
               "at batch {kernel_batch} and {kernel_context} tokens of context",
               "takes {reference_ms} ms against {sdpa_ms} ms for the same attention over contiguous K/V: "
               "{reference_ratio} times as long"],
        "zh": ["比 FasterTransformer 的连续版本高 20–26%", "batch {kernel_batch}、上下文 {kernel_context} 个 token 时",
               "要 {reference_ms} ms，同样的 attention 直接在连续的 K/V 上算只要 {sdpa_ms} ms，"
               "前者的耗时是后者的 {reference_ratio} 倍"],
    },
    "swap-or-recompute": {
        "en": ["For one {swap_tokens}-token sequence",
               "a swap round trip at {swap_1_ms} ms with blocks of 1 token and {swap_16_ms} ms with blocks of 16, "
               "and recomputing it at {recompute_ms} ms", "for blocks of 16 to 64"],
        "zh": ["对一条 {swap_tokens} token 的序列测得",
               "块大小为 1 个 token 时换出再换入一趟 {swap_1_ms} ms，块大小为 16 时 {swap_16_ms} ms，"
               "重算则是 {recompute_ms} ms", "块大小为 16 到 64 时两者差不多"],
    },
    "v0-against-v1": {
        "en": ["a {long_prompt}-token prompt computed whole makes {decoding} decoding requests wait through a "
               "{whole_step_ms} ms step; with a budget of {budget_small} it goes in chunks of the {chunk} tokens "
               "the decodes leave, over {small_steps} steps, none longer than {small_worst_step} ms"],
        "zh": ["一个 {long_prompt} token 的 prompt 整段算，正在 decode 的 {decoding} 个请求"
               "都要等一个 {whole_step_ms} ms 的 step；预算 {budget_small} 时，"
               "它按 decode 剩下的 {chunk} 个 token 一段切开，分 {small_steps} 步算完，"
               "没有一步超过 {small_worst_step} ms"],
    },
    "hash-based-prefix-caching-against-radixattention": {
        "en": ["a {system_prompt}-token system prompt with blocks of {block_size} gives the next request "
               "{cached_tokens} cached tokens"],
        "zh": ["块大小为 {block_size} 时，一个 {system_prompt} token 的 system prompt 只能给下一个请求 "
               "{cached_tokens} 个缓存 token"],
    },
    "what-gqa-and-fp8-do-to-capacity": {
        "en": ["{llama8_layers} layers and {llama8_kv_heads} KV heads of {llama8_head_dim}: "
               "{gqa_bytes} bytes, {gqa_kib} KiB per token",
               "each of its {llama8_query_heads} query heads it would be {mha_kib} KiB",
               "halves the {gqa_kib} KiB to {fp8_kib} KiB",
               "holds {per_gib_mha} tokens without GQA, {per_gib_gqa} with it and {per_gib_fp8} with FP8 too: "
               "{capacity_ratio}× the batch",
               "where memory sets the batch, {fp8_paged_batch} requests at once become {fp8_batch} "
               "({fp8_batch_ratio}×)",
               "a token's log-probability moves by {fp8_mean_drift} on average"],
        "zh": ["{llama8_layers} 层、{llama8_kv_heads} 个 KV head、head 维度 {llama8_head_dim}：float16 下每个 token "
               "{gqa_bytes} 字节，即 {gqa_kib} KiB",
               "如果 {llama8_query_heads} 个 query head 各配一个 KV head，就是 {mha_kib} KiB",
               "再把 {gqa_kib} KiB 减半到 {fp8_kib} KiB",
               "不用 GQA 装 {per_gib_mha} 个 token，用 GQA 装 {per_gib_gqa} 个，再加 FP8 装 {per_gib_fp8} 个",
               "batch 大到 {capacity_ratio} 倍",
               "在显存决定 batch 大小的时候，同时运行的请求从 {fp8_paged_batch} 个变成 {fp8_batch} 个"
               "（{fp8_batch_ratio} 倍）",
               "单个 token 的 log-probability 平均偏 {fp8_mean_drift}"],
    },
    "chunked-prefill-trade": {
        "en": ["{decoding} requests decode on the tiny model when a {long_prompt}-token prompt arrives",
               "the step takes {whole_step_ms} ms, and so does the prompt's time to first token",
               "Cut by a token budget of {budget_small} (stage 10), the decoding requests' p99 inter-token latency "
               "falls to {small_itl_p99} ms and the prompt's first token comes after {small_ttft} ms; "
               "with a budget of {budget_medium}, {medium_itl_p99} ms and {medium_ttft} ms"],
        "zh": ["tiny 模型上 {decoding} 个请求正在 decode，这时来了一个 {long_prompt} token 的 prompt",
               "这一步要 {whole_step_ms} ms，这个 prompt 的首 token 时间也是 {whole_step_ms} ms",
               "用 {budget_small} 的 token 预算切开（stage 10），"
               "decode 请求的 p99 token 间延迟降到 {small_itl_p99} ms，"
               "但 prompt 的首 token 要到 {small_ttft} ms 才出来；预算 {budget_medium} 时是 {medium_itl_p99} ms 和 "
               "{medium_ttft} ms"],
    },
    "tensor-parallelism-memory-per-gpu": {
        "en": ["1/tp of every layer's weights",
               "{llama70_gb} GB of weights, {per_gpu_gb} GB per GPU at tp {tp}; its {llama70_kv_kib} KiB of K/V per "
               "token become {per_gpu_kv_kib} KiB per GPU, {en_kv_heads_per_gpu} KV head each",
               "the tiny model's {tiny_tp1} bytes per token become {tiny_tp2} per worker at tp 2, and {tiny_tp4} again "
               "at tp 4, because its {tiny_kv_heads} KV heads are then replicated"],
        "zh": ["每一层 1/tp 的权重",
               "权重是 {llama70_gb} GB，tp {tp} 时每张卡 {per_gpu_gb} GB；每个 token {llama70_kv_kib} KiB 的 K/V，"
               "摊到每张卡是 {per_gpu_kv_kib} KiB，每卡{zh_kv_heads_per_gpu}个 KV head",
               "tiny 模型每个 token {tiny_tp1} 字节，tp 2 时每个 worker {tiny_tp2} 字节，tp 4 时还是 {tiny_tp4}，"
               "因为它只有 {tiny_kv_heads} 个 KV head"],
    },
    "why-is-speculative-decoding-lossless": {
        "en": ["min(1, p/q)", "max(0, p − q)",
               "with drafts of {drafts}, `bench/speculative.py` measures {tokens_per_forward} tokens per forward pass "
               "and {speedup}× the speed at batch {spec_batch}"],
        "zh": ["min(1, p/q)", "max(0, p − q)",
               "草稿长度 {drafts}，`bench/speculative.py` 测得每次前向 {tokens_per_forward} 个 token，"
               "batch {spec_batch} 时速度是 {speedup} 倍"],
    },
    "why-split-prefill-from-decode": {
        "en": ["(vLLM's `KVConnectorBase_V1`)",
               "`bench/disaggregated.py`: {disagg_decodes} requests decode on a Qwen2.5-0.5B-shaped model when "
               "{disagg_burst} prompts of {disagg_prompt} tokens arrive",
               "their p99 inter-token latency is {disagg_one_p99} ms in one engine, against a {disagg_quiet} ms "
               "decode step before the burst; with a producer and a consumer, {disagg_split_p99} ms",
               "Each request moved {disagg_moved} bytes of K/V"],
        "zh": ["（vLLM 的 `KVConnectorBase_V1`）",
               "`bench/disaggregated.py`：Qwen2.5-0.5B 形状的模型上 {disagg_decodes} 个请求正在 decode，"
               "这时来了 {disagg_burst} 个 {disagg_prompt} token 的 prompt",
               "单个引擎里它们的 p99 token 间隔是 {disagg_one_p99} ms，突发之前一步 decode 只要 {disagg_quiet} ms；"
               "换成一个 producer 加一个 consumer，是 {disagg_split_p99} ms",
               "每个请求搬了 {disagg_moved} 字节的 K/V"],
    },
    "why-a-hybrid-kv-cache": {
        "en": ["For a request of {h_tokens} tokens on a {h_layers}-layer model with five layers of window 128 to one "
               "full, the hybrid cache holds {h_layer_blocks} layer-blocks where keeping every block takes {h_every}: "
               "{h_ratio}× the requests in the same memory"],
        "zh": ["{h_layers} 层、每五个窗口为 128 的层配一个全 attention 层的模型，{h_tokens} 个 token 的请求，"
               "混合 cache 占 {h_layer_blocks} 个“层·块”，每块都留着要 {h_every} 个："
               "同样的显存能放下 {h_ratio} 倍的请求"],
    },
    "in-one-sentence": {
        "en": ["2–4× the throughput of FasterTransformer and Orca in the paper",
               "24× that of Hugging Face Transformers in the launch post"],
        "zh": ["论文里吞吐是 FasterTransformer 和 Orca 的 2–4 倍", "发布博客里是 Hugging Face Transformers 的 24 倍"],
    },
}

# Figures of the vLLM paper and launch post, as the references and benchmarks pages quote them, and
# the explainer's numbers that the page corrects.
QUOTED = {
    "references.md": ["2–4×", "24×", "3.5×", "20.4%", "38.2%", "96.3%", "20–26%", "208 KB", "200 MB",
                      "7.00, 9.81, 13.62 and 30.42"],
    "benchmarks.md": ["blocks of 16 to 128", "16 or 32", "for blocks of 16 to 64"],
}
# The numbers of the argument's own words: K and V (2), the bytes of float16 (2), the bounds of
# min(1, p/q) and max(0, p − q), 1/tp, and the block sizes and tp degrees the benchmarks run.
INPUTS = {"0", "1", "2", "4", "16", "32", "64", "128"}
HEADING = re.compile(r"^#{1,6} .*?(?:\{#([\w-]+)\})?[ \t]*$", re.MULTILINE)


def language(page: Path) -> str:
    return "zh" if page.name.endswith(".zh.md") else "en"


def sections(text: str) -> dict[str, str]:
    """The page's text by section: the id of each heading's anchor, "" for what comes before."""
    cuts = [(0, "")] + [(m.start(), m.group(1) or "") for m in HEADING.finditer(text) if m.start()]
    out: dict[str, str] = {}
    for (start, name), (end, _) in zip(cuts, cuts[1:] + [(len(text), "")], strict=True):
        out[name] = out.get(name, "") + text[start:end]
    return {name: normalised(body) for name, body in out.items()}


def expected(name: str, lang: str) -> list[str]:
    n = computed()
    return [fragment.format(**n) for fragment in FRAGMENTS.get(name, {}).get(lang, [])]


def problems(by_section: dict[str, str], lang: str) -> list[str]:
    """What is wrong with a page's numbers, given by section: a fragment not found in its section
    as computed, or a number (in digits, or a multiple in words) that no fragment accounts for."""
    found = []
    assert set(FRAGMENTS) <= set(by_section), f"no such sections: {set(FRAGMENTS) - set(by_section)}"
    for name, body in by_section.items():
        found += section_problems(body, expected(name, lang), NAMES, f"{name}: ")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_number_stands_in_its_own_sentence(page):
    found = problems(sections(page.read_text(encoding="utf-8")), language(page))
    assert not found, f"{page.name}:\n" + "\n".join(found)


def test_every_computed_number_is_given_on_both_pages():
    used = {lang: {field for per in FRAGMENTS.values() for fragment in per[lang]
                   for _, field, _, _ in string.Formatter().parse(fragment) if field}
            for lang in ("en", "zh")}
    other = {"en": "zh_", "zh": "en_"}  # the words of the other language
    for lang, fields in used.items():
        missing = {k for k in computed() if not k.startswith(other[lang])} - fields
        assert not missing, f"the {lang} page does not give {sorted(missing)}"


def test_a_fragments_own_numbers_are_quoted_figures_or_inputs():
    allowed = set(INPUTS)
    for page, figures in QUOTED.items():
        text = " ".join((DOCS / page).read_text(encoding="utf-8").split())
        for figure in figures:
            assert figure in text, f"{page} no longer quotes {figure!r}"
            allowed |= set(NUMBER.findall(figure))
    for name, per in FRAGMENTS.items():
        for lang, fragments in per.items():
            for fragment in fragments:
                literal = re.sub(r"\{[^}]*\}", " ", fragment)
                unknown = set(NUMBER.findall(NAMES.sub(" ", literal))) - allowed
                assert not unknown, f"{name} ({lang}): {fragment!r} writes {unknown}, which nothing quotes"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_check_refuses_a_changed_or_swapped_number(page):
    """Every fragment, mutated in the page: one number off by a digit, or two of its numbers traded."""
    lang = language(page)
    templates = ((name, template) for name, per in FRAGMENTS.items() for template in per[lang])
    assert_refuses_mutants(sections(page.read_text(encoding="utf-8")), lambda wrong: problems(wrong, lang),
                           mutants(templates, computed()), 100, page.name)


@pytest.mark.parametrize(("page", "number", "wrong"), [
    (PAGES[0], "13 ms and 28 ms", "28 ms and 13 ms"),
    (PAGES[1], "13 ms 和 28 ms", "28 ms 和 13 ms"),
    (PAGES[0], "Two to four times", "Three to four times"),
    (PAGES[1], "两到四倍", "三到四倍"),
    (PAGES[0], "one KV head each", "two KV heads each"),
    (PAGES[1], "20–26%", "20–36%"),
    (PAGES[0], "none longer than 4.4 ms.", "none longer than 4.4 ms, 5 times less."),
    (PAGES[1], "3.7 倍", "3.7 倍，快了两倍"),
], ids=["swap-en", "swap-zh", "words-en", "words-zh", "one-en", "quoted-zh", "extra-en", "extra-words-zh"])
def test_the_check_refuses_these_edits(page, number, wrong):
    by_section = sections(page.read_text(encoding="utf-8"))
    (name,) = [name for name, body in by_section.items() if number in body]
    assert problems({**by_section, name: by_section[name].replace(number, wrong, 1)}, language(page))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_explainers_numbers_are_corrected(page):
    n = computed()
    text = normalised(page.read_text(encoding="utf-8"))
    assert f"**{n['opt_kv_kib']} KiB" in text and f"{n['opt_kv_bytes']}" in text
    assert "208 KB" in text and "200 MB" in text  # named, as what is corrected
    assert f"{n['thousand_mb']} MB" in text
    assert f"2 × {n['opt_layers']}" in text and f"× {n['opt_hidden']} " in text and f"= {n['opt_kv_bytes']} " in text
    assert "**2–4" in text and "24" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_decode_bound_is_stage_0s(page):
    """Where both pages state the same quantity of the bound, they state the same figure."""
    n = computed()
    stage0 = (DOCS / "stages" / page.name.replace("interview", "0_contiguous")).read_text(encoding="utf-8")
    english = page.name == "interview.md"
    start = stage0.index("## Why the batch" if english else "{#why-the-batch-decides-the-throughput}")
    end = stage0.find("\n## ", start)
    figures = [f"{n['weights_gb']} GB", f"{n['bandwidth']} GB/s", f"{n['alone_ms']} ms",
               f"{n['alone_tps']} tokens/s", f"{n['full_ms']} ms", f"{n['full_tps']} tokens/s"]
    for text, name in ((page.read_text(encoding="utf-8"), page.name), (stage0[start:end], "stage 0")):
        missing = [figure for figure in figures if figure not in " ".join(text.split())]
        assert not missing, f"{name} does not state {missing}"


def test_the_batching_follow_up_gives_the_ends_of_the_benchmarks_table():
    """The ends of the ranges over static `generate` and over continuous batching, computed from
    bench/results/throughput.json, are ratios the Benchmarks page's throughput table gives."""
    n = computed()
    page = " ".join((DOCS / "benchmarks.md").read_text(encoding="utf-8").split())
    table = page[page.index("## The engine against transformers"):page.index("**A model where the forward")]
    rows = [row for row in table.split(" | ") if row.endswith("×")]
    for low, high in (("static_low", "static_high"), ("cb_low", "cb_high")):
        assert f"{n[low]}×" in rows and f"{n[high]}×" in rows, (low, high)


# What a step of each scheduler holds. V0's default scheduler runs a step of prefills only, or
# a step of decodes; minipaged's stages 6 to 9 decode first, then admit whole prompts into the
# same forward pass (the order of V0's chunked-prefill scheduler, without chunks).
SENTENCE = re.compile(r"(?<=[.;!?。；！？])\s*")
NOT_V0_DEFAULT = re.compile(r"minipaged|[Ss]tages? \d|chunked-prefill|V1")
DECODE_THEN_ADMIT = {"en": re.compile(r"decodes?\b[^.;]*\bthen\b[^.;]*\b(?:admits?|prompts?)"),
                     "zh": re.compile(r"先[^。；]*decode[^。；]*再[^。；]*(?:接纳|prompt)")}
PREFILLS_ONLY = {"en": re.compile(r"\bruns? only their prefills|prefills alone"),
                 "zh": re.compile(r"只跑[^。；]*prefill")}


def v0_default_claims(text: str, lang: str) -> tuple[list[str], bool]:
    """The sentences that give V0's default step minipaged's order, and whether one gives its own."""
    body = sections(text)["v0-against-v1"]
    wrong, right = [], False
    for sentence in SENTENCE.split(body):
        if "V0" not in sentence or NOT_V0_DEFAULT.search(sentence):
            continue
        wrong += [sentence] if DECODE_THEN_ADMIT[lang].search(sentence) else []
        right = right or bool(PREFILLS_ONLY[lang].search(sentence))
    return wrong, right


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_v0s_default_step_is_prefills_only_or_decodes(page):
    wrong, right = v0_default_claims(page.read_text(encoding="utf-8"), language(page))
    assert not wrong, f"{page.name} gives V0's default scheduler minipaged's order: {wrong}"
    assert right, f"{page.name} does not say that V0's default runs a step of prefills alone"


@pytest.mark.parametrize(("lang", "claim"), [
    ("en", "V0 is the paper's scheduler: phases — decode the running requests, then admit whole prompts."),
    ("zh", "V0 就是论文里的调度器，分阶段：先让运行中的请求 decode，再接纳整个 prompt；支持换出。"),
])
def test_the_v0_check_refuses_minipageds_order_given_to_v0(lang, claim):
    page = PAGES[lang == "zh"].read_text(encoding="utf-8")
    heading = re.search(r"^### .*\{#v0-against-v1\}\n\n", page, re.MULTILINE)
    wrong, _ = v0_default_claims(page[:heading.end()] + claim + " " + page[heading.end():], lang)
    assert wrong


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


# bench/batch_capacity.py's full run: requests per trace. Its results are seeded and
# deterministic; the contiguous policies, which the page quotes as a range, take a few seconds.
CAPACITY_REQUESTS = 500


def test_the_quoted_contiguous_batches_are_what_the_benchmark_computes(monkeypatch):
    """ShareGPT-like at the highest rate, the three contiguous policies run again from the seeded
    trace and compared with bench/results/batch_capacity.json. The paged batch (the real engine
    loop, about a minute) and bench/block_size.py's utilisations (a minute a trace) are left to
    the benchmarks' own runs."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as a script, it imports bench/'s own modules
    spec = importlib.util.spec_from_file_location("batch_capacity", ROOT / "bench" / "batch_capacity.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    data = result("batch_capacity")
    assert data["slots"] == bench.OPT_13B_SLOTS
    rate = max((key for key in data["results"] if key.startswith("ShareGPT/")), key=lambda k: float(k.split("/")[1]))
    requests = bench.trace("ShareGPT", CAPACITY_REQUESTS, float(rate.split("/")[1]) * bench.SCALE["ShareGPT"])
    for policy in ("max", "pow2", "oracle"):
        assert bench.mean_batch_contiguous(requests, policy, bench.OPT_13B_SLOTS) == pytest.approx(
            data["results"][rate][policy], rel=1e-12), policy
