"""Stage 7 — the engine: ``LLM.generate`` on a real model, token for token what transformers gives.

Everything below this stage was machinery; this stage makes it serve text. ``LLM`` loads
a Hugging Face model folder, sizes a paged KV cache, and runs the loop every serving
engine runs::

    while requests remain:
        batch = scheduler.schedule()          # stage 6: who runs, preempting if needed
        cache.swap_out / swap_in / copy_blocks  # the block moves it decided
        logits = model(batch)                 # one forward over all new tokens (prefill + decode)
        tokens = sample(logits)               # greedy, or temperature / top-k / top-p
        append the tokens; finish the sequences that stop

The forward pass takes the new tokens of every scheduled sequence as one flat batch; its
attention layers write K/V through the slot mapping and read through the block tables
(stage 4's reference or stage 5's Triton kernels, ``attention_backend``).

Sampling follows the usual definitions: ``temperature == 0`` is greedy (argmax);
otherwise logits are divided by the temperature, cut to the ``top_k`` most likely tokens
and to the smallest set whose probability reaches ``top_p``, and a token is drawn with the
request's own seeded generator, so a seeded request gives the same text every time.
``cumulative_logprob`` sums the model's log-probabilities (before temperature) of the
tokens produced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from minipaged.models import (
    AttentionMetadata,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model_path,
)
from minipaged.stage4_reference_attention import paged_attention_ref
from minipaged.stage6_scheduler import Scheduler, SchedulerOutput, Sequence, SwapPagedKVCache

BACKENDS = ("ref", "triton")


@dataclass
class SamplingParams:
    """How to generate: vLLM's names. ``temperature=0`` is greedy."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1  # -1: every token
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # return the top-k log-probabilities of each step

    def __post_init__(self) -> None:
        checks = [(self.n >= 1, "n", "an integer >= 1"), (self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
                  (self.temperature >= 0, "temperature", ">= 0 (0 means greedy)"),
                  (self.top_k == -1 or self.top_k >= 1, "top_k", "-1 (every token) or an integer >= 1"),
                  (0 < self.top_p <= 1, "top_p", "in (0, 1]"),
                  (self.logprobs is None or self.logprobs >= 0, "logprobs", "None or an integer >= 0")]
        for ok, name, allowed in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {allowed}, got {getattr(self, name)!r}")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str | None  # "stop" (an end token) or "length"
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p: ``(vocab,)`` float32 logits, the cut ones at -inf."""
    # BEGIN SOLUTION divide by the temperature; keep the top_k largest; keep the smallest set reaching top_p
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
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
    """One token from ``(vocab,)`` float32 logits."""
    # BEGIN SOLUTION greedy at temperature 0, else draw from softmax of the processed logits
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(process_logits(logits, params), dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
    # END SOLUTION


@dataclass
class _Request:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # sample i draws with a generator seeded seed + i
    seqs: list[Sequence] = field(default_factory=list)
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # seq_id -> its generator
    logprob: dict[int, float] = field(default_factory=dict)  # seq_id -> cumulative
    top: dict[int, list] = field(default_factory=dict)  # seq_id -> per-step top logprobs
    finish: dict[int, str] = field(default_factory=dict)  # seq_id -> finish reason


class LLM:
    """A serving engine on a paged KV cache, over a local Hugging Face model (or ``"tiny"``)."""

    scheduler_class = Scheduler

    def __init__(self, model: str = "tiny", *, block_size: int = 16, num_gpu_blocks: int | None = None,
                 kv_cache_memory: int = 256 * 2**20, num_cpu_blocks: int | None = None,
                 max_model_len: int | None = None, preemption_mode: str = "recompute", max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = False,
                 attention_backend: str = "ref", dtype: str | torch.dtype = "float32",
                 device: str = "cpu", seed: int = 0) -> None:
        if attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend: expected one of {BACKENDS}, got {attention_backend!r}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode: expected 'recompute' or 'swap', got {preemption_mode!r}")
        if enable_prefix_caching:
            raise ValueError("enable_prefix_caching needs stage 9, which this engine does not have")
        self.backend = paged_attention_ref
        if attention_backend == "triton":
            from minipaged.stage5_triton_attention import paged_attention_triton

            self.backend = paged_attention_triton
        path = resolve_model_path(model)
        self.dtype, self.device = resolve_dtype(dtype), torch.device(device)
        self.model, self.config = load_model(path, self.dtype, self.device)
        self.tokenizer = load_tokenizer(path)
        generation = path / "generation_config.json"
        eos = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
        self.eos_token_ids = set(self.config.eos_token_ids) | set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if num_gpu_blocks is None:
            num_gpu_blocks = max(1, kv_cache_memory // (block_size * self.config.kv_bytes_per_token(self.dtype)))
        self.max_model_len = max_model_len or min(self.config.max_position_embeddings, num_gpu_blocks * block_size)
        if self.config.sliding_window and self.max_model_len > self.config.sliding_window:
            raise ValueError(f"this model uses sliding-window attention beyond {self.config.sliding_window} tokens, "
                             f"which minipaged does not implement: pass max_model_len <= {self.config.sliding_window}")
        if num_cpu_blocks is None:
            num_cpu_blocks = num_gpu_blocks if preemption_mode == "swap" else 0
        self.scheduler = self.scheduler_class(num_gpu_blocks, block_size, num_cpu_blocks, max_num_seqs, max_num_batched_tokens,
                                   self.max_model_len, preemption_mode)
        c = self.config
        self.cache = SwapPagedKVCache(c.num_layers, num_gpu_blocks, block_size, c.num_kv_heads, c.head_dim,
                                      self.dtype, self.device, num_cpu_blocks)
        self._rng = torch.Generator().manual_seed(seed)
        self._next_request = 0
        self._counts = dict.fromkeys(("steps", "prefill_tokens", "decode_tokens", "token_slots", "held_slots"), 0)

    # -- the public counters -------------------------------------------------------------
    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def num_swapped_blocks(self) -> int:
        return self.scheduler.num_swapped_out_blocks

    @property
    def peak_blocks_used(self) -> int:
        return self.scheduler.peak_blocks_used

    # -- generation ----------------------------------------------------------------------
    def _prepare(self, prompt, params: SamplingParams) -> _Request:
        """Validate one prompt; nothing is queued until every prompt of the call passes."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = None, list(prompt["prompt_token_ids"])
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer.json: give {'prompt_token_ids': [...]}")
            text, ids = prompt, self.tokenizer.encode(prompt).ids
        else:
            raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty: a request needs at least one token")
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.config.vocab_size)]
        if bad:
            raise ValueError(f"token ids must be in 0 .. {self.config.vocab_size - 1}, got {bad[:5]}")
        self._check_n(params)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len={self.max_model_len}")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
        request = _Request(self._next_request, text, ids, params, seed)
        self._next_request += 1
        return request

    def _check_n(self, params: SamplingParams) -> None:
        if params.n != 1:
            raise ValueError("SamplingParams.n > 1 (parallel sampling) needs stage 8, which this engine does not have")

    def _submit(self, request: _Request) -> None:
        """Queue a request's sequence (stage 8 queues several, or forks them later)."""
        self._track(request, self.scheduler.add_sequence(request.prompt_token_ids, request.params.max_tokens))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (strings or ``{"prompt_token_ids": [...]}``); outputs in prompt order."""
        prompts = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        requests = [self._prepare(p, sp) for p, sp in zip(prompts, params, strict=True)]
        self._owner: dict[int, _Request] = {}
        for request in requests:
            self._submit(request)
        with tqdm(total=len(requests), disable=not use_tqdm, desc="generating") as bar:
            while self.scheduler.has_unfinished():
                bar.update(self.step())
        return [self._output(r) for r in requests]

    def _track(self, request: _Request, seq: Sequence) -> None:
        request.generators[seq.seq_id] = torch.Generator().manual_seed(request.seed + len(request.seqs))
        request.seqs.append(seq)
        request.logprob[seq.seq_id] = 0.0
        request.top[seq.seq_id] = []
        self._owner[seq.seq_id] = request

    def step(self) -> int:
        """One scheduler step and one forward pass; returns the number of requests finished."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            raise RuntimeError("the scheduler found nothing to run although requests remain")
        logits = self.execute_model(out)
        logprobs = torch.log_softmax(logits, dim=-1)
        requests = [self._owner[seq.seq_id] for seq, _ in out.scheduled]
        tokens = logits.argmax(dim=-1).tolist()  # greedy rows in one go; the others are drawn
        for i, ((seq, _), request) in enumerate(zip(out.scheduled, requests, strict=True)):
            if request.params.temperature > 0:
                tokens[i] = sample(logits[i], request.params, request.generators[seq.seq_id])
        chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
        finished = 0
        for i, ((seq, _), request) in enumerate(zip(out.scheduled, requests, strict=True)):
            finished += self._accept(request, seq, tokens[i], chosen[i], logprobs[i], logits[i])
        self._count(out)
        return finished

    def _accept(self, request: _Request, seq: Sequence, token: int, logprob: float, logprobs: torch.Tensor,
                logits: torch.Tensor) -> int:
        """Append a sampled token to ``seq``; finish it if it stops. Returns 1 if the request is done."""
        params = request.params
        self.scheduler.append_token(seq, token)
        request.logprob[seq.seq_id] += logprob
        if params.logprobs is not None:
            top = torch.topk(logprobs, params.logprobs) if params.logprobs else None
            entry = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            request.top[seq.seq_id].append({**entry, token: logprob})
        stop = (token in params.stop_token_ids) or (not params.ignore_eos and token in self.eos_token_ids)
        if stop or len(seq.output_token_ids) >= params.max_tokens or len(seq) >= self.max_model_len:
            request.finish[seq.seq_id] = "stop" if stop else "length"
            self.scheduler.finish(seq)
            return int(len(request.finish) == request.params.n)
        return 0

    def execute_model(self, out: SchedulerOutput) -> torch.Tensor:
        """Apply the step's block moves, run the model on its new tokens: ``(num_seqs, vocab)`` float32."""
        # BEGIN SOLUTION block moves first; flatten the new tokens; slot mapping, tables, lengths; forward
        self.cache.swap_out(out.blocks_to_swap_out)
        self.cache.swap_in(out.blocks_to_swap_in)
        self.cache.copy_blocks(out.blocks_to_copy)
        manager = self.scheduler.block_manager
        seqs, counts = [s for s, _ in out.scheduled], [n for _, n in out.scheduled]
        ids, positions = [], []
        for seq, n in out.scheduled:
            ids += seq.token_ids[len(seq) - n :]
            positions += range(len(seq) - n, len(seq))
        seq_ids = [s.seq_id for s in seqs]
        ends = torch.tensor(counts).cumsum(0)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=manager.slot_mapping(seq_ids, counts).to(self.device),
            block_tables=manager.block_tables_tensor(seq_ids).to(self.device),
            seq_lens=torch.tensor([len(s) for s in seqs], dtype=torch.int32, device=self.device),
            query_start_loc=None if max(counts) == 1 else starts.to(self.device),
            backend=self.backend,
        )
        kv_caches = list(zip(self.cache.key_cache, self.cache.value_cache, strict=True))
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                                kv_caches, meta)
            return self.model.compute_logits(hidden[(ends - 1).to(self.device)]).float()
        # END SOLUTION

    def _count(self, out: SchedulerOutput) -> None:
        usage = self.scheduler.block_manager.usage()
        self._counts["steps"] += 1
        self._counts["prefill_tokens"] += sum(n for _, n in out.scheduled if n > 1)
        self._counts["decode_tokens"] += sum(1 for _, n in out.scheduled if n == 1)
        self._counts["token_slots"] += usage.token
        self._counts["held_slots"] += usage.token + usage.internal

    @property
    def stats(self) -> dict:
        """Counters since the engine started: steps, tokens, preemptions, blocks, KV utilisation."""
        c, s = self._counts, self.scheduler
        return {"steps": c["steps"], "prefill_tokens": c["prefill_tokens"], "decode_tokens": c["decode_tokens"],
                "preemptions": s.num_preemptions, "swapped_out_blocks": s.num_swapped_out_blocks,
                "swapped_in_blocks": s.num_swapped_in_blocks, "peak_blocks_used": s.peak_blocks_used,
                "num_gpu_blocks": s.block_manager.num_total_blocks,
                "kv_utilization": c["token_slots"] / c["held_slots"] if c["held_slots"] else 0.0,
                "prefix_cache_hits": 0}

    def _output(self, request: _Request) -> RequestOutput:
        outputs = []
        for index, seq in enumerate(request.seqs):
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True) if self.tokenizer else ""
            outputs.append(CompletionOutput(index, text, list(seq.output_token_ids), request.logprob[seq.seq_id],
                                            request.finish.get(seq.seq_id),
                                            request.top[seq.seq_id] if request.params.logprobs is not None else None))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs)
