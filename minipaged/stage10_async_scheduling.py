"""Stage 10, async scheduling: the scheduler prepares step N + 1 while step N's forward pass runs.

A synchronous engine does one thing at a time: schedule, run the model, sample, process the
outputs, and only then schedule again. Everything but the forward pass keeps the model
waiting. NanoFlow (Zhu et al., 2024) and vLLM V1's ``--async-scheduling`` overlap them: the
forward pass (and the sampler after it) runs in a worker — a thread here: torch releases the
GIL inside its kernels, and one torch thread leaves the second core free — while the engine
schedules the next step and processes the last one's outputs. One step ``N`` is in flight:

1. **Schedule N + 1**, while N runs. A request that N samples is scheduled again with a
   **placeholder** for the token not sampled yet (``AsyncScheduler.num_new_tokens``): its slot
   and blocks are allocated, its id is unknown. Not scheduled yet: a request whose token is
   its last (it ends, whatever the token), or its first since admission (stage 9 makes the
   prompt's blocks findable at its first decode; step N must have written them first).
2. **Wait for N**: its logits and sampled tokens.
3. **Append the tokens** to their sequences, write them into N + 1's messages for the runner
   (``add_sampled_tokens``), and **launch N + 1**.
4. **Process N's outputs** while N + 1 runs: stop tokens, stop strings, finished requests.

What it cannot know, it pays for: a request that stops at step N (an end token, a stop
string) was scheduled in N + 1 too, and that computation is thrown away. The outputs are
those of synchronous stepping, token for token (``tests/test_stage10_async_scheduling.py``): the same
tokens are computed in the same order, each sequence draws with its own generator, and a
request preempted while its step ran keeps the token that step sampled for it.

An exception or Ctrl-C aborts the requests of both steps, scheduled or preempted; a forward
pass still running finishes in the worker before any other starts, its result dropped.
"""

from __future__ import annotations

from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from minipaged.common.sampler import SamplerOutput
from minipaged.common.sampling_params import RequestOutput
from minipaged.common.sequence import Sequence, SequenceStatus
from minipaged.stage7_engine import CUMULATIVE, Request
from minipaged.stage10_sched_output import SchedulerOutput
from minipaged.stage10_v1_scheduler import V1Engine, V1Scheduler, prompt_logprob_requests, tokens_after


class AsyncScheduler(V1Scheduler):
    """V1's scheduler, scheduling placeholders for the tokens of the step in flight."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.admitted_len: dict[Hashable, int] = {}  # each running request's length when it was (re)admitted

    def schedule(self) -> SchedulerOutput:
        """V1's step; the requests it admits are remembered with their length then (``num_new_tokens``)."""
        out = super().schedule()
        for new in out.scheduled_new_reqs:
            self.admitted_len[new.req_id] = len(new.token_ids)
        return out

    def num_new_tokens(self, request: Request, budget: int) -> int:
        """V1's count; a request whose tokens are all computed (the step in flight samples its next)
        gets one placeholder for that token (its id reaches the runner before this step runs:
        ``add_sampled_tokens``), unless it is the request's last (``max_tokens``, ``max_model_len``)
        or its first since it was admitted: its first decode makes its prompt's blocks findable
        (stage 9), and they must not be before the step in flight has surely written their K/V."""
        seq = request.seqs[0]
        if seq.num_computed_tokens < len(seq):
            return super().num_new_tokens(request, budget)
        # BEGIN SOLUTION one placeholder, except for the last token and the first since admission
        last = len(seq.output_token_ids) + 1 >= request.max_tokens or len(seq) + 1 >= self.max_model_len
        return 0 if last or len(seq) == self.admitted_len[request.request_id] else 1
        # END SOLUTION

    def add_sampled_tokens(self, out: SchedulerOutput) -> None:
        """The tokens sampled since ``out`` was scheduled, added to its messages for the runner
        (``CachedRequestData.new_token_ids``) before it runs."""
        requests = {r.request_id: r for r in out.scheduled}
        for cached in out.scheduled_cached_reqs:
            sent = self.num_tokens_sent.get(cached.req_id)
            if sent is not None:  # not finished since
                seq = requests[cached.req_id].seqs[0]
                cached.new_token_ids += tokens_after(seq, sent)
                self.num_tokens_sent[cached.req_id] = len(seq)

    def finish(self, seq: Sequence) -> None:
        """V1's; a sequence preempted while its last step ran finishes from ``waiting``, holding no block."""
        if seq.status is SequenceStatus.RUNNING:
            self.admitted_len.pop(self.request_of(seq).request_id, None)
            super().finish(seq)
        else:  # out of waiting, its row dropped: what an abort does to a request that holds no block
            self.abort(self.request_of(seq).request_id)

    def abort(self, request_id: Hashable) -> bool:
        self.admitted_len.pop(request_id, None)
        return super().abort(request_id)


class InFlight(NamedTuple):
    """The step running in the worker: what was scheduled, the prompt positions it computes for
    ``prompt_logprobs``, and its result to come."""

    out: SchedulerOutput
    prompt_rows: list[tuple[Request, range]]
    future: Future[tuple[list[Request], SamplerOutput, torch.Tensor]]


class AsyncV1Engine(V1Engine):
    """Stage 10's engine with one step in flight, over an ``AsyncScheduler``: ``LLM(..., async_scheduling=True)``."""

    scheduler: AsyncScheduler

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minipaged-forward")  # one step at a time
        self.in_flight: InFlight | None = None

    def forward_and_sample(self, out: SchedulerOutput) -> tuple[list[Request], SamplerOutput, torch.Tensor]:
        """The worker's part of a step: the forward pass, then the sampler on the rows that sample;
        the logits of the prompt positions asked for come back as they are."""
        by_id = {r.request_id: r for r in out.scheduled}
        req_ids, logits = self.runner.execute_model(out)
        requests = [by_id[r] for r in req_ids]
        n = len(requests)
        sampled = self.sampler(logits[:n], [r.seqs[0] for r in requests], [r.params for r in requests])
        return requests, sampled, logits[n:]

    def launch(self, out: SchedulerOutput) -> None:
        self.scheduler.add_sampled_tokens(out)
        self.in_flight = InFlight(out, prompt_logprob_requests(out), self.worker.submit(self.forward_and_sample, out))

    def step(self) -> list[RequestOutput]:
        """Schedule the next step while this one runs; return this one's outputs."""
        if self.in_flight is None:  # nothing running: schedule and launch a step first
            first = self.scheduler.schedule()
            if not first.total_num_scheduled_tokens:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("the scheduler found nothing to run although requests remain")
                return []
            self.launch(first)
        assert self.in_flight is not None
        out, prompt_rows, future = self.in_flight
        next_out: SchedulerOutput | None = None
        try:
            # BEGIN SOLUTION schedule N + 1 while N runs; wait for N; append its tokens; launch N + 1; then N's stops
            next_out = self.scheduler.schedule()
            requests, sampled, prompt_logits = future.result()
            self.in_flight = None
            self.record_prompt_logprobs(prompt_rows, prompt_logits)
            alive = [(i, r) for i, r in enumerate(requests) if not r.is_finished()]  # ended or aborted since: dropped
            for i, r in alive:
                self.record_token(r, r.seqs[0], sampled.token_ids[i], sampled.logprobs[i], sampled.top_logprobs[i])
            if next_out.total_num_scheduled_tokens:
                self.launch(next_out)
            for i, r in alive:
                self.check_stop(r, r.seqs[0], sampled.token_ids[i])
            # END SOLUTION
        except BaseException:  # an exception or Ctrl-C: drop both steps' requests, every block back
            self.drop_steps(out, next_out)
            raise
        self.stats.record_step(*self.step_counts(out))
        outputs = [self.output(r) for _, r in alive if r.params.output_kind is CUMULATIVE or r.is_finished()]
        for o in outputs:
            if o.finished:
                del self.requests[o.request_id]
        return outputs

    def drop_steps(self, out: SchedulerOutput, next_out: SchedulerOutput | None) -> None:
        """Abort the requests of the step in flight and of the next one. The rows those steps were to
        drop are dropped at the step after, in case the runner never saw them (dropping twice is harmless)."""
        self.in_flight = None  # a forward still running ends in the worker; nobody reads its result
        steps = [out] if next_out is None else [out, next_out]
        for step in steps:
            self.scheduler.finished_req_ids[:0] = step.finished_req_ids + step.preempted_req_ids
        for step in steps:
            for request in self.requests_touched(step):
                self.abort_request(request.request_id)
