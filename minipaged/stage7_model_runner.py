"""Stage 7 — the model runner and the sampler: one step's forward pass, and the tokens it gives.

* ``ModelRunner`` — turns a ``SchedulerOutputs`` into one forward pass: it applies the
  step's block moves to the ``PagedKVCache``, flattens the new tokens of every scheduled
  sequence into one batch (prefills and decodes together), builds the slot mapping and
  block tables from the block manager, and runs the model, whose attention layers write
  K/V through ``PagedKVCache.write`` and read through the block tables (stage 4's
  reference or stage 5's Triton kernels, ``attention_backend``).
* ``process_logits`` and ``sample`` — sampling defined, one row of logits at a time:
  ``temperature == 0`` is greedy (argmax); otherwise logits are divided by the temperature,
  cut to the ``top_k`` most likely tokens and to the smallest set whose probability
  reaches ``top_p``, and a token is drawn with the sequence's own seeded generator, so a
  seeded request gives the same text every time.

The engine (``stage7_engine``) calls the runner once a step, then ``Sampler``
(``minipaged.common.sampler``), which does what ``sample`` defines for the whole batch at
once, each row with its own parameters and generator, and is tested equal to it row by row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

import numpy as np
import torch

from minipaged.common.device import to_device
from minipaged.common.prompt_logprobs import prompt_logprob_positions
from minipaged.common.sampler import Sampler
from minipaged.common.sampling_params import SamplingParams
from minipaged.models import AttentionMetadata, CausalLM
from minipaged.stage2_block_table import PagedKVCache
from minipaged.stage4_reference_attention import check_attention_metadata, paged_attention_ref
from minipaged.stage6_scheduler import SchedulerOutputs
from minipaged.stage6_swapping import SwapBlockSpaceManager, SwapPagedKVCache


class PromptLogprobsRequest(Protocol):
    """What the runner reads of a request (the engine's ``Request``): its parameters and sequences."""

    params: SamplingParams
    seqs: list


__all__ = ["ModelRunner", "Runner", "Sampler", "backend_named", "build_attention_metadata",
           "determine_available_kv_memory", "process_logits", "prompt_logprob_rows", "sample"]


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p: ``(vocab,)`` float32 logits, the cut ones at -inf.

    In this order, each on the result of the one before: logits are divided by the
    temperature (the kept logits are the divided ones); ``top_k > 0`` keeps the ``top_k``
    largest (every token tied with the k-th value kept; a ``top_k`` of the vocabulary's size or more
    keeps every token); ``top_p < 1`` keeps the smallest set
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


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from ``(vocab,)`` float32 logits: the argmax at temperature 0, else a draw from
    the softmax of ``process_logits``, with ``generator`` (so a seeded sequence repeats itself)."""
    # BEGIN SOLUTION greedy at temperature 0, else draw from softmax of the processed logits
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(process_logits(logits, params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
    # END SOLUTION


def prompt_logprob_rows(out: SchedulerOutputs) -> list[tuple[PromptLogprobsRequest, range, int]]:
    """The requests of a step that asked for ``prompt_logprobs`` and compute prompt positions in
    it: ``(request, positions, index of the first position's token in the flat batch)``, in order.

    A request's first sequence computes its prompt (the others of a group share or repeat it)."""
    rows: list[tuple[PromptLogprobsRequest, range, int]] = []
    offset = 0
    requests = cast("list[PromptLogprobsRequest]", out.scheduled_groups)  # the engine's requests
    firsts = {id(r.seqs[0]): r for r in requests if r.params.prompt_logprobs is not None}
    if not firsts:  # the usual step: no walk over the batch
        return rows
    for seq, n in out.scheduled:
        if id(seq) in firsts:
            start = len(seq) - n
            positions = prompt_logprob_positions(start, n, len(seq.prompt_token_ids))
            if positions:
                rows.append((firsts[id(seq)], positions, offset))
        offset += n
    return rows


def backend_named(name: str) -> Callable[..., torch.Tensor]:
    """Stage 4's reference (``"ref"``), or stage 5's Triton kernels (``"triton"``, imported only when asked for)."""
    if name == "triton":
        from minipaged.stage5_triton_attention import paged_attention_triton

        return paged_attention_triton
    return paged_attention_ref


def build_attention_metadata(cache: PagedKVCache, slot_mapping: np.ndarray, block_tables: np.ndarray,
                             seq_lens: np.ndarray, query_start_loc: np.ndarray | None,
                             backend: Callable[..., torch.Tensor]) -> AttentionMetadata:
    """A step's ``AttentionMetadata``, from its host arrays: checked there, once (stage 2's
    ``check_slot_mapping``, stage 4's ``check_attention_metadata``), then copied to the cache's device,
    so that no layer checks anything again: a check in every layer would wait for the device in
    every layer. A slot mapping of the engine holds no -1."""
    num_blocks, block_size = cache.key_cache[0].shape[:2]
    cache.check_slot_mapping(slot_mapping, skip=False)
    check_attention_metadata(block_tables, seq_lens, query_start_loc, num_tokens=len(slot_mapping),
                             num_blocks=num_blocks, block_size=block_size)
    return AttentionMetadata.from_host(slot_mapping, block_tables, seq_lens, query_start_loc, backend,
                                       cache.key_cache[0].device)


def determine_available_kv_memory(model: CausalLM, num_layers: int, num_kv_heads: int, head_dim: int,
                                  block_size: int, num_tokens: int, num_rows: int, gpu_memory_utilization: float,
                                  backend: Callable[..., torch.Tensor]) -> int:
    """vLLM's ``determine_num_available_blocks``, in bytes: what ``gpu_memory_utilization`` of the CUDA
    device's memory leaves for K/V once the weights, the memory other processes hold, and the peak of
    a profiling forward (``num_tokens`` tokens of one prompt, then the logits of ``num_rows`` rows, the
    largest step the engine schedules) are taken."""
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    cache = PagedKVCache(num_layers, -(-num_tokens // block_size), block_size, num_kv_heads, head_dim, dtype, device)
    cache_bytes = 2 * sum(t.numel() * t.element_size() for t in cache.key_cache)
    positions = np.arange(num_tokens)
    table = np.arange(cache.num_blocks, dtype=np.int32)[None, :]  # (1, num_blocks): the prompt's blocks in order
    meta = build_attention_metadata(cache, positions, table, np.array([num_tokens], np.int32),
                                    np.array([0, num_tokens], np.int32), backend)
    torch.cuda.empty_cache()  # what engines dropped before this one left cached goes back to the device
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        hidden = model(to_device(np.zeros(num_tokens, np.int64), device), to_device(positions, device), cache, meta)
        model.compute_logits(hidden[:num_rows]).float()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - cache_bytes  # the weights and the step's activations
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)  # what this process's allocator does not hold
    return int(total * gpu_memory_utilization - peak - others)


class Runner(Protocol):
    """What the engine asks of a runner: ``ModelRunner``, or a stand-in without a model (``minipaged.perf``)."""

    def execute(self, out: SchedulerOutputs) -> torch.Tensor: ...


class ModelRunner:
    """Runs the model on a step's new tokens, K/V through the paged cache."""

    def __init__(self, model: CausalLM, cache: SwapPagedKVCache, block_manager: SwapBlockSpaceManager,
                 backend: Callable[..., torch.Tensor]) -> None:
        self.model, self.cache, self.block_manager, self.backend = model, cache, block_manager, backend
        self.device = cache.key_cache[0].device

    def execute(self, out: SchedulerOutputs) -> torch.Tensor:
        """Run one step: ``(num_seqs, vocab)`` float32 logits, one row per scheduled sequence, in order.

        First the block moves, in this order: swap out, swap in, copy-on-write copies — a copy's
        source may be a block swapped in in this step, its destination a GPU block that a swap-out
        in this step has just freed (the scheduler never swaps in and out in one step). Then one
        forward pass over the new tokens of every scheduled sequence, flattened: a sequence with
        ``n`` new tokens contributes its last ``n`` token ids at positions ``len - n .. len - 1``;
        their K/V go to the block manager's ``slot_mapping``; attention reads through
        ``block_tables_tensor`` and ``seq_lens`` (``query_start_loc`` when any sequence has more
        than one new token). Each sequence's row is the logits of its last token:
        ``compute_logits(out, hidden, logits_indices)`` takes them from the hidden states.
        """
        # BEGIN SOLUTION block moves first; flatten the new tokens; slot mapping, tables, lengths; forward
        self.cache.swap_out(out.blocks_to_swap_out)
        self.cache.swap_in(out.blocks_to_swap_in)
        self.cache.copy_blocks(out.blocks_to_copy)
        seqs, counts = [s for s, _ in out.scheduled], [n for _, n in out.scheduled]
        ids: list[int] = []
        positions: list[int] = []
        for seq, n in out.scheduled:
            ids += seq.token_ids[len(seq) - n:]
            positions += range(len(seq) - n, len(seq))
        seq_ids = [s.seq_id for s in seqs]
        ends = np.cumsum(counts)  # (num_seqs,) where each sequence's new tokens end in the flat batch
        meta = build_attention_metadata(
            self.cache, self.block_manager.slot_mapping(seq_ids, counts).numpy(),
            self.block_manager.block_tables_tensor(seq_ids).numpy(), np.array([len(s) for s in seqs], dtype=np.int32),
            None if max(counts) == 1 else np.concatenate([[0], ends]).astype(np.int32), self.backend)
        with torch.inference_mode():
            hidden = self.model(to_device(ids, self.device), to_device(positions, self.device), self.cache, meta)
        return self.compute_logits(out, hidden, ends - 1)
        # END SOLUTION

    def compute_logits(self, out: SchedulerOutputs, hidden: torch.Tensor, logits_indices: np.ndarray) -> torch.Tensor:
        """float32 logits of the flat tokens ``logits_indices`` (one per sequence), then of the prompt
        positions of the requests that ask for ``prompt_logprobs`` (``prompt_logprob_rows``)."""
        extra = [offset + p - positions.start for _, positions, offset in prompt_logprob_rows(out) for p in positions]
        rows = to_device([*logits_indices.tolist(), *extra], self.device, torch.int64)
        with torch.inference_mode():
            return self.model.compute_logits(hidden.index_select(0, rows)).float()
