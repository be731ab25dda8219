"""What one busy core does to torch's threads, and why minipaged counts the free cores.

torch runs each operation on ``torch.get_num_threads()`` OpenMP threads, by default one per
core. When another process holds a core, the operation's threads wait for it at every
barrier, and the engine slows down far more than by the core it lost. This runs stage 7's
engine (the tiny model, 32 prompts of 16 tokens, 64 tokens each, greedy) with 1 thread and
with one per core, first on the machine as it is, then with a busy loop in another process
holding one core: tokens per second, the median of 3 runs (one with --quick). It also prints
what :func:`minipaged.common.threads.free_cores` would choose at the end of each condition; the
1-minute load average it reads lags behind a load that has just begun. Writes
bench/results/threads.json (bench/results/quick/ with --quick); the last line is the headline.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch
from harness import make_parser, results_dir_for  # noqa: E402

from minipaged import LLM, SamplingParams
from minipaged.common.threads import free_cores

PROMPTS, PROMPT_LEN, MAX_TOKENS = 32, 16, 64


def tokens_per_second(llm: LLM, threads: int) -> float:
    torch.set_num_threads(threads)
    prompts = [{"prompt_token_ids": [1 + (7 * i + j) % 2000 for j in range(PROMPT_LEN)]} for i in range(PROMPTS)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return PROMPTS * MAX_TOKENS / (time.perf_counter() - start)


def main() -> None:
    parser = make_parser(__doc__, quick="one run per setting (default: the median of 3)")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    repeats = 1 if args.quick else 3
    cores = len(os.sched_getaffinity(0))
    settings = sorted({1, cores})
    llm = LLM("tiny", stage=7, max_num_seqs=PROMPTS, num_gpu_blocks=512, max_model_len=PROMPT_LEN + MAX_TOKENS)
    tokens_per_second(llm, 1)  # warm up
    print(f"tiny model, {PROMPTS} x {MAX_TOKENS} tokens, {cores} cores; tokens/s, median of {repeats}")
    rows = []
    for condition in ("as it is", "one core busy"):
        busy = None
        if condition == "one core busy":  # a spinning interpreter in a process of its own
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(1)
        try:
            for threads in settings:
                speed = statistics.median(tokens_per_second(llm, threads) for _ in range(repeats))
                rows.append({"condition": condition, "threads": threads, "tokens_per_s": speed})
                print(f"{condition:<14} {threads} thread(s): {speed:8.1f} tokens/s", flush=True)
            chosen, load = free_cores(), os.getloadavg()[0]
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        rows[-1]["free_cores_chose"] = chosen
        print(f"{condition:<14} free_cores() now chooses {chosen} (1-minute load {load:.2f})")
    (results_dir / "threads.json").write_text(json.dumps(
        {"model": "tiny", "cores": cores, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "repeats": repeats,
         "rows": rows}, indent=2))
    by = {(r["condition"], r["threads"]): r["tokens_per_s"] for r in rows}
    quiet = ", ".join(f"{by['as it is', t]:.0f}" for t in settings)
    print("one core busy: " + ", ".join(f"{t} thread(s) {by['one core busy', t]:.0f} tokens/s" for t in settings)
          + f" (as it is: {quiet})")


if __name__ == "__main__":
    main()
