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
"""

from __future__ import annotations

from minipaged.perf.simulate import OPT_13B_SLOTS as OPT_13B_SLOTS  # the paper's budget, for the benchmarks
from minipaged.perf.simulate import Request, synthetic_requests

TRACES = {
    "ShareGPT": {"mean_prompt": 161.31, "mean_output": 337.99},
    "Alpaca": {"mean_prompt": 19.31, "mean_output": 58.45},
}
MAX_LEN = 2048


def trace(name: str, num_requests: int, rate: float, seed: int = 0, max_len: int = MAX_LEN) -> list[Request]:
    """A seeded trace of ``num_requests`` with the named dataset's mean lengths."""
    return synthetic_requests(num_requests, **TRACES[name], max_len=max_len, rate=rate, seed=seed)
