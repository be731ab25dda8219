"""Stage 6 — the scheduler: continuous batching, first come first served, preemption.

Blocks let many sequences share memory; the scheduler decides, step by step, which of
them run. Each step it forms one batch:

1. **Decode** every running sequence (one new token each), oldest first. A sequence whose
   last block is full needs a new block; if none is free, the scheduler **preempts the
   most recently arrived** running sequence — possibly the one asking — so that the
   oldest requests always make progress (first come, first served).
2. **Swap in** swapped-out sequences, oldest first, if nothing was preempted this step.
3. **Admit** waiting prompts, oldest first, if nothing was preempted and nothing waits in
   swap — new prompts join the batch while others decode (**continuous batching**),
   within ``max_num_seqs``, ``max_num_batched_tokens``, and a **watermark** of free blocks
   kept back so that running sequences can grow.

A preempted sequence loses its place in memory in one of two ways
(``preemption_mode``): **recompute** frees its blocks and puts it back in the waiting
queue with its generated tokens kept, to be prefilled again; **swap** copies its blocks
to a pool of CPU blocks and frees the GPU ones, to be copied back later. The block
manager and the cache of stage 3 gain ``swap_out`` / ``swap_in`` for that.

A request that could never fit (prompt + max_tokens beyond ``max_model_len``) is refused
when added, and a ``max_model_len`` the cache cannot hold is refused at construction,
so the scheduler never waits for memory that cannot come. Checked against unlimited
memory: with a cache small enough to preempt again and again, in both modes, every
output is the same.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections.abc import Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from minipaged.stage2_block_table import BlockTable
from minipaged.stage3_copy_on_write import (
    CowBlockSpaceManager,
    CowPagedKVCache,
    RefCountedBlockAllocator,
)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sequence of tokens: its prompt, what it generated, and what the cache holds of it."""

    seq_id: int
    prompt_token_ids: list[int]
    max_tokens: int
    arrival: int  # order of arrival: the scheduler serves the smallest first
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def order(self) -> tuple[int, int]:
        return (self.arrival, self.seq_id)


@dataclass
class SchedulerOutput:
    """One step: who runs and how many new tokens each computes, and the block copies to do first."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    preempted: list[Sequence] = field(default_factory=list)


class SwapBlockSpaceManager(CowBlockSpaceManager):
    """Stage 3's manager plus a pool of CPU blocks that sequences can be swapped out to."""

    def __init__(self, num_blocks: int, block_size: int = 16, num_cpu_blocks: int = 0) -> None:
        super().__init__(num_blocks, block_size)
        self.cpu_allocator = RefCountedBlockAllocator(num_cpu_blocks) if num_cpu_blocks else None
        self.swapped_tables: dict[Hashable, BlockTable] = {}

    def _move(self, tables, seq_ids, source, target, dest_tables) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}  # a block shared by several of seq_ids moves once
        for seq_id in seq_ids:
            table = tables.pop(seq_id)
            for i, block_id in enumerate(table.block_ids):
                if block_id in mapping:
                    target.incref(mapping[block_id])
                else:
                    mapping[block_id] = target.allocate()
                source.free(block_id)
                table.block_ids[i] = mapping[block_id]
            dest_tables[seq_id] = table
        return list(mapping.items())

    def _distinct_blocks(self, tables, seq_ids) -> int:
        return len({b for s in seq_ids for b in tables[s].block_ids})

    def can_swap_out(self, seq_ids: Seq[Hashable]) -> bool:
        # BEGIN SOLUTION enough free CPU blocks for the distinct blocks of seq_ids
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
        # BEGIN SOLUTION
        tables = [self.swapped_tables[s] for s in seq_ids]
        growing = sum(t.num_tokens % self.block_size == 0 for t in tables)  # last block full
        return self._distinct_blocks(self.swapped_tables, seq_ids) + growing + watermark <= self.num_free_blocks
        # END SOLUTION

    def swap_in(self, seq_ids: Seq[Hashable]) -> list[tuple[int, int]]:
        """Move the blocks of ``seq_ids`` back to GPU blocks; return the ``(cpu, gpu)`` copies to do."""
        # BEGIN SOLUTION
        return self._move(self.swapped_tables, seq_ids, self.cpu_allocator, self.allocator, self.block_tables)
        # END SOLUTION


class SwapPagedKVCache(CowPagedKVCache):
    """Stage 3's cache plus CPU copies of its blocks, per layer, for swapping."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                 dtype=torch.float32, device="cpu", num_cpu_blocks: int = 0) -> None:
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        shape = (num_cpu_blocks, block_size, num_kv_heads, head_dim)
        pin = torch.cuda.is_available() and torch.device(device).type == "cuda"
        self.cpu_key_cache = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]
        self.cpu_value_cache = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy GPU blocks to CPU blocks, ``(gpu, cpu)`` pairs, on every layer."""
        # BEGIN SOLUTION
        if pairs:
            src, dst = (torch.tensor(ids) for ids in zip(*pairs, strict=True))
            for gpu, cpu in zip(self.key_cache + self.value_cache, self.cpu_key_cache + self.cpu_value_cache, strict=True):
                cpu[dst] = gpu[src.to(gpu.device)].cpu()
        # END SOLUTION

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to GPU blocks, ``(cpu, gpu)`` pairs, on every layer."""
        # BEGIN SOLUTION
        if pairs:
            src, dst = (torch.tensor(ids) for ids in zip(*pairs, strict=True))
            for gpu, cpu in zip(self.key_cache + self.value_cache, self.cpu_key_cache + self.cpu_value_cache, strict=True):
                gpu[dst.to(gpu.device)] = cpu[src].to(gpu.device)
        # END SOLUTION


class Scheduler:
    """Waiting, running and swapped queues over one ``SwapBlockSpaceManager``."""

    block_manager_class = SwapBlockSpaceManager

    def __init__(self, num_gpu_blocks: int, block_size: int = 16, num_cpu_blocks: int = 0,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 max_model_len: int = 2048, preemption_mode: str = "recompute", watermark: float = 0.01) -> None:
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode: expected 'recompute' or 'swap', got {preemption_mode!r}")
        if preemption_mode == "swap" and num_cpu_blocks < 1:
            raise ValueError("preemption_mode='swap' needs num_cpu_blocks >= 1 (the swap space)")
        self.block_manager = self.block_manager_class(num_gpu_blocks, block_size, num_cpu_blocks)
        if self.block_manager.blocks_needed(max_model_len) > num_gpu_blocks:
            raise ValueError(f"max_model_len={max_model_len} needs {self.block_manager.blocks_needed(max_model_len)} "
                             f"blocks of {block_size}; the cache has {num_gpu_blocks}: lower max_model_len or add blocks")
        self.max_num_batched_tokens = max_num_batched_tokens or max(max_model_len, 2048)
        if self.max_num_batched_tokens < max_model_len or max_num_seqs < 1:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({max_model_len}) and max_num_seqs ({max_num_seqs}) >= 1")
        self.max_num_seqs, self.max_model_len, self.preemption_mode = max_num_seqs, max_model_len, preemption_mode
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.waiting: list[Sequence] = []  # each queue kept in arrival order
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self._arrivals, self._seq_ids = itertools.count(), itertools.count()
        self.num_preemptions = self.num_swapped_out_blocks = self.num_swapped_in_blocks = 0
        self.peak_blocks_used = 0

    def add_sequence(self, prompt_token_ids: list[int], max_tokens: int) -> Sequence:
        """Queue a new request; refuse at once one that could never fit."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: a request needs at least one token")
        if len(prompt_token_ids) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"max_model_len={self.max_model_len}")
        seq = Sequence(next(self._seq_ids), list(prompt_token_ids), max_tokens, next(self._arrivals))
        self.waiting.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        # BEGIN SOLUTION swap the victim out if possible in swap mode, else free it for recompute
        self.running.remove(victim)
        self.num_preemptions += 1
        out.preempted.append(victim)
        manager = self.block_manager
        if self.preemption_mode == "swap" and manager.can_swap_out([victim.seq_id]):
            pairs = manager.swap_out([victim.seq_id])
            out.blocks_to_swap_out += pairs
            self.num_swapped_out_blocks += len(pairs)
            victim.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, victim, key=Sequence.order)
        else:  # recompute: the K/V are dropped and computed again at readmission
            manager.free(victim.seq_id)
            victim.num_computed_tokens = 0
            victim.status = SequenceStatus.WAITING
            bisect.insort(self.waiting, victim, key=Sequence.order)
        # END SOLUTION

    def schedule(self) -> SchedulerOutput:
        """Decide the next step: decodes (preempting the newest when blocks run out), swap-ins, admissions."""
        out, manager = SchedulerOutput(), self.block_manager
        # BEGIN SOLUTION decode the running (oldest first), then swap in, then admit, as the docstring says
        i = 0
        while i < len(self.running):  # 1. decode, preempting the newest when a block is missing
            seq = self.running[i]
            while not manager.can_append_slot(seq.seq_id):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                manager.append_slot(seq.seq_id)
                out.scheduled.append((seq, 1))
                i += 1
        budget = self.max_num_batched_tokens - len(out.scheduled)
        idle = not self.running  # nothing can free blocks: ignore the watermark
        while not out.preempted and self.swapped and budget >= 1 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]  # 2. swap in, oldest first
            if not manager.can_swap_in([seq.seq_id], 0 if idle else self.watermark_blocks):
                break
            pairs = manager.swap_in([seq.seq_id])
            out.blocks_to_swap_in += pairs
            self.num_swapped_in_blocks += len(pairs)
            self.swapped.pop(0)
            manager.append_slot(seq.seq_id)
            self._run(seq, 1, out)
            budget -= 1
        while not out.preempted and not self.swapped and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]  # 3. admit, oldest first
            needed = manager.blocks_needed(len(seq))
            watermark = 0 if not self.running else self.watermark_blocks
            if len(seq) > budget or needed + watermark > manager.num_free_blocks:
                break
            new_tokens = self._allocate(seq)
            self.waiting.pop(0)
            self._run(seq, new_tokens, out)
            budget -= new_tokens
        # END SOLUTION
        out.blocks_to_copy = manager.take_copies()
        self.peak_blocks_used = max(self.peak_blocks_used, manager.num_total_blocks - manager.num_free_blocks)
        return out

    def _allocate(self, seq: Sequence) -> int:
        """Give an admitted sequence its blocks; return how many of its tokens must be computed."""
        self.block_manager.allocate(seq.seq_id, len(seq))
        return len(seq)

    def _run(self, seq: Sequence, num_new_tokens: int, out: SchedulerOutput) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=Sequence.order)
        out.scheduled.append((seq, num_new_tokens))

    def append_token(self, seq: Sequence, token_id: int) -> None:
        """Record a sampled token: the K/V of every token before it are now in the cache."""
        seq.num_computed_tokens = len(seq)
        seq.output_token_ids.append(token_id)

    def finish(self, seq: Sequence) -> None:
        """A sequence is done: give its blocks back."""
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
