"""Stage 8 — sharing in the engine: parallel sampling and beam search on shared blocks.

Stage 3 made sharing possible: ``fork`` gives a new sequence the blocks of another, and
copy-on-write copies only a shared, partly full last block when someone writes to it.
Stage 6 schedules sequence groups, so the sequences of one request run, move and are
preempted together. This stage puts both to work with one new part: an engine whose
output processing forks and frees the sequences of a group. Nothing below it changes.

**Parallel sampling** (``SamplingParams(n=k)``): the prompt is prefilled once, as one
sequence. From its logits, k first tokens are drawn — sample ``i`` with its own
generator, seeded ``seed + i``, exactly as stage 7's engine draws for k independent
requests seeded ``seed + i`` — and the sequence is forked k - 1 times. The k samples share
every prompt block; each copies only the last, partial one, on its first write.

**Beam search** (``LLM.beam_search``): ``beam_width`` beams advance together, in one
group. Each step, every (beam, next token) candidate is scored by the beam's
log-probability plus the token's; the best ``2 * beam_width`` are considered in order: a
candidate that ends (an end token, or the length limit) among the first ``beam_width``
becomes a finished hypothesis, scored ``logprob / generated_len ** length_penalty``; the
best ``beam_width`` others become the next beams. A beam kept twice is forked; a beam not
kept is freed, and its blocks return to the pool once no other beam shares them. Search
stops as transformers' ``generate(num_beams=...)`` does — so the two agree token for token:
with ``early_stopping=True`` as soon as ``beam_width`` hypotheses are finished; with ``False``
once they are and the best running beam's log-probability divided by the current
``generated_len ** length_penalty`` cannot beat the worst of them; with ``"never"`` the same,
but divided by ``max_tokens ** length_penalty`` when the penalty is positive.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from minipaged.common.checks import check_int
from minipaged.common.processor import Prompt
from minipaged.common.sampler import compute_logprobs
from minipaged.common.sampling_params import SamplingParams
from minipaged.common.sequence import SequenceStatus
from minipaged.stage7_engine import LLMEngine, Request, SampledSequence
from minipaged.stage7_model_runner import sample


@dataclass
class BeamSearchParams:
    """transformers' beam search settings: ``early_stopping`` is True, False or ``"never"``."""

    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        check_int("BeamSearchParams.beam_width", self.beam_width, 1)
        check_int("BeamSearchParams.max_tokens", self.max_tokens, 1)
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    token_ids: list[int]  # generated tokens, the end token included if one ended the beam
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    text: str = ""


@dataclass
class BeamSearchOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)  # best first


@dataclass(eq=False)
class BeamRequest(Request):
    """A beam search: its running beams best first, and the finished hypotheses (score, logprob, tokens)."""

    beam: BeamSearchParams = field(default_factory=BeamSearchParams)
    beams: list[SampledSequence] = field(default_factory=list)
    hypotheses: list[tuple[float, float, list[int]]] = field(default_factory=list)
    improvable: bool = True


class BeamState(Protocol):
    """What a beam search keeps between steps: its settings, the finished hypotheses (score, log-probability,
    tokens) best first, and whether a running beam can still beat the worst of them."""

    beam: BeamSearchParams
    beams: list[Any]
    hypotheses: list[tuple[float, float, list[int]]]
    improvable: bool


def select_beams(state: BeamState, candidates: list[tuple[float, int, int]], generated: int,
                 eos_token_ids: Collection[int]) -> tuple[list[tuple[float, int, int]], bool]:
    """One step of beam search, given the best ``2 * beam_width`` candidates ``(log-probability, beam, token)``,
    best first, and the length of the beams once the token is added: the ending candidates among the first
    ``beam_width`` become hypotheses; the best ``beam_width`` others are kept. Returns the kept candidates
    and whether the search is done (the module's docstring says when)."""
    p, width = state.beam, state.beam.beam_width
    beams = state.beams
    # BEGIN SOLUTION ending candidates among the first width become hypotheses; the best width others the beams
    heuristic_ok = state.improvable and not (len(state.hypotheses) == width and p.early_stopping is True)
    keep = []
    for rank, (value, beam, token) in enumerate(candidates):
        ends = (not p.ignore_eos and token in eos_token_ids) or generated >= p.max_tokens
        if ends and rank < width and heuristic_ok:
            tokens = list(beams[beam].output_token_ids) + [token]
            state.hypotheses.append((value / generated**p.length_penalty, value, tokens))
        elif not ends:
            keep.append((value, beam, token))
    state.hypotheses = sorted(state.hypotheses, key=lambda h: -h[0])[:width]
    keep = keep[:width]
    done = not keep
    if keep:
        best_possible = keep[0][0] / ((p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0
                                       else generated) ** p.length_penalty)
        if len(state.hypotheses) == width and best_possible <= state.hypotheses[-1][0]:
            state.improvable = False
        done = not state.improvable or (len(state.hypotheses) == width and p.early_stopping is True)
    # END SOLUTION
    return keep, done


class SharingEngine(LLMEngine):
    """Stage 7's engine whose requests fork: ``n`` samples, and beams, share their blocks."""

    def make_request(self, request_id: Hashable, text: str | None, ids: list[int], params: SamplingParams,
                     seed: int) -> Request:
        """One sequence prefills the prompt; the ``n - 1`` others are forked from it after its first step."""
        request = Request(request_id, [], params.max_tokens, width=params.n, prompt=text, params=params, seed=seed)
        request.seqs = [self.new_sequence(request, ids, 0)]
        return request

    def add_beam_request(self, request_id: Hashable, prompt: Prompt, params: BeamSearchParams) -> BeamRequest:
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"expected BeamSearchParams, got {type(params).__name__}")
        text, ids = self.check(request_id, prompt, params)
        sampling = SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=params.ignore_eos)
        request = BeamRequest(request_id, [SampledSequence(ids)], params.max_tokens, width=params.beam_width,
                              prompt=text, params=sampling, beam=params)
        request.beams = list(request.seqs)
        self.scheduler.add(request)
        self.requests[request_id] = request
        return request

    def fork(self, request: Request, parent: SampledSequence, index: int) -> SampledSequence:
        """A new running sequence of ``request``: the parent's tokens, computed count and log-probabilities (a copy),
        its blocks shared through the block manager's ``fork``, and a generator seeded ``seed + index``."""
        # BEGIN SOLUTION copy the tokens and sampling state, fork the block table, join the group
        child = self.new_sequence(request, parent.prompt_token_ids, index)
        child.output_token_ids = list(parent.output_token_ids)
        child.status, child.num_computed_tokens = SequenceStatus.RUNNING, parent.num_computed_tokens
        child.cumulative_logprob, child.logprobs = parent.cumulative_logprob, list(parent.logprobs)
        self.scheduler.block_manager.fork(parent.seq_id, child.seq_id)
        request.seqs.append(child)
        return child
        # END SOLUTION

    def process_outputs(self, request: Request, seqs: list[SampledSequence], tokens: list[int],
                        chosen: list[float], top: list[dict[int, float] | None], logits: torch.Tensor) -> None:
        """As stage 7, after one rule: when a request of ``n`` samples has prefilled its prompt (one
        sequence so far), fork ``n - 1`` samples first — sample ``i`` seeded ``seed + i`` draws its first
        token from the same logits, greedy samples take the same token — then append every token. It forks
        once: a sample that stops early is not replaced.
        A beam request goes to ``advance_beams``."""
        if isinstance(request, BeamRequest):
            return self.advance_beams(request, seqs, torch.log_softmax(logits, dim=-1))
        # BEGIN SOLUTION after the prompt's step, fork n - 1 samples; each draws its first token from the same logits
        if len(request.seqs) < request.width:
            parent, params = seqs[0], request.params
            for index in range(1, request.width):  # fork first: the samples share the prompt, no new token
                child = self.fork(request, parent, index)
                draw = sample(logits[0], params, child.generator) if params.temperature > 0 else tokens[0]
                sampled = compute_logprobs(logits[:1], [draw], [params.logprobs])
                (logprob,), (top_logprobs,) = sampled.logprobs, sampled.top_logprobs
                self.append_token(request, child, draw, logprob, top_logprobs)
        # END SOLUTION
        super().process_outputs(request, seqs, tokens, chosen, top, logits)

    def advance_beams(self, request: BeamRequest, seqs: list[SampledSequence], logprobs: torch.Tensor) -> None:
        """Score the (beam, token) candidates, finish the ending ones, fork or free the beams."""
        width = request.beam.beam_width
        beams = request.beams
        rows = logprobs[[seqs.index(b) for b in beams]]  # (beams, vocab), best beam first
        scores = torch.tensor([b.cumulative_logprob for b in beams])
        # BEGIN SOLUTION the best 2 * width (beam, token) candidates, by the beam's log-probability plus the token's
        values, indices = torch.topk((rows + scores[:, None]).flatten(), min(2 * width, rows.numel()))
        candidates = [(value, *divmod(index, rows.shape[1])) for value, index in zip(values.tolist(), indices.tolist(),
                                                                                     strict=True)]
        # END SOLUTION
        keep, done = select_beams(request, candidates, len(beams[0].output_token_ids) + 1, self.eos_token_ids)
        request.beams = self.replace_beams(request, beams, [] if done else keep)

    def replace_beams(self, request: BeamRequest, beams: list[SampledSequence],
                      keep: list[tuple[float, int, int]]) -> list[SampledSequence]:
        """The kept candidates become the beams: a beam kept twice is forked, a beam not kept is freed.

        ``keep``: the kept candidates, best first, each ``(logprob, index of its beam in beams, token)``."""
        kept_by: dict[int, list[int]] = {}
        for k, (_, beam, _) in enumerate(keep):
            kept_by.setdefault(beam, []).append(k)
        new_beams = [beams[beam] for _, beam, _ in keep]  # each candidate's beam; below, a beam kept twice forks
        for beam, ks in kept_by.items():
            for k in ks[1:]:  # fork before anyone appends: the forks share the parent's blocks
                new_beams[k] = self.fork(request, beams[beam], k)
        for index, seq in enumerate(beams):
            if index not in kept_by:
                seq.finish_reason = "length"
                self.scheduler.finish(seq)  # dropped: its references go, shared blocks stay
        for seq, (value, _, token) in zip(new_beams, keep, strict=True):
            seq.append_token(token)
            seq.cumulative_logprob = value
        return new_beams

    def beam_search(self, prompts: list[Prompt], params: BeamSearchParams,
                    request_ids: Iterable[Hashable]) -> list[BeamSearchOutput]:
        """Beam search for each prompt (with the request ids given), served together until all are done;
        each output's beams best first. An exception or Ctrl-C aborts every one of them."""
        requests: list[BeamRequest] = []
        try:
            for prompt, request_id in zip(prompts, request_ids):
                requests.append(self.add_beam_request(request_id, prompt, params))
            while self.has_unfinished_requests() and not all(r.is_finished() for r in requests):
                self.step()
        except BaseException:
            for request in requests:
                self.abort_request(request.request_id)
            raise
        return [BeamSearchOutput(r.prompt, r.seqs[0].prompt_token_ids[:],
                                 [BeamSearchSequence(tokens, logprob, score, self.text(tokens))
                                  for score, logprob, tokens in r.hypotheses]) for r in requests]
