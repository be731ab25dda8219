"""How much load does paged memory hold before latency explodes? (the vLLM paper's Figure 12)

`minipaged serve`'s application runs in this process (uvicorn, on a free loopback port) over
the tiny model; a load generator sends requests over HTTP, streaming, with Poisson arrivals
at increasing rates: ShareGPT-like and Alpaca-like lengths (the paper's means, scaled to the
model's 512 positions), each generating exactly its length. Four memory managers share one
KV budget, small enough that memory, not compute, is the limit:

* paged: the engine as it is (stage 6's scheduler over blocks, preemption by recomputation);
* Orca-style contiguous reservation, with stage 0's policies: ``max`` (a slab of
  ``max_model_len``), ``pow2`` (the next power of two of prompt + output), ``oracle`` (exactly
  prompt + output). A request is admitted, first come first served, only when stage 0's
  first-fit arena has a hole for its slab; it keeps the slab until it finishes. The same
  engine then runs it (the reservation only decides admission), so the comparison is
  memory management alone.

Reported per rate: normalized latency (mean of end-to-end latency / output tokens), and the
50th and 99th percentiles of time to first token and of inter-token latency. A system
*holds* a rate while its normalized latency stays under 5 times the paged engine's at the
lowest rate. Writes bench/results/serving.json and .png; the last line is the headline.
``--plot-only`` redraws the .png from the saved .json without measuring anything.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from collections import deque
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import httpx  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import uvicorn  # noqa: E402
from harness import make_parser, results_dir_for  # noqa: E402

from minipaged import LLM  # noqa: E402
from minipaged.common.threads import apply_threads  # noqa: E402
from minipaged.perf.simulate import synthetic_requests  # noqa: E402
from minipaged.serving import build_app  # noqa: E402
from minipaged.stage0_contiguous import ContiguousKVCache  # noqa: E402
from minipaged.stage7_engine import LLMEngine  # noqa: E402

MAX_LEN, BLOCKS, BLOCK_SIZE = 512, 96, 16  # 1,536 token slots: three max-length requests
TRACES = {"ShareGPT": (161.31, 337.99), "Alpaca": (19.31, 58.45)}
PAPER = "vLLM holds 1.7-2.7x the rate of Orca (oracle) and 2.7-8x Orca (max) on ShareGPT"


class ReservingEngine(LLMEngine):
    """Orca-style admission in front of the engine: a request enters the scheduler only when a
    contiguous slab for its reservation fits stage 0's arena; the slab is freed when it ends."""

    def __init__(self, engine: LLMEngine, policy: str, num_slots: int, max_model_len: int) -> None:
        super().__init__(engine.scheduler, engine.runner, engine.sampler, tokenizer=engine.tokenizer,
                         eos_token_ids=engine.eos_token_ids, vocab_size=engine.vocab_size)
        self.arena = ContiguousKVCache(num_slots, max_model_len, policy, num_layers=0)
        self.held: deque = deque()  # checked, not yet admitted: (request_id, token ids, params)

    def add_request(self, request_id, prompt, params):
        _, ids = self.check(request_id, prompt, params)
        if self.arena.reservation(len(ids), params.max_tokens) > self.arena.num_slots:
            raise ValueError("this request's slab can never fit")
        self.held.append((request_id, ids, params))

    def abort_request(self, request_id) -> None:
        self.held = deque(h for h in self.held if h[0] != request_id)
        if request_id in self.arena.slabs:
            self.arena.free(request_id)
        super().abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.held) or super().has_unfinished_requests()

    def step(self):
        while self.held and self.arena.can_allocate(len(self.held[0][1]), self.held[0][2].max_tokens):
            request_id, ids, params = self.held.popleft()  # first come, first served
            self.arena.allocate(request_id, len(ids), params.max_tokens)
            super().add_request(request_id, {"prompt_token_ids": ids}, params)
        outputs = super().step() if super().has_unfinished_requests() else []
        for output in outputs:
            if output.finished:
                self.arena.free(output.request_id)
        return outputs


def start(policy: str):
    llm = LLM("tiny", scheduler="v0", num_gpu_blocks=BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_LEN,
              max_num_seqs=256)
    if policy != "paged":
        llm.engine = ReservingEngine(llm.engine, policy, BLOCKS * BLOCK_SIZE, MAX_LEN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(llm, max_waiting=10_000), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return server, url
        except httpx.HTTPError:
            time.sleep(0.05)


async def one(client, url, prompt, output_len, delay, record):
    await asyncio.sleep(delay)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    sent, times = time.perf_counter(), []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                times.append(time.perf_counter())
    record.append({"latency": times[-1] - sent, "ttft": times[0] - sent, "tokens": output_len,
                   "itl": [b - a for a, b in zip(times, times[1:], strict=False)]})


async def load(url, requests, prompts, rate):
    """Poisson arrivals at ``rate`` requests per second (the trace's gaps, rescaled)."""
    record = []
    gaps = [b.arrival - a.arrival for a, b in zip(requests, requests[1:], strict=False)]
    mean_gap = statistics.mean(gaps) if gaps and statistics.mean(gaps) > 0 else 1
    clock, delays = 0.0, [0.0]
    for gap in gaps:
        clock += gap / mean_gap / rate
        delays.append(clock)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        await asyncio.gather(*(one(client, url, p, r.output_len, d, record)
                               for r, p, d in zip(requests, prompts, delays, strict=True)))
    itl = sorted(x for r in record for x in r["itl"])
    ttft = sorted(r["ttft"] for r in record)
    pick = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0  # noqa: E731
    return {"normalized_latency": statistics.mean(r["latency"] / r["tokens"] for r in record),
            "ttft_p50": pick(ttft, 0.5), "ttft_p99": pick(ttft, 0.99),
            "itl_p50": pick(itl, 0.5), "itl_p99": pick(itl, 0.99)}


def plot(data: dict, path: Path) -> None:
    """Normalized latency against the request rate, one panel per trace, from the saved results."""
    results, held = data["results"], data["held"]
    fig, axes = plt.subplots(1, len(results), figsize=(3.6 * len(results), 3.6), squeeze=False, sharey=True,
                             layout="constrained")
    for ax, (name, by_policy) in zip(axes[0], results.items(), strict=True):
        for policy, rows in by_policy.items():
            rates = sorted(rows, key=float)  # keys are strings once read back from the JSON file
            ax.plot([float(r) for r in rates], [1e3 * rows[r]["normalized_latency"] for r in rates], "o-", ms=4,
                    label="paged" if policy == "paged" else f"Orca ({policy})")
        ax.axhline(held[name]["threshold_ms_per_token"], color="#999", lw=1, ls="--",
                   label="5 × paged at the lowest rate")
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s)", fontsize=11)
        ax.set_title(f"{name}-like", fontsize=12)
        ax.tick_params(labelsize=10)
    axes[0][0].set_ylabel("normalized latency (ms/token)", fontsize=11)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=10, frameon=False)
    fig.suptitle(f"tiny model, {data['blocks']} blocks of {data['block_size']} tokens", fontsize=11)
    fig.savefig(path, dpi=200)
    plt.close(fig)


def headline(held: dict) -> str:
    return "rates held under the latency threshold: " + "; ".join(
        f"{name}: paged {h['paged']}, oracle {h['oracle']}, pow2 {h['pow2']}, max {h['max']} req/s"
        for name, h in held.items()) + f" (paper: {PAPER})"


def main() -> None:
    parser = make_parser(__doc__, quick="one trace, fewer requests and rates")
    parser.add_argument("--threads", type=int,
                        help="torch CPU threads, the same for every policy (default: the free cores)")
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw the plot from the saved results (bench/results/serving.json), measuring nothing")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    if args.plot_only:
        data = json.loads((results_dir / "serving.json").read_text())
        plot(data, results_dir / "serving.png")
        print(headline(data["held"]))
        return
    threads = apply_threads(args.threads)  # one process: every policy runs on the same threads
    print(f"{threads} torch thread(s) for every policy", flush=True)
    traces = ["ShareGPT"] if args.quick else list(TRACES)
    rates = {"ShareGPT": [2, 4, 8, 16] if args.quick else [2, 4, 8, 12, 16, 24, 32, 48],
             "Alpaca": [8, 16, 32, 64, 96, 128, 192]}
    policies = ["paged", "oracle", "pow2", "max"]
    scale = MAX_LEN / 2048
    results: dict = {}
    for name in traces:
        mean_prompt, mean_output = TRACES[name]
        requests = synthetic_requests(40 if args.quick else 120, mean_prompt=mean_prompt * scale,
                                      mean_output=mean_output * scale, max_len=MAX_LEN, rate=1.0, seed=0)
        prompts = [[1 + (7 * i + j) % 2000 for j in range(r.prompt_len)] for i, r in enumerate(requests)]
        for policy in policies:
            server, url = start(policy)
            try:
                for rate in rates[name]:
                    row = asyncio.run(load(url, requests, prompts, rate))
                    results.setdefault(name, {}).setdefault(policy, {})[rate] = row
                    print(f"{name:<9} {policy:<7} {rate:>4} req/s: {1e3 * row['normalized_latency']:8.1f} ms/token, "
                          f"TTFT p50/p99 {1e3 * row['ttft_p50']:7.1f}/{1e3 * row['ttft_p99']:7.1f} ms, "
                          f"ITL p50/p99 {1e3 * row['itl_p50']:5.1f}/{1e3 * row['itl_p99']:6.1f} ms", flush=True)
            finally:
                server.should_exit = True
                time.sleep(0.5)
    held = {}
    for name, by_policy in results.items():
        threshold = 5 * by_policy["paged"][min(by_policy["paged"])]["normalized_latency"]
        held[name] = {policy: max([rate for rate, row in rows.items() if row["normalized_latency"] <= threshold],
                                  default=0) for policy, rows in by_policy.items()}
        held[name]["threshold_ms_per_token"] = 1e3 * threshold
    saved = {"blocks": BLOCKS, "block_size": BLOCK_SIZE, "max_len": MAX_LEN, "threads": threads,
             "results": results, "held": held, "paper": PAPER}
    (results_dir / "serving.json").write_text(json.dumps(saved, indent=2))
    data = json.loads((results_dir / "serving.json").read_text())  # as --plot-only reads it
    plot(data, results_dir / "serving.png")
    print(headline(held))


if __name__ == "__main__":
    main()
