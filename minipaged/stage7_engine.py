"""Stage 7 — the engine: ``LLM.generate`` on a real model, token for token what transformers gives.

Everything below this stage was machinery; this stage makes it serve text. It is built
of parts with one job each, as vLLM and nano-vllm are:

* ``ModelRunner`` and ``Sampler`` (``stage7_model_runner``) — one forward pass over the
  step's new tokens, K/V through the paged cache, then one token per sequence, each with
  its own parameters and seeded generator.
* ``LLMEngine`` — the serving loop, with vLLM's names: ``add_request``,
  ``abort_request``, ``step`` (schedule, execute, sample, append the tokens, finish the
  sequences that stop) and ``has_unfinished_requests``. A request is a sequence group
  of ``n`` independent samples, sample ``i`` drawn with a generator seeded ``seed + i``.
* ``LLM`` — a thin front end: it loads a Hugging Face model folder, builds the parts
  from its arguments, and runs the loop until every prompt is done.

Bad arguments are refused before anything runs. An exception or Ctrl-C inside a step
aborts the requests it touched, and ``generate`` aborts its own: every block goes back
and the same ``LLM`` keeps working. ``cumulative_logprob`` sums the model's
log-probabilities (before temperature) of the tokens produced.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import cast

import torch
from tokenizers import Tokenizer

from minipaged.common.detokenizer import IncrementalDetokenizer
from minipaged.common.processor import Processor, Prompt
from minipaged.common.prompt_logprobs import fill_prompt_logprobs
from minipaged.common.sampler import Sampler
from minipaged.common.sampling_params import (
    CompletionOutput,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    find_stop_string,
)
from minipaged.common.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.common.stats import EngineStats
from minipaged.stage6_scheduler import Scheduler, SchedulerOutputs
from minipaged.stage7_model_runner import (
    Runner,
    prompt_logprob_rows,
)

CUMULATIVE, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


@dataclass(eq=False)
class SampledSequence(Sequence):
    """A sequence with its sampling state: its own generator, log-probabilities and finish reason."""

    generator: torch.Generator | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    text: str | None = None  # the output text, once a stop string has cut it
    detokenizer: IncrementalDetokenizer | None = None  # with stop strings: the output's text, token by token
    text_tail: str = ""  # with stop strings: the text's last characters, where a stop string may have begun


@dataclass(eq=False)
class Request(SequenceGroup[SampledSequence]):
    """A sequence group with what the engine needs to answer it."""

    prompt: str | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with prompt_logprobs: one per prompt token


class LLMEngine:
    """The serving loop: requests in, one scheduled and executed step at a time, outputs out."""

    def __init__(self, scheduler: Scheduler, runner: Runner, sampler: Sampler, *,
                 tokenizer: Tokenizer | None = None, eos_token_ids: Iterable[int] = (), vocab_size: int,
                 seed: int = 0, device: str | torch.device = "cpu") -> None:
        self.scheduler, self.runner, self.sampler, self.tokenizer = scheduler, runner, sampler, tokenizer
        self.eos_token_ids, self.vocab_size = set(eos_token_ids), vocab_size
        self.requests: dict[Hashable, Request] = {}
        self._rng = torch.Generator().manual_seed(seed)  # the seeds of the requests that name none
        self.device = torch.device(device)  # where the sequences' generators draw: the logits' device
        self.stats = EngineStats()
        self.processor = Processor(tokenizer, vocab_size)  # a new request's prompt to checked token ids

    def check(self, request_id: Hashable, prompt: Prompt, params: object) -> tuple[str | None, list[int]]:
        """The prompt's text and token ids (``Processor.process_inputs``); ``ValueError``/``TypeError``
        for anything that cannot run, a request id already in use too."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already exists")
        return self.processor.process_inputs(prompt, params)

    def add_request(self, request_id: Hashable, prompt: Prompt, params: SamplingParams) -> Request:
        """Check and queue one request; ``ValueError``/``TypeError`` before anything is queued."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
        text, ids = self.check(request_id, prompt, params)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
        request = self.make_request(request_id, text, ids, params, seed)
        self.scheduler.add(request)
        self.requests[request_id] = request
        return request

    def new_sequence(self, request: Request, prompt_token_ids: list[int], index: int) -> SampledSequence:
        """Sequence ``index`` of a request, drawing with a generator seeded ``seed + index``, on the engine's
        device (as vLLM keeps its requests' generators): a seed gives the same tokens on the same device."""
        generator = torch.Generator(device=self.device).manual_seed(request.seed + index)
        return SampledSequence(list(prompt_token_ids), generator=generator)

    def make_request(self, request_id: Hashable, text: str | None, ids: list[int], params: SamplingParams,
                     seed: int) -> Request:
        """A group of ``n`` independent sequences: each prefills the prompt and holds it on its own."""
        request = Request(request_id, [], params.max_tokens, width=params.n, prompt=text, params=params, seed=seed)
        request.seqs = [self.new_sequence(request, ids, i) for i in range(params.n)]
        return request

    def abort_request(self, request_id: Hashable) -> None:
        """Stop a request wherever it is; its blocks go back to the pool."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.abort(request_id)
            for seq in request.seqs:
                seq.finish_reason = seq.finish_reason or "abort"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, and return the outputs of the requests that progressed
        (of those whose ``output_kind`` is ``FINAL_ONLY``, only the finished ones).

        An exception or Ctrl-C inside the step aborts every request it scheduled or preempted,
        so that every block goes back and the engine keeps working."""
        out = self.scheduler.schedule()
        if not out.total_num_scheduled_tokens:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler found nothing to run although requests remain")
            return []
        try:
            requests = self.execute_and_sample(out)
        except BaseException:  # an exception or Ctrl-C: drop what this step touched, every block back
            for request in self.requests_touched(out):
                self.abort_request(request.request_id)
            raise
        self.stats.record_step(*self.step_counts(out))
        outputs = [self.output(r) for r in requests if r.params.output_kind is CUMULATIVE or r.is_finished()]
        for o in outputs:
            if o.finished:
                del self.requests[o.request_id]
        return outputs

    def execute_and_sample(self, out: SchedulerOutputs) -> list[Request]:
        """Run the step's forward pass, sample a token for every scheduled sequence, append it:
        the requests that progressed, in order."""
        groups = cast("list[Request]", out.scheduled_groups)  # the scheduler holds this engine's requests
        seqs = cast("list[SampledSequence]", [s for s, _ in out.scheduled])
        sizes = [len(g.seqs_with(SequenceStatus.RUNNING)) for g in groups]
        params = [g.params for g, k in zip(groups, sizes, strict=True) for _ in range(k)]
        logits = self.runner.execute(out)  # (len(seqs) + prompt positions asked for, vocab)
        prompt_rows = cast("list[tuple[Request, range, int]]", prompt_logprob_rows(out))  # this engine's requests
        self.record_prompt_logprobs([(r, p) for r, p, _ in prompt_rows], logits[len(seqs):])
        logits = logits[:len(seqs)]
        sampled = self.sampler(logits, seqs, params)
        start = 0
        for group, k in zip(groups, sizes, strict=True):
            rows = slice(start, start + k)
            self.process_outputs(group, seqs[rows], sampled.token_ids[rows], sampled.logprobs[rows],
                                 sampled.top_logprobs[rows], logits[rows])
            start += k
        return groups

    def record_prompt_logprobs(self, rows: list[tuple[Request, range]], logits: torch.Tensor) -> None:
        """The prompt log-probabilities of a step's prompt positions (``logits``: their rows, in the
        order of ``rows``), written into each request's list; positions computed again (after a
        preemption by recompute) are written again, with the same values."""
        at = 0
        for request, positions in rows:
            if request.prompt_logprobs is None:
                request.prompt_logprobs = [None] * len(request.seqs[0].prompt_token_ids)
            k = request.params.prompt_logprobs or 0
            fill_prompt_logprobs(request.prompt_logprobs, logits[at:at + len(positions)],
                                 request.seqs[0].prompt_token_ids, positions, k)
            at += len(positions)

    def requests_touched(self, out: SchedulerOutputs) -> list[Request]:
        """The requests a failed step may have left half done: the scheduled and the preempted."""
        return cast("list[Request]", out.scheduled_groups + out.preempted)

    def step_counts(self, out: SchedulerOutputs) -> tuple[int, int, int, int]:
        """The step's prefill tokens, decode tokens, and KV slots holding a token and held."""
        usage = self.scheduler.block_manager.usage()
        prefill = sum(n for _, n in out.scheduled if n > 1)
        return prefill, sum(1 for _, n in out.scheduled if n == 1), usage.token, usage.token + usage.internal

    def process_outputs(self, request: Request, seqs: list[SampledSequence], tokens: list[int],
                        chosen: list[float], top: list[dict[int, float] | None], logits: torch.Tensor) -> None:
        """Append each sampled token to its sequence; finish the sequences that stop. ``logits``: the
        group's rows, as the sampler processed them (penalties applied; no temperature)."""
        for seq, token, logprob, top_logprobs in zip(seqs, tokens, chosen, top, strict=True):
            self.append_token(request, seq, token, logprob, top_logprobs)

    def append_token(self, request: Request, seq: SampledSequence, token: int, logprob: float,
                     top_logprobs: dict[int, float] | None) -> None:
        """Append a sampled token to its sequence, then finish the sequence if it stops."""
        self.record_token(request, seq, token, logprob, top_logprobs)
        self.check_stop(request, seq, token)

    def record_token(self, request: Request, seq: SampledSequence, token: int, logprob: float,
                     top_logprobs: dict[int, float] | None) -> None:
        """The token, its log-probability and (if asked for) the top ones, appended to the sequence."""
        seq.append_token(token)
        seq.cumulative_logprob += logprob
        if request.params.logprobs is not None and top_logprobs is not None:
            seq.logprobs.append(top_logprobs)

    def check_stop(self, request: Request, seq: SampledSequence, token: int) -> None:
        """Finish the sequence if its last token ``token`` ends it: a stop token or end token, a stop
        string in the text it added, ``max_tokens`` or ``max_model_len``."""
        params = request.params
        seq.stop_reason = token if token in params.stop_token_ids else None
        stop = seq.stop_reason is not None or (not params.ignore_eos and token in self.eos_token_ids)
        if not stop and params.stop and self.tokenizer:  # in the text this token added (vLLM's rule)
            if seq.detokenizer is None:  # incremental: O(1) per token, not a decode of the whole output
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
            delta = seq.detokenizer.add([token])
            tail = seq.text_tail + delta  # the new text, and the characters before it a stop string may begin in
            found = find_stop_string(tail, params.stop, params.include_stop_str_in_output, len(seq.text_tail))
            if found and len(seq.output_token_ids) >= params.min_tokens:
                text = seq.detokenizer.text
                seq.text, seq.stop_reason, stop = text[:len(text) - len(tail) + len(found[0])], found[1], True
            seq.text_tail = tail[len(tail) - max(map(len, params.stop)) + 1:]
        if stop or len(seq.output_token_ids) >= params.max_tokens or len(seq) >= self.scheduler.max_model_len:
            seq.finish_reason = "stop" if stop else "length"
            self.scheduler.finish(seq)

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""

    def output(self, request: Request) -> RequestOutput:
        """The request's tokens so far; the text is decoded once it is finished (not every step)."""
        done = request.is_finished()
        outputs = [CompletionOutput(i, (self.text(s.output_token_ids) if s.text is None else s.text) if done else "",
                                    list(s.output_token_ids), s.cumulative_logprob, s.finish_reason,
                                    s.logprobs if request.params.logprobs is not None else None, s.stop_reason)
                   for i, s in enumerate(request.seqs)]
        prompt_logprobs = None
        if request.params.prompt_logprobs is not None:  # a one-token prompt has no position to score
            prompt_logprobs = list(request.prompt_logprobs or [None] * len(request.seqs[0].prompt_token_ids))
        return RequestOutput(request.request_id, request.prompt, request.seqs[0].prompt_token_ids[:], outputs, done,
                             prompt_logprobs)
