"""What does tensor parallelism send between the workers, what does it save, and what does it cost here?

Stage 11's workers on this CPU (spawned processes, gloo over loopback), three questions:

1. **Bytes all-reduced per step.** The tiny model at tp 2 (and 4 in the full run) serves prompts
   of several lengths, cut into chunks by a token budget of 64, then decodes. After every step
   each rank's count (``Worker.count_all_reduce_bytes``) is read and set against the formula
   (2 × layers + 1) × tokens × hidden size × dtype bytes: two all-reduces a layer (``o_proj``
   and ``down_proj``, row-parallel) and one for the embedding.
2. **KV per worker.** The same requests at tp 1, 2 and 4: the one block manager hands out the
   same blocks, and each worker holds its KV heads of them. The bytes of one token's K/V on one
   worker are read from the workers' own caches (each rank's ``gather`` of a sequence) and set
   against ``shard_config(...).kv_bytes_per_token``; with 2 KV heads, tp 4 replicates them and
   saves nothing more than tp 2.
3. **Step time.** Steady decode, batch 16 (8 with --quick), the median step of 3 runs of 24
   steps (one of 8 with --quick): tp 1 on one torch thread and on two, against tp 2, whose
   two workers each run one thread. On the tiny model, and (full run only) on a model of
   Qwen2.5-0.5B's shape with random weights (``bench/peer_models.py``), batch 8. The outputs of
   tp 2 are checked equal to tp 1's on the tiny model.

Writes bench/results/tensor_parallel.json and .png (bench/results/quick/ with --quick); the last
line is the headline.
"""

from __future__ import annotations

import os
import random
import statistics
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from harness import make_parser, results_dir_for, write_json  # noqa: E402
from peer_models import model_path  # noqa: E402

from minipaged import (
    LLM,  # noqa: E402
    SamplingParams,  # noqa: E402
)
from minipaged.models.parallel import shard_config  # noqa: E402


def prompt(rng: random.Random, n: int, vocab: int = 2000) -> dict:
    return {"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(n)]}


def all_reduce_bytes(tp: int) -> dict:
    """Every step's tokens and each rank's bytes all-reduced in it, against the formula."""
    rng = random.Random(0)
    llm = LLM("tiny", tensor_parallel_size=tp, block_size=16, num_gpu_blocks=128, max_num_batched_tokens=64)
    with llm:
        c, dtype_bytes = llm.model_config, torch.finfo(llm.config.torch_dtype).bits // 8
        before = llm.executor.collective_rpc("count_all_reduce_bytes")  # counting starts here
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        arrivals = [prompt(rng, n) for n in (5, 23, 40, 97, 150, 11)]  # one a step: steps of many sizes
        steps = []
        while arrivals or llm.engine.has_unfinished_requests():
            if arrivals:
                llm.engine.add_request(f"r{len(arrivals)}", arrivals.pop(0), params)
            llm.engine.step()
            tokens = llm.engine.last_scheduler_output.total_num_scheduled_tokens
            now = llm.executor.collective_rpc("count_all_reduce_bytes")
            steps.append({"tokens": tokens, "measured": [a - b for a, b in zip(now, before, strict=True)],
                          "formula": (2 * c.num_layers + 1) * tokens * c.hidden_size * dtype_bytes})
            before = now
    return {"num_layers": c.num_layers, "hidden_size": c.hidden_size, "dtype_bytes": dtype_bytes, "steps": steps}


def kv_per_worker(tp: int) -> dict:
    """The same requests at ``tp``: blocks the driver hands out; one token's K/V bytes on each worker."""
    rng = random.Random(1)
    prompts = [prompt(rng, n) for n in (30, 70, 110)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM("tiny", tensor_parallel_size=tp, block_size=16, num_gpu_blocks=64)
    with llm:
        engine, c = llm.engine, llm.model_config
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        engine.step()  # the prompts' step: their K/V are written
        seq = engine.requests["r0"].seqs[0]
        table = llm.scheduler.block_manager.get_block_table(seq.seq_id)
        manager = llm.scheduler.block_manager
        blocks_used = manager.num_total_blocks - manager.num_free_blocks
        n = 30  # r0's prompt
        if llm.executor is None:  # one process: its own cache
            shards = [(k.numpy(), v.numpy(), list(range(c.num_kv_heads))) for k, v in [llm.cache.gather(0, table, n)]]
        else:
            shards = llm.executor.collective_rpc("gather", 0, table, n)
        per_rank = [(key.nbytes + value.nbytes) // n * c.num_layers for key, value, _ in shards]
        while engine.has_unfinished_requests():
            engine.step()
        expected = shard_config(c, tp).kv_bytes_per_token(llm.config.torch_dtype)
    return {"tp": tp, "blocks_used": blocks_used, "heads_per_rank": [h for _, _, h in shards],
            "kv_bytes_per_token_per_worker": per_rank, "expected": expected,
            "cache_bytes_per_worker": 64 * 16 * per_rank[0]}


def decode_steps(model: str, tp: int, threads: int, batch: int, steps: int, repeats: int, vocab: int) -> dict:
    """The median time of a decode step in steady state, and the tokens every request produced."""
    torch.set_num_threads(threads)
    rng = random.Random(2)
    prompts = [prompt(rng, 16, vocab) for _ in range(batch)]
    times, tokens = [], None
    for _ in range(repeats):
        llm = LLM(model, tensor_parallel_size=tp, block_size=16, num_gpu_blocks=256, max_model_len=128)
        with llm:
            engine = llm.engine
            params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", p, params)
            engine.step()  # the prompts
            engine.step()  # a first decode, untimed
            run = []
            done = {}
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                outs = engine.step()
                run.append(time.perf_counter() - start)
                done.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
            times.append(statistics.median(run))
            tokens = tokens or done
    return {"model": model, "tp": tp, "driver_threads": threads, "batch": batch,
            "step_ms": 1e3 * statistics.median(times), "step_ms_runs": [1e3 * t for t in times], "tokens": tokens}


def plot(result: dict, path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), layout="constrained", width_ratios=[1.2, 0.8, 1.2])
    ax = axes[0]
    for (name, run), marker in zip(result["bytes"].items(), "os^", strict=False):
        steps = run["steps"]
        ax.plot([s["tokens"] for s in steps], [s["measured"][0] / 1e3 for s in steps], marker,
                ms=7 - 2 * (marker == "s"), fillstyle="none", label=f"measured, {name} (rank 0)")
    most = max(s["tokens"] for run in result["bytes"].values() for s in run["steps"])
    run = next(iter(result["bytes"].values()))
    per_token = (2 * run["num_layers"] + 1) * run["hidden_size"] * run["dtype_bytes"]
    ax.plot([0, most], [0, most * per_token / 1e3], "-", color="#555555", lw=1, zorder=0,
            label=f"(2×{run['num_layers']}+1) × tokens × {run['hidden_size']} × {run['dtype_bytes']} B")
    ax.set(xlabel="tokens in the step", ylabel="kB all-reduced by a rank", title="bytes all-reduced per step")
    ax.legend(fontsize=8, frameon=False)
    ax = axes[1]
    kv = result["kv"]
    names = [f"tp {r['tp']}" for r in kv]
    ax.bar(names, [r["cache_bytes_per_worker"] / 2**20 for r in kv], color="#4c72b0")
    for i, r in enumerate(kv):
        ax.text(i, r["cache_bytes_per_worker"] / 2**20, f"{r['kv_bytes_per_token_per_worker'][0]:,} B\na token",
                ha="center", va="bottom", fontsize=8)
    used = sorted({r["blocks_used"] for r in kv})
    ax.set(ylabel="MiB of K/V per worker", title=f"64 blocks of 16 per worker;\n{' / '.join(map(str, used))} "
           "used, at every tp")
    ax.set_ylim(0, 1.35 * max(r["cache_bytes_per_worker"] for r in kv) / 2**20)
    ax = axes[2]
    timing = result["step_time"]
    models = list(dict.fromkeys(r["model"] for r in timing))
    sides = list(dict.fromkeys(r["side"] for r in timing))
    width = 0.8 / len(sides)
    for k, side in enumerate(sides):
        rows = {r["model"]: r for r in timing if r["side"] == side}
        xs = [m + (k - (len(sides) - 1) / 2) * width for m in range(len(models))]
        ax.bar(xs, [rows[m]["step_ms"] / timing_scale(timing, m) if m in rows else 0 for m in models], width,
               label=side)
    ax.set_xticks(range(len(models)), [f"{m}\n(1 = {timing_scale(timing, m):.1f} ms)" for m in models], fontsize=8)
    ax.set(ylabel="decode step ÷ tp 1, 1 thread", title=f"decode step time, {os.cpu_count()}-core CPU")
    ax.axhline(1, color="#555555", lw=0.8, ls="--")
    ax.legend(fontsize=8, frameon=False)
    fig.savefig(path, dpi=120)


def timing_scale(timing: list, model: str) -> float:
    return next(r["step_ms"] for r in timing if r["model"] == model and r["side"] == "tp 1, 1 thread")


def main() -> None:
    parser = make_parser(__doc__, quick="tp 2 only for the bytes, one timing run of 8 steps at batch 8, tiny model")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    quick = args.quick
    result: dict = {"cpu_count": os.cpu_count(), "load_average_1min": os.getloadavg()[0]}
    result["bytes"] = {f"tp {tp}": all_reduce_bytes(tp) for tp in ((2,) if quick else (2, 4))}
    for name, run in result["bytes"].items():
        exact = all(all(m == s["formula"] for m in s["measured"]) for s in run["steps"])
        total = sum(s["tokens"] for s in run["steps"])
        print(f"{name}: {len(run['steps'])} steps, {total} tokens, every rank's bytes equal the formula: {exact}")
    result["kv"] = [kv_per_worker(tp) for tp in (1, 2, 4)]
    for r in result["kv"]:
        print(f"tp {r['tp']}: {r['blocks_used']} blocks used; K/V of one token on a worker "
              f"{r['kv_bytes_per_token_per_worker']} bytes (shard_config says {r['expected']}); heads per rank "
              f"{r['heads_per_rank']}")
    batch, steps, repeats = (8, 8, 1) if quick else (16, 24, 3)
    models = [("tiny", batch, 2000)] + ([] if quick else [(str(model_path("qwen2.5-0.5b-shaped")), 8, 2000)])
    result["step_time"] = []
    for model, b, vocab in models:
        label = "tiny" if model == "tiny" else "qwen2.5-0.5b-shaped"
        rows = []
        for side, tp, threads in (("tp 1, 1 thread", 1, 1), ("tp 1, 2 threads", 1, 2), ("tp 2, 1 thread each", 2, 1)):
            row = decode_steps(model, tp, threads, b, steps if label == "tiny" else 6, repeats, vocab)
            rows.append({**row, "model": label, "side": side})
            print(f"{label:<20} {side:<20} batch {b}: {row['step_ms']:7.2f} ms a decode step "
                  f"(runs {', '.join(f'{t:.2f}' for t in row['step_ms_runs'])})")
        same = rows[0]["tokens"] == rows[2]["tokens"]
        print(f"{label}: tp 2's tokens equal tp 1's: {same}")
        if label == "tiny":
            assert same, "tp 2 changed an output"
        for row in rows:
            row["same_tokens_as_tp1"] = row["tokens"] == rows[0]["tokens"]
        for row in rows:
            del row["tokens"]
        result["step_time"] += rows
    torch.set_num_threads(1)
    result = write_json(results_dir / "tensor_parallel.json", result)
    plot(result, results_dir / "tensor_parallel.png")
    tiny = {r["side"]: r["step_ms"] for r in result["step_time"] if r["model"] == "tiny"}
    kv = {r["tp"]: r["kv_bytes_per_token_per_worker"][0] for r in result["kv"]}
    print(f"bytes all-reduced = (2L+1) x tokens x hidden x dtype bytes on every rank, every step; K/V per token per "
          f"worker {kv[1]} -> {kv[2]} bytes at tp 2; tiny decode step {tiny['tp 1, 1 thread']:.2f} ms (tp 1) -> "
          f"{tiny['tp 2, 1 thread each']:.2f} ms (tp 2) on {os.cpu_count()} cores")


if __name__ == "__main__":  # tp > 1 spawns workers, which import this file again: nothing may run on import
    main()
