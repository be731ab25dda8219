"""What latency and throughput does one server give as more clients stream at once?

A bounded, closed-loop load generator for ``minipaged serve``: at each concurrency level it
keeps ``C`` streaming completions in flight (a new one starts when one ends) until it has sent
``--requests-per-stream x C`` of them, over HTTP with httpx and asyncio. Every request has the
same prompt length (token ids, ``--prompt-len``) and generates exactly ``--max-tokens`` tokens
(end tokens ignored, greedy), so levels differ only in how many share each engine step.

Measured per request, from the client: time to first token (TTFT: request sent -> first
streamed chunk), inter-token latency (ITL: the gap between consecutive chunks; one chunk per
engine step, one token each), time per output token (TPOT: a request's time from its first
to its last chunk over its tokens after the first; unlike ITL, it does not care whether chunks
arrive one by one or in bursts) and end-to-end latency (sent -> last chunk); per level, p50
and p99 of each and output tokens per second of wall time.

It starts the server itself (``python -m minipaged.cli serve`` on a free loopback port, the
tiny model on this machine's CPU) unless ``--url`` names one that is already running; either
way it talks to the loopback interface only and refuses any other host. Bounded: at most 256
concurrent streams and 4,096 requests. Writes bench/results/serving_load.json and .png
(``--quick``: bench/results/quick/; other settings: bench/results/custom/, so neither
overwrites the full results); the last line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import matplotlib

matplotlib.use("Agg")
import httpx  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from harness import make_parser, results_dir_for  # noqa: E402

from minipaged.common.threads import choose_threads  # noqa: E402
from minipaged.serving.launcher import start_server  # noqa: E402

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
MAX_STREAMS, MAX_REQUESTS = 256, 4096


def loopback_url(url: str) -> str:
    """``url`` without a trailing slash; ``ValueError`` unless it is http on the loopback interface."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in LOOPBACK:
        raise ValueError(f"this load generator talks to the loopback interface only, not {url!r}")
    return url.rstrip("/")


def output_dir(args: argparse.Namespace) -> Path:
    """bench/results for the full run only: a quick run, or one with other settings, never
    overwrites the results the docs show."""
    custom = any(v is not None for v in (args.url, args.streams, args.requests_per_stream, args.prompt_len,
                                         args.max_tokens))
    return results_dir_for(args, custom, create=False)


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def start_tiny_server(max_model_len: int, threads: int, log) -> tuple[subprocess.Popen, str]:
    """``minipaged serve`` (the tiny model, ``threads`` torch threads) on a free loopback port; its
    messages go to ``log``."""
    return start_server("--max-model-len", str(max_model_len), "--max-waiting", str(MAX_STREAMS),
                        "--threads", str(threads), stdout=subprocess.DEVNULL, stderr=log)


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    sent, times = time.perf_counter(), []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]" and json.loads(line[5:]).get("choices"):
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError("the stream ended without a token")
    # ignore_eos: every request generates exactly max_tokens tokens
    return {"ttft": times[0] - sent, "e2e": times[-1] - sent, "itl": np.diff(times).tolist(), "tokens": max_tokens,
            "tpot": (times[-1] - times[0]) / max(max_tokens - 1, 1)}


async def level(url: str, streams: int, num_requests: int, prompt_len: int, max_tokens: int) -> dict:
    """``num_requests`` completions, ``streams`` of them in flight at any time."""
    prompts = [[1 + (7 * i + j) % 2000 for j in range(prompt_len)] for i in range(num_requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    records: list[dict] = []

    async def worker(client):
        while not queue.empty():
            records.append(await one(client, url, queue.get_nowait(), max_tokens))

    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(streams)))
        wall = time.perf_counter() - start
    ttft, e2e, tpot = [r["ttft"] for r in records], [r["e2e"] for r in records], [r["tpot"] for r in records]
    itl = [x for r in records for x in r["itl"]]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else 0.0  # noqa: E731
    return {"streams": streams, "requests": len(records), "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in records) / wall,
            **{f"{name}_p{q}": pct(xs, q) for name, xs in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e))
               for q in (50, 99)}}


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(__doc__, quick="two levels, short requests")
    parser.add_argument("--url", help="a running minipaged server on the loopback interface (default: start one)")
    parser.add_argument("--streams", type=int, nargs="+", help="concurrency levels (default 1 2 4 ... 64)")
    parser.add_argument("--requests-per-stream", type=int, default=None, help="requests sent per stream (default 3)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 64)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens generated per request (default 128)")
    parser.add_argument("--threads", type=int, help="the server's torch threads (default: the cores free now)")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    try:  # refuse any other host before anything runs
        url = loopback_url(args.url) if args.url else None
    except ValueError as err:
        parser.error(str(err))
    streams = args.streams or ([1, 8] if args.quick else [1, 2, 4, 8, 16, 32, 64])
    per_stream = args.requests_per_stream or (2 if args.quick else 3)
    prompt_len = args.prompt_len or (16 if args.quick else 64)
    max_tokens = args.max_tokens or (16 if args.quick else 128)
    if max(streams) > MAX_STREAMS or min(streams) < 1 or max(streams) * per_stream > MAX_REQUESTS or per_stream < 1:
        parser.error(f"at most {MAX_STREAMS} streams and {MAX_REQUESTS} requests per level")
    results_dir = output_dir(args)
    process, load_before = None, os.getloadavg()[0]  # other work on the machine slows every figure
    log = tempfile.TemporaryFile("w+")
    threads = None  # a server given by --url chose its own
    if url is None:
        threads = choose_threads(args.threads)  # counted before the server and this client load the machine
        print(f"the server runs with {threads} torch thread(s); this client shares the machine", flush=True)
        process, url = start_tiny_server(prompt_len + max_tokens, threads, log)
    try:
        rows = []
        for c in streams:
            rows.append(asyncio.run(level(url, c, c * per_stream, prompt_len, max_tokens)))
            r = rows[-1]
            print(f"{c:>4} streams, {r['requests']:>4} requests: {r['tokens_per_s']:7.1f} tokens/s; "
                  f"TTFT p50/p99 {1e3 * r['ttft_p50']:7.1f}/{1e3 * r['ttft_p99']:7.1f} ms, "
                  f"ITL p50/p99 {1e3 * r['itl_p50']:6.1f}/{1e3 * r['itl_p99']:6.1f} ms, "
                  f"TPOT p50 {1e3 * r['tpot_p50']:6.1f} ms, "
                  f"end-to-end p50/p99 {r['e2e_p50']:6.2f}/{r['e2e_p99']:6.2f} s", flush=True)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    except Exception:
        if process is not None:  # what the server said, if it failed
            log.seek(0)
            print(log.read()[-3000:], file=sys.stderr)
        raise
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    machine = f"{cpu_name()}, {os.cpu_count()} CPUs (the model on the CPU)"
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "serving_load.json").write_text(json.dumps(
        {"machine": machine, "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
         "model": model, "server_threads": threads, "prompt_len": prompt_len, "max_tokens": max_tokens,
         "requests_per_stream": per_stream, "levels": rows}, indent=2))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    x = [r["streams"] for r in rows]
    left.plot(x, [r["tokens_per_s"] for r in rows], "o-")
    left.set_ylabel("output tokens / s")
    for name, style in (("ttft", "o-"), ("tpot", "^-"), ("itl", "s-")):
        for q, dash in ((50, style), (99, style[0] + "--")):
            right.plot(x, [1e3 * r[f"{name}_p{q}"] for r in rows], dash, label=f"{name.upper()} p{q}")
    right.set_yscale("log")
    right.set_ylabel("ms")
    right.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(c) for c in x])
        ax.set_xlabel("concurrent streams")
    fig.suptitle(f"{model} model over HTTP, prompt {prompt_len} + {max_tokens} tokens; {machine}", fontsize=9)
    fig.tight_layout()
    fig.savefig(results_dir / "serving_load.png", dpi=120)
    first, top = rows[0], rows[-1]
    peak = max(rows, key=lambda r: r["tokens_per_s"])
    print(f"peak {peak['tokens_per_s']:.0f} tokens/s at {peak['streams']} streams "
          f"({peak['tokens_per_s'] / first['tokens_per_s']:.1f}x {first['streams']}); at {top['streams']}: "
          f"TTFT p50/p99 {1e3 * top['ttft_p50']:.0f}/{1e3 * top['ttft_p99']:.0f} ms, ITL p50/p99 "
          f"{1e3 * top['itl_p50']:.0f}/{1e3 * top['itl_p99']:.0f} ms, end-to-end p50/p99 {top['e2e_p50']:.1f}/"
          f"{top['e2e_p99']:.1f} s on {machine}")


if __name__ == "__main__":
    main()
