"""How much faster does a paged, continuously batched engine serve than transformers' generate?

Both run the same model on the same machine in the same process: minipaged's ``LLM`` and
Hugging Face ``generate``. The requests have ShareGPT-like prompt and output lengths,
scaled to the model's maximum length (the paper's means, 161 and 338 tokens of 2048, times
max_len / 2048), and each request generates exactly its output length (end tokens are
ignored on both sides). transformers serves them in static batches of the same size as
minipaged's ``max_num_seqs``, left-padded, each batch running until its longest request
is done, as ``generate`` must. Throughput counts the generated tokens each request asked
for, per second of wall time.

Writes bench/results/throughput.json and .png; the last line is the ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()

from minipaged.models import resolve_model_path  # noqa: E402
from minipaged.simulate import synthetic_requests  # noqa: E402
from minipaged.stage7_engine import LLM, SamplingParams  # noqa: E402

RESULTS = Path(__file__).parent / "results"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 requests (the default is 128)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, help="max_num_seqs and transformers' batch size (default: 16, 32, 64)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
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
          f"{wanted / len(trace):.0f} tokens, max {max_len}; {args.device}")

    batches = [args.batch] if args.batch else ([32] if args.quick else [16, 32, 64])
    rows = []
    for batch in batches:
        llm = LLM(args.model, max_num_seqs=batch, max_model_len=max_len, device=args.device,
                  attention_backend="triton" if args.device == "cuda" else "ref")
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs]
        start = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ours = time.perf_counter() - start
        assert sum(len(r.outputs[0].token_ids) for r in results) == wanted
        theirs = hf_static_batches(hf, prompts, outputs, batch, pad_id=0)
        rows.append({"batch": batch, "minipaged_tps": wanted / ours, "transformers_tps": wanted / theirs,
                     "ratio": theirs / ours, "engine_steps": llm.stats["steps"]})
        print(f"batch {batch:>3}: minipaged {wanted / ours:8.1f} tokens/s ({llm.stats['steps']} steps), "
              f"transformers {wanted / theirs:8.1f} tokens/s, ratio {theirs / ours:.1f}x")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "throughput.json").write_text(json.dumps(
        {"model": args.model, "requests": len(trace), "generated_tokens": wanted, "device": args.device,
         "rows": rows}, indent=2))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["minipaged_tps"] for r in rows], 0.4, label="minipaged", color="#1b9e77")
    ax.bar([x + 0.2 for x in xs], [r["transformers_tps"] for r in rows], 0.4, label="transformers", color="#999999")
    ax.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"{args.model}, {len(trace)} requests, {args.device}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "throughput.png", dpi=120)
    print("minipaged vs transformers generate, throughput ratio: "
          + ", ".join(f"{r['ratio']:.1f}x at batch {r['batch']}" for r in rows))


if __name__ == "__main__":
    main()
