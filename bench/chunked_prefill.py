"""Does chunked prefill stop a long prompt from stalling the requests that are decoding?

The head-of-line question. 32 requests (16 with --quick) are decoding on the tiny model
when a 480-token prompt arrives (its position table holds 512). Stage 9 computes the prompt
whole, in one step beside the decodes; stage 10 cuts it into chunks of what a token budget
of 64, 256 or 1024 leaves. Measured on the CPU, one thread, from the prompt's arrival to
its first token: the inter-token latency of the decoding requests (p50, p99), the longest
step, and the long prompt's time to first token, each the median of 5 runs (one with
--quick). The outputs are checked equal. Writes
bench/results/chunked_prefill.json and .png (bench/results/quick/ with --quick); the last
line is the headline.
"""

from __future__ import annotations

import json
import random
import statistics
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from harness import make_parser, results_dir_for  # noqa: E402

from minipaged import (
    LLM,  # noqa: E402
    SamplingParams,  # noqa: E402
)
from minipaged.common.threads import apply_threads  # noqa: E402

LONG_PROMPT, SHORT_PROMPT, BUDGETS = 480, 16, (64, 256, 1024)


def run(llm, shorts: list[list[int]], long_prompt: list[int]) -> dict:
    """Decode the short requests, add the long one, time every step until it has its first token."""
    engine = llm.engine
    decode = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(shorts):
        engine.add_request(f"s{i}", {"prompt_token_ids": prompt}, decode)
    while any(not r.seqs[0].output_token_ids for r in engine.requests.values()):
        engine.step()  # until every short request is decoding
    arrival = time.perf_counter()
    engine.add_request("long", {"prompt_token_ids": long_prompt}, SamplingParams(max_tokens=4, temperature=0.0,
                                                                                 ignore_eos=True))
    last = dict.fromkeys((f"s{i}" for i in range(len(shorts))), arrival)
    gaps, steps, first_token = [], [], None
    while first_token is None:
        start = time.perf_counter()
        outputs = engine.step()
        end = time.perf_counter()
        steps.append(end - start)
        for o in outputs:
            if o.request_id == "long":
                first_token = end
            elif o.request_id in last:
                gaps.append(end - last[o.request_id])
                last[o.request_id] = end
    tokens = {}
    while engine.has_unfinished_requests():  # to the end, so that the outputs can be compared
        for o in engine.step():
            if o.finished:
                tokens[o.request_id] = o.outputs[0].token_ids
    gaps.sort()
    return {"itl_p50_ms": 1e3 * statistics.median(gaps), "itl_p99_ms": 1e3 * gaps[int(0.99 * (len(gaps) - 1))],
            "worst_step_ms": 1e3 * max(steps), "ttft_ms": 1e3 * (first_token - arrival), "steps": len(steps),
            "tokens": tokens}


def main() -> None:
    parser = make_parser(__doc__, quick="16 decoding requests instead of 32, one repeat")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads for every side (default: 1)")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    threads = apply_threads(args.threads)
    print(f"{threads} torch thread(s) for every side")
    rng = random.Random(0)
    count, repeats = (16, 1) if args.quick else (32, 5)
    shorts = [[rng.randrange(1, 2000) for _ in range(SHORT_PROMPT)] for _ in range(count)]
    long_prompt = [rng.randrange(1, 2000) for _ in range(LONG_PROMPT)]
    configs = {"stage 9 (whole prompt)": lambda: LLM("tiny", stage=9, num_gpu_blocks=512, max_model_len=512)}
    for budget in BUDGETS:
        configs[f"stage 10, budget {budget}"] = (lambda b=budget: LLM(stage=10, model=
            "tiny", num_gpu_blocks=512, max_model_len=512, max_num_batched_tokens=b))
    rows, reference = {}, None
    for name, make in configs.items():
        runs = [run(make(), shorts, long_prompt) for _ in range(repeats)]
        reference = reference or runs[0]["tokens"]
        assert all(r["tokens"] == reference for r in runs), f"{name} changed an output"
        rows[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "tokens"}  # of each measure
        rows[name]["threads"] = torch.get_num_threads()
        r = rows[name]
        print(f"{name:<24} inter-token p50 {r['itl_p50_ms']:6.1f} ms  p99 {r['itl_p99_ms']:6.1f} ms  "
              f"worst step {r['worst_step_ms']:6.1f} ms  long prompt's first token {r['ttft_ms']:6.1f} ms "
              f"({r['steps']:.0f} steps)")
    (results_dir / "chunked_prefill.json").write_text(json.dumps(
        {"decoding_requests": count, "long_prompt": LONG_PROMPT, "threads": threads, "rows": rows}, indent=2))
    fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
    names, width = list(rows), 0.27
    for k, (key, label) in enumerate((("itl_p99_ms", "inter-token latency p99"), ("worst_step_ms", "worst step"),
                                      ("ttft_ms", "long prompt's first token"))):
        ax.bar([i + (k - 1) * width for i in range(len(names))], [rows[n][key] for n in names], width, label=label)
    ax.set_xticks(range(len(names)), [n.replace(", ", "\n") for n in names], fontsize=8)
    ax.set_ylabel("milliseconds")
    ax.set_title(f"{count} requests decoding, a {LONG_PROMPT}-token prompt arrives (tiny model, CPU)", fontsize=9,
                 loc="left")
    ax.legend(frameon=False, fontsize=8)
    fig.savefig(results_dir / "chunked_prefill.png", dpi=120)
    whole, chunked = rows["stage 9 (whole prompt)"], rows["stage 10, budget 256"]
    print(f"chunked prefill (budget 256): worst step {whole['worst_step_ms']:.1f} -> "
          f"{chunked['worst_step_ms']:.1f} ms, inter-token p99 {whole['itl_p99_ms']:.1f} -> "
          f"{chunked['itl_p99_ms']:.1f} ms, long prompt's first token {whole['ttft_ms']:.1f} -> "
          f"{chunked['ttft_ms']:.1f} ms")


if __name__ == "__main__":
    main()
