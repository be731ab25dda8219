"""The batched sampler: a step's logits ``(num_seqs, vocab)`` to one token per row, in a few tensor ops.

Stage 7 defines sampling one row at a time (``process_logits`` and ``sample``): that is the
definition. A step of 64 sequences would call it 64 times, each a dozen small ops, and the
engine waits for every one. ``Sampler`` does the same for the whole batch at once, as vLLM's
``Sampler`` does: each row's parameters become a column of per-row values (``temperature``,
``top_k``, ``top_p``, ``min_p``, the penalties), and every rule is one op over the rows that
ask for it. Only the draw stays per row, so that each sequence draws with its own seeded
generator. Tested equal to the one-row definitions row by row: greedy exactly, and the same
token from the same seed (``tests/test_stage7_sampler.py``).

The order is vLLM V1's (``minipaged.common.logits_processors`` states the rules): ``min_tokens``,
``logit_bias``, the repetition, frequency and presence penalties, ``min_p``; then the
temperature, ``top_k`` and ``top_p`` of the sampled rows.

Log-probabilities: the chosen token's for every row (``cumulative_logprob``), the top ``k`` only
for the rows that ask for ``logprobs=k``. Which logits they are taken from is vLLM V1's
``logprobs_mode``: ``raw_logprobs`` (the default) the model's, before any of the rules above;
``processed_logprobs`` the ones the token was drawn from, after all of them (a greedy row's:
after the penalties and ``logit_bias``; a sampled row's: after the temperature, ``top_k`` and
``top_p`` too, the cut tokens at ``-inf``). ``raw_logits`` and ``processed_logits`` return the
same logits without the log-softmax.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from minipaged.common.sampling_params import SamplingParams


class SampledRow(Protocol):
    """What the sampler reads of a sequence: its tokens and its generator."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


@dataclass
class SamplerOutput:
    """One token per row, the log-probability of each, and the top ones of the rows that asked."""

    token_ids: list[int]
    logprobs: list[float]  # of the chosen token, as the sampler's logprobs_mode says
    top_logprobs: list[dict[int, float] | None]  # {token: logprob} of the top k and the chosen one


def apply_penalties(logits: torch.Tensor, seqs: Sequence[SampledRow], params: Sequence[SamplingParams],
                    eos_token_ids: Collection[int]) -> None:
    """``min_tokens``, ``logit_bias``, the penalties and ``min_p``, in place, each over the rows asking for it."""
    num_seqs, vocab = logits.shape
    banned = [(i, t) for i, (s, p) in enumerate(zip(seqs, params, strict=True))
              if len(s.output_token_ids) < p.min_tokens
              for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)) if 0 <= t < vocab]
    if banned:
        banned_rows, banned_cols = zip(*banned, strict=True)
        logits[list(banned_rows), list(banned_cols)] = float("-inf")
    biased = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
    if biased:
        bias_rows, bias_cols, bias = zip(*biased, strict=True)
        if not all(0 <= t < vocab for t in bias_cols):
            raise ValueError(f"logit_bias has token ids outside the vocabulary ({vocab})")
        logits.index_put_((torch.tensor(bias_rows), torch.tensor(bias_cols)), torch.tensor(bias, dtype=logits.dtype),
                          accumulate=True)
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:  # (len(rep), vocab): which tokens each row has seen, prompt and output
        seen = torch.zeros(len(rep), vocab, dtype=torch.bool)
        for k, i in enumerate(rep):
            seen[k, seqs[i].prompt_token_ids + seqs[i].output_token_ids] = True
        penalty = torch.tensor([params[i].repetition_penalty for i in rep], dtype=logits.dtype)[:, None]
        rows = logits[rep]
        logits[rep] = torch.where(seen, torch.where(rows > 0, rows / penalty, rows * penalty), rows)
    counted = [i for i, p in enumerate(params)
               if (p.frequency_penalty or p.presence_penalty) and seqs[i].output_token_ids]
    if counted:  # (len(counted), vocab): each token's count in the row's output
        counts = torch.zeros(len(counted), vocab, dtype=logits.dtype)
        for k, i in enumerate(counted):
            ids = torch.tensor(seqs[i].output_token_ids)
            counts[k].index_add_(0, ids, torch.ones(len(ids), dtype=logits.dtype))
        freq = torch.tensor([params[i].frequency_penalty for i in counted], dtype=logits.dtype)[:, None]
        presence = torch.tensor([params[i].presence_penalty for i in counted], dtype=logits.dtype)[:, None]
        logits[counted] = logits[counted] - freq * counts - presence * (counts > 0).to(logits.dtype)
    cut = [i for i, p in enumerate(params) if p.min_p > 0 and p.temperature > 0]
    if cut:
        temp = torch.tensor([params[i].temperature for i in cut])[:, None]
        min_p = torch.tensor([params[i].min_p for i in cut])[:, None]
        probs = torch.softmax(logits[cut] / temp, dim=-1)
        logits[cut] = logits[cut].masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``process_logits``' cuts for a batch: ``(n, vocab)`` tempered logits, per-row ``top_k`` (the
    vocabulary size: no cut) and ``top_p`` (1: no cut); the cut ones at -inf."""
    vocab = logits.shape[1]
    if bool((top_k < vocab).any()):
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (top_k - 1)[:, None])  # (n, 1)
        logits = torch.where(top_k[:, None] < vocab, logits.masked_fill(logits < kth, float("-inf")), logits)
    if bool((top_p < 1).any()):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (probs.cumsum(-1) - probs >= top_p[:, None]) & (top_p[:, None] < 1)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return logits


class Sampler:
    """Logits ``(num_seqs, vocab)`` to one token per sequence, every row with its own parameters.

    ``eos_token_ids`` are the tokens ``min_tokens`` holds back; ``logprobs_mode`` which logits the
    log-probabilities come from (the module's docstring)."""

    def __init__(self, eos_token_ids: Iterable[int] = (), logprobs_mode: str = "raw_logprobs") -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SampledRow],
                 params: Sequence[SamplingParams]) -> SamplerOutput:
        with torch.inference_mode():  # the runner's logits are inference tensors, changed in place
            return self.sample(logits, seqs, params)

    def sample(self, logits: torch.Tensor, seqs: Sequence[SampledRow],
               params: Sequence[SamplingParams]) -> SamplerOutput:
        processors = any(p.has_logits_processors for p in params)
        raw = logits.clone() if processors and self.logprobs_mode.startswith("raw") else logits
        if processors:
            apply_penalties(logits, seqs, params, self.eos_token_ids)
        token_ids = logits.max(dim=-1).indices  # (num_seqs,) the greedy rows' tokens (argmax, 3x slower on CPU)
        processed = logits
        drawn = [i for i, p in enumerate(params) if p.temperature > 0]
        if drawn:
            vocab = logits.shape[1]
            temp = torch.tensor([params[i].temperature for i in drawn], dtype=logits.dtype)[:, None]
            top_k = torch.tensor([params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in drawn])
            top_p = torch.tensor([params[i].top_p for i in drawn])
            cut = top_k_top_p(logits[drawn] / temp, top_k, top_p)  # (len(drawn), vocab)
            probs = torch.softmax(cut, dim=-1)
            for k, i in enumerate(drawn):  # each with its own generator: a seeded sequence repeats itself
                token_ids[i] = torch.multinomial(probs[k], 1, generator=seqs[i].generator)[0]
            if self.logprobs_mode.startswith("processed"):
                processed = logits.clone()
                processed[drawn] = cut
        tokens = token_ids.tolist()
        source = raw if self.logprobs_mode.startswith("raw") else processed
        logprobs, top = compute_logprobs(source, tokens, [p.logprobs for p in params],
                                         as_logits=self.logprobs_mode.endswith("logits"))
        return SamplerOutput(tokens, logprobs, top)


def compute_logprobs(logits: torch.Tensor, token_ids: list[int], num_logprobs: Sequence[int | None],
                     as_logits: bool = False) -> tuple[list[float], list[dict[int, float] | None]]:
    """The log-probability of each row's token, for every row; the top ``k`` ones (and the chosen
    one), ``{token: logprob}``, only for the rows whose ``num_logprobs`` is a number ``k``.
    ``as_logits``: the logits themselves instead (the same tokens are the top ones)."""
    rows = logits if as_logits else torch.log_softmax(logits, dim=-1)  # (n, vocab); one pass
    logprobs = rows.gather(1, torch.tensor(token_ids)[:, None])[:, 0].tolist()
    top: list[dict[int, float] | None] = [None] * len(token_ids)
    asked = [i for i, k in enumerate(num_logprobs) if k is not None]
    if asked:
        values, indices = torch.topk(rows[asked], max(num_logprobs[i] or 0 for i in asked))
        for r, i in enumerate(asked):
            k = num_logprobs[i] or 0
            top[i] = {**dict(zip(indices[r, :k].tolist(), values[r, :k].tolist(), strict=True)),
                      token_ids[i]: logprobs[i]}
    return logprobs, top
