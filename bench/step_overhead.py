"""How much of a decode step is spent outside the model's forward: stage 7 vs stage 10.

Stage 7's runner rebuilds every step's inputs (token ids, positions, slot mapping, block
tables) from Python lists of every running sequence; stage 10 keeps a persistent
``InputBatch`` and only writes what changed. The point of the persistent batch is the time
around the forward pass, so this measures exactly that: with 16 and 64 requests in steady
decode on the tiny model (CPU), the wall time of ``engine.step()`` and, inside it, the time
of the model's own ``forward`` and ``compute_logits`` (wrapped here, from the outside), each
summed over the decode steps of a run; the share outside the forward is ``1 - forward /
step``, split into the scheduler's ``schedule``, the runner's inputs (its call less the
forward), the sampler, and the rest (outputs and counters), the median of 5 runs of 200
steps (one of 16 with --quick). The requests ask for their outputs when they finish
(``FINAL_ONLY``), as ``LLM.generate`` does. The thread count and the machine's load are recorded.

Stage 10 runs twice: stepping synchronously, and with async scheduling, where the forward
and the sampler run in a worker thread while the engine schedules the next step and
processes the last one's outputs. There the parts overlap: schedule and rest are work done
while the model runs, and the step is what the model waits for. On a CPU the overlap is
small: the tiny model's forward is mostly Python dispatching small kernels, and only inside
a kernel does torch release the GIL that the engine's Python needs.
Writes bench/results/step_overhead.json (bench/results/quick/ with --quick); the last line
is the headline.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time

import torch
from harness import make_parser, results_dir_for  # noqa: E402

from minipaged import RequestOutputKind, SamplingParams
from minipaged.common.threads import apply_threads
from minipaged.stage7_engine import LLM as Stage7LLM
from minipaged.stage10_v1_scheduler import LLM as Stage10LLM

PROMPT = 16
ENGINES = {"stage 7": (Stage7LLM, {}), "stage 10": (Stage10LLM, {}),
           "stage 10 async": (Stage10LLM, {"async_scheduling": True})}


class Timed:
    """Replaces one method of an instance with a timed call to the original."""

    def __init__(self, fn, clock: dict, key: str) -> None:
        self.fn, self.clock, self.key = fn, clock, key

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.clock[self.key] += time.perf_counter() - start


def run(llm_class, options: dict, batch: int, steps: int, seed: int) -> dict:
    llm = llm_class("tiny", max_num_seqs=batch, num_gpu_blocks=1024, max_model_len=512, **options)
    clock = dict.fromkeys(("forward", "schedule", "runner", "sample"), 0.0)
    runner = llm.engine.runner
    timed = [(llm.model, "forward", "forward"), (llm.model, "compute_logits", "forward"),
             (llm.engine.scheduler, "schedule", "schedule"), (llm.engine, "sampler", "sample"),
             (runner, "execute_model" if hasattr(runner, "execute_model") else "execute", "runner")]
    for obj, name, key in timed:  # instance attributes win over the class's methods
        setattr(obj, name, Timed(getattr(obj, name), clock, key))
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # as LLM.generate asks
    for i in range(batch):
        llm.engine.add_request(str(i), {"prompt_token_ids": [rng.randrange(1, 2000) for _ in range(PROMPT)]},
                               params)
    while llm.stats.decode_tokens < 4 * batch:  # the prompts (in chunks, for stage 10's budget), a few decodes
        llm.engine.step()
    clock.update(dict.fromkeys(clock, 0.0))
    step_seconds = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        outputs = llm.engine.step()
        step_seconds += time.perf_counter() - start
        assert not outputs, "not a steady decode step"  # none finished
    ms = {key: 1000 * seconds / steps for key, seconds in clock.items()}
    step_ms = 1000 * step_seconds / steps
    # where the time outside the forward goes: the scheduler, the runner's inputs, the sampler, the rest
    # (outputs, counters, bookkeeping); the runner's time includes the forward, which is taken out
    return {"step_ms": step_ms, "forward_ms": ms["forward"], "outside_ms": step_ms - ms["forward"],
            "outside_share": 1 - clock["forward"] / step_seconds, "schedule_ms": ms["schedule"],
            "inputs_ms": ms["runner"] - ms["forward"], "sample_ms": ms["sample"],
            "rest_ms": step_ms - ms["runner"] - ms["schedule"] - ms["sample"]}


def main() -> None:
    parser = make_parser(__doc__, quick="16 decode steps and one run (default: 200 and 5)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: the free cores)")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    threads = apply_threads(args.threads)
    steps, repeats = (16, 1) if args.quick else (200, 5)
    load_before = os.getloadavg()[0]
    print(f"tiny model, CPU ({platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores), "
          f"{threads} torch thread(s), load {load_before:.2f}; {steps} decode steps, median of {repeats}")
    rows = []
    for batch in (16, 64):
        for engine, (cls, options) in ENGINES.items():
            runs = [run(cls, options, batch, steps, seed) for seed in range(repeats)]
            row = {"engine": engine, "batch": batch, "threads": threads,
                   **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
            rows.append(row)
            print(f"batch {batch:>3} {engine:<14} step {row['step_ms']:6.2f} ms, forward {row['forward_ms']:6.2f} ms, "
                  f"outside {row['outside_ms']:5.2f} ms ({100 * row['outside_share']:4.1f}% of the step): "
                  f"schedule {row['schedule_ms']:.2f}, inputs {row['inputs_ms']:.2f}, sample {row['sample_ms']:.2f}, "
                  f"rest {row['rest_ms']:.2f} ms")
    load_after = os.getloadavg()[0]
    (results_dir / "step_overhead.json").write_text(json.dumps(
        {"model": "tiny", "device": "cpu", "cores": len(os.sched_getaffinity(0)), "threads": threads,
         "torch_threads": torch.get_num_threads(), "load_before": load_before, "load_after": load_after,
         "decode_steps": steps, "repeats": repeats, "rows": rows}, indent=2))
    by = {(r["engine"], r["batch"]): r for r in rows}
    print("outside the forward, stage 7 -> stage 10 -> stage 10 async: " + ", ".join(
        f"batch {b} " + " -> ".join(f"{by[e, b]['outside_ms']:.2f} ms ({100 * by[e, b]['outside_share']:.0f}%)"
                                    for e in ENGINES) for b in (16, 64)))


if __name__ == "__main__":
    main()
