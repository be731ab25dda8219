"""Stage 6 — the scheduler: continuous batching, first come first served, preemption.

Blocks let many sequences share memory; the scheduler decides, step by step, which of
them run. It schedules **sequence groups**: the sequences of one request (one, most
often; the samples or beams of a request from stage 8 on), which run, wait, move and
are preempted together, as in vLLM. Each step it forms one batch:

1. **Decode** every running group (one new token per sequence), oldest first. A
   sequence whose last block is full (or shared) needs a new block; if too few are free,
   the scheduler **preempts the most recently arrived** running group — possibly the one
   asking — so that the oldest requests always make progress (first come, first served).
2. **Swap in** swapped-out groups, oldest first, if nothing was preempted this step.
3. **Admit** waiting groups, oldest first, if nothing was preempted and nothing waits in
   swap — new prompts join the batch while others decode (**continuous batching**),
   within ``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens per step, and
   keeping a **watermark** of free blocks back so that running sequences can grow.

A preempted group loses its place in memory in one of two ways (``preemption_mode``):
**recompute** frees its blocks and puts it back in the waiting queue, in arrival order,
with its generated tokens kept, to be prefilled again; **swap** copies its blocks to a
pool of CPU blocks and frees the GPU ones, to be copied back later (if the CPU pool is
full, it falls back to recompute). Blocks shared inside a group move once and stay
shared. The block manager and the cache of stage 3 gain ``swap_out`` / ``swap_in``.

A request that could never fit is refused when added, and a ``max_model_len`` the cache
cannot hold is refused at construction, so the scheduler never waits for memory that
cannot come. Checked against unlimited memory: with a cache small enough to preempt
again and again, in both modes, every output is the same.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import itertools
from collections.abc import Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from minipaged.common.config import PREEMPTION_MODES, check_choice
from minipaged.common.stats import SchedulerStats
from minipaged.stage2_block_table import BlockTable
from minipaged.stage3_copy_on_write import (
    CowBlockSpaceManager,
    CowPagedKVCache,
    RefCountedBlockAllocator,
)

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sequence of tokens: its prompt, what it generated, and how much of it the cache holds."""

    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        """Record a generated token: the K/V of every token before it are now in the cache."""
        self.num_computed_tokens = len(self)
        self.output_token_ids.append(token_id)


@dataclass(eq=False)
class SequenceGroup:
    """The sequences of one request, scheduled together. ``width``: the most it runs at once."""

    request_id: Hashable
    seqs: list[Sequence]
    max_tokens: int  # tokens each sequence may generate
    width: int = 1
    arrival: int = -1  # set by Scheduler.add: the scheduler serves the smallest first

    def seqs_with(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self.seqs if s.status is status]

    def is_finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)

    def max_num_running_seqs(self) -> int:
        return max(self.width, len(self.seqs) - len(self.seqs_with(SequenceStatus.FINISHED)))


def _arrival(group: SequenceGroup) -> int:
    return group.arrival


@dataclass
class SchedulerOutput:
    """One step: who runs and how many new tokens each computes, and the block moves to do first."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # a group's sequences together
    scheduled_groups: list[SequenceGroup] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    preempted: list[SequenceGroup] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class SwapBlockSpaceManager(CowBlockSpaceManager):
    """Stage 3's manager plus a pool of CPU blocks that sequences can be swapped out to."""

    def __init__(self, allocator: RefCountedBlockAllocator, block_size: int = 16,
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
            for block_id in reversed(self.swapped_tables.pop(seq_id).block_ids):
                self.cpu_allocator.free(block_id)
        else:
            super().free(seq_id)


class SwapPagedKVCache(CowPagedKVCache):
    """Stage 3's cache plus CPU copies of its blocks, per layer, for swapping."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                 dtype=torch.float32, device="cpu", num_cpu_blocks: int = 0) -> None:
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        shape = (num_cpu_blocks, block_size, num_kv_heads, head_dim)
        pin = torch.cuda.is_available() and torch.device(device).type == "cuda"
        self.cpu_key_cache = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]
        self.cpu_value_cache = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]

    def _copy(self, pairs, to_cpu: bool) -> None:
        if pairs:
            src, dst = (torch.tensor(ids) for ids in zip(*pairs, strict=True))
            for gpu, cpu in zip(self.key_cache + self.value_cache, self.cpu_key_cache + self.cpu_value_cache, strict=True):
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


class Scheduler:
    """Waiting, running and swapped queues of sequence groups over one ``SwapBlockSpaceManager``."""

    def __init__(self, block_manager: SwapBlockSpaceManager, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, max_model_len: int = 2048,
                 preemption_mode: str = "recompute", watermark: float = 0.01) -> None:
        check_choice("preemption_mode", preemption_mode, PREEMPTION_MODES)
        if preemption_mode == "swap" and block_manager.cpu_allocator is None:
            raise ValueError("preemption_mode='swap' needs a CPU block pool (num_cpu_blocks >= 1)")
        needed, total = block_manager.blocks_needed(max_model_len), block_manager.num_total_blocks
        if needed > total:
            raise ValueError(f"max_model_len={max_model_len} needs {needed} blocks of {block_manager.block_size}; "
                             f"the cache has {total}: lower max_model_len or add blocks")
        max_num_batched_tokens = max_num_batched_tokens or max(max_model_len, 2048)
        if max_num_batched_tokens < max_model_len or max_num_seqs < 1:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_model_len "
                             f"({max_model_len}) and max_num_seqs ({max_num_seqs}) >= 1")
        self.block_manager, self.preemption_mode = block_manager, preemption_mode
        self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len = (
            max_num_seqs, max_num_batched_tokens, max_model_len)
        self.watermark_blocks = int(watermark * total)
        self.waiting: list[SequenceGroup] = []  # each queue kept in arrival order
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self._arrivals = itertools.count()
        self._stats = SchedulerStats(num_gpu_blocks=total)  # its counters; make_stats() adds the queues

    def add(self, group: SequenceGroup) -> None:
        """Queue a new request; ``ValueError`` at once for one that could never be served."""
        longest = max((len(s) for s in group.seqs), default=0)
        if not group.seqs or min(len(s) for s in group.seqs) < 1:
            raise ValueError("the prompt is empty: a request needs at least one token")
        if longest + group.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({longest} tokens) + max_tokens ({group.max_tokens}) exceeds "
                             f"max_model_len={self.max_model_len}")
        if group.max_num_running_seqs() > self.max_num_seqs:
            raise ValueError(f"a request of {group.max_num_running_seqs()} sequences exceeds "
                             f"max_num_seqs={self.max_num_seqs}")
        worst = group.max_num_running_seqs() * self.block_manager.blocks_needed(longest + group.max_tokens)
        if worst > self.block_manager.num_total_blocks:
            raise ValueError(f"a request of {group.max_num_running_seqs()} sequences may need {worst} blocks; "
                             f"the cache has {self.block_manager.num_total_blocks}")
        group.arrival = next(self._arrivals)
        for seq in group.seqs:
            seq.status = SequenceStatus.WAITING
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return any(not g.is_finished() for g in (*self.waiting, *self.running, *self.swapped))

    def make_stats(self) -> SchedulerStats:
        """Its queues now, and its counters since it started: preemptions, blocks swapped out and
        in (one per block moved), the most blocks ever in use at the end of a step."""
        manager = self.block_manager
        return dataclasses.replace(self._stats, num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
                                   num_swapped_reqs=len(self.swapped),
                                   num_used_blocks=manager.num_total_blocks - manager.num_free_blocks)

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request wherever it is, its blocks freed; False if it is not here."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.seqs:
                        if seq.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
                            self.block_manager.free(seq.seq_id)
                        seq.status = SequenceStatus.FINISHED
                    return True
        return False

    def finish(self, seq: Sequence) -> None:
        """A running sequence is done: give its blocks back (its group leaves when all are done)."""
        self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED

    def _num_running_seqs(self) -> int:
        return sum(g.max_num_running_seqs() for g in self.running)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self.running.remove(group)
        self._stats.num_preemptions += 1
        out.preempted.append(group)
        manager, ids = self.block_manager, [s.seq_id for s in group.seqs_with(SequenceStatus.RUNNING)]
        # BEGIN SOLUTION swap the whole group out if the mode and the CPU pool allow, else free it for recompute
        if self.preemption_mode == "swap" and manager.can_swap_out(ids):
            pairs = manager.swap_out(ids)
            out.blocks_to_swap_out += pairs
            self._stats.num_swapped_out_blocks += len(pairs)
            for seq in group.seqs_with(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, group, key=_arrival)
        else:  # recompute: the K/V are dropped and computed again at readmission
            for seq in group.seqs_with(SequenceStatus.RUNNING):
                manager.free(seq.seq_id)
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
            bisect.insort(self.waiting, group, key=_arrival)
        # END SOLUTION

    def schedule(self) -> SchedulerOutput:
        """Decide the next step, in three phases, as vLLM's scheduler sections them: the running
        groups (``_schedule_running``), then the swapped ones (``_schedule_swapped``), then the
        waiting ones (``_schedule_prefills``). The rules of each phase are in its docstring.

        The token budget starts at ``max_num_batched_tokens``; every token scheduled in this step
        comes off it — the decodes', the swap-ins', and each admitted group's scheduled tokens —
        and ``max_num_seqs`` counts the running, swapped-in and admitted groups alike (each as
        ``max_num_running_seqs``). The watermark is ``watermark_blocks`` while something runs — a
        group decoded, swapped in or admitted in this step — and 0 while nothing does (nothing
        could free blocks then).

        Returns the batch, the block moves of the step (the copy-on-write copies last), and the
        groups it preempted. Each phase lists its groups in the order it takes them, a group's
        sequences together; the order of the phases within ``scheduled`` is not a rule (the
        runner takes any order). Queues stay in arrival order.
        """
        out = SchedulerOutput()
        self.running = [g for g in self.running if not g.is_finished()]
        self._schedule_running(out)
        # BEGIN SOLUTION the budget left after the decodes; the watermark only if something runs
        budget, num_seqs = self.max_num_batched_tokens - len(out.scheduled), self._num_running_seqs()
        watermark = self.watermark_blocks if self.running else 0  # nothing can free blocks: no watermark
        # END SOLUTION
        budget, num_seqs, watermark = self._schedule_swapped(out, budget, num_seqs, watermark)
        self._schedule_prefills(out, budget, num_seqs, watermark)
        out.blocks_to_copy = self.block_manager.take_copies()
        used = self.block_manager.num_total_blocks - self.block_manager.num_free_blocks
        self._stats.peak_blocks_used = max(self._stats.peak_blocks_used, used)
        return out

    def _schedule_running(self, out: SchedulerOutput) -> None:
        """Phase 1: decode every running group, oldest first — one new slot (``append_slot``) for
        each of its running sequences, one token each. When ``can_append_slots`` says no, preempt
        the newest running group (the last of ``running``), possibly the one asking, until it says
        yes.

        A preempted group is swapped out whole if the mode is ``swap`` and ``can_swap_out`` says
        the CPU pool has room: its running sequences marked ``SWAPPED``, the group in ``swapped``,
        its ``(gpu, cpu)`` pairs in ``blocks_to_swap_out`` and their number added to
        ``num_swapped_out_blocks``. Otherwise it is recomputed: its blocks freed,
        ``num_computed_tokens`` set to 0, marked ``WAITING``, back in ``waiting``.
        """
        manager = self.block_manager
        # BEGIN SOLUTION oldest first; preempt the newest group until the blocks are there
        i = 0
        while i < len(self.running):
            group = self.running[i]
            seqs = group.seqs_with(SequenceStatus.RUNNING)
            while not manager.can_append_slots([s.seq_id for s in seqs]):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is group:
                    break
            else:
                for seq in seqs:
                    manager.append_slot(seq.seq_id)
                    out.scheduled.append((seq, 1))
                out.scheduled_groups.append(group)
                i += 1
        # END SOLUTION

    def _schedule_swapped(self, out: SchedulerOutput, budget: int, num_seqs: int,
                          watermark: int) -> tuple[int, int, int]:
        """Phase 2, unless something was preempted in this step: swap in swapped groups, oldest
        first, stopping at the first that does not fit — ``can_swap_in`` with the watermark, the
        sequences scheduled plus every sequence the group may run within ``max_num_seqs``, and its
        swapped sequences (one token each) within the token budget — then give each of its
        sequences its next slot and schedule one token each. A swap-in adds its ``(cpu, gpu)``
        pairs to ``blocks_to_swap_in`` and their number to ``num_swapped_in_blocks``.

        Returns ``(budget, num_seqs, watermark)`` after it.
        """
        manager = self.block_manager
        # BEGIN SOLUTION oldest first, while it fits; each swap-in spends budget and sequences
        while not out.preempted and self.swapped:
            group = self.swapped[0]
            seqs = group.seqs_with(SequenceStatus.SWAPPED)
            ids = [s.seq_id for s in seqs]
            if (len(seqs) > budget or num_seqs + group.max_num_running_seqs() > self.max_num_seqs
                    or not manager.can_swap_in(ids, watermark)):
                break
            pairs = manager.swap_in(ids)
            out.blocks_to_swap_in += pairs
            self._stats.num_swapped_in_blocks += len(pairs)
            self.swapped.pop(0)
            for seq in seqs:
                manager.append_slot(seq.seq_id)
            self._run(group, [(s, 1) for s in seqs], out)
            budget, num_seqs, watermark = budget - len(seqs), num_seqs + group.max_num_running_seqs(), self.watermark_blocks
        return budget, num_seqs, watermark
        # END SOLUTION

    def _schedule_prefills(self, out: SchedulerOutput, budget: int, num_seqs: int, watermark: int) -> None:
        """Phase 3, unless something was preempted in this step or anything waits in swap: admit
        waiting groups, oldest first, stopping at the first that does not fit — the blocks of its
        waiting sequences (``blocks_needed`` of each one's full length) plus the watermark must be
        free, ``max_num_seqs`` as above, and its tokens (each waiting sequence's full length)
        within the budget left (a group larger than the whole budget runs alone, when nothing else
        is scheduled yet); ``allocate`` each sequence, set its ``num_computed_tokens`` to what
        ``allocate`` returns, and schedule the tokens not already in the cache.
        """
        manager = self.block_manager
        # BEGIN SOLUTION oldest first, while blocks, sequences and tokens last
        while not out.preempted and not self.swapped and self.waiting:
            group = self.waiting[0]
            seqs = group.seqs_with(SequenceStatus.WAITING)
            needed = sum(manager.blocks_needed(len(s)) for s in seqs)
            too_many_tokens = sum(len(s) for s in seqs) > budget and out.scheduled  # alone, a group may exceed it
            if (too_many_tokens or needed + watermark > manager.num_free_blocks
                    or num_seqs + group.max_num_running_seqs() > self.max_num_seqs):
                break
            for seq in seqs:
                seq.num_computed_tokens = manager.allocate(seq.seq_id, seq.token_ids)
            self.waiting.pop(0)
            self._run(group, [(s, len(s) - s.num_computed_tokens) for s in seqs], out)
            budget -= sum(n for _, n in out.scheduled[-len(seqs):])
            num_seqs, watermark = num_seqs + group.max_num_running_seqs(), self.watermark_blocks
        # END SOLUTION

    def _run(self, group: SequenceGroup, scheduled: list[tuple[Sequence, int]], out: SchedulerOutput) -> None:
        for seq, _ in scheduled:
            seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, group, key=_arrival)
        out.scheduled += scheduled
        out.scheduled_groups.append(group)
