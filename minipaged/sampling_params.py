"""What a request asks for and what it gets back, with vLLM's names: ``SamplingParams``,
``RequestOutput`` and ``CompletionOutput`` (vLLM's ``sampling_params.py`` and ``outputs.py``).

Every field is checked when the object is made, so that bad input is refused before
anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def check_int(name: str, value, low: int, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}{' or None' if allow_none else ''}, got {value!r}")


@dataclass
class SamplingParams:
    """How to generate: vLLM's names. ``temperature=0`` is greedy; ``top_k=-1`` keeps every token."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # also return the top-k log-probabilities of each step

    def __post_init__(self) -> None:
        check_int("SamplingParams.n", self.n, 1)
        check_int("SamplingParams.max_tokens", self.max_tokens, 1)
        check_int("SamplingParams.logprobs", self.logprobs, 0, allow_none=True)
        check_int("SamplingParams.seed", self.seed, 0, allow_none=True)
        if self.top_k != -1:
            check_int("SamplingParams.top_k", self.top_k, 1)
        if not isinstance(self.temperature, int | float) or not self.temperature >= 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")


@dataclass
class CompletionOutput:
    index: int
    text: str  # decoded when the request finishes
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str | None  # "stop" (an end or stop token), "length", or "abort"
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
