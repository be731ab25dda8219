"""Stage 10 — the engine core: one loop over V1's scheduler and runner, stepped in turn or through a batch queue.

vLLM V1's ``EngineCore`` has one loop and two ways to step it, chosen by ``async_scheduling``:

* ``step``: schedule, run the forward pass, sample, update the requests — one thing at a time.
* ``step_with_batch_queue``: two steps in flight. Step ``N + 1`` is scheduled while ``N`` runs on
  the device, and launched before ``N``'s tokens are read: its placeholders take ``N``'s sampled
  tokens on the device. Only then are ``N``'s tokens read back (the one wait, for ``N``'s work alone)
  and its outputs processed (stop tokens, stop strings, finished requests) while ``N + 1`` runs. The
  scheduler's side is ``AsyncScheduler`` (``stage10_async_scheduling``): it schedules a placeholder
  for each token not sampled yet. On a CPU every call runs to its end, so nothing overlaps; the
  order of the steps is the same.

The parts the scheduler and the runner hold when they are configured take part in the same
loop: a spec decoder (stage 12 gives one) proposes tokens before a step and checks them after it;
a request whose K/V a connector failed to load (stage 14) goes back to be computed again.

An exception or Ctrl-C inside a step aborts every request it touched (both steps' with a batch
queue, scheduled or preempted): every block goes back and the engine keeps working.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from minipaged.common.device import to_device
from minipaged.common.processor import Prompt
from minipaged.common.sampler import PendingSamplerOutput, SamplerOutput
from minipaged.common.sampling_params import RequestOutput, SamplingParams
from minipaged.stage7_engine import CUMULATIVE, LLMEngine, Request
from minipaged.stage9_prefix_caching import skip_cache_reads_for_prompt_logprobs
from minipaged.stage10_front_end import ChildRequestId, ParentRequest
from minipaged.stage10_v1_scheduler import prompt_logprob_requests

if TYPE_CHECKING:
    from minipaged.stage10_model_runner import V1ModelRunner
    from minipaged.stage10_sched_output import SchedulerOutput
    from minipaged.stage10_v1_scheduler import V1Scheduler


class SpecTokenProposer(Protocol):
    """A part that guesses tokens past a request's last before a step and checks them after it
    (stage 12 gives one; the scheduler and the runner hold it too)."""

    def propose(self, running: list[Request]) -> None: ...
    def verify(self, engine: V1Engine, request: Request, spec_token_ids: list[int], logits: torch.Tensor) -> None: ...


class StepResult(NamedTuple):
    """What a step's forward pass and sampler give: the requests that sample (in order), the tokens of
    those without guessed tokens (``plain``: their indices), on their way to the host, every row of
    logits (the requests', then the prompt positions asked for, then the rows that check guessed
    tokens), and the requests whose K/V failed to load."""

    requests: list[Request]
    plain: list[int]
    sampled: PendingSamplerOutput
    logits: torch.Tensor
    failed_req_ids: list[Hashable]


class InFlight(NamedTuple):
    """A step launched and not yet processed: what was scheduled, the prompt positions it computes for
    ``prompt_logprobs``, and what it gives."""

    out: SchedulerOutput
    prompt_rows: list[tuple[Request, range]]
    result: StepResult


class V1Engine(LLMEngine):
    """Stage 7's engine over V1's parts: one loop, ``step`` or ``step_with_batch_queue``.

    Its scheduler and runner stand in for stage 6's and stage 7's, and the hooks that read a step take
    V1's ``SchedulerOutput``; none of them is a subtype of the part it replaces, so where they narrow
    stage 7's types the type checker is told so (``type: ignore``).
    """

    scheduler: V1Scheduler  # type: ignore[assignment]
    runner: V1ModelRunner  # type: ignore[assignment]

    def __init__(self, *args: Any, spec_decoder: SpecTokenProposer | None = None, async_scheduling: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spec_decoder, self.async_scheduling = spec_decoder, async_scheduling
        self.in_flight: InFlight | None = None
        self.stale: set[Hashable] = set()  # sent back after the step in flight was scheduled: its tokens dropped
        self.last_scheduler_output: SchedulerOutput | None = None  # kept for pictures of the steps
        self.parents: dict[Hashable, ParentRequest] = {}  # requests of n > 1 samples, by id

    def add_request(self, request_id: Hashable, prompt: Prompt, params: SamplingParams) -> Request:
        """Check and queue a request; one of ``n > 1`` samples fans out into ``n`` child requests
        (``ParentRequest``): child ``i`` is seeded ``seed + i``, the request's seed or one drawn for it."""
        if not (isinstance(params, SamplingParams) and params.n > 1):
            return super().add_request(request_id, prompt, params)
        if request_id in self.parents:
            raise ValueError(f"request {request_id!r} already exists")
        parent = ParentRequest(request_id, params)
        children: list[Request] = []
        try:
            for index, child_id in enumerate(parent.child_ids):
                children.append(super().add_request(child_id, prompt, parent.child_params(index)))
                parent.seed = children[0].seed  # drawn for the first child when the request names none
        except BaseException:
            for child in children:
                self.abort_request(child.request_id)
            raise
        self.parents[request_id] = parent
        return children[0]

    def abort_request(self, request_id: Hashable) -> None:
        """Stop a request wherever it is (a parent: every child); its blocks go back to the pool."""
        parent = self.parents.pop(request_id, None)
        for child_id in parent.child_ids if parent is not None else [request_id]:
            super().abort_request(child_id)

    def gather(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The children's outputs of a step, each parent's gathered into one (``ParentRequest.make_output``)."""
        gathered: list[RequestOutput] = []
        touched: dict[Hashable, None] = {}  # the parents of this step's children, in order
        for output in outputs:
            parent_id = output.request_id.parent if isinstance(output.request_id, ChildRequestId) else None
            if parent_id in self.parents:
                self.parents[parent_id].add_output(output)
                touched[parent_id] = None
            else:
                gathered.append(output)
        for parent_id in touched:
            made = self.parents[parent_id].make_output()
            if made is not None:
                gathered.append(made)
                if made.finished:
                    del self.parents[parent_id]
        return gathered

    def make_request(self, request_id: Hashable, text: str | None, ids: list[int], params: SamplingParams,
                     seed: int) -> Request:
        request = super().make_request(request_id, text, ids, params, seed)
        skip_cache_reads_for_prompt_logprobs(self.scheduler.block_manager, request.seqs, params)
        return request

    def step(self) -> list[RequestOutput]:
        """One step of the loop, as ``async_scheduling`` chooses: ``step_with_batch_queue``, or stage 7's
        (schedule, ``execute_and_sample``, outputs); a spec decoder proposes first."""
        if self.spec_decoder is not None:
            self.spec_decoder.propose(self.scheduler.running)
        try:
            outputs = self.step_with_batch_queue() if self.async_scheduling else super().step()
        except BaseException:  # blocks made findable for the step's tokens may never have been written
            self.scheduler.kv_cache_manager.reset_prefix_cache()
            raise
        return self.gather(outputs) if self.parents else outputs

    # ---- the parts of a step ----

    def forward_and_sample(self, out: SchedulerOutput) -> StepResult:
        """The forward pass, then the sampler on the rows that sample without guessed tokens."""
        req_ids, logits = self.runner.execute_model(out)
        failed = list(self.runner.failed_req_ids)
        if len(req_ids) == len(out.scheduled):  # every request samples (the runner keeps the step's order)
            requests = out.scheduled
        else:
            by_id = {r.request_id: r for r in out.scheduled}
            requests = [by_id[r] for r in req_ids]
        spec = out.scheduled_spec_decode_tokens
        plain = [i for i, r in enumerate(req_ids) if r not in spec] if spec else list(range(len(req_ids)))
        if len(plain) == len(requests):
            rows, sampling = logits[:len(requests)], requests
        else:
            rows = logits.index_select(0, to_device(plain, logits.device, torch.int64))
            sampling = [requests[i] for i in plain]
        sampled = self.sampler.sample_async(rows, [r.seqs[0] for r in sampling], [r.params for r in sampling])
        self.runner.set_prev_sampled([r.request_id for r in sampling], sampled.token_ids)  # the next placeholders
        return StepResult(requests, plain, sampled, logits, failed)

    def execute_and_sample(self, out: SchedulerOutput) -> list[Request]:  # type: ignore[override]
        """Run the step; update the requests that sampled (those, in order)."""
        prompt_rows = prompt_logprob_requests(out)
        result = self.forward_and_sample(out)
        self.process_step(out, prompt_rows, result)
        self.last_scheduler_output = out
        return result.requests

    def process_step(self, out: SchedulerOutput, prompt_rows: list[tuple[Request, range]], result: StepResult) -> None:
        """A step's prompt log-probabilities; its failed loads sent back; each sampled token appended (a stop
        ends its request), or a request's guessed tokens checked by the spec decoder."""
        requests, logits, spec = result.requests, result.logits, out.scheduled_spec_decode_tokens
        n, m = len(requests), sum(len(p) for _, p in prompt_rows)
        self.record_prompt_logprobs(prompt_rows, logits[n:n + m])
        for req_id in result.failed_req_ids:
            self.scheduler.recompute_after_load_error(self.requests[req_id])
        spec_rows, at = {}, n + m  # the rows before each guessed token, request by request
        for r in out.num_scheduled_tokens if spec else ():
            if r in spec:
                spec_rows[r], at = logits[at:at + len(spec[r])], at + len(spec[r])
        sampled = result.sampled.result()
        for k, i in enumerate(result.plain):
            request = requests[i]
            self.append_token(request, request.seqs[0], sampled.token_ids[k], sampled.logprobs[k],
                              sampled.top_logprobs[k])
        for i, request in enumerate(requests if spec else ()):
            if request.request_id in spec and self.spec_decoder is not None:
                rows = torch.cat([spec_rows[request.request_id], logits[i:i + 1]])  # (d + 1, vocab)
                self.spec_decoder.verify(self, request, spec[request.request_id], rows)

    # ---- the batch queue ----

    def launch(self, out: SchedulerOutput) -> None:
        """Queue a step's forward pass and sampler (on a GPU the host goes on at once); it is in flight."""
        self.in_flight = InFlight(out, prompt_logprob_requests(out), self.forward_and_sample(out))

    def step_with_batch_queue(self) -> list[RequestOutput]:
        """Two steps in flight: schedule and launch the next one before this one's tokens are read (they reach
        the next step's inputs on the device); then this one's outputs."""
        if self.in_flight is None:  # nothing in flight: schedule and launch a step first
            first = self.scheduler.schedule()
            if not first.total_num_scheduled_tokens:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("the scheduler found nothing to run although requests remain")
                return []
            self.launch(first)
        assert self.in_flight is not None
        out, prompt_rows, launched = self.in_flight
        next_out: SchedulerOutput | None = None
        try:
            # BEGIN SOLUTION schedule N + 1 and launch it before N's tokens are read; then N's outputs
            next_out = self.scheduler.schedule()
            self.in_flight = None
            if next_out.total_num_scheduled_tokens:
                self.launch(next_out)
            requests, sampled, logits = self.read_step(launched, next_out)
            self.record_prompt_logprobs(prompt_rows, logits[len(requests):])
            alive = [(i, r) for i, r in enumerate(requests) if not r.is_finished()]  # ended or aborted since: dropped
            for i, r in alive:
                self.append_token(r, r.seqs[0], sampled.token_ids[i], sampled.logprobs[i], sampled.top_logprobs[i])
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

    def read_step(self, result: StepResult, next_out: SchedulerOutput
                  ) -> tuple[list[Request], SamplerOutput, torch.Tensor]:
        """A launched step's requests that sampled, their tokens on the host (the one wait for the device),
        and its rows of logits. Requests whose K/V failed to load in it go back to be computed again; the
        next step, launched already, still computes them (their rows are dropped at the step after), and
        what it samples for them is dropped when it is read (``stale``)."""
        sampled = result.sampled.result()
        stale, self.stale = self.stale, set()
        for req_id in result.failed_req_ids:
            self.scheduler.recompute_after_load_error(self.requests[req_id])
            if req_id in next_out.num_scheduled_tokens:
                self.stale.add(req_id)
        keep = [i for i, r in enumerate(result.requests) if r.request_id not in stale]
        if len(keep) == len(result.requests):
            return result.requests, sampled, result.logits
        n = len(result.requests)
        rows = to_device(keep + list(range(n, len(result.logits))), result.logits.device, torch.int64)
        return ([result.requests[i] for i in keep],
                SamplerOutput([sampled.token_ids[i] for i in keep], [sampled.logprobs[i] for i in keep],
                              [sampled.top_logprobs[i] for i in keep]),
                result.logits.index_select(0, rows))

    def drop_steps(self, out: SchedulerOutput, next_out: SchedulerOutput | None) -> None:
        """Abort the requests of the step in flight and of the next one. The rows those steps were to
        drop are dropped at the step after, in case the runner never saw them (dropping twice is harmless)."""
        self.in_flight = None  # nobody reads what a launched step gives
        steps = [out] if next_out is None else [out, next_out]
        for step in steps:
            self.scheduler.finished_req_ids[:0] = step.finished_req_ids + step.preempted_req_ids
        for step in steps:
            for request in self.requests_touched(step):
                self.abort_request(request.request_id)

    # ---- what the loop reads of a step ----

    def requests_touched(self, out: SchedulerOutput) -> list[Request]:  # type: ignore[override]
        return out.scheduled + out.preempted

    def step_counts(self, out: SchedulerOutput) -> tuple[int, int, int, int]:  # type: ignore[override]
        """A decode is a request past its prompt (fed back the token it sampled, or its placeholder); every
        other token is a prompt's."""
        # the running requests come first in ``scheduled``, in the order of their entries
        decodes = sum(computed >= len(r.seqs[0].prompt_token_ids)
                      for computed, r in zip(out.scheduled_cached_reqs.num_computed_tokens, out.scheduled))
        token, held = self.scheduler.kv_cache_manager.num_slots()
        return out.total_num_scheduled_tokens - decodes, decodes, token, held
