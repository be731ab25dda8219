"""How many requests does one K/V memory hold at once when sliding-window layers give back their blocks? (stage 15)

The vLLM paper's Figure 13 question, one link on. A model whose layers mix sliding windows with full
attention (Gemma 2 and 3, gpt-oss) is served two ways from the same bytes of K/V:

* **hybrid** (stage 15, vLLM's default): the layers cut into ``kv_cache_groups``, a block holding
  ``group_size`` layers, one pool with its null block; a sliding-window group gives back the blocks
  its window has left (``remove_skipped_blocks``).
* **every layer full**, the baseline (``disable_hybrid_kv_cache_manager=True``): stage 10's
  ``KVCacheManager`` over stage 6's block manager, a block holding every layer, every block kept.

The memory is turned into blocks as ``LLM`` turns it (``EngineConfig.resolve``; for a hybrid cache,
``LLM.hybrid_num_blocks``: the bytes over blocks of ``group_size`` layers, one of them the null block),
and the scheduler and its
KV cache manager are built by ``LLM``'s own builders (``build_kv_cache_groups``, ``build_block_manager``,
``build_scheduler``). They are driven by the real V1 engine loop (``V1Engine``) with a runner that has no
model: residency is the scheduler's decision, which no forward pass changes. Every request is queued at
the start, so that memory alone sets the batch; reported over the steps while requests still wait (the
steady state, the drain left out): the requests running on average, the most at once, and the blocks the
windows give back per step. The cache is Gemma 3 12B's (48 layers, 8 KV heads of 256, bfloat16: 384 KiB
a token) in 12 GiB; its layers slide 1:1 (alternating), 5:1 (Gemma 3's) or all, with windows of 128,
1,024 and 4,096 tokens; the requests are ShareGPT-like (bench/workloads.py: at most 2,048 tokens).

Then a forward that runs: the tiny model with its layers 0 and 2 given a window of 64 (1:1), served by
``LLM`` from one K/V memory with the hybrid cache and with every block kept, on ShareGPT-like requests
scaled to its 512 positions; tokens per second on one CPU thread, the two runs interleaved, and their
tokens checked equal.

Writes bench/results/hybrid_capacity.json and .png (bench/results/quick/ with --quick); the last line is
the headline.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
import types
from pathlib import Path

import torch
from harness import environment, make_parser, results_dir_for, write_json
from workloads import MAX_LEN, trace

from minipaged import LLM, SamplingParams
from minipaged.common.config import V1_MAX_NUM_BATCHED_TOKENS, EngineConfig
from minipaged.common.sampler import Sampler
from minipaged.models import load_config, resolve_model_path
from minipaged.models.config import ModelConfig
from minipaged.perf.simulate import synthetic_requests
from minipaged.stage10_engine_core import V1Engine
from minipaged.stage15_hybrid_kv_cache import HybridKVCacheManager
from minipaged.stage15_kv_cache_groups import SlidingWindowManager, group_size

# Gemma 3 12B's K/V (its config.json): 48 layers, 8 KV heads of 256, in bfloat16; 12 GiB of it.
GEMMA3_12B = {"num_hidden_layers": 48, "num_key_value_heads": 8, "head_dim": 256}
MEMORY = 12 * 2**30
BLOCK_SIZE = 16
PATTERNS = {"1:1": (1, 1), "5:1": (5, 1), "all sliding": (1, 0)}  # sliding layers, then full ones, repeated
WINDOWS = (128, 1024, 4096)
MAX_NUM_SEQS = 1024  # so that memory alone sets the batch

# The forward that runs: the tiny model, layers 0 and 2 sliding.
TINY_WINDOW, TINY_PATTERN = 64, ("sliding_attention", "full_attention") * 2
TINY_SLOTS = 1024  # K/V memory: 1,024 tokens of every layer (64 blocks of 16)
TINY_TRACE = {"mean_prompt": 161.31 * 512 / 2048, "mean_output": 337.99 * 512 / 2048, "max_len": 512}


def layer_types(pattern: str, num_layers: int) -> list[str]:
    sliding, full = PATTERNS[pattern]
    cycle = ["sliding_attention"] * sliding + ["full_attention"] * full
    return [cycle[i % len(cycle)] for i in range(num_layers)]


def model_config(pattern: str, window: int) -> ModelConfig:
    """The model's shape as the engine reads it from a config.json (a Qwen2-style one, with layer_types)."""
    layers = GEMMA3_12B["num_hidden_layers"]
    return ModelConfig.from_hf({
        "model_type": "qwen2", "vocab_size": 2, "hidden_size": 3840, "intermediate_size": 1,
        "num_attention_heads": 16, **GEMMA3_12B, "max_position_embeddings": 131072,
        "use_sliding_window": True, "sliding_window": window, "layer_types": layer_types(pattern, layers)})


class NoModelRunner:
    """V1's runner without a model: it moves no K/V; the requests that sample are those whose every token is
    computed after the step (as ``V1ModelRunner.forward`` chooses them), each given the same logits."""

    vocab_size = 2
    failed_req_ids: list = []

    def execute_model(self, out):
        req_ids = [r.request_id for r in out.scheduled if r.seqs[0].num_computed_tokens >= len(r.seqs[0])]
        return req_ids, torch.zeros(len(req_ids), self.vocab_size)

    def set_prev_sampled(self, req_ids, token_ids) -> None:
        """No batch to keep the sampled tokens in."""


def build_scheduler(mc: ModelConfig, memory: int, hybrid: bool, dtype: str, max_model_len: int):
    """The V1 scheduler ``LLM`` builds for ``mc`` from ``memory`` bytes of K/V (prefix caching off: the
    requests share no prefix), by ``LLM``'s own builders, with no weights loaded."""
    parts = types.SimpleNamespace(model_config=mc, spec_decoder=None)
    parts.config = EngineConfig(block_size=BLOCK_SIZE, kv_cache_memory=memory, dtype=dtype,
                                max_model_len=max_model_len, max_num_seqs=MAX_NUM_SEQS,
                                max_num_batched_tokens=V1_MAX_NUM_BATCHED_TOKENS, enable_prefix_caching=False,
                                disable_hybrid_kv_cache_manager=not hybrid).resolve(mc)
    parts.kv_cache_groups = LLM.build_kv_cache_groups(parts)
    if parts.kv_cache_groups is not None:  # as LLM.__init__: the same bytes in blocks of group_size layers
        parts.config = dataclasses.replace(parts.config, num_gpu_blocks=LLM.hybrid_num_blocks(parts))
    scheduler = LLM.build_scheduler(parts, None if hybrid else LLM.build_block_manager(parts))
    assert isinstance(scheduler.kv_cache_manager, HybridKVCacheManager) == hybrid
    return scheduler


def build_engine(mc: ModelConfig, memory: int, hybrid: bool) -> V1Engine:
    """That scheduler in the V1 engine loop, with a runner that has no model."""
    scheduler = build_scheduler(mc, memory, hybrid, "bfloat16", MAX_LEN)
    return V1Engine(scheduler, NoModelRunner(), Sampler(), vocab_size=NoModelRunner.vocab_size)


def count_given_back(engine: V1Engine) -> list[int]:
    """A counter, ``[blocks]``, of the blocks the sliding-window groups give back before their steps."""
    given = [0]
    manager = engine.scheduler.kv_cache_manager
    for group in manager.coordinator.managers if isinstance(manager, HybridKVCacheManager) else ():
        if isinstance(group, SlidingWindowManager):
            remove = group.remove_skipped_blocks

            def counting(req_id, num_computed_tokens, remove=remove, allocator=group.allocator):
                free = allocator.num_free_blocks
                remove(req_id, num_computed_tokens)
                given[0] += allocator.num_free_blocks - free

            group.remove_skipped_blocks = counting
    return given


def residency(engine: V1Engine, requests) -> dict:
    """Queue every request, step until none waits; averages over those steps."""
    scheduler = engine.scheduler
    for r in requests:
        engine.add_request(r.request_id, {"prompt_token_ids": [1] * r.prompt_len},
                           SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
    given = count_given_back(engine)
    running, returned, steps = [], [], 0
    start = time.perf_counter()
    while scheduler.waiting:
        before = given[0]
        engine.step()
        running.append(sum(not r.is_finished() for r in scheduler.running))
        returned.append(given[0] - before)
        steps += 1
    stats = scheduler.make_stats()
    return {"num_blocks": scheduler.block_manager.num_total_blocks, "mean_running": statistics.fmean(running),
            "max_running": max(running), "given_back_per_step": statistics.fmean(returned), "steps": steps,
            "finished": len(requests) - len(engine.requests), "preemptions": stats.num_preemptions,
            "seconds": time.perf_counter() - start}


def capacity(num_requests: int, memory: int) -> dict:
    requests = trace("ShareGPT", num_requests, rate=1.0)  # lengths only: every request is queued at once
    layers = GEMMA3_12B["num_hidden_layers"]
    bytes_per_layer_token = model_config("5:1", 1024).kv_bytes_per_token(torch.bfloat16) // layers
    out = {"requests": num_requests, "memory_bytes": memory, "block_size": BLOCK_SIZE,
           "kv_bytes_per_token": layers * bytes_per_layer_token, "rows": [],
           "mean_request_tokens": statistics.fmean(r.prompt_len + r.output_len for r in requests),
           "max_request_tokens": max(r.prompt_len + r.output_len for r in requests)}
    full = residency(build_engine(model_config("5:1", 1024), memory, hybrid=False), requests)
    full["layers_per_block"], full["block_bytes"] = layers, BLOCK_SIZE * layers * bytes_per_layer_token
    out["every_layer_full"] = full
    print(f"every layer full: {full['num_blocks']:>5} blocks, {full['mean_running']:6.1f} running on average "
          f"(at most {full['max_running']}), {full['preemptions']} preemptions  [{full['seconds']:.1f} s]")
    for pattern in PATTERNS:
        for window in WINDOWS:
            mc = model_config(pattern, window)
            engine = build_engine(mc, memory, hybrid=True)
            row = {"pattern": pattern, "window": window, **residency(engine, requests)}
            groups = engine.scheduler.kv_cache_manager.coordinator.groups
            row["group_size"], row["num_groups"] = group_size(groups), len(groups)
            row["layers_per_block"] = row["group_size"]
            row["block_bytes"] = BLOCK_SIZE * row["group_size"] * bytes_per_layer_token
            row["given_back_mib_per_step"] = row["given_back_per_step"] * row["block_bytes"] / 2**20
            row["ratio"] = row["mean_running"] / full["mean_running"]
            out["rows"].append(row)
            print(f"{pattern:<11} window {window:>4}: {row['num_groups']} groups of {row['group_size']:>2} layers, "
                  f"{row['num_blocks']:>5} blocks, {row['mean_running']:6.1f} running on average "
                  f"(at most {row['max_running']}; every layer full: {full['mean_running']:.1f}) = "
                  f"{row['ratio']:.2f}x, {row['given_back_per_step']:.1f} blocks "
                  f"({row['given_back_mib_per_step']:.0f} MiB) given back a step  [{row['seconds']:.1f} s]")
    return out


def tiny_with_windows(folder: Path) -> Path:
    """The tiny model's files, its config.json given sliding windows on layers 0 and 2."""
    path = folder / "tiny-sliding"
    shutil.copytree(resolve_model_path("tiny"), path)
    config = json.loads((path / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=TINY_WINDOW, layer_types=list(TINY_PATTERN))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def throughput(num_requests: int, repeats: int) -> dict:
    requests = synthetic_requests(num_requests, **TINY_TRACE, rate=1.0)
    prompts = [{"prompt_token_ids": [1 + (7 * r.request_id + i) % 2000 for i in range(r.prompt_len)]}
               for r in requests]
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in requests]
    tokens_out = sum(r.output_len for r in requests)
    found: dict[str, list[float]] = {"hybrid": [], "every_layer_full": []}  # tokens per CPU second
    wall: dict[str, list[float]] = {"hybrid": [], "every_layer_full": []}  # per second on the clock: a shared machine's
    cpu_ms: dict[str, list[float]] = {"hybrid": [], "every_layer_full": []}  # CPU milliseconds a step
    outputs, info = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        path = tiny_with_windows(Path(folder))
        mc = load_config(path)
        memory = TINY_SLOTS * mc.kv_bytes_per_token(torch.float32)
        for _ in range(repeats):  # interleaved, so that both see the same machine
            for name in found:
                llm = LLM(path, kv_cache_memory=memory, block_size=BLOCK_SIZE, max_model_len=512,
                          max_num_seqs=MAX_NUM_SEQS, enable_prefix_caching=False,
                          disable_hybrid_kv_cache_manager=name != "hybrid")
                mine = build_scheduler(mc, memory, name == "hybrid", "float32", 512)  # the capacity runs' blocks
                assert llm.scheduler.block_manager.num_total_blocks == mine.block_manager.num_total_blocks
                start, cpu = time.perf_counter(), time.process_time()
                done = llm.generate(prompts, params, use_tqdm=False)
                cpu, seconds = time.process_time() - cpu, time.perf_counter() - start
                found[name].append(tokens_out / cpu)
                wall[name].append(tokens_out / seconds)
                cpu_ms[name].append(1000 * cpu / llm.stats.steps)
                outputs[name] = [o.outputs[0].token_ids for o in done]
                info[name] = {"num_blocks": llm.scheduler.block_manager.num_total_blocks,
                              "preemptions": llm.stats.scheduler.num_preemptions, "steps": llm.stats.steps,
                              "decodes_per_step": llm.stats.decode_tokens / llm.stats.steps}
    assert outputs["hybrid"] == outputs["every_layer_full"], "the hybrid cache changed the tokens"
    out = {"requests": num_requests, "output_tokens": tokens_out, "window": TINY_WINDOW, "layers": list(TINY_PATTERN),
           "kv_slots": TINY_SLOTS, "repeats": repeats}
    for name, rates in found.items():
        out[name] = {**info[name], "tokens_per_s": statistics.median(rates), "runs": rates,
                     "wall_tokens_per_s": statistics.median(wall[name]), "ms_per_step": statistics.median(cpu_ms[name])}
    out["ratio"] = out["hybrid"]["tokens_per_s"] / out["every_layer_full"]["tokens_per_s"]
    print(f"tiny model, window {TINY_WINDOW} on layers 0 and 2, {num_requests} requests: hybrid "
          f"{out['hybrid']['tokens_per_s']:,.0f} tokens/s ({out['hybrid']['num_blocks']} blocks of 2 layers), "
          f"every layer full {out['every_layer_full']['tokens_per_s']:,.0f} tokens/s "
          f"({out['every_layer_full']['num_blocks']} blocks of 4): {out['ratio']:.2f}x, the same tokens; "
          + ", ".join(f"{name} {r['decodes_per_step']:.1f} decodes a step over {r['steps']} steps, "
                      f"{r['ms_per_step']:.2f} CPU ms each" for name in found for r in [out[name]]))
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, full = data["capacity"]["rows"], data["capacity"]["every_layer_full"]
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4), layout="constrained")
    width = 0.8 / len(PATTERNS)
    for k, pattern in enumerate(PATTERNS):
        mine = [r for r in rows if r["pattern"] == pattern]
        xs = [i + (k - 1) * width for i in range(len(mine))]
        axes[0].bar(xs, [r["mean_running"] for r in mine], width, label=f"hybrid, {pattern}")
        axes[1].bar(xs, [r["given_back_mib_per_step"] for r in mine], width, label=f"hybrid, {pattern}")
    axes[0].axhline(full["mean_running"], color="black", ls="--", lw=1, label="every layer full")
    for ax in axes:
        ax.set_xticks(range(len(WINDOWS)), [f"window {w:,}" for w in WINDOWS], fontsize=9.5)
        ax.tick_params(labelsize=9.5)
    axes[0].set_ylabel("requests running at once (mean)", fontsize=10)
    axes[0].set_title("12 GiB of Gemma 3 12B's K/V", fontsize=11)
    axes[1].set_ylabel("MiB of K/V given back per step", fontsize=10)
    axes[1].set_title("what the windows give back", fontsize=11)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=9.5,
               frameon=False)
    fig.savefig(path, dpi=200)
    plt.close(fig)


def main() -> None:
    parser = make_parser(__doc__, quick="150 requests in 2 GiB; 16 on the tiny model, one run "
                                        "(default: 1,000 in 12 GiB; 48, the median of 3)", plot_only="hybrid_capacity")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    if args.plot_only:
        plot(json.loads((results_dir / "hybrid_capacity.json").read_text()), results_dir / "hybrid_capacity.png")
        return
    torch.set_num_threads(1)
    cap = capacity(150, 2 * 2**30) if args.quick else capacity(1000, MEMORY)
    speed = throughput(16 if args.quick else 48, 1 if args.quick else 3)
    data = write_json(results_dir / "hybrid_capacity.json", {
        "environment": environment("cpu"), "cores": len(os.sched_getaffinity(0)), "torch_threads": 1,
        "capacity": cap, "throughput": speed})
    plot(data, results_dir / "hybrid_capacity.png")
    by = {(r["pattern"], r["window"]): r for r in cap["rows"]}
    gemma = by["5:1", 1024]
    print(f"Gemma 3's 5:1 with window 1,024: {gemma['mean_running']:.1f} requests at once against "
          f"{cap['every_layer_full']['mean_running']:.1f} with every layer full ({gemma['ratio']:.2f}x); "
          f"window 128: {by['5:1', 128]['ratio']:.2f}x; tiny model on a CPU: {speed['ratio']:.2f}x tokens/s")


if __name__ == "__main__":
    main()
