"""Stage 8 — sharing in the engine: parallel sampling and beam search on shared blocks.

Stage 3 made sharing possible: ``fork`` gives a new sequence the blocks of another, and
copy-on-write copies only a shared, partly full last block when someone writes to it.
This stage puts it to work in the two decoding methods that need many sequences per
request.

**Parallel sampling** (``SamplingParams(n=k)``): the prompt is prefilled once, as one
sequence. From its logits, k first tokens are drawn — each sample has its own generator,
seeded ``seed + i`` — and the sequence is forked k - 1 times. The k samples share every
prompt block; each copies only the last, partial one, on its first write. With
``LLM(share_blocks=False)`` each sample is an independent sequence that prefills and holds
its own copy of the prompt: the same samples, in more memory.

**Beam search** (``LLM.beam_search``): ``beam_width`` beams advance together. Each step,
every (beam, next token) candidate is scored by the beam's log-probability plus the
token's; the best ``2 * beam_width`` are considered in order: a candidate that ends (an
end token, or the length limit) among the first ``beam_width`` becomes a finished
hypothesis, scored ``logprob / generated_len ** length_penalty``; the best ``beam_width``
others become the next beams. A beam kept twice is forked; a beam not kept is freed, and
its blocks return to the pool once no other beam shares them. Search stops as
transformers' ``generate(num_beams=...)`` does — so the two agree token for token.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from minipaged.stage6_scheduler import Scheduler, SchedulerOutput, Sequence, SequenceStatus
from minipaged.stage7_engine import LLM as EngineLLM
from minipaged.stage7_engine import SamplingParams, _Request, sample


class ForkingScheduler(Scheduler):
    """A scheduler that can fork a running sequence into a new one sharing its blocks."""

    def fork_sequence(self, parent: Sequence) -> Sequence:
        # BEGIN SOLUTION a new sequence with the parent's tokens, its blocks shared, running beside it
        child = Sequence(next(self._seq_ids), list(parent.prompt_token_ids), parent.max_tokens, parent.arrival,
                         list(parent.output_token_ids), SequenceStatus.RUNNING, parent.num_computed_tokens)
        self.block_manager.fork(parent.seq_id, child.seq_id)
        bisect.insort(self.running, child, key=Sequence.order)
        return child
        # END SOLUTION


@dataclass
class BeamSearchParams:
    """transformers' beam search settings: ``early_stopping`` is True, False or ``"never"``."""

    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1 or self.max_tokens < 1:
            raise ValueError(f"beam_width and max_tokens must be >= 1, got {self.beam_width}, {self.max_tokens}")
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


class LLM(EngineLLM):
    """Stage 7's engine with parallel sampling (``n > 1``) and beam search on shared blocks."""

    scheduler_class = ForkingScheduler

    def __init__(self, model: str = "tiny", *, share_blocks: bool = True, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.share_blocks = share_blocks

    def _check_n(self, params: SamplingParams) -> None:
        pass  # any n >= 1 (SamplingParams checks it)

    def _submit(self, request: _Request) -> None:
        copies = 1 if self.share_blocks else request.params.n  # unshared: every sample prefills its own copy
        for _ in range(copies):
            self._track(request, self.scheduler.add_sequence(request.prompt_token_ids, request.params.max_tokens))

    def _accept(self, request, seq, token, logprob, logprobs, logits) -> int:
        # BEGIN SOLUTION on the prompt's first token, fork n - 1 samples and draw their tokens from the same logits
        if self.share_blocks and len(request.seqs) < request.params.n:
            children = [self.scheduler.fork_sequence(seq) for _ in range(request.params.n - 1)]
            finished = 0
            for child in children:  # fork first: every child shares the prompt, none of the new tokens
                self._track(request, child)
                draw = sample(logits, request.params, request.generators[child.seq_id]) \
                    if request.params.temperature > 0 else token
                finished += super()._accept(request, child, draw, float(logprobs[draw]), logprobs, logits)
            return finished + super()._accept(request, seq, token, logprob, logprobs, logits)
        return super()._accept(request, seq, token, logprob, logprobs, logits)
        # END SOLUTION

    def beam_search(self, prompts, params: BeamSearchParams | None = None) -> list[BeamSearchOutput]:
        """Beam search for each prompt (one after the other); each output's beams best first."""
        params = params or BeamSearchParams()
        prepared = [self._prepare(p, SamplingParams(max_tokens=params.max_tokens)) for p in
                    ([prompts] if isinstance(prompts, str | dict) else prompts)]
        blocks = self.scheduler.block_manager.blocks_needed
        for request in prepared:
            need = params.beam_width * blocks(len(request.prompt_token_ids) + params.max_tokens)
            if need > self.scheduler.block_manager.num_total_blocks:
                raise ValueError(f"beam search of width {params.beam_width} may need {need} blocks; the cache "
                                 f"has {self.scheduler.block_manager.num_total_blocks}")
        if self.scheduler.has_unfinished():
            raise RuntimeError("beam_search needs an idle engine")
        return [self._beam_search_one(request, params) for request in prepared]

    def _logits(self, beams: list[Sequence], prefill: bool) -> torch.Tensor:
        """Run the model on the beams' new tokens: ``(len(beams), vocab)`` log-probabilities."""
        out = SchedulerOutput(scheduled=[(b, len(b) if prefill else 1) for b in beams],
                              blocks_to_copy=self.scheduler.block_manager.take_copies())
        return torch.log_softmax(self.execute_model(out), dim=-1)

    def _beam_search_one(self, request: _Request, params: BeamSearchParams) -> BeamSearchOutput:
        scheduler, manager = self.scheduler, self.scheduler.block_manager
        prompt_len, width = len(request.prompt_token_ids), params.beam_width
        first = scheduler.add_sequence(request.prompt_token_ids, params.max_tokens)
        scheduler.waiting.remove(first)
        manager.allocate(first.seq_id, prompt_len)
        first.status = SequenceStatus.RUNNING
        scheduler.running.append(first)
        beams, scores = [first], [0.0]  # running beams, best first, and their cumulative log-probs
        finished: list[tuple[float, float, list[int]]] = []  # (score, logprob, tokens), best first
        improvable, step = True, 0
        # BEGIN SOLUTION score (beam, token) candidates, finish the ending ones, fork/free the rest
        while True:
            logprobs = self._logits(beams, prefill=step == 0)  # (beams, vocab)
            total = (logprobs + torch.tensor(scores)[:, None]).flatten()
            values, indices = torch.topk(total, min(2 * width, total.numel()))
            generated = step + 1
            candidates, hits = [], []
            for value, index in zip(values.tolist(), indices.tolist(), strict=True):
                beam, token = divmod(index, logprobs.shape[1])
                ends = (not params.ignore_eos and token in self.eos_token_ids) or generated >= params.max_tokens
                candidates.append((value, beam, token))
                hits.append(ends)
            heuristic_ok = improvable and not (len(finished) == width and params.early_stopping is True)
            for rank, ((value, beam, token), ends) in enumerate(zip(candidates, hits, strict=True)):
                if ends and rank < width and heuristic_ok:
                    tokens = beams[beam].output_token_ids + [token]
                    finished.append((value / generated**params.length_penalty, value, tokens))
            finished = sorted(finished, key=lambda f: -f[0])[:width]
            keep = [c for c, ends in zip(candidates, hits, strict=True) if not ends][:width]
            if all(hits) or not keep:
                break
            beams, scores = self._advance(beams, keep)
            step += 1
            best_possible = scores[0] / ((params.max_tokens if params.early_stopping == "never"
                                          and params.length_penalty > 0 else generated) ** params.length_penalty)
            if len(finished) == width and best_possible <= finished[-1][0]:
                improvable = False
            if not improvable or (len(finished) == width and params.early_stopping is True):
                break
        # END SOLUTION
        for beam in list(beams):
            scheduler.finish(beam)
        results = [BeamSearchSequence(tokens, logprob, score, self._text(tokens)) for score, logprob, tokens in finished]
        return BeamSearchOutput(request.prompt, request.prompt_token_ids, results)

    def _advance(self, beams: list[Sequence], keep: list[tuple[float, int, int]]) -> tuple[list[Sequence], list[float]]:
        """The kept candidates become the beams: fork a beam kept twice, free a beam not kept."""
        scheduler, manager = self.scheduler, self.scheduler.block_manager
        children: dict[int, list[int]] = {}
        for k, (_, beam, _) in enumerate(keep):
            children.setdefault(beam, []).append(k)
        new_beams: list[Sequence | None] = [None] * len(keep)
        for beam, ks in children.items():
            new_beams[ks[0]] = beams[beam]
            for k in ks[1:]:  # fork before anyone appends: the forks share the parent's blocks
                new_beams[k] = scheduler.fork_sequence(beams[beam])
        for beam_index, beam in enumerate(beams):
            if beam_index not in children:
                scheduler.finish(beam)  # dropped: its references go, shared blocks stay
        for seq, (_, _, token) in zip(new_beams, keep, strict=True):
            scheduler.append_token(seq, token)
            manager.append_slot(seq.seq_id)  # copy-on-write if the last block is shared
        self.scheduler.peak_blocks_used = max(self.scheduler.peak_blocks_used,
                                              manager.num_total_blocks - manager.num_free_blocks)
        return new_beams, [value for value, _, _ in keep]

    def _text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer else ""
