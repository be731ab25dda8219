"""Prompt log-probabilities, as vLLM's ``SamplingParams(prompt_logprobs=k)`` returns them.

A forward pass over a prompt computes the logits of every position, and position ``p``'s
logits score the prompt's token ``p + 1``: that is what a scorer (lm-evaluation-harness's
log-likelihoods, a perplexity) asks for. The runner keeps those rows for the requests that ask
(it keeps only each sequence's last row otherwise), after the rows the sampler reads; the
engine turns them into ``{token: logprob}`` for each prompt token: its own and the top ``k``.
The first token has no position before it: ``None``, as in vLLM.

They are always *raw*: the log-softmax of the model's logits, before any sampling parameter
touches them (vLLM computes them so too). A prompt's positions are computed once per
prefill, whole or in chunks; the rows of a step are those of its new tokens that are followed
by a prompt token (``prompt_logprob_positions``), so the runner and the engine agree on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minipaged.common.sampler import compute_logprobs


def prompt_logprob_positions(start: int, num_new: int, num_prompt_tokens: int) -> range:
    """The positions, among a step's new tokens ``start .. start + num_new - 1``, whose logits
    score a prompt token: those followed by one (position ``p`` scores token ``p + 1``)."""
    return range(start, max(start, min(start + num_new, num_prompt_tokens - 1)))


def fill_prompt_logprobs(prompt_logprobs: list[dict[int, float] | None], logits: torch.Tensor,
                         prompt_token_ids: Sequence[int], positions: range, k: int) -> None:
    """Write the log-probabilities of the tokens after ``positions`` into ``prompt_logprobs``
    (one entry per prompt token, ``None`` until computed). ``logits``: ``(len(positions), vocab)``,
    the rows of those positions, in order; ``k``: how many top tokens each entry adds."""
    if not positions:
        return
    targets = list(prompt_token_ids[positions.start + 1:positions.stop + 1])
    top = compute_logprobs(logits.float(), targets, [k] * len(targets)).top_logprobs
    prompt_logprobs[positions.start + 1:positions.stop + 1] = top
