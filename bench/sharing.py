"""How much KV memory does sharing save, for parallel sampling and beam search? (the vLLM paper's Figure 15)

The paper measures it on Alpaca (Figure 15) and on ShareGPT (§6.3). Runs the tiny model
through minipaged's engines on ShareGPT-like and Alpaca-like requests (the paper's mean
lengths, each request clipped to 500 tokens), on both engines:

* **V0** (the paper's): parallel sampling with n = 2, 4, 6 with shared blocks (stage 8: one
  prefill, then forks) and without (stage 7's engine serving n separate requests seeded one
  apart); beam search with width 2, 4, 6 on forked beams, whose unshared baseline is every
  beam holding its own copy of its tokens.
* **V1** (vLLM V1's, the default): no fork, no copy-on-write. The n samples are n requests
  (stage 10's front end), which share the prompt's full blocks through the prefix cache; the
  baseline is the same n requests with prefix caching off. Beam search runs in the front end,
  one request per beam and step, the beams' common blocks found in the prefix cache; the
  baseline again every beam holding its own copy.

The saving is 1 - (blocks in use with sharing) / (blocks without), summed over the steps (for
V1's beams: over the steps' scheduled requests, whose blocks are held while they run). Block
size 16. Writes bench/results/sharing.json and .png; the last line is the headline.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from harness import make_parser, results_dir_for  # noqa: E402

from minipaged import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from minipaged.perf.simulate import synthetic_requests  # noqa: E402

TRACES = {"ShareGPT": (161.31, 337.99), "Alpaca": (19.31, 58.45)}
PAPER = {("Alpaca", "parallel"): "6.1-9.8%", ("Alpaca", "beam"): "37.6-55.2%",
         ("ShareGPT", "parallel"): "16.2-30.5%", ("ShareGPT", "beam"): "44.3-66.3%"}


def blocks_over_time(llm, run) -> list[int]:
    """Blocks in use after every step of ``run()``."""
    manager, seen = llm.scheduler.block_manager, []
    step = llm.engine.step

    def recording_step():
        outputs = step()
        seen.append(manager.num_total_blocks - manager.num_free_blocks)
        return outputs

    llm.engine.step = recording_step
    run()
    return seen


def parallel_saving(requests, n) -> float:
    prompts = [{"prompt_token_ids": [1 + i % 2000 for i in range(r.prompt_len)]} for r in requests]
    shared = LLM("tiny", stage=8, num_gpu_blocks=4096)
    params = [SamplingParams(n=n, max_tokens=r.output_len, temperature=1.0, seed=10 * i, ignore_eos=True)
              for i, r in enumerate(requests)]
    used_shared = sum(blocks_over_time(shared, lambda: shared.generate(prompts, params, use_tqdm=False)))
    unshared = LLM("tiny", stage=7, num_gpu_blocks=4096)
    alone = [SamplingParams(max_tokens=r.output_len, temperature=1.0, seed=10 * i + k, ignore_eos=True)
             for i, r in enumerate(requests) for k in range(n)]
    repeated = [p for p in prompts for _ in range(n)]
    used_unshared = sum(blocks_over_time(unshared, lambda: unshared.generate(repeated, alone, use_tqdm=False)))
    return 1 - used_shared / used_unshared


def beam_saving(requests, width) -> float:
    shared = unshared = 0
    for r in requests:
        llm = LLM("tiny", stage=8, num_gpu_blocks=4096)
        manager, replace_beams = llm.scheduler.block_manager, llm.engine.replace_beams

        def recording(request, beams, keep, manager=manager, replace_beams=replace_beams):
            nonlocal shared, unshared
            new_beams = replace_beams(request, beams, keep)
            if new_beams:  # the blocks the beams hold now, shared or each its own copy
                shared += len({b for beam in new_beams for b in manager.get_block_table(beam.seq_id)})
                unshared += sum(manager.blocks_needed(len(beam) - 1) for beam in new_beams)
            return new_beams

        llm.engine.replace_beams = recording
        prompt = [1 + i % 2000 for i in range(r.prompt_len)]
        llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(width, max(r.output_len, 2), ignore_eos=True))
    return 1 - shared / unshared


def v1_parallel_saving(requests, n) -> float:
    """V1: n requests per prompt, seeded as stage 10's front end seeds them; prefix caching on, then off."""
    prompts = [{"prompt_token_ids": [1 + i % 2000 for i in range(r.prompt_len)]} for r in requests]
    params = [SamplingParams(n=n, max_tokens=r.output_len, temperature=1.0, seed=10 * i, ignore_eos=True)
              for i, r in enumerate(requests)]
    used = []
    for caching in (True, False):
        llm = LLM("tiny", num_gpu_blocks=4096, enable_prefix_caching=caching)
        used.append(sum(blocks_over_time(llm, lambda llm=llm: llm.generate(prompts, params, use_tqdm=False))))
    return 1 - used[0] / used[1]


def v1_beam_saving(requests, width) -> float:
    """V1: beam search in the front end; the blocks the beams' requests hold while a step runs them, beside
    every beam holding its own copy of its tokens."""
    shared = unshared = 0
    for r in requests:
        llm = LLM("tiny", num_gpu_blocks=4096)
        manager, schedule = llm.scheduler.block_manager, llm.scheduler.schedule

        def recording(manager=manager, schedule=schedule):
            nonlocal shared, unshared
            out = schedule()
            if out.scheduled:
                shared += manager.num_total_blocks - manager.num_free_blocks
                unshared += sum(manager.blocks_needed(len(q.seqs[0])) for q in out.scheduled)
            return out

        llm.scheduler.schedule = recording
        prompt = [1 + i % 2000 for i in range(r.prompt_len)]
        llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(width, max(r.output_len, 2), ignore_eos=True))
    return 1 - shared / unshared


def plot(data: dict, path: Path) -> None:
    """Memory saved by sharing against n or the beam width, one panel per trace, from the saved results."""
    results = data["saving"]
    fig, axes = plt.subplots(1, 2, figsize=(7.2, 3.6), sharey=True, layout="constrained")
    for ax, trace in zip(axes, TRACES, strict=True):
        for kind, color, label in (("parallel", "#1b9e77", "parallel sampling"), ("beam", "#7570b3", "beam search")):
            ax.plot([2, 4, 6], [100 * results[f"{trace}/{kind}/{k}"] for k in (2, 4, 6)], "o-", ms=4, color=color,
                    label=f"{label}, V0 (fork)")
            if f"V1/{trace}/{kind}/2" in results:
                ax.plot([2, 4, 6], [100 * results[f"V1/{trace}/{kind}/{k}"] for k in (2, 4, 6)], "s--", ms=4,
                        color=color, label=f"{label}, V1 (prefix cache)")
        ax.set_title(f"{trace}-like", fontsize=11)
        ax.set_xlabel("n (parallel) or beam width", fontsize=10)
        ax.set_xticks([2, 4, 6])
        ax.tick_params(labelsize=9.5)
    axes[0].set_ylabel("KV memory saved (%)", fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=2, fontsize=9,
               frameon=False)
    fig.savefig(path, dpi=200)
    plt.close(fig)


def main() -> None:
    parser = make_parser(__doc__, quick="fewer requests", plot_only="sharing")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    if args.plot_only:
        plot(json.loads((results_dir / "sharing.json").read_text()), results_dir / "sharing.png")
        return
    results = {}
    for trace, (prompt_mean, output_mean) in TRACES.items():
        requests = synthetic_requests(4 if args.quick else 12, mean_prompt=prompt_mean,
                                      mean_output=output_mean, max_len=500, seed=1)
        for k in (2, 4, 6):
            results[f"{trace}/parallel/{k}"] = parallel_saving(requests, k)
            results[f"{trace}/beam/{k}"] = beam_saving(requests, k)
            results[f"V1/{trace}/parallel/{k}"] = v1_parallel_saving(requests, k)
            results[f"V1/{trace}/beam/{k}"] = v1_beam_saving(requests, k)
            print(f"{trace:<9} n/width {k}: parallel sampling saves {100 * results[f'{trace}/parallel/{k}']:5.1f}% "
                  f"(V1 {100 * results[f'V1/{trace}/parallel/{k}']:5.1f}%), beam search "
                  f"{100 * results[f'{trace}/beam/{k}']:5.1f}% (V1 {100 * results[f'V1/{trace}/beam/{k}']:5.1f}%)")
    paper = {f"{a}/{b}": v for (a, b), v in PAPER.items()}
    (results_dir / "sharing.json").write_text(json.dumps({"saving": results, "paper": paper}, indent=2))
    plot(json.loads((results_dir / "sharing.json").read_text()), results_dir / "sharing.png")
    print("memory saved by sharing, V0 / V1 (paper): " + "; ".join(
        f"{t} {kind} " + " / ".join(f"{100 * min(results[f'{e}{t}/{kind}/{k}'] for k in (2, 4, 6)):.1f}-"
                                    f"{100 * max(results[f'{e}{t}/{kind}/{k}'] for k in (2, 4, 6)):.1f}%"
                                    for e in ("", "V1/")) + f" ({PAPER[(t, kind)]})"
        for t in TRACES for kind in ("parallel", "beam")))


if __name__ == "__main__":
    main()
