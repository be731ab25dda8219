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
from typing import Any

from minipaged.common.sequence import Sequence, SequenceStatus
from minipaged.stage7_engine import Request
from minipaged.stage10_sched_output import SchedulerOutput
from minipaged.stage10_v1_scheduler import V1Scheduler, tokens_after


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
