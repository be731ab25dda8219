"""Stage 10, async scheduling: step N + 1 is scheduled and launched before step N's tokens are read.

A synchronous engine does one thing at a time: schedule, run the model, sample, process the
outputs, and only then schedule again. On a GPU, everything but the forward pass keeps the device
waiting. NanoFlow (Zhu et al., 2024) and vLLM V1's ``--async-scheduling`` overlap them with a
**batch queue** of two steps (``V1Engine.step_with_batch_queue``, ``stage10_engine_core``):

1. **Schedule N + 1** while N runs on the device. A request that N samples is scheduled again
   with a **placeholder** for the token not sampled yet (``AsyncScheduler.num_new_tokens``): its
   slot and blocks are allocated, its id unknown to the host. Not scheduled yet: a request whose
   token is its last (it ends, whatever the token), its first since admission (blocks that a KV
   connector loaded become findable at a request's first decode, and only once the step that
   loaded them is known not to have failed), or one whose sampling reads its own tokens on the
   host (``min_tokens``, penalties).
2. **Launch N + 1.** Its placeholders take N's sampled tokens on the device
   (``V1ModelRunner.prepare_input_ids``, vLLM's ``prev_sampled_token_ids``): nothing waits for N.
3. **Read N**: its tokens come to the host (the one wait for the device, for N's work alone),
   and its outputs are processed while N + 1 runs: stop tokens, stop strings, finished requests.

What it cannot know, it pays for: a request that stops at step N (an end token, a stop string)
was scheduled in N + 1 too, and that computation is thrown away. The outputs are those of
synchronous stepping, token for token (``tests/test_stage10_async_scheduling.py``): the same
tokens are computed in the same order, each sequence draws with its own generator, and a
request preempted while its step ran keeps the token that step sampled for it.

An exception or Ctrl-C aborts the requests of both steps, scheduled or preempted.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from minipaged.common.sequence import Sequence, SequenceStatus
from minipaged.stage7_engine import Request
from minipaged.stage10_sched_output import SchedulerOutput
from minipaged.stage10_v1_scheduler import V1Scheduler


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
        gets one placeholder for that token (the runner takes its id on the device, from the step
        before), unless it is the request's last (``max_tokens``, ``max_model_len``) or its first
        since it was admitted: its first decode makes findable the prompt blocks a KV connector
        loaded (stage 14), and they must not be before the step in flight, which loaded them, is
        known not to have failed. A request whose
        sampling reads its own tokens on the host (``min_tokens``, a penalty) gets none either: its
        last token is not there before the step in flight is read."""
        seq = request.seqs[0]
        if seq.num_computed_tokens < len(seq):
            return super().num_new_tokens(request, budget)
        if self.samples_from_its_tokens(request):
            return 0
        # BEGIN SOLUTION one placeholder, except for the last token and the first since admission
        last = len(seq.output_token_ids) + 1 >= request.max_tokens or len(seq) + 1 >= self.max_model_len
        return 0 if last or len(seq) == self.admitted_len[request.request_id] else 1
        # END SOLUTION

    @staticmethod
    def samples_from_its_tokens(request: Request) -> bool:
        """Whether the sampler reads the request's output tokens: ``min_tokens`` or a penalty."""
        params = request.params
        return bool(params.min_tokens or params.presence_penalty or params.frequency_penalty
                    or params.repetition_penalty != 1.0)

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
