"""How fast is paged decode attention, and what does paging cost?

For each batch size and context length, times decode attention (one query token per
sequence) with K/V in a paged cache of randomly scattered blocks:

* ``sdpa``   — no paging at all: ``torch.nn.functional.scaled_dot_product_attention`` on
  the same K/V laid out contiguously (the baseline; the query heads of a KV head are
  passed as that head's query rows, so K/V are read once);
* ``ref``    — stage 4, gather then attend;
* ``v1``, ``v2`` — stage 5's Triton kernels.

Achieved bandwidth = bytes of K/V that must be read / time, and its share of the
device's peak. On a GPU: bfloat16, 32 query / 8 KV heads, head dim 128, block 16, batch
1/8/64/256 x context 512/2k/4k/8k/32k; the headline is batch 64 at context 4k. Each case is
made on the device, from a generator there (a batch of 256 at 32k is 34 GB of K/V: made on the
CPU and copied, it would take minutes); a case whose K/V would not fit three times in the free
memory is skipped. Every kernel's output is checked against the contiguous ``sdpa``'s; the
timed calls skip the argument checks (``validate=False``) and are given the longest sequence
(``max_seq_len``), so that none reads anything back from the device. On a CPU
(``--device cpu``, the default without a GPU) the kernels run in Triton's interpreter: only
small correctness-sized cases run, and their timings say nothing about GPU speed.

Writes bench/results/attention_kernels.json and .png (a GPU's under bench/results/gpu/, with its
name and the versions that measured it; --quick under quick/); the last line is the headline.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from harness import add_device_arguments, environment, make_parser, results_dir_for  # noqa: E402

from minipaged.stage4_reference_attention import paged_attention_ref  # noqa: E402
from minipaged.stage5_triton_attention import paged_attention_triton  # noqa: E402

PEAK_GBPS = {"H200": 4800, "H100": 3350, "A100-SXM4-80GB": 2039, "A100": 1555, "L40S": 864,
             "A10": 600, "L4": 300, "RTX 4090": 1008}  # HBM/GDDR bandwidth, GB/s


def peak_bandwidth(name: str) -> float | None:
    for key, gbps in PEAK_GBPS.items():
        if key in name:
            return gbps
    return None


def make_case(batch, context, heads, kv_heads, head_dim, block_size, dtype, device, seed=0):
    """A decode case made on ``device``: the query, a paged K/V cache whose blocks are shuffled
    across the sequences, the block tables and the sequence lengths."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=gen, dtype=dtype, device=device)
    value_cache = torch.randn(cache_shape, generator=gen, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, generator=gen, device=device).view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, heads, head_dim, generator=gen, dtype=dtype, device=device)
    return query, key_cache, value_cache, block_tables, seq_lens


def contiguous_sdpa(query, key_cache, value_cache, block_tables, context):
    """The no-paging baseline: K/V of each sequence contiguous, (batch, kv_heads, context, dim)."""
    batch, heads, dim = query.shape
    kv_heads = key_cache.shape[2]
    k = key_cache[block_tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    v = value_cache[block_tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    q = query.view(batch, kv_heads, heads // kv_heads, dim)  # a KV head's query heads as its rows
    return lambda: F.scaled_dot_product_attention(q, k, v)  # (batch, kv_heads, group, dim)


def free_bytes(device: torch.device) -> int:
    """The device's free memory, counting what torch's allocator holds but no tensor uses."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def timed(fn, device: torch.device) -> float:
    """Median milliseconds per call."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def measure(case: tuple[torch.Tensor, ...], context: int, kv_bytes: int, device: torch.device) -> dict[str, float]:
    """Milliseconds per call of each kernel on ``case``, each output checked against ``sdpa``'s first.

    The paged calls are given ``validate=False`` and the host's lengths (one query each, ``context``
    tokens at most), so that no timed call waits to read them from the device. Stage 4's ``ref``
    gathers every sequence's K/V in float32: it runs only where that stays under 2 GB."""
    lengths: dict[str, Any] = {"validate": False, "max_query_len": 1, "max_seq_len": context}
    query, key_cache, value_cache, block_tables, _ = case
    sdpa = contiguous_sdpa(query, key_cache, value_cache, block_tables, context)
    kernels = {"sdpa": sdpa,
               "v1": lambda: paged_attention_triton(*case, version="v1", **lengths),
               "v2": lambda: paged_attention_triton(*case, version="v2", **lengths)}
    if kv_bytes < 2**31:
        kernels["ref"] = lambda: paged_attention_ref(*case, **lengths)
    expected = sdpa().reshape(query.shape).float()  # query head h is row h % group of KV head h // group
    tolerance = 3e-2 if query.dtype == torch.bfloat16 else 1e-4
    ms = {}
    for kernel, fn in kernels.items():
        if kernel != "sdpa":
            err = (fn().float() - expected).abs().max().item()
            assert err < tolerance, f"{kernel} is wrong: {err}"
        ms[kernel] = timed(fn, device)
    return ms


def main() -> None:
    parser = make_parser(__doc__, quick="fewer shapes")
    parser.add_argument("--peak-gbps", type=float, help="the device's peak memory bandwidth")
    add_device_arguments(parser, dtype=False)
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":  # read when the kernels were defined, at import
        parser.error("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    results_dir = results_dir_for(args)
    device = torch.device(args.device)
    if on_gpu:
        name = torch.cuda.get_device_name(device)
        dtype, heads, kv_heads, head_dim, block_size = torch.bfloat16, 32, 8, 128, 16
        batches = [1, 64] if args.quick else [1, 8, 64, 256]
        contexts = [512, 4096] if args.quick else [512, 2048, 4096, 8192, 32768]
        peak = args.peak_gbps or peak_bandwidth(name)
    else:
        name = "CPU, Triton interpreter (correctness-sized cases; timings say nothing about GPU speed)"
        dtype, heads, kv_heads, head_dim, block_size = torch.float32, 8, 2, 64, 16
        batches, contexts = [1, 4], [128, 600]
        peak = None
    print(f"device: {name}")
    rows = []
    for batch in batches:
        for context in contexts:
            kv_bytes = 2 * batch * context * kv_heads * head_dim * dtype.itemsize
            if on_gpu and 3 * kv_bytes > 0.8 * free_bytes(device):  # the paged K/V, its contiguous copy, and room
                continue
            row: dict[str, Any] = {"batch": batch, "context": context, "kv_bytes": kv_bytes,
                   "ms": measure(make_case(batch, context, heads, kv_heads, head_dim, block_size, dtype, device),
                                 context, kv_bytes, device)}
            row["gbps"] = {k: kv_bytes / (ms * 1e-3) / 1e9 for k, ms in row["ms"].items()}
            rows.append(row)
            cells = "  ".join(f"{k} {ms:8.3f} ms {row['gbps'][k]:7.0f} GB/s" for k, ms in row["ms"].items())
            print(f"batch {batch:>3}  context {context:>5}:  {cells}")
    (results_dir / "attention_kernels.json").write_text(json.dumps(
        {"device": name, "dtype": str(dtype), "peak_gbps": peak, "environment": environment(device), "rows": rows},
        indent=2))
    fig, ax = plt.subplots(figsize=(7, 4))
    for kernel in ("sdpa", "ref", "v1", "v2"):
        points = [(r["batch"] * r["context"], r["gbps"][kernel]) for r in rows if kernel in r["gbps"]]
        if points:
            xs, ys = zip(*sorted(points), strict=True)
            ax.semilogx(xs, ys, "o-", label=kernel)
    if peak:
        ax.axhline(peak, color="black", ls="--", lw=0.8, label=f"peak {peak:.0f} GB/s")
    ax.set_xlabel("tokens of context in the batch (batch x context)")
    ax.set_ylabel("K/V bytes read / time (GB/s)")
    ax.set_title(name if on_gpu else "CPU interpreter (not a speed measurement)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(results_dir / "attention_kernels.png", dpi=120)
    if not on_gpu:
        print(f"CPU: v1, v2 and ref agree with the contiguous sdpa on {len(rows)} cases; the speed figures need a GPU")
        return
    head = next((r for r in rows if r["batch"] == 64 and r["context"] == 4096), rows[-1])
    overhead = head["ms"]["v2"] / head["ms"]["sdpa"] - 1
    share = f", {100 * head['gbps']['v2'] / peak:.0f}% of peak bandwidth" if peak else ""
    print(f"batch {head['batch']}, context {head['context']}: v2 paging overhead vs contiguous SDPA "
          f"{100 * overhead:+.0f}%{share} ({name})")


if __name__ == "__main__":
    main()
