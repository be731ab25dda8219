"""What a request asks for and what it gets back, with vLLM's names: ``SamplingParams``,
``RequestOutput`` and ``CompletionOutput`` (vLLM's ``sampling_params.py`` and ``outputs.py``).

Every field is checked when the object is made, with vLLM's rules, so that bad input is
refused before anything runs: nothing a ``SamplingParams`` holds can fail inside a step.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable
from dataclasses import dataclass, field

from minipaged.common.checks import check_float, check_int

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy
MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: a temperature in (SAMPLING_EPS, this) is raised to this
SEED_RANGE = (-(2**63), 2**63 - 1)  # a torch.long, as vLLM's OpenAI server takes it
MAX_N = 2**16  # sample i is seeded seed + i: every such seed must fit torch's generator


class RequestOutputKind(enum.Enum):
    """When a request's outputs are made, as vLLM names it: at every step it progresses (``CUMULATIVE``,
    its tokens so far), or once, when it finishes (``FINAL_ONLY``, what ``LLM.generate`` asks for)."""

    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    """How to generate, with vLLM's names and rules.

    ``temperature`` below ``1e-5`` (0 included) is greedy, and then ``top_k``, ``top_p`` and
    ``min_p`` are off; a temperature in ``(1e-5, 1e-2)`` is raised to ``1e-2`` (vLLM does the
    same: smaller ones overflow). ``top_k=-1`` keeps every token. The penalties, ``logit_bias``,
    ``min_tokens`` and ``min_p`` are applied by ``minipaged.common.logits_processors``.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    seed: int | None = None
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides (positive) or multiplies (negative) prompt+output tokens' logits
    logit_bias: dict[int, float] | None = None  # added to the token's logit
    min_tokens: int = 0  # end and stop tokens are banned until this many tokens are generated
    stop: list[str] | None = None  # strings that end the output (a str is one); the text is cut before it
    include_stop_str_in_output: bool = False  # ... or after it
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # also return the top-k log-probabilities of each step
    prompt_logprobs: int | None = None  # also return, per prompt token, its log-probability and the top k
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # an output every step, or only the last

    def __post_init__(self) -> None:
        check_int("SamplingParams.n", self.n, 1)
        if self.n > MAX_N:
            raise ValueError(f"SamplingParams.n must be <= {MAX_N}, got {self.n}")
        check_int("SamplingParams.max_tokens", self.max_tokens, 1)
        check_int("SamplingParams.logprobs", self.logprobs, 0, allow_none=True)
        check_int("SamplingParams.prompt_logprobs", self.prompt_logprobs, 0, allow_none=True)
        check_int("SamplingParams.min_tokens", self.min_tokens, 0)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"SamplingParams.output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        if self.seed is not None:
            check_int("SamplingParams.seed", self.seed, SEED_RANGE[0])
            if self.seed > SEED_RANGE[1]:
                raise ValueError(f"SamplingParams.seed must be <= {SEED_RANGE[1]}, got {self.seed}")
        if self.top_k != -1:
            check_int("SamplingParams.top_k", self.top_k, 1)
        check_float("SamplingParams.temperature", self.temperature, 0.0, math.inf)
        check_float("SamplingParams.top_p", self.top_p, 0.0, 1.0, open_low=True)
        check_float("SamplingParams.min_p", self.min_p, 0.0, 1.0)
        check_float("SamplingParams.presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_float("SamplingParams.frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_float("SamplingParams.repetition_penalty", self.repetition_penalty, 0.0, math.inf, open_low=True)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (not isinstance(self.stop, list)
                                      or not all(isinstance(x, str) and x for x in self.stop)):
            raise ValueError(f"SamplingParams.stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list, got {self.stop_token_ids!r}")
        for token in self.stop_token_ids:
            check_int("SamplingParams.stop_token_ids[]", token, 0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"SamplingParams.logit_bias must be a dict, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                check_int("SamplingParams.logit_bias key", token, 0)
                check_float(f"SamplingParams.logit_bias[{token}]", bias, -math.inf, math.inf)
        if self.temperature < SAMPLING_EPS:  # greedy, as vLLM: the sampling filters have nothing to do
            self.temperature, self.top_k, self.top_p, self.min_p = 0.0, -1, 1.0, 0.0
        elif self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    @property
    def has_logits_processors(self) -> bool:
        """True when a penalty, a bias, ``min_tokens`` or ``min_p`` changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.min_p)


def find_stop_string(text: str, stops: list[str], include: bool = False, checked: int = 0) -> tuple[str, str] | None:
    """The text cut at the earliest stop string in it, and that string; None if there is none.

    vLLM's rule: where two begin at the same place, the one listed first wins; the cut is
    before the string, or after it with ``include`` (``include_stop_str_in_output``). Only a
    string that ends after the first ``checked`` characters counts (they were searched before)."""
    hits = [(at, i, stop) for i, stop in enumerate(stops)
            if (at := text.find(stop, max(0, checked - len(stop) + 1))) >= 0]
    if not hits:
        return None
    at, _, stop = min(hits)
    return (text[: at + len(stop)] if include else text[:at]), stop


@dataclass
class CompletionOutput:
    index: int
    text: str  # decoded when the request finishes
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str | None  # "stop" (an end or stop token, or a stop string), "length", or "abort"
    logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None for EOS)


@dataclass
class RequestOutput:
    request_id: Hashable
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    # with prompt_logprobs=k: per prompt position, {token: logprob} of its token and the top k; None first
    prompt_logprobs: list[dict[int, float] | None] | None = None
