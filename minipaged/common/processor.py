"""The input processor: a new request's prompt to token ids, checked before anything is queued.

As vLLM V1's ``Processor`` (``vllm/v1/engine/processor.py``) is for its engine: the engine
hands it each new request's prompt and sampling parameters and gets back the prompt's text
and token ids, or a ``ValueError``/``TypeError`` for anything the model cannot run. It knows
the model's tokenizer and vocabulary; which request ids are in use is the engine's to check.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from minipaged.common.sampling_params import SamplingParams

Prompt = str | dict[str, list[int]]  # a text, or {"prompt_token_ids": [...]}


class Processor:
    """Prompts — strings or ``{"prompt_token_ids": [...]}`` — to token ids the model can run."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """The prompt's text (None when it came as token ids) and its token ids, unchecked."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer.json: give {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt).ids
        raise TypeError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def process_inputs(self, prompt: Prompt, params: object) -> tuple[str | None, list[int]]:
        """The prompt's text and token ids; ``ValueError``/``TypeError`` for anything that cannot run
        (``params``: the request's parameters, checked against the model when they are ``SamplingParams``)."""
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty: a request needs at least one token")
        bad = [t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"token ids must be in 0 .. {self.vocab_size - 1}, got {bad[:5]}")
        if isinstance(params, SamplingParams) and params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary ({self.vocab_size})")
        if isinstance(params, SamplingParams) and params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer (tokenizer.json): use stop_token_ids")
        return text, ids
