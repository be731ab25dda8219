"""How many requests run at once in one KV budget? (the vLLM paper's Figure 13)

One budget, the paper's for OPT-13B on an A100-40GB: 12 GiB of KV cache, 800 KiB per token,
15,728 token slots. Requests from a ShareGPT-like or Alpaca-like trace (bench/workloads.py)
arrive at several rates and are served first come, first served, with no model: each step
every running request produces one token. Contiguous reservation (stage 0, policies
``max``, ``pow2``, ``oracle``) runs in its own first-fit loop (``simulate_contiguous``);
paged memory runs through the real engine loop and stage 6 ``Scheduler`` (blocks of 16, preemption by
recomputation), and once more with stage 13's FP8 cache: one byte per value instead of fp16's two,
so the same 12 GiB hold twice the token slots. Reported: the average number of running requests over the steps while
requests keep arriving (the steady state, without the final drain). At low rates arrivals
limit the batch; at high rates, memory does. Writes bench/results/batch_capacity.json and .png; the last line
is the headline.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from harness import make_parser, results_dir_for  # noqa: E402
from workloads import MAX_LEN, OPT_13B_SLOTS, TRACES, trace  # noqa: E402

from minipaged.perf.simulate import (  # noqa: E402
    OPT_13B_KV_BUDGET,
    OPT_13B_KV_BYTES_PER_TOKEN,
    simulate_contiguous,
    simulated_engine,
)
from minipaged.stage7_engine import SamplingParams  # noqa: E402

SCALE = {"ShareGPT": 1, "Alpaca": 40}  # Alpaca's requests are ~6x shorter: more arrive per step
FP8_SLOTS = OPT_13B_KV_BUDGET // (OPT_13B_KV_BYTES_PER_TOKEN // 2)  # stage 13: e4m3, one byte a value, fp16's two
PAPER_SHAREGPT_2RPS = {"max": 7.00, "pow2": 9.81, "oracle": 13.62, "paged": 30.42}


def mean_batch_paged(requests, slots: int, block_size: int = 16) -> float:
    """Serve the trace through the real engine loop and scheduler, with a runner that has no model."""
    engine = simulated_engine(slots // block_size, block_size, MAX_LEN, max_num_seqs=1024,
                              max_num_batched_tokens=8 * MAX_LEN)
    pending, step, total, busy = sorted(requests, key=lambda r: r.arrival), 0, 0, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrival <= step:
            r = pending.pop(0)
            engine.add_request(r.request_id, {"prompt_token_ids": [1] * r.prompt_len},
                               SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
        batch = len(engine.step()) if engine.has_unfinished_requests() else 0  # one sequence per request
        if pending:  # the steady state: requests keep arriving
            total += batch
            busy += 1
        step += 1
    return total / max(busy, 1)


def mean_batch_contiguous(requests, policy: str, slots: int) -> float:
    return simulate_contiguous(requests, policy, slots, MAX_LEN).mean_batch


def plot(data: dict, path: Path) -> None:
    """Requests running at once against the arrival rate, one panel per trace, from the saved results."""
    results = data["results"]
    fig, axes = plt.subplots(1, 2, figsize=(7.2, 3.4), layout="constrained")
    for ax, name in zip(axes, TRACES, strict=True):
        rates = sorted((key.split("/", 1)[1] for key in results if key.startswith(f"{name}/")), key=float)
        for kind in ("max", "pow2", "oracle", "paged", "paged_fp8"):
            if kind not in results[f"{name}/{rates[0]}"]:
                continue
            label = {"paged": "paged", "paged_fp8": "paged, FP8 cache"}.get(kind, f"contiguous, {kind}")
            ax.plot([float(r) for r in rates], [results[f"{name}/{r}"][kind] for r in rates], "o-", ms=4,
                    label=label)
        ax.set_title(f"{name}-like (arrivals ×{SCALE[name]})", fontsize=11)
        ax.set_xlabel("arrivals per step", fontsize=10)
        ax.tick_params(labelsize=9.5)
    axes[0].set_ylabel("requests running at once", fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=9.5,
               frameon=False)
    fig.savefig(path, dpi=200)
    plt.close(fig)


def main() -> None:
    parser = make_parser(__doc__, quick="fewer requests and rates", plot_only="batch_capacity")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    if args.plot_only:
        plot(json.loads((results_dir / "batch_capacity.json").read_text()), results_dir / "batch_capacity.png")
        return
    rates = [0.05, 0.2] if args.quick else [0.01, 0.02, 0.05, 0.1, 0.2]
    results = {}
    for name in TRACES:
        for rate in rates:
            requests = trace(name, 150 if args.quick else 500, rate * SCALE[name])
            row = {p: mean_batch_contiguous(requests, p, OPT_13B_SLOTS) for p in ("max", "pow2", "oracle")}
            row["paged"] = mean_batch_paged(requests, OPT_13B_SLOTS)
            row["paged_fp8"] = mean_batch_paged(requests, FP8_SLOTS)
            results[f"{name}/{rate}"] = row
            print(f"{name:<9} rate {rate * SCALE[name]:<5} req/step: "
                  + "  ".join(f"{k} {v:6.2f}" for k, v in row.items()))
    memory_bound = {}  # ShareGPT-like at rates where requests always wait: memory alone sets the batch
    for rate in [1.0] if args.quick else [0.5, 1.0]:
        requests = trace("ShareGPT", 150 if args.quick else 500, rate)
        memory_bound[f"ShareGPT/{rate}"] = row = {"paged": mean_batch_paged(requests, OPT_13B_SLOTS),
                                                  "paged_fp8": mean_batch_paged(requests, FP8_SLOTS)}
        print(f"ShareGPT  rate {rate:<5} req/step: paged {row['paged']:6.2f}  paged_fp8 {row['paged_fp8']:6.2f}")
    saved = {"slots": OPT_13B_SLOTS, "fp8_slots": FP8_SLOTS, "results": results, "memory_bound": memory_bound,
             "paper_sharegpt_2rps": PAPER_SHAREGPT_2RPS}
    (results_dir / "batch_capacity.json").write_text(json.dumps(saved, indent=2))
    plot(json.loads((results_dir / "batch_capacity.json").read_text()), results_dir / "batch_capacity.png")
    top, bound = results[f"ShareGPT/{rates[-1]}"], memory_bound[max(memory_bound, key=lambda k: float(k[9:]))]
    print("ShareGPT, saturated: " + ", ".join(f"{k} {v:.2f}" for k, v in top.items())
          + f"; memory-bound, the FP8 cache runs {bound['paged_fp8'] / bound['paged']:.2f}x paged's requests"
          + "  (paper at 2 req/s: " + ", ".join(f"{k} {v}" for k, v in PAPER_SHAREGPT_2RPS.items()) + ")")


if __name__ == "__main__":
    main()
