"""How much faster does a paged, continuously batched engine serve than transformers and CTranslate2?

All run the same model on the same machine in the same process: minipaged's ``LLM`` (stage 10's
by default, ``--engine stage7`` for the lower one; ``--async-scheduling`` where stage 10 has it),
Hugging Face ``generate`` in static batches, transformers' own continuous batching (its
``ContinuousBatchingManager``, the engine behind ``generate_batch``, with paged attention), and
CTranslate2, a C++ inference engine, on its own float32 conversion of the model (on the CPU only).

Each request generates exactly its output length (end tokens are ignored everywhere). Two
workloads (``--workload``):

``sharegpt`` (the default): ShareGPT-like prompt and output lengths, log-normal with a long tail
(prompts of 2 tokens at least), on one of two models (``--model``):

* ``tiny`` (the default): the 4-layer Llama that ships with minipaged; 128 requests (64 with
  --quick), the paper's means (161 and 338 tokens of 2048) scaled to its 512 positions. The model
  is so small that every engine is bound by its own per-operation overhead.
* ``qwen2.5-0.5b-shaped``: Qwen2.5-0.5B's shape (24 layers, hidden 896, vocabulary 151,936) with
  random weights, built once under build/models/ (bench/peer_models.py); 32 requests (8 with
  --quick), mean prompt 8 and output 8 tokens, at most 48 together, so that a full run takes about
  a quarter of an hour on one CPU thread. Here the forward pass dominates.

``steady``, meant for a GPU: nano-vllm's throughput workload (its bench.py; bench/workloads.py
draws the same requests): 256 requests, prompt and output lengths each uniform in 100..1024
tokens of random ids, all served in one batch of 256 on the Qwen2.5-0.5B-shaped model. Most of
the run decodes a full batch: the steady state, not the tail. For scale, not measured here:
nano-vllm's README reports, for its own Qwen3-0.6B (28 layers, hidden 1024) on an RTX 4070 Laptop
(8 GB), 1,434 generated tokens/s for nano-vllm and 1,362 for vLLM on this workload. A full run
takes about a quarter of an hour on an H200 (each repeat: minipaged about 20 s, ``generate`` 90 s,
transformers' continuous batching 140 s). On the CPU it is far too big: ``--quick`` shrinks it to
8 requests of 16..64 tokens each way, a check that it runs, not a measurement.

Static ``generate`` serves the requests in batches of the same size as minipaged's
``max_num_seqs``, left-padded, each batch running until its longest request is done, as it must;
transformers' continuous batching gets the same number of requests per batch. CTranslate2 batches
statically too: it sorts the requests by prompt length and cuts them into batches of that size;
a request that has its tokens leaves its batch (a callback stops it at its own length), but no
waiting request takes its place, so each batch runs until its longest request is done. It also
forwards a batch's prompts at once only as far as the shortest of them goes; the rest of each
longer prompt takes one decoding step a token. minipaged's KV cache holds every running request
at its longest (no preemption), as the peers' caches do.

Throughput counts the generated tokens each request asked for, per second of wall time, the
median of 3 runs of each side, the four sides taken in turn in each repeat (one run with
--quick); every run's figure, the thread count of each side and the load average before and after
are kept in the results. Every side is warmed up first, greedily like the timed runs, and each of
minipaged's runs is a fresh engine: its prefix cache (always on in stage 10) would otherwise serve
the prompts of the run before. The greedy outputs are compared with transformers' continuous
batching and with CTranslate2 (how many are token for token the same). Also reported: the share of
minipaged's wall time spent outside the model's forward pass (scheduling, block bookkeeping,
inputs, sampling).

On a GPU (``--device cuda``, the default where there is one) every side but CTranslate2 runs on
it, in bfloat16 (``--dtype``), minipaged with stage 5's Triton kernels; each timed run starts and
ends with ``torch.cuda.synchronize()``, and the forward's share is the device's time (CUDA events
around each forward, read after the run, so that measuring it makes the host wait for nothing).

Caveats: on the CPU everything runs in float32, where a side's runs spread on a shared machine:
read the figures as ratios measured side by side, not as absolute speeds. With the 0.5B model's
random weights a greedy choice can be a close call, so an output may differ between engines that
round differently (in bfloat16, often). If CTranslate2 cannot be installed (``pip install
'.[bench]'``) or cannot run the model, the other three sides still run and the reason is in the
results.

Writes bench/results/throughput.json and .png for the tiny model, throughput_<model>.json and .png
for another, throughput_steady.json and .png for the steady workload; a GPU's run writes under
bench/results/gpu/ instead, with the GPU's name and the versions that measured it. The last line
is the ratios. ``--plot-only`` redraws the .png from the saved .json without measuring anything.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()

from harness import add_device_arguments, dtype_for, environment, make_parser, results_dir_for, synchronize  # noqa: E402
from peer_models import WORKLOADS, ctranslate2_model, model_path  # noqa: E402
from workloads import STEADY, STEADY_QUICK, steady  # noqa: E402

from minipaged import LLM  # noqa: E402
from minipaged.common.config import EngineConfig  # noqa: E402
from minipaged.common.threads import apply_threads  # noqa: E402
from minipaged.models import resolve_dtype  # noqa: E402
from minipaged.perf.simulate import synthetic_requests  # noqa: E402
from minipaged.stage7_engine import SamplingParams  # noqa: E402

ENGINES = {"stage10": 10, "stage7": 7}  # the engine as of each stage
HAS_ASYNC_SCHEDULING = "async_scheduling" in EngineConfig.__dataclass_fields__
SIDES = ("minipaged", "transformers", "transformers_cb", "ctranslate2")
BLOCK_SIZE = 16


def hf_static_batches(model, prompts, outputs, batch_size, pad_id) -> float:
    """Seconds to serve every request with transformers, in padded batches of ``batch_size``."""
    synchronize(model.device)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, lengths = prompts[i : i + batch_size], outputs[i : i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        steps = max(lengths)  # the batch runs until its longest request is done
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                           do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    synchronize(model.device)
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
        synchronize(model.device)
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
        synchronize(model.device)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return seconds, [list(results[i]) for i in ids]


def load_ctranslate2(name: str, path: Path, threads: int):
    """CTranslate2's generator on its conversion of the model, and its vocabulary (token strings by
    id, which is what it takes as input); or the reason it cannot run, as a string."""
    try:
        import ctranslate2

        directory = ctranslate2_model(name, path)
        vocabulary = json.loads((directory / "vocabulary.json").read_text())
        if len(set(vocabulary)) != len(vocabulary):
            raise ValueError("its vocabulary names two ids alike, so token strings cannot stand for ids")
        generator = ctranslate2.Generator(str(directory), device="cpu", compute_type="float32",
                                          intra_threads=threads, inter_threads=1)
        generator.generate_batch([vocabulary[1:4]], max_length=2, end_token=[])  # warm up, not timed
        return generator, vocabulary
    except Exception as e:  # whatever the failure, the other sides still run, and say why
        return f"{type(e).__name__}: {e}"


def ctranslate2_batches(generator, vocabulary, prompts, outputs, batch_size) -> tuple[float, list[list[int]]]:
    """Seconds to serve every request with CTranslate2's ``generate_batch``, and its tokens.

    ``max_length`` is one number for all the requests, so each stops at its own output length
    through the callback, which CTranslate2 calls for every generated token (``batch_id`` is the
    request's index in the list) and which ends that request when it returns True. ``end_token=[]``:
    no token ends a request early."""
    starts = [[vocabulary[i] for i in p] for p in prompts]
    made = [0] * len(prompts)

    def stop_at_length(step) -> bool:
        made[step.batch_id] += 1
        return made[step.batch_id] >= outputs[step.batch_id]

    start = time.perf_counter()
    results = generator.generate_batch(starts, max_batch_size=batch_size, max_length=max(outputs), sampling_topk=1,
                                       include_prompt_in_result=False, end_token=[], callback=stop_at_length)
    seconds = time.perf_counter() - start
    return seconds, [list(r.sequences_ids[0]) for r in results]


class ForwardTimer:
    """Wraps the model inside minipaged's runner and adds up the seconds of its forward passes.

    On a GPU a forward returns once its kernels are queued, so a host clock would time their launch:
    there each call is bracketed by two CUDA events, read by ``seconds`` once the run is over and
    synchronized. Recording an event makes the host wait for nothing, so the timed run is not slowed."""

    def __init__(self, model, device: torch.device):
        self.model, self.gpu = model, device.type == "cuda"
        self.host_seconds = 0.0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def timed(self, fn, *args):
        if self.gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return fn(*args)
            finally:
                end.record()
                self.events.append((start, end))
        start_s = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.host_seconds += time.perf_counter() - start_s

    def __call__(self, *args):
        return self.timed(self.model, *args)

    def compute_logits(self, hidden):
        return self.timed(self.model.compute_logits, hidden)

    @property
    def seconds(self) -> float:
        """The forward passes' seconds; on a GPU, read after the device is synchronized."""
        return self.host_seconds + sum(start.elapsed_time(end) for start, end in self.events) / 1e3


def warm_up_prompts(max_len: int) -> list[dict]:
    """The untimed warm-up's requests: a short prompt, and one as long as ``max_len`` leaves room
    for (past 512 tokens, stage 5's ``PARTITION_SIZE``, where it can be), so that on a GPU both of
    stage 5's decode kernels (``use_v1`` picks v2 for a few long sequences) and its prefill kernel
    are compiled before the timed runs. Token 1 over and over: no timed prompt shares a block with
    it in the prefix cache."""
    return [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [1] * max(3, max_len - 8)}]


def run_minipaged(args, path: Path, batch: int, max_len: int, prompts, outputs) -> dict:
    """One timed run of minipaged's ``LLM`` on a fresh engine, warmed up greedily first: its
    seconds, its share of them outside the forward, its steps and its tokens. A fresh engine, since
    the prefix cache (on by default in stage 10) would serve the run before's prompts again. Its KV
    cache holds every running request at its longest: no preemption, as in the peers' caches."""
    device = torch.device(args.device)
    options = {"async_scheduling": True} if args.async_scheduling else {}
    options["enforce_eager"] = args.enforce_eager
    llm = LLM(str(path), stage=ENGINES[args.engine], max_num_seqs=batch, max_model_len=max_len, block_size=BLOCK_SIZE,
              num_gpu_blocks=batch * -(-max_len // BLOCK_SIZE), device=args.device, dtype=dtype_for(args),
              attention_backend="triton" if device.type == "cuda" else "ref", **options)
    llm.generate(warm_up_prompts(max_len), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    timer = llm.engine.runner.model = ForwardTimer(llm.engine.runner.model, device)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs]
    steps_before = llm.stats.steps
    synchronize(device)
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    synchronize(device)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "outside": 1 - timer.seconds / seconds, "steps": llm.stats.steps - steps_before,
            "tokens": [r.outputs[0].token_ids for r in results]}


def sharegpt_requests(model: str, quick: bool, vocab: int) -> tuple[list[list[int]], list[int], dict[str, Any]]:
    """The model's ShareGPT-like requests (peer_models.WORKLOADS): prompts, output lengths, and
    what the results say of the workload."""
    workload = WORKLOADS[model]
    max_len = workload["max_len"]
    trace = synthetic_requests(workload["requests"][1 if quick else 0], mean_prompt=workload["mean_prompt"],
                               mean_output=workload["mean_output"], max_len=max_len, seed=0)
    # The prompts' ids are drawn on the CPU, from a seeded CPU generator: the same prompts on every device.
    # Two prompt tokens at least: CTranslate2's generate_batch (4.8) takes a batch whose shortest prompt has one
    # token as if include_prompt_in_result were True, and returns the prompts' tokens as output.
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (max(2, r.prompt_len),), generator=gen).tolist() for r in trace]
    outputs = [min(r.output_len, max_len - len(p)) for r, p in zip(trace, prompts, strict=True)]
    return prompts, outputs, {"name": "sharegpt", "mean_prompt": workload["mean_prompt"],
                              "mean_output": workload["mean_output"], "max_len": max_len, "min_prompt": 2}


def steady_requests(quick: bool) -> tuple[list[list[int]], list[int], dict[str, Any]]:
    """nano-vllm's steady workload (workloads.steady), or its small --quick version."""
    workload = STEADY_QUICK if quick else STEADY
    prompts, outputs = steady(workload.requests, workload.lengths, seed=0)
    return prompts, outputs, {"name": "steady", "lengths": list(workload.lengths), "max_len": workload.max_len,
                              "source": "nano-vllm's bench.py"}


def results_name(model: str, workload: str = "sharegpt") -> str:
    if workload == "steady":
        return "throughput_steady"
    return "throughput" if model == "tiny" else f"throughput_{model}"


def plot(data: dict, path: Path) -> None:
    """Generated tokens per second of each engine, per batch size, from the saved results."""
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 3.8), layout="constrained")
    xs = range(len(rows))
    bars = [("minipaged", "minipaged_tps", "#1b9e77"),
            ("transformers, continuous batching", "transformers_cb_tps", "#7570b3"),
            ("CTranslate2 (static batches)", "ctranslate2_tps", "#d95f02"),
            ("transformers generate", "transformers_tps", "#999999")]
    bars = [b for b in bars if any(r.get(b[1]) is not None for r in rows)]  # no CTranslate2 bars if it did not run
    width = 0.8 / len(bars)
    for k, (label, key, color) in enumerate(bars):
        ax.bar([x + width * (k - (len(bars) - 1) / 2) for x in xs], [r.get(key) or 0 for r in rows], width,
               label=label, color=color)
    ax.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows], fontsize=11)
    ax.tick_params(axis="y", labelsize=10)
    ax.set_ylabel("generated tokens / s", fontsize=11)
    where = data["device"]
    if where == "cuda" and data.get("environment"):
        where = f"{data['environment']['device_name']}, {data.get('dtype', 'bfloat16')}"
    workload = " (steady)" if data.get("workload", {}).get("name") == "steady" else ""
    ax.set_title(f"{data['model']} model, {data['requests']} requests{workload}, {where}", fontsize=11)
    fig.legend(loc="outside lower center", ncol=2, fontsize=9.5, frameon=False)  # below: it covers no bar
    fig.savefig(path, dpi=200)
    plt.close(fig)


def headline(rows: list[dict]) -> str:
    def ratios(r: dict) -> str:
        ct2 = f" / {r['ratio_ct2']:.1f}x" if r.get("ratio_ct2") is not None else ""
        return f"{r['ratio']:.1f}x / {r['ratio_cb']:.1f}x{ct2} at batch {r['batch']}"

    peers = "generate / continuous batching" + (" / CTranslate2" if rows and rows[0].get("ratio_ct2") else "")
    return f"minipaged's throughput vs transformers {peers}: " + ", ".join(map(ratios, rows))


def parse_args():
    parser = make_parser(__doc__, quick="fewer requests and one run (tiny: 64, not 128; the 0.5B model: 8, not 32; "
                                        "steady: 8 requests of 16..64 tokens, not 256 of 100..1024)")
    parser.add_argument("--workload", default="sharegpt", choices=("sharegpt", "steady"),
                        help="sharegpt: log-normal lengths, a long tail (default); steady: nano-vllm's uniform "
                             "100..1024, for a GPU")
    parser.add_argument("--model", choices=sorted(WORKLOADS),
                        help="sharegpt's model (default: tiny); steady runs on qwen2.5-0.5b-shaped")
    parser.add_argument("--engine", default="stage10", choices=sorted(ENGINES), help="minipaged's LLM (stage10)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs for minipaged's decode steps (on CUDA they replay one by default)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="stage 10's async_scheduling=True (schedule a step while the one before runs)")
    parser.add_argument("--batch", type=int, help="max_num_seqs and the peers' batch size (default: 16, 32, 64; "
                                                  "steady: every request at once)")
    add_device_arguments(parser)
    parser.add_argument("--threads", type=int, help="CPU threads for every side (default: the free cores)")
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw the plot from the saved results (bench/results/throughput[_<model>].json), "
                             "measuring nothing")
    args = parser.parse_args()
    if args.workload == "steady" and args.model not in (None, STEADY.model):
        parser.error(f"--workload steady runs on {STEADY.model}")
    args.model = args.model or (STEADY.model if args.workload == "steady" else "tiny")
    if args.async_scheduling and (args.engine != "stage10" or not HAS_ASYNC_SCHEDULING):
        parser.error("--async-scheduling needs stage 10's LLM with an async_scheduling option")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    return args


def main() -> None:
    args = parse_args()
    results_dir = results_dir_for(args)
    name = results_name(args.model, args.workload)
    if args.plot_only:
        data = json.loads((results_dir / f"{name}.json").read_text())
        plot(data, results_dir / f"{name}.png")
        print(headline(data["rows"]))
        return
    load_before = os.getloadavg()
    threads = apply_threads(args.threads)  # one count for every side: minipaged, transformers, CTranslate2
    repeats = 1 if args.quick else 3
    dtype = dtype_for(args)
    torch.manual_seed(0)
    path = model_path(args.model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype)).to(args.device).eval()
    if args.workload == "steady":
        prompts, outputs, workload = steady_requests(args.quick)
    else:
        prompts, outputs, workload = sharegpt_requests(args.model, args.quick, hf.config.vocab_size)
    max_len = workload["max_len"]
    wanted = sum(outputs)
    print(f"{args.model}, {workload['name']} workload: {len(prompts)} requests, mean prompt "
          f"{sum(map(len, prompts)) / len(prompts):.0f}, mean output {wanted / len(prompts):.0f} tokens, "
          f"max {max_len}; "
          f"{args.device} ({environment(args.device)['device_name']}), {dtype}, {threads} thread(s) for every side; "
          f"minipaged {args.engine}{' with async scheduling' if args.async_scheduling else ''}")

    ct2 = load_ctranslate2(args.model, path, threads) if args.device == "cpu" else "runs here on the CPU only"
    ct2_error = ct2 if isinstance(ct2, str) else None
    if ct2_error:
        print(f"CTranslate2 will not run: {ct2_error}")
    if args.batch:
        batches = [args.batch]
    elif args.workload == "steady":
        batches = [len(prompts)]  # every request at once, as nano-vllm serves them (its max_num_seqs is 512)
    else:
        batches = [32] if args.quick else [16, 32, 64]
    cb_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype),
                                                                 attn_implementation="sdpa").to(args.device).eval()
    hf_static_batches(hf, [[1, 2, 3]], [2], 1, pad_id=0)  # warm up, greedy, not timed
    rows = []
    for batch in batches:
        row_load_before = os.getloadavg()
        seconds: dict[str, list[float]] = {side: [] for side in SIDES}
        outside = []
        same_ct2 = None
        for _ in range(repeats):  # the sides in turn, so that a busy spell touches each alike
            ours = run_minipaged(args, path, batch, max_len, prompts, outputs)
            seconds["minipaged"].append(ours["seconds"])
            outside.append(ours["outside"])
            steps, tokens = ours["steps"], ours["tokens"]
            assert sum(map(len, tokens)) == wanted
            seconds["transformers"].append(hf_static_batches(hf, prompts, outputs, batch, pad_id=0))
            continuous, cb_tokens = hf_continuous_batching(cb_model, prompts, outputs, batch)
            seconds["transformers_cb"].append(continuous)
            same = sum(a == b for a, b in zip(tokens, cb_tokens, strict=True))
            if not ct2_error:
                try:
                    ct2_seconds, ct2_tokens = ctranslate2_batches(*ct2, prompts, outputs, batch)
                    if sum(map(len, ct2_tokens)) != wanted:
                        raise RuntimeError(f"it generated {sum(map(len, ct2_tokens))} tokens, not {wanted}")
                    seconds["ctranslate2"].append(ct2_seconds)
                    same_ct2 = sum(a == b for a, b in zip(tokens, ct2_tokens, strict=True))
                except Exception as e:  # record why, and go on without it
                    ct2_error = f"{type(e).__name__}: {e}"
                    print(f"CTranslate2 failed, and runs no more: {ct2_error}")
                    seconds["ctranslate2"], same_ct2 = [], None
        median = {side: statistics.median(v) if v else None for side, v in seconds.items()}
        ours_s, static, continuous, ct2_time = (median[side] for side in SIDES)
        rows.append({"batch": batch, "minipaged_tps": wanted / ours_s, "transformers_tps": wanted / static,
                     "transformers_cb_tps": wanted / continuous,
                     "ctranslate2_tps": wanted / ct2_time if ct2_time else None,
                     "ratio": static / ours_s, "ratio_cb": continuous / ours_s,
                     "ratio_ct2": ct2_time / ours_s if ct2_time else None,
                     "outside_forward": statistics.median(outside),
                     "identical_to_cb": same, "identical_to_ct2": same_ct2, "engine_steps": steps, "repeats": repeats,
                     "tps_each_run": {k: [round(wanted / t, 1) for t in v] for k, v in seconds.items()},
                     "threads": {side: threads for side in SIDES},
                     "loadavg_before": row_load_before, "loadavg_after": os.getloadavg()})
        spread = "; ".join(f"{k} {min(v):.0f}-{max(v):.0f}" for k, v in rows[-1]["tps_each_run"].items() if v)
        ct2_text = (f", CTranslate2 {wanted / ct2_time:8.1f} ({ct2_time / ours_s:.1f}x; {same_ct2}/{len(tokens)} "
                    "outputs identical to minipaged's)" if ct2_time else f", CTranslate2 not run ({ct2_error})")
        print(f"batch {batch:>3}: minipaged {wanted / ours_s:8.1f} tokens/s ({steps} steps, "
              f"{100 * rows[-1]['outside_forward']:.0f}% outside the forward), generate {wanted / static:8.1f}, "
              f"transformers continuous batching {wanted / continuous:8.1f}; ratios {static / ours_s:.1f}x and "
              f"{continuous / ours_s:.1f}x; {same}/{len(tokens)} outputs identical to continuous batching" + ct2_text
              + (f" (medians of {repeats}; tokens/s ranged {spread})" if repeats > 1 else ""))
    ct2_version = None
    try:
        import ctranslate2

        ct2_version = ctranslate2.__version__
    except ImportError:
        pass
    data = {"model": args.model, "requests": len(prompts), "generated_tokens": wanted, "device": args.device,
            "dtype": dtype, "environment": environment(args.device),
            "workload": {**workload, "mean_prompt_drawn": sum(map(len, prompts)) / len(prompts),
                         "mean_output_drawn": wanted / len(prompts)},
            "minipaged_engine": args.engine, "async_scheduling": args.async_scheduling,
            "ctranslate2": {"version": ct2_version, "error": ct2_error,
                            "batching": "static: sorted by prompt length, batches of max_batch_size, a finished "
                                        "request leaves its batch and none joins"},
            "threads": threads, "repeats": repeats, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "rows": rows}
    (results_dir / f"{name}.json").write_text(json.dumps(data, indent=2))
    plot(json.loads((results_dir / f"{name}.json").read_text()), results_dir / f"{name}.png")
    print(headline(rows))


if __name__ == "__main__":
    main()
