"""Stage 12 — propose and verify: an n-gram proposer, and the rejection sampler that keeps the output exact.

Speculative decoding (Leviathan et al., 2023; Chen et al., 2023) guesses ``k`` tokens cheaply,
lets the target model score all of them in one forward pass, and keeps the longest run of
guesses the model agrees with, plus one token of the model's own. This file holds its two
ideas; ``stage12_speculative`` puts them into stage 10's engine.

* ``NgramProposer`` (vLLM's name; "prompt lookup"): the guesses are what followed the same
  words before. The longest suffix of the request's tokens, ``prompt_lookup_max`` tokens down
  to ``prompt_lookup_min``, that also occurs earlier in its tokens — its first occurrence —
  proposes the (up to) ``num_speculative_tokens`` tokens that followed it. None found: no draft.
* ``RejectionSampler`` (vLLM's name) turns the target model's logits at the ``d + 1`` positions
  of a request's last token and its ``d`` drafts into the tokens the request keeps. Position
  ``j``'s distribution ``p_j`` is exactly the one non-speculative decoding would draw from
  there (penalties and ``logit_bias`` over the tokens before it, accepted drafts included;
  then temperature, ``top_k``, ``top_p``). Greedy: a draft is kept while it is ``p_j``'s argmax;
  the first that is not is replaced by the argmax, and if all are kept the last position adds
  one more. Sampling: draft ``x`` is kept with probability ``min(1, p_j(x) / q_j(x))``; on a
  rejection the token is drawn from the normalised residual ``max(0, p_j - q_j)``. An n-gram
  draft is certain (``q_j`` is one-hot at ``x``): keep it with probability ``p_j(x)``, else
  draw from ``p_j`` without ``x``. Either way the token at every position has exactly the
  distribution ``p_j`` — the output is the target model's, only sooner. Draws use the
  request's seeded generator, so a seeded request repeats itself.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from minipaged.common.sampler import apply_penalties, compute_logprobs, top_k_top_p
from minipaged.common.sampling_params import SamplingParams


@dataclass
class NgramProposer:
    """Drafts from the request's own tokens: what followed the longest repeated suffix."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int

    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to ``num_speculative_tokens`` draft tokens for what follows ``token_ids``; [] if none."""
        tokens = np.asarray(token_ids)
        # BEGIN SOLUTION the longest suffix n (max down to min) seen earlier; the tokens after its first occurrence
        for n in range(min(self.prompt_lookup_max, len(tokens) - 1), self.prompt_lookup_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every n-gram but the suffix
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return tokens[start:start + self.num_speculative_tokens].tolist()
        return []
        # END SOLUTION


@dataclass
class Context:
    """A request's tokens as seen at one position of its drafts (the sampler's ``SampledRow``)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None


@dataclass
class VerifiedTokens:
    """What a request keeps from a step: the accepted drafts and one token of the model's own."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    num_accepted: int = 0  # of the drafts


class RejectionSampler:
    """The tokens a request keeps, given the target's logits at its last token and at each draft."""

    def __init__(self, eos_token_ids: Collection[int] = (), logprobs_mode: str = "raw_logprobs") -> None:
        self.eos_token_ids, self.logprobs_mode = frozenset(eos_token_ids), logprobs_mode

    def target_logits(self, logits: torch.Tensor, context: Context, params: SamplingParams) -> torch.Tensor:
        """``(vocab,)``: the logits non-speculative decoding would draw from after ``context``, the cut
        ones at -inf (a greedy request's: after the penalties only; its draw is their argmax)."""
        row = logits.clone()[None]
        if params.has_logits_processors:
            apply_penalties(row, [context], [params], self.eos_token_ids)
        if params.temperature == 0:
            return row[0]
        vocab, device = row.shape[1], row.device
        top_k = torch.tensor([params.top_k], device=device) if 0 < params.top_k < vocab else None
        top_p = torch.tensor([params.top_p], device=device) if params.top_p < 1 else None
        return top_k_top_p(row / params.temperature, top_k, top_p)[0]

    def __call__(self, logits: torch.Tensor, prompt_token_ids: list[int], output_token_ids: list[int],
                 generator: torch.Generator | None, params: SamplingParams, draft_token_ids: list[int],
                 draft_probs: torch.Tensor | None = None) -> VerifiedTokens:
        """``logits``: ``(len(draft_token_ids) + 1, vocab)`` float32, row ``j`` the target's after the
        ``j``-th draft (row 0: after the request's last token). ``draft_probs``: ``(len(draft_token_ids),
        vocab)``, the distributions the drafts were drawn from (a draft model's); None: each draft
        was certain (one-hot ``q``, the n-gram proposer's)."""
        out = VerifiedTokens()
        for j in range(len(draft_token_ids) + 1):
            context = Context(prompt_token_ids, output_token_ids + out.token_ids, generator)
            target = self.target_logits(logits[j], context, params)
            draft = draft_token_ids[j] if j < len(draft_token_ids) else None
            # BEGIN SOLUTION greedy: the target's argmax; sampling: accept or resample against q (one-hot for n-grams)
            if params.temperature == 0:
                token = int(target.max(dim=-1).indices)  # as the Sampler takes it
            else:
                p = torch.softmax(target, dim=-1)
                q = None
                if draft is not None:
                    q = torch.zeros_like(p) if draft_probs is None else draft_probs[j].to(p)
                    if draft_probs is None:
                        q[draft] = 1.0
                token = self.accept_or_resample(p, q, draft, generator)
            # END SOLUTION
            self.record(out, logits[j], target, token, params)
            if token != draft:
                break
            out.num_accepted += 1
        return out

    @staticmethod
    def accept_or_resample(p: torch.Tensor, q: torch.Tensor | None, draft: int | None,
                           generator: torch.Generator | None) -> int:
        """One position: keep ``draft`` with probability ``min(1, p(x) / q(x))``, else draw from the
        residual ``max(0, p - q)``, normalised; with no draft, draw from ``p``."""
        # BEGIN SOLUTION accept with min(1, p/q); on rejection draw from max(0, p - q) renormalised
        if draft is None or q is None:
            return int(torch.multinomial(p, 1, generator=generator))
        if float(torch.rand(1, generator=generator, device=p.device)) < min(1.0, float(p[draft] / q[draft])):
            return draft
        residual = (p - q).clamp(min=0)
        if float(residual.sum()) <= 0:  # p = q up to rounding: the draft is p's own draw
            return draft
        return int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
        # END SOLUTION

    def record(self, out: VerifiedTokens, raw: torch.Tensor, target: torch.Tensor, token: int,
               params: SamplingParams) -> None:
        """The token, with its log-probability as the ``logprobs_mode`` says (``Sampler``'s rule)."""
        source = raw if self.logprobs_mode.startswith("raw") else target
        sampled = compute_logprobs(source[None], [token], [params.logprobs],
                                   as_logits=self.logprobs_mode.endswith("logits"))
        out.token_ids.append(token)
        out.logprobs.append(sampled.logprobs[0])
        out.top_logprobs.append(sampled.top_logprobs[0])
