"""The logits processors of ``SamplingParams``, with vLLM's semantics, applied by stage 7's ``Sampler``.

Each sequence's row of logits ``(vocab,)`` is changed in this order, as vLLM V1 does:

1. ``min_tokens``: while fewer tokens than that are generated, the end tokens (unless
   ``ignore_eos``) and the ``stop_token_ids`` are set to ``-inf``;
2. ``logit_bias``: ``bias`` is added to its token's logit;
3. ``repetition_penalty`` (every token of the prompt and of the output so far): a positive
   logit is divided by it, a negative one multiplied; then ``frequency_penalty`` times the
   token's count in the output, and ``presence_penalty`` once if it occurs there, are
   subtracted;
4. ``min_p`` (sampled rows only): a token whose probability at the request's temperature is
   below ``min_p`` times the most likely token's is set to ``-inf``.

Temperature, ``top_k`` and ``top_p`` then apply as before (stage 7's ``process_logits``).
The rows are changed in place, so the log-probabilities a request gets back are those of
the processed logits (before temperature), as in vLLM V0.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from minipaged.common.sampling_params import SamplingParams


def process_row(row: torch.Tensor, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                params: SamplingParams, eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """One sequence's ``(vocab,)`` logits after ``params``' processors (a new tensor)."""
    row = row.clone()
    vocab = row.numel()
    if len(output_token_ids) < params.min_tokens:
        held = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        banned = [t for t in held if 0 <= t < vocab]
        if banned:
            row[banned] = float("-inf")
    if params.logit_bias:
        bad = [t for t in params.logit_bias if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias has token ids outside the vocabulary ({vocab}): {bad[:5]}")
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=row.device)
        row.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=row.device))
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        seen[torch.tensor(list(prompt_token_ids) + list(output_token_ids), dtype=torch.long, device=row.device)] = True
        penalized = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
        row = torch.where(seen, penalized, row)
    if (params.frequency_penalty or params.presence_penalty) and output_token_ids:
        counts = torch.bincount(torch.tensor(list(output_token_ids), dtype=torch.long, device=row.device),
                                minlength=vocab)[:vocab].to(row.dtype)
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(row.dtype)
    if params.min_p > 0 and params.temperature > 0:
        probs = torch.softmax(row / params.temperature, dim=-1)
        row = row.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return row


def apply_logits_processors(logits: torch.Tensor, seqs, params: list[SamplingParams],
                            eos_token_ids: Collection[int] = ()) -> None:
    """Process, in place, each row of ``(num_seqs, vocab)`` logits whose params ask for it.

    ``seqs[i]`` has ``prompt_token_ids`` and ``output_token_ids``; rows whose params have no
    processor are left untouched."""
    with torch.inference_mode():  # the runner's logits are inference tensors
        for i, (seq, p) in enumerate(zip(seqs, params, strict=True)):
            if p.has_logits_processors:
                logits[i] = process_row(logits[i], seq.prompt_token_ids, seq.output_token_ids, p, eos_token_ids)
