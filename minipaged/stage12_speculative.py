"""Stage 12 — speculative decoding on paged KV: propose, verify in one forward, roll back what is rejected.

A decode step computes one token per request and reads the whole model to do it. With
speculative decoding (``LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2})``, vLLM's names) each step goes:

1. **Propose.** Before the step, every request whose tokens are all computed but the last gets
   drafts from the ``NgramProposer`` (``stage12_rejection_sampler``).
2. **Schedule.** A request with ``d`` drafts is scheduled as ``1 + d`` tokens of the token budget
   (its last token and the drafts); ``allocate_slots`` finds blocks for the lookahead slots
   before the step. Drafts that do not fit — the budget, ``max_tokens``, ``max_model_len`` or
   the free blocks — are cut, down to none: a request decodes without drafts rather than
   preempt another for them.
3. **Verify.** One forward pass computes the last token and the drafts together (the varlen
   path that chunks use), their K/V written into the slots. The runner returns the target's
   logits at all ``1 + d`` positions, and the ``RejectionSampler`` keeps the longest run of
   drafts the target agrees with, plus one token of the target's own: ``a + 1`` tokens.
4. **Roll back.** The rejected drafts' K/V sit in slots past the request's tokens: nothing reads
   them, and the next step's tokens overwrite them. ``num_computed_tokens`` goes back to what
   was verified (in the scheduler and in the runner's persistent batch), the slots stay
   allocated. Prefix caching names a block only once its sequence's tokens are known (stage
   9 caches the blocks of the prompt), so no hash ever covers a draft.

Greedy outputs are stage 10's, token for token; sampled outputs have stage 10's distribution.
A stop token, a stop string or ``max_tokens`` among the kept tokens ends the request there.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from minipaged.common.sequence import Sequence
from minipaged.common.stats import SpecDecodingStats
from minipaged.stage7_engine import LLMEngine, Request
from minipaged.stage10_model_runner import InputBatch
from minipaged.stage10_sched_output import NewRequestData, SchedulerOutput
from minipaged.stage10_v1_scheduler import V1Scheduler
from minipaged.stage12_rejection_sampler import NgramProposer, RejectionSampler


class SpecInputBatch(InputBatch):
    """The persistent batch with each request's drafts after its tokens, for the step they are verified in."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_drafts: dict[Hashable, int] = {}  # drafts at the end of each row, since the last step

    def add_request(self, new: NewRequestData) -> None:
        self.num_drafts.pop(new.req_id, None)
        super().add_request(new)

    def update_request(self, req_id: Hashable, new_token_ids: list[int], new_block_ids: tuple[list[int], ...]) -> None:
        """Drop the row's drafts (the tokens the target kept arrive as new tokens), then append the
        update, then this step's drafts (``spec_token_ids``). After a verification the row's last
        token is not computed."""
        row = self.row_of[req_id]
        # BEGIN SOLUTION roll back past the drafts; apply the update; computed = all but the last; add the drafts
        verified = self.num_drafts.pop(req_id, None)
        if verified is not None:
            self.num_tokens[row] -= verified
        super().update_request(req_id, new_token_ids, new_block_ids)
        if verified is not None:
            self.num_computed_tokens[row] = self.num_tokens[row] - 1
        drafts = self.spec_token_ids.get(req_id, [])
        t = self.num_tokens[row]
        self.token_ids[row, t:t + len(drafts)] = drafts
        self.num_tokens[row] += len(drafts)
        if drafts:
            self.num_drafts[req_id] = len(drafts)
        # END SOLUTION

    def remove_request(self, req_id: Hashable) -> None:
        self.num_drafts.pop(req_id, None)
        super().remove_request(req_id)


class SpecDecoder:
    """Speculative decoding as one part, which V1's engine, scheduler and runner hold (stage 10's seams):
    drafts proposed before a step, cut to what fits when it is scheduled, the rows that verify them
    picked out of the forward pass, and the tokens the rejection sampler keeps appended after it."""

    def __init__(self, proposer: NgramProposer, rejection_sampler: RejectionSampler) -> None:
        self.proposer, self.rejection_sampler = proposer, rejection_sampler
        self.spec_token_ids: dict[Hashable, list[int]] = {}  # the drafts proposed for the next step
        self.scheduled: dict[Hashable, list[int]] = {}  # the drafts scheduled in this step, so far
        self.spec_stats = SpecDecodingStats()

    def propose(self, running: list[Request]) -> None:
        """Drafts for every running request whose tokens are all computed but its last."""
        for request in running:
            seq = request.seqs[0]
            if not request.is_finished() and seq.num_computed_tokens == len(seq) - 1:
                drafts = self.proposer.propose(seq.token_ids)
                if drafts:
                    self.spec_token_ids[request.request_id] = drafts

    @staticmethod
    def fits(scheduler: V1Scheduler, seq: Sequence, num_new_tokens: int) -> bool:
        """Would ``allocate_slots(seq, num_new_tokens)`` find the blocks, with nobody preempted?"""
        return scheduler.kv_cache_manager.can_allocate_slots(seq, num_new_tokens)

    def num_new_tokens(self, scheduler: V1Scheduler, request: Request, n: int, budget: int) -> int:
        """The scheduler's count ``n``; a decode with drafts adds as many of them as the budget, the
        request's ``max_tokens`` and ``max_model_len``, and the free blocks leave room for."""
        drafts = self.spec_token_ids.pop(request.request_id, [])
        seq = request.seqs[0]
        if n != 1 or not drafts:
            return n
        # BEGIN SOLUTION cut the drafts to the budget, max_tokens and max_model_len; none unless their slots fit
        room = min(budget - 1, request.max_tokens - len(seq.output_token_ids) - 1,
                   scheduler.max_model_len - len(seq) - 1)
        drafts = drafts[:max(0, room)]
        if not drafts or not self.fits(scheduler, seq, 1 + len(drafts)):
            return 1
        self.scheduled[request.request_id] = drafts
        return 1 + len(drafts)
        # END SOLUTION

    def take_scheduled(self, out: SchedulerOutput) -> dict[Hashable, list[int]]:
        """The drafts of the requests the step kept (a preempted request's are dropped); proposals are
        for one step."""
        spec = {r: d for r, d in self.scheduled.items() if r in out.num_scheduled_tokens}
        self.scheduled, self.spec_token_ids = {}, {}
        return spec

    def logits_indices(self, out: SchedulerOutput, ends: np.ndarray) -> np.ndarray:
        """For each request with ``d`` drafts (in the step's order; ``ends``: one past each request's last
        flat index), the ``d`` rows of its last token and of every draft but the last (whose row is the
        request's own, among the first ones)."""
        spec = out.scheduled_spec_decode_tokens
        # BEGIN SOLUTION the flat index of the last token and of each draft but the last, request by request
        rows = [int(end) - 1 - len(spec[r]) + j for r, end in zip(out.num_scheduled_tokens, ends, strict=True)
                if r in spec for j in range(len(spec[r]))]
        # END SOLUTION
        return np.array(rows, dtype=np.int64)

    def verify(self, engine: LLMEngine, request: Request, drafts: list[int], logits: torch.Tensor) -> None:
        """Keep what the rejection sampler keeps (``logits``: the ``d + 1`` rows), token by token (a stop ends
        it there; ``engine.append_token``); then roll ``num_computed_tokens`` back to the tokens verified."""
        seq = request.seqs[0]
        # BEGIN SOLUTION verify; append each kept token until one stops the request; roll back what was computed
        kept = self.rejection_sampler(logits, seq.prompt_token_ids, seq.output_token_ids, seq.generator,
                                      request.params, drafts)
        for token, logprob, top in zip(kept.token_ids, kept.logprobs, kept.top_logprobs, strict=True):
            engine.append_token(request, seq, token, logprob, top)
            if request.is_finished():
                break
        else:
            seq.num_computed_tokens = len(seq) - 1  # the rejected drafts' K/V are past the tokens: never read
        # END SOLUTION
        self.spec_stats.num_drafts += 1
        self.spec_stats.num_draft_tokens += len(drafts)
        self.spec_stats.num_accepted_tokens += kept.num_accepted
