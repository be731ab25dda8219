"""What does a preemption cost: swapping or recomputing? (the vLLM paper's Figure 19)

For one preempted sequence of 512 tokens of the tiny model (its whole position table), across block sizes 1 to 256:

* swap: ``swap_out`` then ``swap_in`` of its blocks (stage 6's block manager and cache);
* recompute: the prefill of its 512 tokens through the engine's forward pass.

What a CPU-only run can show: the recompute cost, and how the number of block copies grows
as blocks shrink. What it cannot: the real cost of swapping, which on a GPU crosses the
PCIe bus (small blocks mean many small transfers, the paper's reason to prefer
recomputation for small blocks) — here "GPU" and "CPU" memory are the same RAM. Writes
bench/results/swap_vs_recompute.json and .png; the last line is the headline.
"""

from __future__ import annotations

import json
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from harness import make_parser, results_dir_for  # noqa: E402

from minipaged import LLM  # noqa: E402
from minipaged.common.sequence import Sequence  # noqa: E402
from minipaged.stage6_scheduler import SchedulerOutputs  # noqa: E402
from minipaged.stage6_swapping import SwapBlockSpaceManager  # noqa: E402

SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
TOKENS = 512  # the tiny model's whole position table


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def measure(size: int, device: str, repeats: int) -> dict:
    """Time one swap round trip and one recomputation of a 512-token sequence."""
    blocks = TOKENS // size
    llm = LLM("tiny", scheduler="v0", num_gpu_blocks=blocks + 1, block_size=size, max_model_len=TOKENS,
              preemption_mode="swap", device=device)
    manager: SwapBlockSpaceManager = llm.scheduler.block_manager
    seq = Sequence(list(range(1, TOKENS + 1)))
    manager.allocate(seq.seq_id, seq.token_ids)

    def swap_round_trip():
        llm.cache.swap_out(manager.swap_out([seq.seq_id]))
        llm.cache.swap_in(manager.swap_in([seq.seq_id]))
        if device == "cuda":
            torch.cuda.synchronize()

    def recompute():
        llm.engine.runner.execute(SchedulerOutputs(scheduled=[(seq, TOKENS)]))
        if device == "cuda":
            torch.cuda.synchronize()

    return {"blocks": blocks, "swap_ms": best_of(swap_round_trip, repeats),
            "recompute_ms": best_of(recompute, repeats)}


def main() -> None:
    parser = make_parser(__doc__, quick="fewer repeats")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    repeats = 2 if args.quick else 5
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = {}
    for size in SIZES:
        rows[size] = measure(size, device, repeats)
        blocks = rows[size]["blocks"]
        print(f"block {size:>3} ({blocks:>4} blocks): swap out+in {rows[size]['swap_ms']:8.2f} ms, "
              f"recompute {rows[size]['recompute_ms']:8.2f} ms")
    saved = {"device": device, "tokens": TOKENS, "rows": rows}
    (results_dir / "swap_vs_recompute.json").write_text(json.dumps(saved, indent=2))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.loglog(SIZES, [rows[s]["swap_ms"] for s in SIZES], "o-", base=2, label="swap out + in")
    ax.loglog(SIZES, [rows[s]["recompute_ms"] for s in SIZES], "s-", base=2, label="recompute (prefill)")
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("ms per preemption")
    ax.set_title(f"{TOKENS} tokens, tiny model, {device}" + (" (swap is a RAM copy here)" if device == "cpu" else ""),
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(results_dir / "swap_vs_recompute.png", dpi=120)
    print(f"swap round trip {rows[1]['swap_ms']:.2f} ms at block 1 vs {rows[16]['swap_ms']:.2f} ms at 16; "
          f"recompute {rows[16]['recompute_ms']:.1f} ms ({device}"
          + (": swapping copies RAM to RAM, so its PCIe cost is not shown)" if device == "cpu" else ")"))


if __name__ == "__main__":
    main()
