"""Stage 7 — the engine: ``LLM.generate`` on a real model, token for token what transformers gives.

Everything below this stage was machinery; this stage makes it serve text. It is built
of parts with one job each, as vLLM and nano-vllm are:

* ``ModelRunner`` — turns a ``SchedulerOutput`` into one forward pass: it applies the
  step's block moves to the ``PagedKVCache``, flattens the new tokens of every scheduled
  sequence into one batch (prefills and decodes together), builds the slot mapping and
  block tables from the block manager, and runs the model, whose attention layers write
  K/V through ``PagedKVCache.write`` and read through the block tables (stage 4's
  reference or stage 5's Triton kernels, ``attention_backend``).
* ``Sampler`` — logits to tokens, each sequence with its own parameters and generator:
  ``temperature == 0`` is greedy (argmax); otherwise logits are divided by the
  temperature, cut to the ``top_k`` most likely tokens and to the smallest set whose
  probability reaches ``top_p``, and a token is drawn with the sequence's own seeded
  generator, so a seeded request gives the same text every time.
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

import itertools
import json
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from minipaged.common.logits_processors import apply_logits_processors
from minipaged.common.sampling_params import (
    CompletionOutput,
    RequestOutput,
    SamplingParams,
    check_int,
    find_stop_string,
)
from minipaged.models import (
    AttentionMetadata,
    load_config,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model_path,
)
from minipaged.stage3_copy_on_write import RefCountedBlockAllocator
from minipaged.stage4_reference_attention import paged_attention_ref
from minipaged.stage6_scheduler import (
    Scheduler,
    SchedulerOutput,
    Sequence,
    SequenceGroup,
    SequenceStatus,
    SwapBlockSpaceManager,
    SwapPagedKVCache,
)

BACKENDS = ("ref", "triton")


@dataclass(eq=False)
class SampledSequence(Sequence):
    """A sequence with its sampling state: its own generator, log-probabilities and finish reason."""

    generator: torch.Generator | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    text: str | None = None  # the output text, once a stop string has cut it
    num_text_chars: int = 0  # with stop strings: the decoded output's length at the last step


@dataclass(eq=False)
class Request(SequenceGroup):
    """A sequence group with what the engine needs to answer it."""

    prompt: str | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p: ``(vocab,)`` float32 logits, the cut ones at -inf.

    In this order, each on the result of the one before: logits are divided by the
    temperature (the kept logits are the divided ones); ``top_k > 0`` keeps the ``top_k``
    largest (every token tied with the k-th value kept); ``top_p < 1`` keeps the smallest set
    of most likely tokens whose probability — the softmax of what top-k left — reaches
    ``top_p``: the token that crosses it is kept, so a tiny ``top_p`` keeps exactly the most
    likely token; among tokens tied in probability only as many as the set needs are kept
    (which of them is free).
    """
    # BEGIN SOLUTION divide by the temperature; keep the top_k largest; keep the smallest set reaching top_p
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= params.top_p  # the mass before this token already reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits
    # END SOLUTION


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from ``(vocab,)`` float32 logits: the argmax at temperature 0, else a draw from
    the softmax of ``process_logits``, with ``generator`` (so a seeded sequence repeats itself)."""
    # BEGIN SOLUTION greedy at temperature 0, else draw from softmax of the processed logits
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(process_logits(logits, params), dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
    # END SOLUTION


class Sampler:
    """Logits ``(num_seqs, vocab)`` to one token per sequence, and the log-probabilities of all.

    First the rows whose params ask for penalties, ``logit_bias``, ``min_tokens`` or ``min_p``
    are processed in place (``minipaged.common.logits_processors``; ``eos_token_ids`` are the tokens
    ``min_tokens`` holds back)."""

    def __init__(self, eos_token_ids=()) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: list[SampledSequence],
                 params: list[SamplingParams]) -> tuple[list[int], torch.Tensor]:
        apply_logits_processors(logits, seqs, params, self.eos_token_ids)
        tokens = logits.argmax(dim=-1).tolist()  # greedy rows in one go; the others are drawn
        for i, (seq, p) in enumerate(zip(seqs, params, strict=True)):
            if p.temperature > 0:
                tokens[i] = sample(logits[i], p, seq.generator)
        return tokens, torch.log_softmax(logits, dim=-1)


class ModelRunner:
    """Runs the model on a step's new tokens, K/V through the paged cache."""

    def __init__(self, model, cache: SwapPagedKVCache, block_manager: SwapBlockSpaceManager, backend) -> None:
        self.model, self.cache, self.block_manager, self.backend = model, cache, block_manager, backend
        self.device = cache.key_cache[0].device

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step: ``(num_seqs, vocab)`` float32 logits, one row per scheduled sequence, in order.

        First the block moves, in this order: swap out, swap in, copy-on-write copies. Then one
        forward pass over the new tokens of every scheduled sequence, flattened: a sequence with
        ``n`` new tokens contributes its last ``n`` token ids at positions ``len - n .. len - 1``;
        their K/V go to the block manager's ``slot_mapping``; attention reads through
        ``block_tables_tensor`` and ``seq_lens`` (``query_start_loc`` when any sequence has more
        than one new token). Each sequence's row is the logits of its last token.
        """
        # BEGIN SOLUTION block moves first; flatten the new tokens; slot mapping, tables, lengths; forward
        self.cache.swap_out(out.blocks_to_swap_out)
        self.cache.swap_in(out.blocks_to_swap_in)
        self.cache.copy_blocks(out.blocks_to_copy)
        seqs, counts = [s for s, _ in out.scheduled], [n for _, n in out.scheduled]
        ids, positions = [], []
        for seq, n in out.scheduled:
            ids += seq.token_ids[len(seq) - n:]
            positions += range(len(seq) - n, len(seq))
        seq_ids = [s.seq_id for s in seqs]
        ends = torch.tensor(counts).cumsum(0)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=self.block_manager.slot_mapping(seq_ids, counts).to(self.device),
            block_tables=self.block_manager.block_tables_tensor(seq_ids).to(self.device),
            seq_lens=torch.tensor([len(s) for s in seqs], dtype=torch.int32, device=self.device),
            query_start_loc=None if max(counts) == 1 else starts.to(self.device),
            backend=self.backend,
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                                self.cache, meta)
            return self.model.compute_logits(hidden[(ends - 1).to(self.device)]).float()
        # END SOLUTION


class LLMEngine:
    """The serving loop: requests in, one scheduled and executed step at a time, outputs out."""

    def __init__(self, scheduler: Scheduler, runner, sampler: Sampler, *, tokenizer=None,
                 eos_token_ids=(), vocab_size: int, seed: int = 0) -> None:
        self.scheduler, self.runner, self.sampler, self.tokenizer = scheduler, runner, sampler, tokenizer
        self.eos_token_ids, self.vocab_size = set(eos_token_ids), vocab_size
        self.requests: dict[object, Request] = {}
        self._rng = torch.Generator().manual_seed(seed)
        self.counters = dict.fromkeys(("steps", "prefill_tokens", "decode_tokens", "token_slots", "held_slots"), 0)

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer.json: give {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt).ids
        raise TypeError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def check(self, request_id, prompt, params) -> tuple[str | None, list[int]]:
        """The prompt's text and token ids; ``ValueError``/``TypeError`` for anything that cannot run."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already exists")
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty: a request needs at least one token")
        bad = [t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"token ids must be in 0 .. {self.vocab_size - 1}, got {bad[:5]}")
        if isinstance(params, SamplingParams) and params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary ({self.vocab_size})")
        if isinstance(params, SamplingParams) and params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer (tokenizer.json): use stop_token_ids")
        return text, ids

    def add_request(self, request_id, prompt, params: SamplingParams) -> Request:
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
        """Sequence ``index`` of a request, drawing with a generator seeded ``seed + index``."""
        return SampledSequence(list(prompt_token_ids), generator=torch.Generator().manual_seed(request.seed + index))

    def make_request(self, request_id, text, ids, params: SamplingParams, seed: int) -> Request:
        """A group of ``n`` independent sequences: each prefills the prompt and holds it on its own."""
        request = Request(request_id, [], params.max_tokens, width=params.n, prompt=text, params=params, seed=seed)
        request.seqs = [self.new_sequence(request, ids, i) for i in range(params.n)]
        return request

    def abort_request(self, request_id) -> None:
        """Stop a request wherever it is; its blocks go back to the pool."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.abort(request_id)
            for seq in request.seqs:
                seq.finish_reason = seq.finish_reason or "abort"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, and return the outputs of the requests that progressed."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler found nothing to run although requests remain")
            return []
        try:
            sizes = [len(g.seqs_with(SequenceStatus.RUNNING)) for g in out.scheduled_groups]
            seqs = [s for s, _ in out.scheduled]
            logits = self.runner.execute(out)
            tokens, logprobs = self.sampler(logits, seqs, [g.params for g, k in zip(out.scheduled_groups, sizes,
                                                                                     strict=True) for _ in range(k)])
            chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
            start = 0
            for group, k in zip(out.scheduled_groups, sizes, strict=True):
                rows = range(start, start + k)
                self.process_outputs(group, [seqs[i] for i in rows], [tokens[i] for i in rows],
                                     [chosen[i] for i in rows], logprobs[start:start + k], logits[start:start + k])
                start += k
        except BaseException:  # an exception or Ctrl-C: drop what this step touched, every block back
            for group in out.scheduled_groups + out.preempted:
                self.abort_request(group.request_id)
            raise
        self._count(out)
        outputs = [self.output(g) for g in out.scheduled_groups]
        for o in outputs:
            if o.finished:
                del self.requests[o.request_id]
        return outputs

    def process_outputs(self, request: Request, seqs: list[SampledSequence], tokens: list[int],
                        chosen: list[float], logprobs: torch.Tensor, logits: torch.Tensor) -> None:
        """Append each sampled token to its sequence; finish the sequences that stop."""
        for seq, token, logprob, row in zip(seqs, tokens, chosen, logprobs, strict=True):
            self.append_token(request, seq, token, logprob, row)

    def append_token(self, request: Request, seq: SampledSequence, token: int, logprob: float,
                     logprobs: torch.Tensor) -> None:
        params = request.params
        seq.append_token(token)
        seq.cumulative_logprob += logprob
        if params.logprobs is not None:
            top = torch.topk(logprobs, params.logprobs)
            seq.logprobs.append({**dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)), token: logprob})
        seq.stop_reason = token if token in params.stop_token_ids else None
        stop = seq.stop_reason is not None or (not params.ignore_eos and token in self.eos_token_ids)
        if not stop and params.stop:  # found in the decoded text, in what this token added (vLLM's rule)
            text, checked = self.text(seq.output_token_ids), seq.num_text_chars
            seq.num_text_chars = len(text)
            found = find_stop_string(text, params.stop, params.include_stop_str_in_output, checked)
            if found and len(seq.output_token_ids) >= params.min_tokens:
                (seq.text, seq.stop_reason), stop = found, True
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
        return RequestOutput(request.request_id, request.prompt, request.seqs[0].prompt_token_ids[:], outputs, done)

    def _count(self, out: SchedulerOutput) -> None:
        usage = self.scheduler.block_manager.usage()
        c = self.counters
        c["steps"] += 1
        c["prefill_tokens"] += sum(n for _, n in out.scheduled if n > 1)
        c["decode_tokens"] += sum(1 for _, n in out.scheduled if n == 1)
        c["token_slots"] += usage.token
        c["held_slots"] += usage.token + usage.internal

    @property
    def stats(self) -> dict:
        """Counters since the engine started: steps, tokens, preemptions, blocks, KV utilisation."""
        c, s = self.counters, self.scheduler
        return {"steps": c["steps"], "prefill_tokens": c["prefill_tokens"], "decode_tokens": c["decode_tokens"],
                "preemptions": s.num_preemptions, "swapped_out_blocks": s.num_swapped_out_blocks,
                "swapped_in_blocks": s.num_swapped_in_blocks, "peak_blocks_used": s.peak_blocks_used,
                "num_gpu_blocks": s.block_manager.num_total_blocks,
                "kv_utilization": c["token_slots"] / c["held_slots"] if c["held_slots"] else 0.0}


class LLM:
    """A serving engine on a paged KV cache, over a local Hugging Face model (or ``"tiny"``)."""

    engine_class = LLMEngine

    def __init__(self, model: str = "tiny", *, block_size: int = 16, num_gpu_blocks: int | None = None,
                 kv_cache_memory: int = 256 * 2**20, num_cpu_blocks: int | None = None,
                 max_model_len: int | None = None, preemption_mode: str = "recompute", max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, attention_backend: str = "ref",
                 dtype: str | torch.dtype = "float32", device: str = "cpu", seed: int = 0) -> None:
        check_int("block_size", block_size, 1)
        check_int("num_gpu_blocks", num_gpu_blocks, 1, allow_none=True)
        check_int("num_cpu_blocks", num_cpu_blocks, 0, allow_none=True)
        check_int("max_model_len", max_model_len, 1, allow_none=True)
        check_int("max_num_seqs", max_num_seqs, 1)
        check_int("max_num_batched_tokens", max_num_batched_tokens, 1, allow_none=True)
        check_int("kv_cache_memory", kv_cache_memory, 1)
        if attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend: expected one of {BACKENDS}, got {attention_backend!r}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode: expected 'recompute' or 'swap', got {preemption_mode!r}")
        backend = paged_attention_ref
        if attention_backend == "triton":
            from minipaged.stage5_triton_attention import paged_attention_triton

            backend = paged_attention_triton
        path = resolve_model_path(model)
        self.dtype, self.device = resolve_dtype(dtype), torch.device(device)
        c = self.config = load_config(path)
        if max_model_len is not None and max_model_len > c.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's {c.max_position_embeddings} positions")
        if num_gpu_blocks is None:
            num_gpu_blocks = max(1, kv_cache_memory // (block_size * c.kv_bytes_per_token(self.dtype)))
        self.max_model_len = max_model_len or min(c.max_position_embeddings, num_gpu_blocks * block_size)
        if c.sliding_window and self.max_model_len > c.sliding_window:
            raise ValueError(f"this model uses sliding-window attention beyond {c.sliding_window} tokens, "
                             f"which minipaged does not implement: pass max_model_len <= {c.sliding_window}")
        if num_cpu_blocks is None:
            num_cpu_blocks = num_gpu_blocks if preemption_mode == "swap" else 0
        cpu_allocator = RefCountedBlockAllocator(num_cpu_blocks) if num_cpu_blocks else None
        manager = self.build_block_manager(num_gpu_blocks, block_size, cpu_allocator)
        self.scheduler = Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=self.max_model_len, preemption_mode=preemption_mode)
        self.model, _ = load_model(path, self.dtype, self.device)
        self.tokenizer = load_tokenizer(path)
        self.cache = SwapPagedKVCache(c.num_layers, num_gpu_blocks, block_size, c.num_kv_heads, c.head_dim,
                                      self.dtype, self.device, num_cpu_blocks)
        generation = path / "generation_config.json"
        eos = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
        eos_ids = set(c.eos_token_ids) | set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.engine = self.engine_class(self.scheduler, ModelRunner(self.model, self.cache, manager, backend),
                                        Sampler(eos_ids), tokenizer=self.tokenizer, eos_token_ids=eos_ids,
                                        vocab_size=c.vocab_size, seed=seed)
        self._request_ids = itertools.count()

    def build_block_manager(self, num_gpu_blocks: int, block_size: int,
                            cpu_allocator: RefCountedBlockAllocator | None) -> SwapBlockSpaceManager:
        """The block manager the scheduler and the runner share."""
        return SwapBlockSpaceManager(RefCountedBlockAllocator(num_gpu_blocks), block_size, cpu_allocator)

    def next_request_id(self) -> int:
        return next(self._request_ids)

    @property
    def stats(self) -> dict:
        return self.engine.stats

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def num_swapped_blocks(self) -> int:
        return self.scheduler.num_swapped_out_blocks

    @property
    def peak_blocks_used(self) -> int:
        return self.scheduler.peak_blocks_used

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (strings or ``{"prompt_token_ids": [...]}``); outputs in prompt order."""
        prompts = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids, done = [], {}
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(self.next_request_id())
                self.engine.add_request(ids[-1], prompt, p)
            with tqdm(total=len(ids), disable=not use_tqdm, desc="generating") as bar:
                while self.engine.has_unfinished_requests() and any(i not in done for i in ids):
                    for output in self.engine.step():
                        if output.finished:
                            done[output.request_id] = output
                            bar.update(1)
        except BaseException:  # nothing of this call stays queued, every block goes back
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return [done[i] for i in ids]

