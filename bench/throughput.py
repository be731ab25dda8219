"""How much faster does a paged, continuously batched engine serve than transformers?

All run the same model on the same machine in the same process: minipaged's ``LLM``,
Hugging Face ``generate`` in static batches, and transformers' own continuous batching
(its ``ContinuousBatchingManager``, the engine behind ``generate_batch``, with paged
attention). The requests have ShareGPT-like prompt and output lengths, scaled to the
model's maximum length (the paper's means, 161 and 338 tokens of 2048, times
max_len / 2048), and each request generates exactly its output length (end tokens are
ignored everywhere). Static ``generate`` serves them in batches of the same size as
minipaged's ``max_num_seqs``, left-padded, each batch running until its longest request
is done, as it must; transformers' continuous batching gets the same number of requests
per batch. Throughput counts the generated tokens each request asked for, per second of
wall time, the median of 3 runs of each side taken in turn (one with --quick); the greedy
outputs are checked equal. Also reported: the share of minipaged's
wall time spent outside the model's forward pass (scheduling, block bookkeeping, inputs,
sampling).

Writes bench/results/throughput.json and .png; the last line is the ratios. ``--plot-only``
redraws the .png from the saved .json without measuring anything.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()

from harness import make_parser, results_dir_for  # noqa: E402

from minipaged.common.threads import apply_threads  # noqa: E402
from minipaged.models import resolve_model_path  # noqa: E402
from minipaged.perf.simulate import synthetic_requests  # noqa: E402
from minipaged.stage7_engine import LLM, SamplingParams  # noqa: E402


def hf_static_batches(model, prompts, outputs, batch_size, pad_id) -> float:
    """Seconds to serve every request with transformers, in padded batches of ``batch_size``."""
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, lengths = prompts[i : i + batch_size], outputs[i : i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        steps = max(lengths)  # the batch runs until its longest request is done
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                           do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    return time.perf_counter() - start


def hf_continuous_batching(model, prompts, outputs, batch_size) -> tuple[float, list[list[int]]]:
    """Seconds to serve every request with transformers' continuous batching, and its tokens."""
    from transformers.generation import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max(outputs))
    manager = model.init_continuous_batching(
        generation_config=config,
        continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=batch_size))
    manager.start()
    try:
        manager.add_request([1, 2, 3], request_id="warm-up", max_new_tokens=2)  # not timed: start-up, warm-up
        while (result := manager.get_result(timeout=60)) is not None and not result.is_finished():
            pass
        start = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
               for i, (p, n) in enumerate(zip(prompts, outputs, strict=True))]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("transformers' continuous batching returned nothing for a minute")
            if result.is_finished():
                results[result.request_id] = result.generated_tokens
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return seconds, [list(results[i]) for i in ids]


class ForwardTimer:
    """Wraps the model inside minipaged's runner and adds up the seconds of its forward passes."""

    def __init__(self, model):
        self.model, self.seconds = model, 0.0

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self.model(*args)
        finally:
            self.seconds += time.perf_counter() - start

    def compute_logits(self, hidden):
        start = time.perf_counter()
        try:
            return self.model.compute_logits(hidden)
        finally:
            self.seconds += time.perf_counter() - start


def plot(data: dict, path: Path) -> None:
    """Generated tokens per second of each engine, per batch size, from the saved results."""
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), layout="constrained")
    xs = range(len(rows))
    bars = [("minipaged", "minipaged_tps", "#1b9e77"),
            ("transformers, continuous batching", "transformers_cb_tps", "#7570b3"),
            ("transformers generate", "transformers_tps", "#999999")]
    for k, (label, key, color) in enumerate(bars):
        ax.bar([x + 0.27 * (k - 1) for x in xs], [r[key] for r in rows], 0.27, label=label, color=color)
    ax.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows], fontsize=11)
    ax.tick_params(axis="y", labelsize=10)
    ax.set_ylabel("generated tokens / s", fontsize=11)
    ax.set_title(f"{data['model']} model, {data['requests']} requests, {data['device']}", fontsize=11)
    fig.legend(loc="outside lower center", ncol=3, fontsize=9.5, frameon=False)  # below: it covers no bar
    fig.savefig(path, dpi=200)
    plt.close(fig)


def headline(rows: list[dict]) -> str:
    return ("minipaged's throughput vs transformers generate / continuous batching: "
            + ", ".join(f"{r['ratio']:.1f}x / {r['ratio_cb']:.1f}x at batch {r['batch']}" for r in rows))


def main() -> None:
    parser = make_parser(__doc__, quick="64 requests and one run (the default: 128, 3 runs)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, help="max_num_seqs and transformers' batch size (default: 16, 32, 64)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads for every side (default: the free cores)")
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw the plot from the saved results (bench/results/throughput.json), "
                             "measuring nothing")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    if args.plot_only:
        data = json.loads((results_dir / "throughput.json").read_text())
        plot(data, results_dir / "throughput.png")
        print(headline(data["rows"]))
        return
    threads = apply_threads(args.threads)  # one count for every side: minipaged and both transformers runs
    repeats = 1 if args.quick else 3
    torch.manual_seed(0)
    path = resolve_model_path(args.model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    max_len = min(hf.config.max_position_embeddings, 2048)
    scale = max_len / 2048
    trace = synthetic_requests(64 if args.quick else 128, mean_prompt=161.31 * scale, mean_output=337.99 * scale,
                               max_len=max_len, seed=0)
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (r.prompt_len,), generator=gen).tolist() for r in trace]
    outputs = [r.output_len for r in trace]
    wanted = sum(outputs)
    print(f"{len(trace)} requests, mean prompt {sum(map(len, prompts)) / len(prompts):.0f}, mean output "
          f"{wanted / len(trace):.0f} tokens, max {max_len}; {args.device}, "
          f"{threads} torch thread(s) for every side")

    batches = [args.batch] if args.batch else ([32] if args.quick else [16, 32, 64])
    cb_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                 attn_implementation="sdpa").to(args.device).eval()
    rows = []
    for batch in batches:
        llm = LLM(args.model, max_num_seqs=batch, max_model_len=max_len, device=args.device,
                  attention_backend="triton" if args.device == "cuda" else "ref")
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
        timer = llm.engine.runner.model = ForwardTimer(llm.engine.runner.model)
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs]
        seconds = {"minipaged": [], "transformers": [], "transformers_cb": []}
        outside = []
        for _ in range(repeats):  # the three sides in turn, so that a busy spell touches each alike
            timer.seconds, steps_before = 0.0, llm.stats.steps
            start = time.perf_counter()
            results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            seconds["minipaged"].append(time.perf_counter() - start)
            outside.append(1 - timer.seconds / seconds["minipaged"][-1])
            steps = llm.stats.steps - steps_before
            tokens = [r.outputs[0].token_ids for r in results]
            assert sum(map(len, tokens)) == wanted
            seconds["transformers"].append(hf_static_batches(hf, prompts, outputs, batch, pad_id=0))
            continuous, cb_tokens = hf_continuous_batching(cb_model, prompts, outputs, batch)
            seconds["transformers_cb"].append(continuous)
            same = sum(a == b for a, b in zip(tokens, cb_tokens, strict=True))
        ours, static, continuous = (statistics.median(seconds[k]) for k in seconds)
        rows.append({"batch": batch, "minipaged_tps": wanted / ours, "transformers_tps": wanted / static,
                     "transformers_cb_tps": wanted / continuous, "ratio": static / ours,
                     "ratio_cb": continuous / ours, "outside_forward": statistics.median(outside),
                     "identical_to_cb": same, "engine_steps": steps, "repeats": repeats,
                     "tps_each_run": {k: [round(wanted / t, 1) for t in v] for k, v in seconds.items()},
                     "threads": {"minipaged": threads, "transformers": threads, "transformers_cb": threads}})
        spread = "; ".join(f"{k} {min(v):.0f}-{max(v):.0f}" for k, v in rows[-1]["tps_each_run"].items())
        print(f"batch {batch:>3}: minipaged {wanted / ours:8.1f} tokens/s ({steps} steps, "
              f"{100 * rows[-1]['outside_forward']:.0f}% outside the forward), generate {wanted / static:8.1f}, "
              f"transformers continuous batching {wanted / continuous:8.1f}; ratios {static / ours:.1f}x and "
              f"{continuous / ours:.1f}x; {same}/{len(tokens)} outputs identical to continuous batching"
              + (f" (medians of {repeats}; tokens/s ranged {spread})" if repeats > 1 else ""))
    (results_dir / "throughput.json").write_text(json.dumps(
        {"model": args.model, "requests": len(trace), "generated_tokens": wanted, "device": args.device,
         "threads": threads, "repeats": repeats, "rows": rows}, indent=2))
    plot(json.loads((results_dir / "throughput.json").read_text()), results_dir / "throughput.png")
    print(headline(rows))


if __name__ == "__main__":
    main()
