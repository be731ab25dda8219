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

from minipaged.common.device import to_device
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
    """``min_tokens``, ``logit_bias``, the penalties and ``min_p``, in place, each over the rows asking for it.
    What each rule needs of a row is built on the host and copied to the logits' device once."""
    num_seqs, vocab = logits.shape
    device, dtype = logits.device, logits.dtype
    banned = [(i, t) for i, (s, p) in enumerate(zip(seqs, params, strict=True))
              if len(s.output_token_ids) < p.min_tokens
              for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)) if 0 <= t < vocab]
    if banned:
        banned_rows, banned_cols = zip(*banned, strict=True)
        logits[to_device(banned_rows, device), to_device(banned_cols, device)] = float("-inf")
    biased = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
    if biased:
        bias_rows, bias_cols, bias = zip(*biased, strict=True)
        if not all(0 <= t < vocab for t in bias_cols):
            raise ValueError(f"logit_bias has token ids outside the vocabulary ({vocab})")
        logits.index_put_((to_device(bias_rows, device), to_device(bias_cols, device)),
                          to_device(bias, device, dtype), accumulate=True)
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:  # (len(rep), vocab): which tokens each row has seen, prompt and output
        seen_rows = [k for k, i in enumerate(rep) for _ in seqs[i].prompt_token_ids + seqs[i].output_token_ids]
        seen_cols = [t for i in rep for t in seqs[i].prompt_token_ids + seqs[i].output_token_ids]
        seen = torch.zeros(len(rep), vocab, dtype=torch.bool, device=device)
        seen[to_device(seen_rows, device), to_device(seen_cols, device)] = True
        penalty = to_device([params[i].repetition_penalty for i in rep], device, dtype)[:, None]
        rep_rows = to_device(rep, device)
        rows = logits[rep_rows]
        logits[rep_rows] = torch.where(seen, torch.where(rows > 0, rows / penalty, rows * penalty), rows)
    counted = [i for i, p in enumerate(params)
               if (p.frequency_penalty or p.presence_penalty) and seqs[i].output_token_ids]
    if counted:  # (len(counted), vocab): each token's count in the row's output
        out_rows = [k for k, i in enumerate(counted) for _ in seqs[i].output_token_ids]
        out_cols = [t for i in counted for t in seqs[i].output_token_ids]
        counts = torch.zeros(len(counted), vocab, dtype=dtype, device=device)
        counts.index_put_((to_device(out_rows, device), to_device(out_cols, device)),
                          torch.ones(len(out_cols), dtype=dtype, device=device), accumulate=True)
        freq = to_device([params[i].frequency_penalty for i in counted], device, dtype)[:, None]
        presence = to_device([params[i].presence_penalty for i in counted], device, dtype)[:, None]
        counted_rows = to_device(counted, device)
        logits[counted_rows] = logits[counted_rows] - freq * counts - presence * (counts > 0).to(dtype)
    cut = [i for i, p in enumerate(params) if p.min_p > 0 and p.temperature > 0]
    if cut:
        temp = to_device([params[i].temperature for i in cut], device)[:, None]
        min_p = to_device([params[i].min_p for i in cut], device)[:, None]
        cut_rows = to_device(cut, device)
        probs = torch.softmax(logits[cut_rows] / temp, dim=-1)
        logits[cut_rows] = logits[cut_rows].masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values,
                                                        float("-inf"))


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                max_top_k: int | None = None) -> torch.Tensor:
    """``process_logits``' cuts for a batch: ``(n, vocab)`` tempered logits, per-row ``top_k`` (the
    vocabulary size: no cut) and ``top_p`` (1: no cut); the cut ones at -inf. ``None``: no row cuts
    (the caller knows it on the host, so nothing is read back from the device). ``max_top_k``: the
    largest ``top_k``, if the caller knows it: only that many logits per row are ordered (``topk``),
    not the whole vocabulary."""
    vocab = logits.shape[1]
    if top_k is not None:
        k = vocab if max_top_k is None else min(max_top_k, vocab)
        kth = torch.topk(logits, k, dim=-1).values.gather(1, (top_k - 1)[:, None])  # (n, 1)
        logits = torch.where(top_k[:, None] < vocab, logits.masked_fill(logits < kth, float("-inf")), logits)
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (probs.cumsum(-1) - probs >= top_p[:, None]) & (top_p[:, None] < 1)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return logits


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs`` ``(n, vocab)``, row ``k`` drawn with ``generators[k]``: ``(n,)``.

    The exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` draws token ``i`` with probability
    ``p_i``. It is what ``torch.multinomial`` does for one sample, so the same generator state gives
    the same token as ``torch.multinomial(probs[k], 1, generator=g)``; unlike it, nothing is read
    back (``multinomial`` checks its input on the host), and the draw stays on the device, as vLLM's
    does. A generator must be on the device of ``probs``."""
    q = torch.empty_like(probs)
    for row, generator in zip(q.unbind(0), generators, strict=True):  # (vocab,) views, made in one call
        row.exponential_(generator=generator)
    return probs.div(q).argmax(dim=-1)


class Sampler:
    """Logits ``(num_seqs, vocab)`` to one token per sequence, every row with its own parameters.

    ``eos_token_ids`` are the tokens ``min_tokens`` holds back; ``logprobs_mode`` which logits the
    log-probabilities come from (the module's docstring). Everything runs on the logits' device;
    the tokens and their log-probabilities come back to the host in one copy (and the top ones, for
    the rows that ask for them, in one more)."""

    def __init__(self, eos_token_ids: Iterable[int] = (), logprobs_mode: str = "raw_logprobs") -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SampledRow],
                 params: Sequence[SamplingParams]) -> SamplerOutput:
        return self.sample_async(logits, seqs, params).result()

    def sample_async(self, logits: torch.Tensor, seqs: Sequence[SampledRow],
                     params: Sequence[SamplingParams]) -> PendingSamplerOutput:
        """The same, queued on the logits' device: the tokens stay there (``token_ids``), their copy to the
        host is started, and ``result()`` waits for it alone (not for work queued after it)."""
        with torch.inference_mode():  # the runner's logits are inference tensors, changed in place
            return self.sample(logits, seqs, params)

    def sample(self, logits: torch.Tensor, seqs: Sequence[SampledRow],
               params: Sequence[SamplingParams]) -> PendingSamplerOutput:
        kinds = {id(p): p for p in params}.values()  # the distinct parameters: often one for the whole batch
        processors = any(p.has_logits_processors for p in kinds)
        raw = logits.clone() if processors and self.logprobs_mode.startswith("raw") else logits
        if processors:
            apply_penalties(logits, seqs, params, self.eos_token_ids)
        token_ids = logits.max(dim=-1).indices  # (num_seqs,) the greedy rows' tokens (argmax, 3x slower on CPU)
        processed = logits
        sampling = any(p.temperature > 0 for p in kinds)
        drawn = [i for i, p in enumerate(params) if p.temperature > 0] if sampling else []
        if drawn:
            vocab, device = logits.shape[1], logits.device
            rows = to_device(drawn, device)
            temp = to_device([params[i].temperature for i in drawn], device, logits.dtype)[:, None]
            top_k = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in drawn]
            top_p = [params[i].top_p for i in drawn]
            cut = top_k_top_p(logits.index_select(0, rows) / temp,  # (len(drawn), vocab)
                              to_device(top_k, device) if min(top_k) < vocab else None,
                              to_device(top_p, device) if min(top_p) < 1 else None, max(top_k))
            token_ids[rows] = draw(torch.softmax(cut, dim=-1), [seqs[i].generator for i in drawn])
            if self.logprobs_mode.startswith("processed"):
                processed = logits.clone()
                processed[rows] = cut
        source = raw if self.logprobs_mode.startswith("raw") else processed
        asked = any(p.logprobs is not None for p in kinds)
        num_logprobs = [p.logprobs for p in params] if asked else [None] * len(params)
        return logprobs_on_device(source, token_ids, num_logprobs, as_logits=self.logprobs_mode.endswith("logits"))


class PendingSamplerOutput:
    """A ``SamplerOutput`` on its way to the host: the tokens ``token_ids`` ``(n,)`` on the device (a next
    step's inputs may take them there), the copy of everything the host reads queued behind the
    step's work, and, on CUDA, an event recorded after it. ``result()`` waits for that event only."""

    def __init__(self, token_ids: torch.Tensor, chosen: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None,
                 num_logprobs: Sequence[int | None]) -> None:
        self.token_ids, self.num_logprobs = token_ids, num_logprobs
        # token ids are exact in float64 (any vocabulary below 2**53): one copy for the tokens and their logprobs
        rows = [torch.stack((token_ids.to(torch.float64), chosen.to(torch.float64)))]
        if top is not None:
            rows.append(torch.stack((top[0].to(torch.float64), top[1].to(torch.float64))))
        self.event: torch.cuda.Event | None = None
        if token_ids.device.type == "cuda" and torch.cuda.is_available():
            self.host = [t.to("cpu", non_blocking=True) for t in rows]  # pinned by the copy: not waited for
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = rows

    def result(self) -> SamplerOutput:
        if self.event is not None:
            self.event.synchronize()
        host_tokens, logprobs = self.host[0].tolist()
        tokens_list = [int(t) for t in host_tokens]
        top: list[dict[int, float] | None] = [None] * len(tokens_list)
        if len(self.host) > 1:
            host_values, host_indices = self.host[1].tolist()
            asked = [i for i, k in enumerate(self.num_logprobs) if k is not None]
            for r, i in enumerate(asked):
                k = self.num_logprobs[i] or 0
                top[i] = {**{int(t): v for t, v in zip(host_indices[r][:k], host_values[r][:k], strict=True)},
                          tokens_list[i]: logprobs[i]}
        return SamplerOutput(tokens_list, logprobs, top)


def logprobs_on_device(logits: torch.Tensor, token_ids: torch.Tensor | list[int], num_logprobs: Sequence[int | None],
                       as_logits: bool = False) -> PendingSamplerOutput:
    """``compute_logprobs``, its copy to the host queued and not waited for."""
    tokens = token_ids if isinstance(token_ids, torch.Tensor) else to_device(token_ids, logits.device, torch.int64)
    rows = logits if as_logits else torch.log_softmax(logits, dim=-1)  # (n, vocab); one pass
    chosen = rows.gather(1, tokens[:, None])[:, 0]
    asked = [i for i, k in enumerate(num_logprobs) if k is not None]
    top = None
    if asked:
        top = torch.topk(rows.index_select(0, to_device(asked, logits.device, torch.int64)),
                         max(num_logprobs[i] or 0 for i in asked))
    return PendingSamplerOutput(tokens, chosen, top, num_logprobs)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor | list[int], num_logprobs: Sequence[int | None],
                     as_logits: bool = False) -> SamplerOutput:
    """The tokens ``token_ids`` ``(n,)``, the log-probability of each row's token, and the top ``k``
    ones (and the chosen one), ``{token: logprob}``, only for the rows whose ``num_logprobs`` is a
    number ``k``; on the host. ``as_logits``: the logits themselves instead (the same tokens are the
    top ones). The tokens and their log-probabilities come back in one copy, the top ones in one more."""
    return logprobs_on_device(logits, token_ids, num_logprobs, as_logits).result()
