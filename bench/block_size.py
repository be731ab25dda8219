"""What block size? (the vLLM paper's Figure 18b)

Small blocks waste less memory in each sequence's last block; large blocks make each read
of K/V longer and the block tables shorter. For block sizes 1 to 256 this measures the
KV utilisation of the paged manager on the ShareGPT-like and Alpaca-like traces (one
budget of 15,728 slots, stage 2's manager, first come first served) and, where a GPU is
present, the latency of stage 5's decode kernel (v2, bfloat16, 32 query / 8 KV heads,
head dim 128, batch 64, context 4k). Writes bench/results/block_size.json and .png; the
last line is the headline.
"""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from harness import make_parser, results_dir_for  # noqa: E402
from workloads import OPT_13B_SLOTS, TRACES, trace  # noqa: E402

from minipaged.perf.simulate import simulate_paged  # noqa: E402

SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def kernel_latency_ms(block_size: int) -> float:
    import triton.testing

    from minipaged.stage5_triton_attention import paged_attention_triton

    batch, context, kv_heads = 64, 4096, 8
    blocks = batch * (context // block_size)
    cache = torch.randn(2, blocks, block_size, kv_heads, 128, dtype=torch.bfloat16, device="cuda")
    tables = torch.randperm(blocks, device="cuda").view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, 32, 128, dtype=torch.bfloat16, device="cuda")
    return triton.testing.do_bench(lambda: paged_attention_triton(query, cache[0], cache[1], tables, lens,
                                                                  validate=False), return_mode="median")


def main() -> None:
    parser = make_parser(__doc__, quick="a shorter trace")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    results = {}
    for name in TRACES:
        count = (100 if args.quick else 400) * (1 if name == "ShareGPT" else 3)
        requests = trace(name, count, rate=0.2 if name == "ShareGPT" else 40.0)
        for size in SIZES:
            r = simulate_paged(requests, OPT_13B_SLOTS // size, size)
            results[f"{name}/{size}"] = {"token": r.fractions["token"], "internal": r.fractions["internal"],
                                         "running": r.mean_running}
    gpu = torch.cuda.is_available()
    latency = {size: kernel_latency_ms(size) for size in SIZES} if gpu else {}
    for size in SIZES:
        cells = "  ".join(f"{n} {100 * results[f'{n}/{size}']['token']:5.1f}% "
                          f"({results[f'{n}/{size}']['running']:5.1f} running)" for n in TRACES)
        print(f"block {size:>3}: {cells}" + (f"  kernel {latency[size]:.3f} ms" if gpu else ""))
    (results_dir / "block_size.json").write_text(json.dumps({"utilisation": results, "kernel_ms": latency}, indent=2))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for name in TRACES:
        ax.semilogx(SIZES, [100 * results[f"{name}/{s}"]["token"] for s in SIZES], "o-", base=2, label=name)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("memory holding K/V (%)")
    if gpu:
        twin = ax.twinx()
        twin.semilogx(SIZES, [latency[s] for s in SIZES], "s--", color="black", base=2, label="kernel latency")
        twin.set_ylabel("decode kernel latency (ms)")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(results_dir / "block_size.png", dpi=120)
    best = max(SIZES, key=lambda s: results[f"ShareGPT/{s}"]["token"])
    print(f"ShareGPT utilisation: {100 * results['ShareGPT/16']['token']:.1f}% at block 16, "
          f"{100 * results['ShareGPT/256']['token']:.1f}% at 256 (best at {best})"
          + ("" if gpu else "; kernel latency needs a GPU"))


if __name__ == "__main__":
    main()
