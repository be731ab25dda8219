"""What disaggregated prefill buys running decodes when a burst of long prompts arrives (stage 14).

Eight requests are decoding when a burst of long prompts arrives. Measured, for the decodes' tokens
from the burst's arrival until every prompt of the burst has its first token: the inter-token
latency (ITL: median, 99th percentile, largest) and the burst's time to first token. Three set-ups:

* **one engine, 1 thread** — the burst's prompt chunks share the decodes' steps (V1's token budget);
* **one engine, 2 threads** — the same, given both cores of this machine;
* **producer + consumer** — two processes of 1 thread each, as the proxy runs them: the burst goes to
  the producer (``max_tokens=1``), which saves its blocks to a folder; each prompt then goes to the
  consumer, which loads its blocks, computes its last block, and decodes beside the running requests.

Beside them, the baseline measured in the same run: a decode step's time before the burst arrives.
Also the bytes moved per burst request, against layers x 2 x tokens x KV heads x head dim x dtype bytes.
What two cores can show: the consumer's steps hold no prefill, so the decodes' ITL stays near a decode
step's, while the producer works on the other core. They cannot show a network between the two
(the blocks go through a folder on one disk), nor a GPU, where a decode step is far shorter than a
prefill and the gap is larger. A synchronous connector loads in the consumer's step: that step is
longer, once per prompt, and the figure shows it.

Writes bench/results/disaggregated.json and .png (bench/results/quick/ with --quick); the last line is the headline.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time

from harness import make_parser, results_dir_for, write_json  # noqa: E402
from peer_models import model_path  # noqa: E402

from minipaged import LLM, SamplingParams
from minipaged.common.threads import apply_threads

DECODES = 8


def workload(vocab: int, burst: int, prompt_len: int) -> tuple[list[dict], list[dict]]:
    """(the running requests' prompts, the burst's long prompts), token ids inside ``vocab``."""
    running = [{"prompt_token_ids": [(13 * i + j) % (vocab - 1) + 1 for j in range(16)]} for i in range(DECODES)]
    long = [{"prompt_token_ids": [(97 * i + 7 * j) % (vocab - 1) + 1 for j in range(prompt_len)]}
            for i in range(burst)]
    return running, long


def producer_main(model: str, folder: str, sizes: dict, inbox, outbox) -> None:
    """The producer: computes each prompt it is sent (1 token), saving its blocks; answers its index."""
    apply_threads(1)
    llm = LLM(model, kv_transfer_config=connector(folder, "kv_producer"), **sizes)
    outbox.put("ready")
    prefill = SamplingParams(max_tokens=1, temperature=0.0)
    while (job := inbox.get()) is not None:
        for i, prompt in job:
            llm.engine.add_request(i, prompt, prefill)
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                if out.finished:
                    outbox.put(out.request_id)


def connector(folder: str, kv_role: str) -> dict:
    return {"kv_role": kv_role, "kv_connector_extra_config": {"shared_storage_path": folder}}


def run(engine: LLM, running: list[dict], burst: list[dict], send=None, receive=None) -> dict:
    """Decodes, then the burst (to the engine, or through ``send``/``receive`` to a producer first): the
    decodes' ITL and the burst's TTFT, in ms."""
    decode = SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    step_engine = engine.engine
    for i, prompt in enumerate(running):
        step_engine.add_request(f"d{i}", prompt, decode)
    step_engine.step()  # the decodes' prompts
    quiet = []  # the decodes' steps before the burst: the baseline
    for _ in range(6):
        start = time.perf_counter()
        step_engine.step()
        quiet.append(1000 * (time.perf_counter() - start))
    arrived = time.perf_counter()
    if send is None:
        for i, prompt in enumerate(burst):
            step_engine.add_request(i, prompt, first)
    else:
        send([(i, p) for i, p in enumerate(burst)])
    itl: list[float] = []
    ttft: dict[int, float] = {}
    last = {f"d{i}": arrived for i in range(len(running))}
    while len(ttft) < len(burst):
        if receive is not None:
            for i in receive(block=not step_engine.has_unfinished_requests()):
                step_engine.add_request(i, burst[i], first)
        for out in step_engine.step():
            now = time.perf_counter()
            if isinstance(out.request_id, str):  # a decode
                itl.append(1000 * (now - last[out.request_id]))
                last[out.request_id] = now
            elif out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = 1000 * (now - arrived)
    for request_id in [f"d{i}" for i in range(len(running))] + list(range(len(burst))):
        step_engine.abort_request(request_id)
    return {"itl_ms": itl, "ttft_ms": [ttft[i] for i in range(len(burst))], "quiet_ms": quiet}


def summary(result: dict) -> dict:
    itl = sorted(result["itl_ms"])
    return {"itl_p50_ms": statistics.median(itl), "itl_p99_ms": itl[min(len(itl) - 1, int(0.99 * len(itl)))],
            "itl_max_ms": itl[-1], "ttft_mean_ms": statistics.mean(result["ttft_ms"]),
            "ttft_max_ms": max(result["ttft_ms"]), "decode_tokens": len(itl),
            "itl_no_burst_ms": statistics.median(result["quiet_ms"])}


def disaggregated(model: str, sizes: dict, running: list[dict], burst: list[dict]) -> tuple[dict, LLM]:
    """The producer in a spawned process, the consumer here, one thread each, over a fresh folder."""
    folder = tempfile.mkdtemp(prefix="minipaged-disagg-")
    context = mp.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    producer = context.Process(target=producer_main, args=(model, folder, sizes, inbox, outbox))
    producer.start()
    try:
        apply_threads(1)
        consumer = LLM(model, kv_transfer_config=connector(folder, "kv_consumer"), **sizes)
        assert outbox.get(timeout=600) == "ready"

        def receive(block: bool) -> list[int]:
            done = [outbox.get(timeout=600)] if block else []
            while not outbox.empty():
                done.append(outbox.get())
            return done
        result = run(consumer, running, burst, send=inbox.put, receive=receive)
        inbox.put(None)
        producer.join(60)
    finally:
        if producer.is_alive():
            producer.kill()
    return result, consumer


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 3.0), layout="constrained")
    colors = {"one engine, 1 thread": "#c44e52", "one engine, 2 threads": "#dd8452",
              "producer + consumer": "#4c72b0"}
    for name, row in results.items():
        itl = sorted(row["itl_ms"])
        ax.plot([100 * (i + 1) / len(itl) for i in range(len(itl))], itl, color=colors[name], label=name)
    ax.set_yscale("log")
    ax.set_xlabel("decode tokens during the burst (%), by inter-token latency")
    ax.set_ylabel("inter-token latency (ms)")
    ax.legend(fontsize=9, frameon=False)
    fig.savefig(path)


def main() -> None:
    parser = make_parser(__doc__, quick="the tiny model, a shorter burst")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    name = "tiny" if args.quick else "qwen2.5-0.5b-shaped"
    model = str(model_path(name))
    burst_size, prompt_len = (8, 280) if args.quick else (4, 256)
    sizes = dict(block_size=16, num_gpu_blocks=512, max_model_len=512, max_num_batched_tokens=512)
    probe = LLM(model, **sizes)
    mc = probe.model_config
    running, burst = workload(mc.vocab_size, burst_size, prompt_len)
    del probe
    results = {}
    for threads in (1, 2):
        apply_threads(threads)
        results[f"one engine, {threads} thread{'s' * (threads > 1)}"] = run(LLM(model, **sizes), running, burst)
    result, consumer = disaggregated(model, sizes, running, burst)
    results["producer + consumer"] = result
    loaded = consumer.stats.kv_transfer.num_loaded_bytes / len(burst)
    tokens = (prompt_len - 1) // 16 * 16  # the full blocks before the last token's
    formula = mc.num_layers * 2 * tokens * mc.num_kv_heads * mc.head_dim * 4  # float32
    rows = {k: summary(v) for k, v in results.items()}
    for k, row in rows.items():
        print(f"{k:<22} ITL p50 {row['itl_p50_ms']:7.1f} ms  p99 {row['itl_p99_ms']:7.1f} ms  "
              f"max {row['itl_max_ms']:7.1f} ms  (no burst: {row['itl_no_burst_ms']:6.1f} ms)  "
              f"TTFT mean {row['ttft_mean_ms']:7.1f} ms")
    print(f"bytes moved per burst request: {loaded:,.0f} (formula: {formula:,})")
    write_json(results_dir / "disaggregated.json", {
        "model": name, "burst": burst_size, "prompt_len": prompt_len, "decodes": DECODES, "block_size": 16,
        "max_num_batched_tokens": 512, "summary": rows, "itl_ms": {k: v["itl_ms"] for k, v in results.items()},
        "bytes_per_request": {"measured": loaded, "formula": formula}})
    plot(results, results_dir / "disaggregated.png")
    one, split = rows["one engine, 1 thread"], rows["producer + consumer"]
    print(f"{name}: decodes' p99 inter-token latency during a burst of {burst_size} x {prompt_len}-token prompts: "
          f"one engine {one['itl_p99_ms']:.1f} ms, producer + consumer {split['itl_p99_ms']:.1f} ms "
          f"({one['itl_p99_ms'] / split['itl_p99_ms']:.1f}x lower)")


if __name__ == "__main__":
    main()
