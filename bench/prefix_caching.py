"""What does prefix caching buy when requests share a prefix? (the vLLM paper's Figure 16)

The tiny model serves 32 requests that share a prefix — a one-shot prefix of about 80
tokens and a five-shot prefix of about 340 — each followed by its own question of 8 to 24
tokens and 16 generated tokens, with ``enable_prefix_caching`` off and on. One request
runs first (it fills the cache), then the other 31. Reported: prefill tokens computed,
block hits, and throughput (requests per second). Writes bench/results/prefix_caching.json
and .png; the last line is the headline.
"""

from __future__ import annotations

import json
import random
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from harness import make_parser, results_dir_for  # noqa: E402

from minipaged import LLM, SamplingParams  # noqa: E402

PREFIXES = {"one-shot": 80, "five-shot": 340}


def main() -> None:
    parser = make_parser(__doc__, quick="12 requests instead of 32")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    rng = random.Random(0)
    count = 12 if args.quick else 32
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    rows = {}
    for name, length in PREFIXES.items():
        prefix = [rng.randrange(1, 2000) for _ in range(length)]
        prompts = [{"prompt_token_ids": prefix + [rng.randrange(1, 2000) for _ in range(rng.randint(8, 24))]}
                   for _ in range(count)]
        for caching in (False, True):
            llm = LLM("tiny", stage=9, num_gpu_blocks=1024, enable_prefix_caching=caching)
            start = time.perf_counter()
            first = llm.generate(prompts[:1], params, use_tqdm=False)
            rest = llm.generate(prompts[1:], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            rows[f"{name}/{'on' if caching else 'off'}"] = {
                "prefill_tokens": llm.stats.prefill_tokens, "hits": llm.stats.prefix_cache_hits,
                "requests_per_s": count / seconds, "outputs": [o.outputs[0].token_ids for o in first + rest]}
        on, off = rows[f"{name}/on"], rows[f"{name}/off"]
        assert on["outputs"] == off["outputs"], "caching changed an output"
        print(f"{name:<9} ({length} shared tokens): prefill tokens {off['prefill_tokens']} -> {on['prefill_tokens']}, "
              f"{on['hits']} block hits, {off['requests_per_s']:.1f} -> {on['requests_per_s']:.1f} requests/s")
    (results_dir / "prefix_caching.json").write_text(json.dumps(
        {k: {m: v for m, v in row.items() if m != "outputs"} for k, row in rows.items()}, indent=2))
    fig, ax = plt.subplots(figsize=(5, 3))
    names = list(PREFIXES)
    for i, (state, color) in enumerate((("off", "#999999"), ("on", "#1b9e77"))):
        ax.bar([x + 0.4 * i for x in range(len(names))], [rows[f"{n}/{state}"]["prefill_tokens"] for n in names],
               0.4, color=color, label=f"caching {state}")
    ax.set_xticks([x + 0.2 for x in range(len(names))], names)
    ax.set_ylabel("prefill tokens computed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(results_dir / "prefix_caching.png", dpi=120)
    print("prefix caching: " + ", ".join(
        f"{n} {rows[f'{n}/on']['requests_per_s'] / rows[f'{n}/off']['requests_per_s']:.1f}x throughput, "
        f"{100 * (1 - rows[f'{n}/on']['prefill_tokens'] / rows[f'{n}/off']['prefill_tokens']):.0f}% "
        "fewer prefill tokens" for n in names))


if __name__ == "__main__":
    main()
