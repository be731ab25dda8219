"""Synthetic ShareGPT-like and Alpaca-like request traces, as the vLLM paper describes them.

The paper (its Figure 11) reports mean input and output lengths of 161.31 and
337.99 tokens for ShareGPT and 19.31 and 58.45 for Alpaca, with requests capped at 2,048
tokens, and Poisson arrivals. The raw datasets are not used here (nothing is downloaded);
instead lengths are drawn, seeded, from log-normal distributions (sigma 1.0, a long right
tail like real conversations) whose means are the paper's, clipped to at least one token
and to prompt + output <= ``max_len``. Arrival times are a Poisson process in *scheduler
steps* (``rate`` requests per step): the benchmarks run without a model, so a step, not a
second, is the unit of time.

The drawing itself is ``minipaged.perf.simulate.synthetic_requests``; this module only names
the two traces.

Beside those tail-heavy traces, ``steady`` is nano-vllm's throughput workload (its ``bench.py``),
meant for a GPU: 256 requests whose prompt and output lengths are each uniform in 100..1024
tokens, of random token ids, all submitted at once. Uniform lengths keep a large batch decoding
for most of the run: a steady state, where the forward of a full batch, not the tail of the
longest requests, sets the throughput. ``STEADY_QUICK`` is the same shape small enough for a CPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from minipaged.perf.simulate import OPT_13B_SLOTS as OPT_13B_SLOTS  # the paper's budget, for the benchmarks
from minipaged.perf.simulate import TraceRequest, synthetic_requests

TRACES = {
    "ShareGPT": {"mean_prompt": 161.31, "mean_output": 337.99},
    "Alpaca": {"mean_prompt": 19.31, "mean_output": 58.45},
}
MAX_LEN = 2048


def trace(name: str, num_requests: int, rate: float, seed: int = 0, max_len: int = MAX_LEN) -> list[TraceRequest]:
    """A seeded trace of ``num_requests`` with the named dataset's mean lengths."""
    return synthetic_requests(num_requests, **TRACES[name], max_len=max_len, rate=rate, seed=seed)


@dataclass(frozen=True)
class SteadyWorkload:
    """How many requests, the range of their prompt and of their output lengths (each uniform, ends
    included), and the model that serves them (bench/peer_models.py)."""

    requests: int
    lengths: tuple[int, int]
    model: str = "qwen2.5-0.5b-shaped"  # in place of nano-vllm's Qwen3-0.6B

    @property
    def max_len(self) -> int:
        """The longest request, prompt and output together."""
        return 2 * self.lengths[1]


# nano-vllm's bench.py: 256 requests, prompt and output lengths each uniform in 100..1024, token ids in 0..10000.
STEADY = SteadyWorkload(requests=256, lengths=(100, 1024))
STEADY_QUICK = SteadyWorkload(requests=8, lengths=(16, 64))  # --quick, and a CPU
STEADY_MAX_TOKEN_ID = 10000


def steady(num_requests: int, lengths: tuple[int, int], seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """The prompts (token ids) and output lengths of ``num_requests`` requests, drawn as nano-vllm's
    bench.py draws them: every prompt (its length, then its ids), then every output length, from
    Python's ``random`` seeded with ``seed``. Its full size draws the very requests of nano-vllm's
    README: 142,827 prompt tokens and 133,966 output tokens."""
    rng = random.Random(seed)
    low, high = lengths
    prompts = [[rng.randint(0, STEADY_MAX_TOKEN_ID) for _ in range(rng.randint(low, high))]
               for _ in range(num_requests)]
    outputs = [rng.randint(low, high) for _ in range(num_requests)]
    return prompts, outputs
