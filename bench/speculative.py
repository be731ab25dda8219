"""Speculative decoding with n-gram drafts: acceptance, tokens per forward pass, and speedup over stage 10.

Two workloads on the tiny model, greedy: **repetitive** prompts, that restate a text the model
then goes on restating (a start, the model's own continuation of it, and the start again: the
case prompt lookup was made for), and **random** prompts (token ids drawn at random, where an
n-gram rarely repeats). For k = 1, 2, 4 and 8 drafts, at batch 1 and 16: the acceptance rate
alpha (draft tokens kept / verified), the tokens a request gets per decode forward pass it takes
part in (measured), what Leviathan et al.'s formula gives for it from alpha, (1 - alpha^(k+1)) /
(1 - alpha) (drafts of k tokens, each kept with probability alpha) weighted by the share of
decode passes that had a draft at all (prompt lookup proposes only where an n-gram repeats),
and the wall-time speedup
over stage 10 on the same requests (the median of 3 runs each). The formula's figure is also the
speedup it predicts for a proposer that costs nothing and a step that costs the same whatever it
verifies. Every output is checked identical to stage 10's.

On this CPU a forward pass over k + 1 tokens costs more than over one: the formula's equal-cost
step holds where decoding is memory-bound (a GPU at small batch), not where it is compute- or
dispatch-bound (here); the gap between tokens per forward pass and wall-time speedup is that cost.
Writes bench/results/speculative.json and .png (bench/results/quick/ with --quick); the last line
is the headline.
"""

from __future__ import annotations

import json
import random
import statistics
import time

from harness import make_parser, results_dir_for  # noqa: E402

from minipaged import LLM, SamplingParams
from minipaged.common.threads import apply_threads

KS = (1, 2, 4, 8)
BATCHES = (1, 16)


def workloads(batch: int, max_tokens: int) -> dict[str, list[list[int]]]:
    """``batch`` prompts of each kind."""
    llm, rng = LLM("tiny", stage=10), random.Random(0)
    starts = [".. versionchanged::", "The following example", "Return the number of", "class Counter"]
    repetitive = []
    for i in range(batch):
        start = llm.tokenizer.encode(starts[i % len(starts)]).ids
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        continuation = llm.generate({"prompt_token_ids": start}, greedy, use_tqdm=False)[0].outputs[0].token_ids
        repetitive.append(start + continuation + start)
    random_ids = [[rng.randrange(2048) for _ in range(40)] for _ in range(batch)]
    return {"repetitive": repetitive, "random": random_ids}


def timed_run(llm, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]], int]:
    """Wall time, outputs, and the decode forward passes the requests took part in (one per running
    request per step: its ``CachedRequestData``)."""
    engine, step, decodes = llm.engine, llm.engine.step, [0]

    def counted():
        outputs = step()
        decodes[0] += len(engine.last_scheduler_output.scheduled_cached_reqs)
        return outputs

    engine.step = counted
    start = time.perf_counter()
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        del engine.step
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs], decodes[0]


def main() -> None:
    parser = make_parser(__doc__, quick="16 tokens per request and one run each (default: 64 and 3)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: the cores not busy now)")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    threads = apply_threads(args.threads)
    max_tokens, repeats = (16, 1) if args.quick else (64, 3)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for batch in BATCHES:
        for name, prompts in workloads(batch, max_tokens).items():
            base = LLM("tiny", stage=10, num_gpu_blocks=1024)
            timed_run(base, prompts, params)  # warm up
            base_times, expected, _ = zip(*(timed_run(base, prompts, params) for _ in range(repeats)), strict=True)
            for k in KS:
                config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                          "prompt_lookup_min": 2}
                llm = LLM("tiny", num_gpu_blocks=1024, speculative_config=config)
                timed_run(llm, prompts, params)
                before = llm.stats.spec_decoding
                runs = [timed_run(llm, prompts, params) for _ in range(repeats)]
                times, outputs, decodes = zip(*runs, strict=True)
                assert all(o == expected[0] for o in outputs), f"outputs differ from stage 10's ({name}, k={k})"
                stats = llm.stats.spec_decoding
                coverage = (stats.num_drafts - before.num_drafts) / sum(decodes)  # decode passes with a draft
                drafts = stats.num_draft_tokens - before.num_draft_tokens
                alpha = (stats.num_accepted_tokens - before.num_accepted_tokens) / drafts if drafts else 0.0
                formula = coverage * ((1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1) + 1 - coverage
                decoded = len(prompts) * (max_tokens - 1)  # each request's tokens after its prompt's step
                rows.append({"batch": batch, "workload": name, "k": k, "acceptance_rate": round(alpha, 3),
                             "passes_with_a_draft": round(coverage, 3),
                             "tokens_per_forward": round(decoded * repeats / sum(decodes), 2),
                             "formula_tokens_per_forward": round(formula, 2),
                             "speedup": round(statistics.median(base_times) / statistics.median(times), 2)})
                print(json.dumps(rows[-1]), flush=True)
    result = {"threads": threads, "max_tokens": max_tokens, "repeats": repeats, "rows": rows}
    (results_dir / "speculative.json").write_text(json.dumps(result, indent=2))
    plot(result, results_dir / "speculative.png")
    best = max((r for r in rows if r["workload"] == "repetitive"), key=lambda r: r["speedup"])
    print(f"repetitive prompts, batch {best['batch']}, k={best['k']}: acceptance {best['acceptance_rate']:.0%}, "
          f"{best['tokens_per_forward']} tokens per forward pass (the formula: {best['formula_tokens_per_forward']}), "
          f"{best['speedup']}x stage 10's wall time; outputs identical")


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, batch in zip(axes, BATCHES, strict=True):
        for name, style in (("repetitive", "-o"), ("random", "--s")):
            rows = [r for r in result["rows"] if r["batch"] == batch and r["workload"] == name]
            ks = [r["k"] for r in rows]
            ax.plot(ks, [r["speedup"] for r in rows], style, label=f"{name}: wall-time speedup")
            ax.plot(ks, [r["tokens_per_forward"] for r in rows], style, alpha=0.35, label=f"{name}: tokens per forward")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(KS, [str(k) for k in KS])
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("draft tokens k")
    axes[0].set_ylabel("over stage 10 (1 = no gain)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
