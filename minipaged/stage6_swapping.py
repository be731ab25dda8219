"""Stage 6 — swapping: a pool of CPU blocks that a preempted group moves to, and back from.

The scheduler (``stage6_scheduler``) preempts a group in one of two ways; in ``swap`` mode
the group leaves the GPU without losing its K/V. The block manager and the cache of stage 3
gain ``swap_out`` / ``swap_in``: ``SwapBlockSpaceManager`` moves the group's block tables
to CPU blocks and frees the GPU ones (or back), and returns the ``(from, to)`` block pairs
to copy; ``SwapPagedKVCache`` copies them, on every layer. Blocks shared inside a group
move once and stay shared. The manager only counts and maps blocks: who moves, and when,
is the scheduler's decision.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence as Seq

import torch

from minipaged.stage2_block_table import BlockTable
from minipaged.stage3_copy_on_write import (
    CowBlockSpaceManager,
    CowPagedKVCache,
    RefCountedBlockAllocator,
    RefCountingAllocator,
)


class SwapBlockSpaceManager(CowBlockSpaceManager):
    """Stage 3's manager plus a pool of CPU blocks that sequences can be swapped out to."""

    def __init__(self, allocator: RefCountingAllocator, block_size: int = 16,
                 cpu_allocator: RefCountedBlockAllocator | None = None) -> None:
        super().__init__(allocator, block_size)
        self.cpu_allocator = cpu_allocator
        self.swapped_tables: dict[Hashable, BlockTable] = {}

    def can_append_slots(self, seq_ids: Seq[Hashable]) -> bool:
        """Whether every sequence of ``seq_ids`` can take one more token now."""
        return sum(self.needs_new_block(s) for s in seq_ids) <= self.num_free_blocks

    def _distinct_blocks(self, tables: dict[Hashable, BlockTable], seq_ids: Seq[Hashable]) -> int:
        return len({b for s in seq_ids for b in tables[s].block_ids})

    def _move(self, tables, seq_ids, source, target, dest_tables) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}  # a block shared by several of seq_ids moves once
        for seq_id in seq_ids:
            table = tables.pop(seq_id)
            for i, block_id in enumerate(table.block_ids):
                if block_id in mapping:
                    target.incref(mapping[block_id])
                else:
                    (mapping[block_id],) = target.allocate(1)
                source.free(block_id)
                table.block_ids[i] = mapping[block_id]
            dest_tables[seq_id] = table
        return list(mapping.items())

    def can_swap_out(self, seq_ids: Seq[Hashable]) -> bool:
        """Enough free CPU blocks for the distinct blocks of ``seq_ids``."""
        # BEGIN SOLUTION
        return self.cpu_allocator is not None and (
            self._distinct_blocks(self.block_tables, seq_ids) <= self.cpu_allocator.num_free_blocks)
        # END SOLUTION

    def swap_out(self, seq_ids: Seq[Hashable]) -> list[tuple[int, int]]:
        """Move the blocks of ``seq_ids`` to CPU blocks; return the ``(gpu, cpu)`` copies to do."""
        # BEGIN SOLUTION
        return self._move(self.block_tables, seq_ids, self.allocator, self.cpu_allocator, self.swapped_tables)
        # END SOLUTION

    def can_swap_in(self, seq_ids: Seq[Hashable], watermark: int = 0) -> bool:
        """Enough free GPU blocks for the blocks of ``seq_ids``, the next token of each, and the watermark."""
        # BEGIN SOLUTION a sequence grows into a new block if its last block is full or shared in the group
        tables = [self.swapped_tables[s] for s in seq_ids]
        lasts = [t.block_ids[-1] for t in tables]
        growing = sum(t.num_tokens % self.block_size == 0 or lasts.count(t.block_ids[-1]) > 1 for t in tables)
        return self._distinct_blocks(self.swapped_tables, seq_ids) + growing + watermark <= self.num_free_blocks
        # END SOLUTION

    def swap_in(self, seq_ids: Seq[Hashable]) -> list[tuple[int, int]]:
        """Move the blocks of ``seq_ids`` back to GPU blocks; return the ``(cpu, gpu)`` copies to do."""
        # BEGIN SOLUTION
        return self._move(self.swapped_tables, seq_ids, self.cpu_allocator, self.allocator, self.block_tables)
        # END SOLUTION

    def free(self, seq_id: Hashable) -> None:
        """Free the blocks of ``seq_id``, on the GPU or, if it is swapped out, on the CPU."""
        if seq_id in self.swapped_tables:
            assert self.cpu_allocator is not None  # only a manager with a CPU pool swaps out
            for block_id in reversed(self.swapped_tables.pop(seq_id).block_ids):
                self.cpu_allocator.free(block_id)
        else:
            super().free(seq_id)


class SwapPagedKVCache(CowPagedKVCache):
    """Stage 3's cache plus CPU copies of its blocks, per layer, for swapping."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 num_cpu_blocks: int = 0) -> None:
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        shape = (num_cpu_blocks, block_size, num_kv_heads, head_dim)
        pin = torch.cuda.is_available() and torch.device(device).type == "cuda"
        self.cpu_key_cache = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]
        self.cpu_value_cache = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]

    def _copy(self, pairs, to_cpu: bool) -> None:
        if pairs:
            src, dst = (torch.tensor(ids) for ids in zip(*pairs, strict=True))
            for gpu, cpu in zip(self.key_cache + self.value_cache, self.cpu_key_cache + self.cpu_value_cache,
                                strict=True):
                if to_cpu:
                    cpu[dst] = gpu[src.to(gpu.device)].cpu()
                else:
                    gpu[dst.to(gpu.device)] = cpu[src].to(gpu.device)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy GPU blocks to CPU blocks, ``(gpu, cpu)`` pairs, on every layer."""
        self._copy(pairs, to_cpu=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to GPU blocks, ``(cpu, gpu)`` pairs, on every layer."""
        self._copy(pairs, to_cpu=False)
