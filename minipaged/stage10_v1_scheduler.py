"""Stage 10 — from the paper to today's vLLM (V1): one token budget, chunked prefill, a persistent batch.

Stage 6 schedules as the paper did: a step decodes the running requests, then admits whole
prompts. vLLM V1 has no phases. A request is its tokens and how many of them are computed
(``num_computed_tokens``); a step hands out at most ``max_num_batched_tokens`` new tokens
(the ``token_budget``):

1. **Running requests, oldest first**, each get ``min(tokens not yet computed, budget left)``:
   1 for a decode, a **chunk** of its prompt for a request still prefilling. A request
   that needs a block when none is free preempts the **newest** running request by
   **recompute** — its blocks freed, back to the *front* of ``waiting``, its
   ``num_computed_tokens`` back to 0 (no swap in V1).
2. **Waiting requests, oldest first**, while budget, blocks and ``max_num_seqs`` last; the
   first that does not fit stops the others. With prefix caching (on by default, as in vLLM
   V1; ``enable_prefix_caching=False`` turns it off) stage 9's ``allocate`` takes the cached
   prefix, so a request starts at its first uncached token (stage 9 never takes the block of
   the last token, so it is always computed). The last request admitted may get only a
   chunk of its prompt.

A chunk attends to the computed prefix and to itself: stage 4's variable-length path
(``query_start_loc``). Decodes and chunks share one forward pass; a request whose prompt
is not finished produces no token that step. The scheduler tells the runner only what
changed since the last step (``NewRequestData``, ``CachedRequestData``, in a
``SchedulerOutput``: ``stage10_sched_output``); the runner (``stage10_model_runner``) keeps
every request's inputs in a **persistent batch**.

Composed from a block manager (stage 9's, or stage 6's without prefix caching), stage 7's
sampler and engine, and the model, through their public interfaces. Simplification: V1
allocates a chunk's blocks as it schedules it; here the manager's ``allocate`` takes blocks
for the whole sequence when it is admitted. One
sequence per request: ``n > 1`` and beam search are refused. Checked against stage 9: the
same tokens and log-probabilities for any budget, from 1 token up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any, Protocol

from minipaged.common.checks import check_int
from minipaged.common.prompt_logprobs import prompt_logprob_positions
from minipaged.common.sequence import Sequence, SequenceStatus
from minipaged.common.stats import SchedulerStats
from minipaged.stage7_engine import Request
from minipaged.stage10_kv_cache_manager import KVCacheManager
from minipaged.stage10_sched_output import NewRequestData, SchedulerOutput


def tokens_after(seq: Sequence, start: int) -> list[int]:
    """``seq.token_ids[start:]``, without copying the prompt when ``start`` is past it."""
    prompt = len(seq.prompt_token_ids)
    return seq.output_token_ids[start - prompt:] if start >= prompt else seq.token_ids[start:]


class SchedulerConnector(Protocol):
    """The scheduler side of a KV connector, which the scheduler holds when one is configured (vLLM's
    ``Scheduler.connector``; stage 14 gives one): told what each step loads and saves, which
    requests end, and which ones read K/V it failed to load."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any: ...
    def request_finished(self, request: Sequence, block_ids: list[int]) -> Any: ...
    def recompute_after_load_error(self, request: Sequence) -> None: ...


class SpecTokenScheduler(Protocol):
    """A part that guesses tokens past a request's last, to be checked in the same forward (vLLM's
    ``spec_token_ids``; stage 12 gives one): it says how many a decode takes this step, and which."""

    def num_new_tokens(self, scheduler: V1Scheduler, request: Request, n: int, budget: int) -> int: ...
    def take_scheduled(self, scheduler_output: SchedulerOutput) -> dict[Hashable, list[int]]: ...


class V1Scheduler:
    """Waiting and running requests under one token budget per step (``max_num_batched_tokens``)."""

    def __init__(self, kv_cache_manager: KVCacheManager, *, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 256, max_model_len: int = 2048, connector: SchedulerConnector | None = None,
                 spec_decoder: SpecTokenScheduler | None = None) -> None:
        check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        check_int("max_num_seqs", max_num_seqs, 1)
        self.kv_cache_manager, self.block_manager = kv_cache_manager, kv_cache_manager.manager
        if self.block_manager.blocks_needed(max_model_len) > self.block_manager.num_total_blocks:
            raise ValueError(f"max_model_len={max_model_len} does not fit the cache's blocks")
        self.max_num_batched_tokens, self.max_num_seqs, self.max_model_len = (
            max_num_batched_tokens, max_num_seqs, max_model_len)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in the order they were admitted: the oldest first
        self.finished_req_ids: list[Hashable] = []  # for the runner, at the next step
        self.num_tokens_sent: dict[Hashable, int] = {}  # tokens of each request the runner holds
        self._stats = SchedulerStats(num_gpu_blocks=self.block_manager.num_total_blocks)
        self.connector, self.spec_decoder = connector, spec_decoder  # optional parts (the module's docstring)

    def add(self, request: Request) -> None:
        """Queue a request of one sequence; ``ValueError`` for one that could never be served."""
        if len(request.seqs) != 1 or request.width != 1:
            raise ValueError("stage 10 serves one sequence per request: n > 1 and beam search are stage 8's")
        seq = request.seqs[0]
        if len(seq) < 1:
            raise ValueError("the prompt is empty: a request needs at least one token")
        longest = len(seq) + request.max_tokens
        if (longest > self.max_model_len
                or self.block_manager.blocks_needed(longest) > self.block_manager.num_total_blocks):
            raise ValueError(f"prompt ({len(seq)} tokens) + max_tokens ({request.max_tokens}) exceeds "
                             f"max_model_len={self.max_model_len} or the cache")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return any(not r.is_finished() for r in (*self.waiting, *self.running))

    def make_stats(self) -> SchedulerStats:
        """Its queues now and its counters since it started (it never swaps)."""
        manager = self.block_manager
        running = sum(not r.is_finished() for r in self.running)  # finished ones leave at the next step
        return dataclasses.replace(self._stats, num_running_reqs=running, num_waiting_reqs=len(self.waiting),
                                   num_used_blocks=manager.num_total_blocks - manager.num_free_blocks)

    def finish(self, seq: Sequence) -> None:
        """A sequence is done: its blocks go back, and the runner drops its row next step."""
        request = self.request_of(seq)
        self.tell_connector_finished(seq)
        self.kv_cache_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        self.finished_req_ids.append(request.request_id)
        self.num_tokens_sent.pop(request.request_id, None)

    def request_of(self, seq: Sequence) -> Request:
        return next(r for r in (*self.running, *self.waiting) if r.seqs[0] is seq)

    def abort(self, request_id: Hashable) -> bool:
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    seq = request.seqs[0]
                    self.tell_connector_finished(seq)
                    if seq.status is SequenceStatus.RUNNING:
                        self.kv_cache_manager.free(seq)
                    seq.status = SequenceStatus.FINISHED
                    self.finished_req_ids.append(request_id)
                    self.num_tokens_sent.pop(request_id, None)
                    return True
        return False

    def tell_connector_finished(self, seq: Sequence) -> None:
        """A request ends (finished or aborted): its connector, if any, hears of it with the blocks it
        still holds (vLLM's ``request_finished``), before they are freed."""
        if self.connector is not None:
            holds = seq.status is SequenceStatus.RUNNING
            self.connector.request_finished(seq, self.block_manager.get_block_table(seq.seq_id) if holds else [])

    def recompute_after_load_error(self, request: Request) -> None:
        """A running request read K/V that a part could not load (a connector's): it goes back to the front
        of ``waiting`` to be computed from its first token (vLLM's ``kv_load_failure_policy="recompute"``),
        its blocks freed and its row dropped at the next step; its connector hears of it."""
        seq = request.seqs[0]
        self.running.remove(request)
        self.kv_cache_manager.free(seq)
        seq.num_computed_tokens, seq.status = 0, SequenceStatus.WAITING
        self.waiting.insert(0, request)
        self.finished_req_ids.append(request.request_id)
        self.num_tokens_sent.pop(request.request_id, None)
        if self.connector is not None:
            self.connector.recompute_after_load_error(seq)

    def preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Recompute: free the blocks, forget the computed tokens, back to the front of ``waiting``."""
        seq = request.seqs[0]
        # BEGIN SOLUTION free its blocks, num_computed_tokens to 0, WAITING, at the front of waiting
        self.kv_cache_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.insert(0, request)
        # END SOLUTION
        out.preempted.append(request)
        out.preempted_req_ids.append(request.request_id)
        self._stats.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        """Decide the next step; the rules, each checked by a test of its own:

        1. Running requests, oldest first, while budget is left: each gets
           ``n = num_new_tokens(request, budget left)`` tokens (a request given 0 — with async scheduling,
           its next token is not sampled yet — is skipped, not scheduled), if ``allocate_slots``
           finds room for them; if not, preempt the newest running request (the last of
           ``running``), possibly the one asking (then stop), and try again. Every scheduled
           token — decodes too — comes off the budget.
        2. Waiting requests, oldest first, while budget is left and fewer than ``max_num_seqs`` run;
           stop at the first that ``allocate_prompt`` refuses. (V1 admits nothing in a step that
           preempted; here that is no rule of its own: the request just preempted heads the queue
           and cannot fit, its blocks being one fewer than it needs.) An admitted request joins
           the end of ``running`` with ``num_computed_tokens`` set to what ``allocate_prompt``
           found and gets ``n`` tokens as above.

        At the end every scheduled request's ``num_computed_tokens`` grows by its ``n`` (V1 counts
        them computed as soon as they are scheduled). New requests go to the runner whole
        (``NewRequestData``), running ones as differences (an entry of the step's ``CachedRequestData``:
        the tokens after those the runner holds, the new blocks, the tokens computed before the step),
        each just before ``add_to_step`` records its request: that also makes the full blocks its ``n``
        tokens complete findable, at once, for the requests scheduled after it in the same step.
        """
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = []
        self.running = [r for r in self.running if r.seqs[0].status is not SequenceStatus.FINISHED]  # one seq each
        budget, kv = self.max_num_batched_tokens, self.kv_cache_manager
        # BEGIN SOLUTION running requests first (preempting the newest when blocks are short), then waiting ones
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            seq = request.seqs[0]
            n = self.num_new_tokens(request, budget)
            if n == 0:  # nothing to compute yet (with async scheduling: its token is not sampled yet)
                i += 1
                continue
            while (new_blocks := kv.allocate_slots(seq, n)) is None:
                victim = self.running.pop()  # the newest
                self.preempt(victim, out)
                if victim is request:
                    break
            if new_blocks is None:
                break  # it preempted itself: every older request is scheduled
            sent = self.num_tokens_sent[request.request_id]  # tokens of it the runner holds
            out.scheduled_cached_reqs.add(request.request_id, tokens_after(seq, sent), new_blocks,
                                          seq.num_computed_tokens)
            self.add_to_step(request, n, out)
            budget -= n
            i += 1
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            seq = request.seqs[0]
            computed = kv.allocate_prompt(seq)
            if computed is None:
                break
            self.waiting.pop(0)
            self.running.append(request)
            seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, computed
            n = min(len(seq) - computed, budget)
            out.scheduled_new_reqs.append(NewRequestData(
                request.request_id, list(seq.token_ids), kv.block_ids(seq), computed))
            self.add_to_step(request, n, out)
            budget -= n
        for request in out.scheduled:
            request.seqs[0].num_computed_tokens += out.num_scheduled_tokens[request.request_id]
        # END SOLUTION
        if self.spec_decoder is not None:  # the guessed tokens of the requests still scheduled
            out.scheduled_spec_decode_tokens = self.spec_decoder.take_scheduled(out)
        if self.connector is not None:  # what the connector's worker side loads and saves this step
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        if not out.scheduled:  # no step runs: the runner hears of these rows at the next one that does
            self.finished_req_ids = out.finished_req_ids + out.preempted_req_ids + self.finished_req_ids
        used = self.block_manager.num_total_blocks - self.block_manager.num_free_blocks
        self._stats.peak_blocks_used = max(self._stats.peak_blocks_used, used)
        return out

    def num_new_tokens(self, request: Request, budget: int) -> int:
        """The tokens a running request computes this step: ``num_tokens_to_compute``; with a spec
        decoder, a decode also takes the guessed tokens it lets fit (``spec_decoder.num_new_tokens``)."""
        n = self.num_tokens_to_compute(request, budget)
        return n if self.spec_decoder is None else self.spec_decoder.num_new_tokens(self, request, n, budget)

    def num_tokens_to_compute(self, request: Request, budget: int) -> int:
        """The tokens of a running request not computed yet, at most ``budget``."""
        seq = request.seqs[0]
        # BEGIN SOLUTION what is not computed yet, cut to the budget
        return min(len(seq) - seq.num_computed_tokens, budget)
        # END SOLUTION

    def add_to_step(self, request: Request, n: int, out: SchedulerOutput) -> None:
        """The request computes ``n`` tokens this step; the full blocks they complete become findable now, for
        the requests scheduled after it."""
        seq, req_id = request.seqs[0], request.request_id
        out.num_scheduled_tokens[req_id] = n
        out.scheduled.append(request)
        self.num_tokens_sent[req_id] = len(seq)
        self.kv_cache_manager.cache_blocks(seq, seq.num_computed_tokens + n)


def prompt_logprob_requests(out: SchedulerOutput) -> list[tuple[Request, range]]:
    """The requests of a step that asked for ``prompt_logprobs``, with the prompt positions it
    computes for them, in order (as the runner orders their rows). Read right after ``schedule``,
    which has already counted the step's tokens computed."""
    rows = []
    for request in out.scheduled:
        if request.params.prompt_logprobs is not None:
            seq, n = request.seqs[0], out.num_scheduled_tokens[request.request_id]
            positions = prompt_logprob_positions(seq.num_computed_tokens - n, n, len(seq.prompt_token_ids))
            if positions:
                rows.append((request, positions))
    return rows


