"""How much of a decode step is spent outside the model's forward: stage 7 vs stage 10.

Stage 7's runner rebuilds every step's inputs (token ids, positions, slot mapping, block
tables) from Python lists of every running sequence; stage 10 keeps a persistent
``InputBatch`` and only writes what changed. The point of the persistent batch is the time
around the forward pass, so this measures exactly that: with 16 and 64 requests in steady
decode on the tiny model, the wall time of ``engine.step()`` and, inside it, the time
of the model's own ``forward`` and ``compute_logits`` (wrapped here, from the outside), each
summed over the decode steps of a run; the share outside the forward is ``1 - forward /
step``, split into the scheduler's ``schedule``, the runner's inputs (its call less the
forward), the sampler, and the rest (outputs and counters), the median of 5 runs of 200
steps (one of 16 with --quick). The requests ask for their outputs when they finish
(``FINAL_ONLY``), as ``LLM.generate`` does. The thread count and the machine's load are recorded.

Stage 10 runs twice: stepping synchronously, and with async scheduling, vLLM's batch queue:
step N + 1 is scheduled and launched before step N's tokens are read, and N's outputs are
processed after that launch. On a CPU every call runs to its end, so nothing overlaps: the
parts are the same work in another order, and what the batch queue costs shows.

On a GPU (``--device cuda``, the default where there is one) the engine runs in bfloat16
(``--dtype``) with stage 5's Triton kernels. Its calls return once their kernels are queued, so
the decode steps are timed between two ``torch.cuda.synchronize()``, and the forward's timer
synchronizes before and after each forward: its time is that of the forward's kernels, not of
their launch (else the wait for them would show up in the sampler, which reads the tokens back).
Those two waits per step take away a little of the overlap of host and device, so a measured
step is a little longer than an unmeasured one.

Writes bench/results/step_overhead.json (bench/results/quick/ with --quick; on a GPU,
bench/results/gpu/ and gpu/quick/); the last line is the headline.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time

import torch
from harness import add_device_arguments, dtype_for, environment, make_parser, results_dir_for, synchronize

from minipaged import LLM, RequestOutputKind, SamplingParams
from minipaged.common.threads import apply_threads

PROMPT = 16
ENGINES = {"stage 7": (LLM, {"stage": 7}), "stage 10": (LLM, {"stage": 10}),
           "stage 10 async": (LLM, {"stage": 10, "async_scheduling": True})}


class Timed:
    """Replaces one method of an instance with a timed call to the original; with ``device`` (a
    GPU), the device is synchronized before and after the call, so that its kernels are timed too."""

    def __init__(self, fn, clock: dict, key: str, device: torch.device | None = None) -> None:
        self.fn, self.clock, self.key, self.device = fn, clock, key, device

    def __call__(self, *args, **kwargs):
        if self.device is not None:
            synchronize(self.device)
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            if self.device is not None:
                synchronize(self.device)
            self.clock[self.key] += time.perf_counter() - start


def run(llm_class, options: dict, batch: int, steps: int, seed: int, device: torch.device, dtype: str) -> dict:
    gpu = device.type == "cuda"
    llm = llm_class("tiny", max_num_seqs=batch, num_gpu_blocks=1024, max_model_len=512, device=device, dtype=dtype,
                    attention_backend="triton" if gpu else "ref", **options)
    clock = dict.fromkeys(("forward", "schedule", "runner", "sample"), 0.0)
    runner = llm.engine.runner
    # Only the forward waits for the device; the sampler waits anyway, when it reads its tokens back.
    wait = device if gpu else None
    timed = [(llm.model, "forward", "forward", wait), (llm.model, "compute_logits", "forward", wait),
             (llm.engine.scheduler, "schedule", "schedule", None),
             (llm.engine.sampler, "sample_async", "sample", None),
             (runner, "execute_model" if hasattr(runner, "execute_model") else "execute", "runner", None)]
    for obj, name, key, sync in timed:  # instance attributes win over the class's methods
        setattr(obj, name, Timed(getattr(obj, name), clock, key, sync))
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # as LLM.generate asks
    for i in range(batch):
        llm.engine.add_request(str(i), {"prompt_token_ids": [rng.randrange(1, 2000) for _ in range(PROMPT)]},
                               params)
    while llm.stats.decode_tokens < 4 * batch:  # the prompts (in chunks, for stage 10's budget), a few decodes
        llm.engine.step()
    clock.update(dict.fromkeys(clock, 0.0))
    synchronize(device)
    start = time.perf_counter()  # the steps timed together: on a GPU, a wait after each would end its overlap
    for _ in range(steps):
        outputs = llm.engine.step()
        assert not outputs, "not a steady decode step"  # none finished
    synchronize(device)
    step_seconds = time.perf_counter() - start
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
    add_device_arguments(parser)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    results_dir = results_dir_for(args)
    threads = apply_threads(args.threads)
    device, dtype = torch.device(args.device), dtype_for(args)
    steps, repeats = (16, 1) if args.quick else (200, 5)
    load_before = os.getloadavg()[0]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"tiny model, {dtype}, {where} (host: {platform.processor() or platform.machine()}, "
          f"{len(os.sched_getaffinity(0))} cores), {threads} torch thread(s), load {load_before:.2f}; "
          f"{steps} decode steps, median of {repeats}")
    rows = []
    for batch in (16, 64):
        for engine, (cls, options) in ENGINES.items():
            runs = [run(cls, options, batch, steps, seed, device, dtype) for seed in range(repeats)]
            row = {"engine": engine, "batch": batch, "threads": threads,
                   **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
            rows.append(row)
            print(f"batch {batch:>3} {engine:<14} step {row['step_ms']:6.2f} ms, forward {row['forward_ms']:6.2f} ms, "
                  f"outside {row['outside_ms']:5.2f} ms ({100 * row['outside_share']:4.1f}% of the step): "
                  f"schedule {row['schedule_ms']:.2f}, inputs {row['inputs_ms']:.2f}, sample {row['sample_ms']:.2f}, "
                  f"rest {row['rest_ms']:.2f} ms")
    load_after = os.getloadavg()[0]
    (results_dir / "step_overhead.json").write_text(json.dumps(
        {"model": "tiny", "device": args.device, "dtype": dtype, "environment": environment(device),
         "cores": len(os.sched_getaffinity(0)), "threads": threads,
         "torch_threads": torch.get_num_threads(), "load_before": load_before, "load_after": load_after,
         "decode_steps": steps, "repeats": repeats, "rows": rows}, indent=2))
    by = {(r["engine"], r["batch"]): r for r in rows}
    print("outside the forward, stage 7 -> stage 10 -> stage 10 async: " + ", ".join(
        f"batch {b} " + " -> ".join(f"{by[e, b]['outside_ms']:.2f} ms ({100 * by[e, b]['outside_share']:.0f}%)"
                                    for e in ENGINES) for b in (16, 64)))


if __name__ == "__main__":
    main()
