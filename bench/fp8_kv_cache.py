"""What an FP8 KV cache costs in accuracy, and in time on this CPU (stage 13).

Two models: the tiny Llama that ships with minipaged, and a random-weight model of Qwen2.5-0.5B's
shape (24 layers, 14 query heads on 2 KV heads, float32). Each is served three ways: its own dtype
in the cache (``auto``, the reference), ``kv_cache_dtype="fp8"`` with every scale 1.0, and ``fp8``
with ``calculate_kv_scales`` (each layer's scales from its first batch). Measured against ``auto``:

* **scoring** — the log-probability of every token of a set of texts (``prompt_logprobs``, what
  lm-evaluation-harness asks a server for): the largest and the mean drift of a token's
  log-probability, and the largest drift of a text's total, the figure a log-likelihood task
  compares;
* **greedy agreement** — 64 tokens from each prompt: the requests whose output is identical, and
  the share of tokens generated before the first one that differs;
* **time** (tiny only) — tokens per second of 32 requests of 64 tokens, the median of 3 runs. On a
  CPU nothing reads memory faster for it: e4m3 is a storage type, every read converts it, so FP8
  costs time here; the bytes it saves are what a GPU's decode is bound by.

Writes bench/results/fp8_kv_cache.json (bench/results/quick/ with --quick); the last line is the headline.
"""

from __future__ import annotations

import json
import random
import statistics
import time

from harness import make_parser, results_dir_for  # noqa: E402
from peer_models import model_path  # noqa: E402

from minipaged import LLM, SamplingParams
from minipaged.common.threads import apply_threads

MODES = {"auto": {}, "fp8": {"kv_cache_dtype": "fp8"},
         "fp8, calibrated": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}}
SENTENCES = [
    "Return the number of items in the list. If the list is empty, return zero.",
    "This module provides functions for reading and writing configuration files.",
    "Create a new instance of the class with the given name and the default value.",
    "Raise an exception if the file does not exist or if it cannot be read.",
    "The scheduler admits a request when its blocks fit, and preempts the newest one when they do not.",
    "Paged attention stores the cache in blocks of sixteen tokens, found through a block table.",
    "def count(items):\n    total = 0\n    for item in items:\n        total += 1\n    return total\n",
    "A decode step reads every weight of the model and every key and value of the batch.",
]


def texts(count: int, seed: int = 0) -> list[str]:
    """``count`` texts of two to four of the sentences, in a seeded order."""
    rng = random.Random(seed)
    return [" ".join(rng.sample(SENTENCES, rng.randint(2, 4))) for _ in range(count)]


def token_logprobs(llm: LLM, prompts: list[str]) -> list[list[float]]:
    """Each prompt's tokens' log-probabilities, its first token's left out (it has none)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[d[t] for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)] for o in outs]


def greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    before = [next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), len(w)) / len(w)
              for g, w in zip(got, want, strict=True)]
    return {"identical": sum(g == w for g, w in zip(got, want, strict=True)) / len(want),
            "tokens_before_first_difference": statistics.mean(before)}


def drift(got: list[list[float]], want: list[list[float]]) -> dict:
    tokens = [abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)]
    totals = [abs(sum(g) - sum(w)) for g, w in zip(got, want, strict=True)]
    return {"max_token_logprob_drift": max(tokens), "mean_token_logprob_drift": statistics.mean(tokens),
            "max_text_loglikelihood_drift": max(totals), "tokens_scored": len(tokens)}


def tokens_per_second(model: str, mode: dict, prompts: list[str], max_tokens: int, runs: int) -> float:
    llm = LLM(model, **mode)
    greedy(llm, prompts[:2], 4)  # warm up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        greedy(llm, prompts, max_tokens)
        times.append(time.perf_counter() - start)
    return len(prompts) * max_tokens / statistics.median(times)


def measure(name: str, path: str, count: int, max_tokens: int) -> dict:
    prompts = texts(count)
    reference = LLM(path)
    want_scores, want_tokens = token_logprobs(reference, prompts), greedy(reference, prompts, max_tokens)
    rows = {}
    for mode, kwargs in list(MODES.items())[1:]:
        llm = LLM(path, **kwargs)
        rows[mode] = {**drift(token_logprobs(llm, prompts), want_scores),
                      **agreement(greedy(llm, prompts, max_tokens), want_tokens),
                      "num_gpu_blocks": llm.config.num_gpu_blocks}
        print(f"{name:<20} {mode:<16} " + "  ".join(f"{k} {v:.4g}" for k, v in rows[mode].items()))
    rows["auto"] = {"num_gpu_blocks": reference.config.num_gpu_blocks}
    return rows


def main() -> None:
    parser = make_parser(__doc__, quick="fewer texts, shorter outputs, one timed run")
    args = parser.parse_args()
    apply_threads(1)
    results_dir = results_dir_for(args)
    count, max_tokens, runs = (4, 16, 1) if args.quick else (16, 64, 3)
    results = {"tiny": measure("tiny", "tiny", count, max_tokens),
               "qwen2.5-0.5b-shaped": measure("qwen2.5-0.5b-shaped", str(model_path("qwen2.5-0.5b-shaped")),
                                              count // 2, max_tokens // 4)}
    prompts = texts(32, seed=1)
    speed = {mode: tokens_per_second("tiny", kwargs, prompts, max_tokens, runs) for mode, kwargs in MODES.items()}
    print("tiny, tokens/s: " + ", ".join(f"{m} {v:.0f}" for m, v in speed.items()))
    (results_dir / "fp8_kv_cache.json").write_text(json.dumps(
        {"results": results, "tokens_per_second": speed, "threads": 1}, indent=2))
    tiny = results["tiny"]["fp8, calibrated"]
    print(f"tiny, calibrated FP8 cache: {tiny['identical']:.0%} of greedy outputs identical, largest token "
          f"log-probability drift {tiny['max_token_logprob_drift']:.3g}; "
          f"{speed['fp8, calibrated'] / speed['auto']:.2f}x the tokens/s of the float32 cache on this CPU")


if __name__ == "__main__":
    main()
