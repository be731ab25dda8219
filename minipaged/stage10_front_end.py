"""Stage 10 — what V1 serves in its front end: ``n`` samples, and beam search, as requests of one sequence.

V1's scheduler and runner know one sequence per request; vLLM V1 serves the rest in its front end,
and so does this stage.

**``n`` samples** (``SamplingParams(n=k)``, vLLM's ``vllm/v1/engine/parallel_sampling.py``): a
``ParentRequest`` makes ``k`` child requests, each an ordinary request of one sample, and gathers
their outputs back into one ``RequestOutput`` of ``k`` completions, in index order. Child ``i``
draws with a generator seeded ``seed + i`` (the request's ``seed``, or one the engine draws for it
once), as stage 8's sample ``i`` does: the same seed gives the same ``k`` samples, and stage 8's.
Aborting the parent aborts every child.

**Beam search** (``LLM.beam_search``, vLLM's ``vllm/beam_search.py``): each step, one request per
beam (the prompt and the beam's tokens) for one greedy token and its top ``2 * beam_width``
log-probabilities; stage 8's ``select_beams`` chooses among the candidates. The same beams as
stage 8's engine, without forking anything.

The paper's sharing is still there, without copy-on-write: the children's prompts, and the
beams' common tokens, are the same tokens, so the prefix cache (stage 9) hands their full blocks
from one request to the next — within a step too, as V1's KV cache manager makes a block
findable as soon as a step is scheduled to fill it. A hit stops before the last prompt token's
block: each request computes that block, and what it samples, on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from minipaged.common.processor import Prompt
from minipaged.common.sampling_params import CompletionOutput, RequestOutput, RequestOutputKind, SamplingParams
from minipaged.stage8_sharing import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, select_beams


@dataclass(frozen=True)
class ChildRequestId:
    """The id of sample ``index`` of the request ``parent``."""

    parent: Hashable
    index: int


class ParentRequest:
    """A request of ``n`` samples: its children's ids and parameters, and their outputs gathered."""

    def __init__(self, request_id: Hashable, params: SamplingParams) -> None:
        self.request_id, self.params = request_id, params
        self.seed = params.seed  # None until the engine has drawn one for the first child
        self.child_ids = [ChildRequestId(request_id, i) for i in range(params.n)]
        self.latest: dict[int, RequestOutput] = {}  # each child's last output
        self.finished: set[int] = set()

    def child_params(self, index: int) -> SamplingParams:
        """One sample, seeded ``seed + index``; the first with the request's seed, which may be None (the
        engine then draws one, and the parent keeps it as ``seed``)."""
        # BEGIN SOLUTION one sample each, seeded seed + index
        return dataclasses.replace(self.params, n=1, seed=None if self.seed is None else self.seed + index)
        # END SOLUTION

    def add_output(self, output: RequestOutput) -> None:
        """A child's output: kept, and counted if it is its last."""
        assert isinstance(output.request_id, ChildRequestId)
        index = output.request_id.index
        self.latest[index] = output
        if output.finished:
            self.finished.add(index)

    def make_output(self) -> RequestOutput | None:
        """The parent's output, if one is due: at every step with ``CUMULATIVE`` (the children's tokens so
        far; one that has none yet is empty), once every child is done with ``FINAL_ONLY``. Its
        completions are in index order."""
        done = len(self.finished) == self.params.n
        # BEGIN SOLUTION none before every child is done, unless cumulative; the n completions, in index order
        if not done and self.params.output_kind is RequestOutputKind.FINAL_ONLY:
            return None
        completions = [dataclasses.replace(self.latest[i].outputs[0], index=i) if i in self.latest
                       else CompletionOutput(i, "", [], 0.0, None) for i in range(self.params.n)]
        # END SOLUTION
        first = next(iter(self.latest.values()))
        return RequestOutput(self.request_id, first.prompt, first.prompt_token_ids, completions, done,
                             first.prompt_logprobs)


@dataclass
class Beam:
    """A beam of a search run in the front end: its tokens and their summed log-probability."""

    output_token_ids: list[int]
    cumulative_logprob: float = 0.0


@dataclass
class BeamSearchInstance:
    """One prompt's beam search in the front end (vLLM's name): its beams best first, its hypotheses."""

    beam: BeamSearchParams
    prompt: str | None
    prompt_token_ids: list[int]
    beams: list[Any] = field(default_factory=lambda: [Beam([])])
    hypotheses: list[tuple[float, float, list[int]]] = field(default_factory=list)
    improvable: bool = True


def beam_search_over(generate: Callable[[list[Prompt], SamplingParams], list[RequestOutput]],
                     prompts: list[tuple[str | None, list[int]]], params: BeamSearchParams,
                     eos_token_ids: Collection[int], text: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
    """Beam search in the front end, over any engine's ``generate``, as vLLM's ``LLM.beam_search`` runs over
    V1: each step, one request per beam (its prompt and tokens), for one greedy token and its top
    ``2 * beam_width`` log-probabilities; the candidates are scored as ``advance_beams`` scores them (in
    float32, as the engine adds them), and ``select_beams`` chooses. The beams' common tokens are the
    engine's to share: V1's prefix cache finds their full blocks. The same beams as stage 8's engine."""
    width = params.beam_width
    one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width, ignore_eos=True)
    searches = [BeamSearchInstance(params, text_, ids) for text_, ids in prompts]
    live = list(searches)
    while live:
        asked: list[Prompt] = [{"prompt_token_ids": s.prompt_token_ids + b.output_token_ids}
                               for s in live for b in s.beams]
        outputs = iter(generate(asked, one))
        running = []
        for search in live:
            candidates = []
            for b, beam in enumerate(search.beams):
                logprobs = next(outputs).outputs[0].logprobs
                assert logprobs is not None
                top = logprobs[0]  # {token: log-probability}: the top 2 * width
                values = torch.tensor(list(top.values())) + torch.tensor(beam.cumulative_logprob)  # float32
                candidates += [(value, b, token) for token, value in zip(top, values.tolist(), strict=True)]
            candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
            generated = len(search.beams[0].output_token_ids) + 1
            keep, done = select_beams(search, candidates[:2 * width], generated, eos_token_ids)
            if not done:
                search.beams = [Beam(search.beams[b].output_token_ids + [token], value) for value, b, token in keep]
                running.append(search)
        live = running
    return [BeamSearchOutput(s.prompt, s.prompt_token_ids, [BeamSearchSequence(tokens, logprob, score, text(tokens))
                                                           for score, logprob, tokens in s.hypotheses])
            for s in searches]
