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
1/8/64/256 x context 512/2k/8k/32k; the headline is batch 64 at context 4k. On a CPU the
kernels run in Triton's interpreter: only small correctness-sized cases run, and their
timings say nothing about GPU speed.

Writes bench/results/attention_kernels.json and .png; the last line is the headline.
"""

from __future__ import annotations

import json
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from harness import make_parser, results_dir_for  # noqa: E402

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
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    block_tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).to(torch.int32).to(device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, heads, head_dim, generator=gen).to(dtype).to(device)
    return query, key_cache, value_cache, block_tables, seq_lens


def contiguous_sdpa(query, key_cache, value_cache, block_tables, context):
    """The no-paging baseline: K/V of each sequence contiguous, (batch, kv_heads, context, dim)."""
    batch, heads, dim = query.shape
    kv_heads = key_cache.shape[2]
    k = key_cache[block_tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    v = value_cache[block_tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    q = query.view(batch, kv_heads, heads // kv_heads, dim)  # a KV head's query heads as its rows
    return lambda: F.scaled_dot_product_attention(q, k, v), (k, v)


def timed(fn, device) -> float:
    """Median milliseconds per call."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def main() -> None:
    parser = make_parser(__doc__, quick="fewer shapes")
    parser.add_argument("--peak-gbps", type=float, help="the device's peak memory bandwidth")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    if on_gpu:
        name = torch.cuda.get_device_name()
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
            kv_bytes = 2 * batch * context * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
            if on_gpu and 3 * kv_bytes > 0.8 * torch.cuda.mem_get_info()[0]:
                continue
            case = make_case(batch, context, heads, kv_heads, head_dim, block_size, dtype, device)
            sdpa, _ = contiguous_sdpa(*case[:4], context)
            expected = paged_attention_ref(*case)
            row = {"batch": batch, "context": context, "kv_bytes": kv_bytes, "ms": {}}
            kernels = {"sdpa": sdpa,
                       "v1": lambda c=case: paged_attention_triton(*c, version="v1", validate=False),
                       "v2": lambda c=case: paged_attention_triton(*c, version="v2", validate=False)}
            if kv_bytes < 2**31:
                kernels["ref"] = lambda c=case: paged_attention_ref(*c)
            for kernel, fn in kernels.items():
                out = fn()
                if kernel != "sdpa":
                    err = (out.float() - expected.float()).abs().max().item()
                    assert err < (3e-2 if dtype == torch.bfloat16 else 1e-4), f"{kernel} is wrong: {err}"
                row["ms"][kernel] = timed(fn, device)
            row["gbps"] = {k: kv_bytes / (ms * 1e-3) / 1e9 for k, ms in row["ms"].items()}
            rows.append(row)
            cells = "  ".join(f"{k} {ms:8.3f} ms {row['gbps'][k]:7.0f} GB/s" for k, ms in row["ms"].items())
            print(f"batch {batch:>3}  context {context:>5}:  {cells}")
            del case
    (results_dir / "attention_kernels.json").write_text(json.dumps(
        {"device": name, "dtype": str(dtype), "peak_gbps": peak, "rows": rows}, indent=2))
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
        print(f"CPU: v1, v2 and ref agree on {len(rows)} cases; the speed figures need a GPU")
        return
    head = next((r for r in rows if r["batch"] == 64 and r["context"] == 4096), rows[-1])
    overhead = head["ms"]["v2"] / head["ms"]["sdpa"] - 1
    share = f", {100 * head['gbps']['v2'] / peak:.0f}% of peak bandwidth" if peak else ""
    print(f"batch {head['batch']}, context {head['context']}: v2 paging overhead vs contiguous SDPA "
          f"{100 * overhead:+.0f}%{share} ({name})")


if __name__ == "__main__":
    main()
