"""Stage 6 — the scheduler: continuous batching, first come first served, preemption.

Blocks let many sequences share memory; the scheduler decides, step by step, which of
them run. It schedules **sequence groups**: the sequences of one request (one, most
often; the samples or beams of a request from stage 8 on), which run, wait, move and
are preempted together, as in vLLM (``Sequence`` and ``SequenceGroup`` are in
``minipaged/common/sequence.py``, as vLLM keeps them in ``vllm/sequence.py``). Each step it
forms one batch:

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
with its generated tokens kept, to be prefilled again; **swap** moves its blocks to a pool
of CPU blocks (``stage6_swapping``), to be moved back later (if the CPU pool is full, it
falls back to recompute).

A request that could never fit is refused when added, and a ``max_model_len`` the cache
cannot hold is refused at construction, so the scheduler never waits for memory that
cannot come. Checked against unlimited memory: with a cache small enough to preempt
again and again, in both modes, every output is the same.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field

from minipaged.common.checks import check_choice
from minipaged.common.config import PREEMPTION_MODES
from minipaged.common.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.common.stats import SchedulerStats
from minipaged.stage6_swapping import SwapBlockSpaceManager


def _arrival(group: SequenceGroup) -> int:
    return group.arrival


@dataclass
class SchedulerOutputs:
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
        running = sum(not g.is_finished() for g in self.running)  # finished ones leave at the next step
        return dataclasses.replace(self._stats, num_running_reqs=running, num_waiting_reqs=len(self.waiting),
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

    def _preempt(self, group: SequenceGroup, out: SchedulerOutputs) -> None:
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

    def schedule(self) -> SchedulerOutputs:
        """Decide the next step, in three phases, as vLLM's scheduler sections them: the running
        groups (``_schedule_running``), then the swapped ones (``_schedule_swapped``), then the
        waiting ones (``_schedule_prefills``). The rules of each phase are in its docstring.

        The token budget starts at ``max_num_batched_tokens``; every token scheduled in this step
        comes off it — the decodes', the swap-ins', and each admitted group's scheduled tokens —
        and ``max_num_seqs`` counts the running, swapped-in and admitted groups alike (each as
        ``max_num_running_seqs``). The watermark is ``watermark_blocks`` while something runs — a
        group decoded, swapped in or admitted in this step — and 0 while nothing does (nothing
        could free blocks then): into an empty batch, a group that needs more than
        ``num_total_blocks - watermark_blocks`` blocks is still swapped in or admitted.

        Returns the batch, the block moves of the step (the copy-on-write copies last), and the
        groups it preempted. Each phase lists its groups in the order it takes them, a group's
        sequences together; the order of the phases within ``scheduled`` is not a rule (the
        runner takes any order). Queues stay in arrival order.
        """
        out = SchedulerOutputs()
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

    def _schedule_running(self, out: SchedulerOutputs) -> None:
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

    def _schedule_swapped(self, out: SchedulerOutputs, budget: int, num_seqs: int,
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
            budget, num_seqs = budget - len(seqs), num_seqs + group.max_num_running_seqs()
            watermark = self.watermark_blocks
        return budget, num_seqs, watermark
        # END SOLUTION

    def _schedule_prefills(self, out: SchedulerOutputs, budget: int, num_seqs: int, watermark: int) -> None:
        """Phase 3, unless something was preempted in this step or anything waits in swap: admit
        waiting groups, oldest first, stopping at the first that does not fit — the blocks of its
        waiting sequences (``blocks_needed`` of each one's full length) plus the watermark must be
        free, ``max_num_seqs`` as above, and its tokens (each waiting sequence's full length: a
        recomputed one's generated tokens are prefilled again, and count too) within the budget
        left (a group larger than the whole budget runs alone, when nothing else is scheduled yet);
        ``allocate`` each sequence, set its ``num_computed_tokens`` to what ``allocate`` returns,
        and schedule the tokens not already in the cache.
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

    def _run(self, group: SequenceGroup, scheduled: list[tuple[Sequence, int]], out: SchedulerOutputs) -> None:
        for seq, _ in scheduled:
            seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, group, key=_arrival)
        out.scheduled += scheduled
        out.scheduled_groups.append(group)
