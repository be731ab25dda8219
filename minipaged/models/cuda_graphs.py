"""Decode steps replayed from CUDA graphs: the GPU stops waiting for Python between kernels.

A decode step of a small model is hundreds of short kernels; launched one by one from Python,
the launches take longer than the kernels, and the GPU idles between them. A CUDA graph
records the kernels of one forward pass once and replays them all with one launch. vLLM captures
a graph per batch size of ``cudagraph_capture_sizes`` (1, 2, 4, then multiples of 8) and pads a
step up to the next size; nano-vllm does the same in its model runner. A graph replays the very
addresses it recorded, so its inputs live in static buffers that each step fills first:

* token ids, positions, the slot mapping, block tables and context lengths, ``max_num_seqs`` rows
  (a slot mapping and block tables per KV cache group, where the layers keep several: stage 15);
* padded rows write their K/V into a scratch block of the cache, which no sequence is given,
  and attend over one token of it: their output is dropped;
* the attention kernels are launched for ``max_model_len`` (the grid of the longest context), and
  each row stops at its own length, read from the buffer.

Only decode steps (one new token per sequence) of at most the largest size are replayed; prefills,
chunks and verification steps run eagerly, as vLLM's piecewise-free ("full") graphs do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minipaged.models.transformer import AttentionMetadata, GroupedAttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's ``cudagraph_capture_sizes``: 1, 2, 4, then multiples of 8, up to ``max_num_seqs``."""
    return [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))


class CUDAGraphModel:
    """The model, its decode steps of up to ``max_num_seqs`` sequences replayed from CUDA graphs; called
    and asked for logits as the model is. The cache's last block is the scratch block (the engine
    allocates one more block than its block manager hands out)."""

    def __init__(self, model: Any, cache: Any, backend: Callable[..., torch.Tensor], max_num_seqs: int,
                 max_model_len: int, group_of_layer: list[int] | None = None) -> None:
        self.model, self.cache, self.backend, self.max_model_len = model, cache, backend, max_model_len
        self.group_of_layer = group_of_layer  # each layer's KV cache group; None: one group, every layer
        groups = 1 if group_of_layer is None else max(group_of_layer) + 1
        num_blocks, block_size = cache.key_cache[0].shape[:2]
        self.scratch_block = num_blocks - 1
        self.scratch_slot = self.scratch_block * block_size
        self.sizes = capture_sizes(max_num_seqs)
        rows, width, device = self.sizes[-1], -(-max_model_len // block_size), cache.key_cache[0].device
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((groups, rows), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((groups, rows, width), self.scratch_block, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.graphs: dict[int, Any] = {}  # size -> its torch.cuda.CUDAGraph
        self.hidden: torch.Tensor | None = None  # (rows, hidden): what the graphs write
        self.replays = 0  # steps replayed: the others ran eagerly
        self.capture()

    def meta(self, size: int) -> AttentionMetadata | GroupedAttentionMetadata:
        """The buffers' first ``size`` rows as a step's metadata: one, or each layer its group's."""
        metas = [AttentionMetadata(slots[:size], tables[:size], self.seq_lens[:size], None, self.backend,
                                   max_query_len=1, max_seq_len=self.max_model_len)
                 for slots, tables in zip(self.slot_mapping, self.block_tables, strict=True)]
        return metas[0] if self.group_of_layer is None else GroupedAttentionMetadata(metas, self.group_of_layer)

    def run_static(self, size: int) -> None:
        """The forward over the buffers' first ``size`` rows, into ``hidden``: what a graph records."""
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.cache, self.meta(size))
        if self.hidden is None:  # the first call, a warm-up: the output's buffer, for every size
            self.hidden = torch.empty(self.sizes[-1], *hidden.shape[1:], dtype=hidden.dtype, device=hidden.device)
        self.hidden[:size] = hidden

    def capture(self) -> None:
        """One graph per size, the largest first, all in one memory pool (nano-vllm's order); each
        recorded after a warm-up run (the kernels compile, the allocator settles)."""
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self.run_static(size)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.run_static(size)
                pool = pool if pool is not None else graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: Any,
                 meta: AttentionMetadata | GroupedAttentionMetadata) -> torch.Tensor:
        """A decode step of at most the largest size: its inputs copied into the buffers (device to
        device, nothing read back), the graph of the next size up replayed; any other step, eagerly."""
        n = input_ids.shape[0]
        groups = meta.groups if isinstance(meta, GroupedAttentionMetadata) else [meta]
        if groups[0].query_start_loc is not None or n > self.sizes[-1]:
            return self.model(input_ids, positions, cache, meta)
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        for g, group in enumerate(groups):
            self.slot_mapping[g, :n] = group.slot_mapping
            self.block_tables[g, :n, :group.block_tables.shape[1]] = group.block_tables
        self.slot_mapping[:, n:size] = self.scratch_slot  # padded rows write where no sequence reads
        self.seq_lens[:n] = groups[0].seq_lens
        self.seq_lens[n:size] = 1
        self.graphs[size].replay()
        self.replays += 1
        assert self.hidden is not None
        return self.hidden[:n]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def parameters(self) -> Any:
        return self.model.parameters()
