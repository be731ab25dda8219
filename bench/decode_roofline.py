"""How fast could paged decode attention possibly be on A100, H100 and H200?

Not a measurement: a bound. A decode step reads the K and V of every context token once
per KV head and does little arithmetic with them, so no kernel can finish one layer's
attention faster than (bytes it must move) / (peak memory bandwidth). The bytes are counted
by ``minipaged.perf.kernel_report.decode_bytes`` (K/V, queries, outputs, block tables); the
bandwidths are the vendors' peaks. Shape: 32 query heads on 8 KV heads, head dim 128,
bfloat16, block size 16 (a Llama-3-8B layer).

The last panel is about the other way a kernel falls short of the bound: too few programs
to keep every SM streaming. At batch 1 and 32k tokens of context, stage 5's v1 launches one
program per (sequence, KV head); v2 splits the context into partitions of 512 tokens.

Writes bench/results/decode_roofline.json and .png (``--quick``: under bench/results/quick/);
the last line is the headline.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from harness import make_parser, results_dir_for  # noqa: E402

from minipaged.perf.kernel_report import GPUS, decode_bound_us, decode_bytes, decode_programs  # noqa: E402

BATCHES = (1, 8, 64)
CONTEXTS = (1024, 4096, 16384, 32768)


def run(batches=BATCHES, contexts=CONTEXTS) -> dict:
    bounds = [{"gpu": gpu, "batch": b, "context": c, "bytes": decode_bytes(b, c),
               "bound_us": decode_bound_us(gpu, batch=b, context=c)}
              for gpu in GPUS for b in batches for c in contexts]
    programs = {v: decode_programs(1, 32768, version=v) for v in ("v1", "v2")}
    per_sm = {gpu: {v: n / sms for v, n in programs.items()} for gpu, (_, sms) in GPUS.items()}
    return {"shape": {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16, "dtype": "bf16"},
            "bounds": bounds, "programs_batch1_32k": programs, "programs_per_sm_batch1_32k": per_sm}


def plot(result: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, len(BATCHES) + 1, figsize=(13, 3.8), constrained_layout=True)
    for ax, batch in zip(axes, BATCHES, strict=False):
        for gpu in GPUS:
            rows = [r for r in result["bounds"] if r["gpu"] == gpu and r["batch"] == batch]
            ax.plot([r["context"] for r in rows], [r["bound_us"] for r in rows], marker="o", label=gpu)
        ax.set(xscale="log", yscale="log", title=f"batch {batch}", xlabel="context tokens per sequence")
        ax.set_xticks(CONTEXTS, [f"{c // 1024}k" for c in CONTEXTS])
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("fastest possible µs per layer")
    axes[0].legend(fontsize=9)
    ax = axes[-1]
    gpus = list(GPUS)
    for i, version in enumerate(("v1", "v2")):
        values = [result["programs_per_sm_batch1_32k"][g][version] for g in gpus]
        ax.bar([x + 0.4 * i for x in range(len(gpus))], values, width=0.4, label=version)
    ax.axhline(1, color="k", lw=0.8, ls="--")
    ax.set_xticks([x + 0.2 for x in range(len(gpus))], gpus, rotation=20, fontsize=9)
    ax.set(yscale="log", ylim=(0.02, 40), title="batch 1 × 32k: programs per SM", ylabel="programs / SM")
    ax.legend(fontsize=9, ncol=2, loc="upper left")
    fig.suptitle("Decode attention: a lower bound from bytes moved ÷ peak bandwidth — not a measurement",
                 fontsize=12)
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main() -> None:
    parser = make_parser(__doc__, quick="write under bench/results/quick/")
    args = parser.parse_args()
    out = results_dir_for(args)
    result = run()
    (out / "decode_roofline.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "decode_roofline.png")
    h200 = next(r for r in result["bounds"] if r["gpu"] == "H200" and r["batch"] == 64 and r["context"] == 4096)
    per_sm = result["programs_per_sm_batch1_32k"]["H100 SXM"]
    print(f"bound, not a measurement: batch 64 x 4k context moves {h200['bytes'] / 1e6:.0f} MB per layer, "
          f">= {h200['bound_us']:.0f} us on an H200; at batch 1 x 32k an H100 gets {per_sm['v1']:.2f} programs "
          f"per SM from v1 and {per_sm['v2']:.1f} from v2")


if __name__ == "__main__":
    main()
