"""How much of the KV memory holds K/V? (the vLLM paper's Figure 2)

Runs a ShareGPT-like trace through stage 0's contiguous cache under the `max`, `pow2` and
`oracle` reservation policies, and through stage 2's paged manager (blocks of 16), in one
KV budget (16,384 token slots, about the 12 GB an A100-40GB keeps for OPT-13B's cache),
and reports the share of memory per kind of slot while requests wait for memory.
Writes bench/results/memory_utilization.json and .png; the last line is the headline.
"""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from harness import make_parser, results_dir_for  # noqa: E402

from minipaged.learn.viz import plot_usage  # noqa: E402
from minipaged.perf.simulate import (  # noqa: E402
    format_usage_table,
    simulate_contiguous,
    simulate_paged,
    synthetic_requests,
)

PAPER_TOKEN_SHARE = {"max": 20.4, "pow2": 26.8, "oracle": 38.2, "paged/16": 96.3}


def main() -> None:
    parser = make_parser(__doc__, quick="a short trace")
    parser.add_argument("--slots", type=int, default=16384)
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    trace = synthetic_requests(150 if args.quick else 1000, rate=0.2, seed=0)
    results = [simulate_contiguous(trace, p, args.slots, 2048) for p in ("max", "pow2", "oracle")]
    results.append(simulate_paged(trace, args.slots // 16, 16))
    print(format_usage_table(results))
    payload = {r.policy: {"fractions": r.fractions, "mean_running": r.mean_running,
                          "paper_token_share": PAPER_TOKEN_SHARE[r.policy]} for r in results}
    (results_dir / "memory_utilization.json").write_text(json.dumps(payload, indent=2))
    plot_usage(results)
    plt.title("KV memory by kind of slot")
    plt.tight_layout()
    plt.savefig(results_dir / "memory_utilization.png", dpi=120)
    print("token share (ours vs paper): " + ", ".join(
        f"{r.policy} {100 * r.fractions['token']:.1f}% vs {PAPER_TOKEN_SHARE[r.policy]}%" for r in results))


if __name__ == "__main__":
    main()
