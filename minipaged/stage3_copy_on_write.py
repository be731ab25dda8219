"""Stage 3 — sharing blocks: reference counts, fork, and copy-on-write.

Many requests hold the same tokens: the n samples of one prompt (parallel sampling), the
beams of a beam search, every request that starts with one system prompt. With a
contiguous cache each holds its own copy. With block tables, two sequences can point at
the *same* physical block, exactly as two processes share a page after ``fork()``.

Three things make that safe, as in an operating system:

* **Reference counts.** Each block counts the block tables that hold it. ``free`` of a
  sequence drops one reference per block; a block returns to the pool only at zero.
  ``RefCountedBlockAllocator`` *wraps* a stage-1 ``BlockAllocator`` (as vLLM's allocators
  wrap one another) and keeps the counts beside it, calling only its public methods.
* **Fork.** ``fork(parent, child)`` gives the child a copy of the parent's block *table*
  (not of the blocks) and adds one reference to each block: no K/V is copied.
* **Copy-on-write.** Full blocks never change again, so sharing them is free. The last
  block of a sequence is still being filled: when a sequence appends a token to a last
  block that others share, it first gets a private block, and the cache must copy the
  old block's K/V into it. ``append_slot`` records that ``(source, destination)`` pair;
  ``take_copies()`` hands the pairs of a step to whoever runs the model, which applies
  them with ``PagedKVCache.copy_blocks`` on every layer before writing new K/V.

Checked against stages 2 and 0: every branch of a fork tree reads exactly what its own
unshared cache would hold, in fewer physical blocks.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

import torch

from minipaged.stage1_block_allocator import BlockAllocator
from minipaged.stage2_block_table import Allocator, BlockSpaceManager, BlockTable, PagedKVCache


class RefCountedBlockAllocator:
    """Stage 1's pool, wrapped, with a reference count per block.

    ``allocate`` hands out blocks with one reference each; ``incref`` adds one; ``free``
    drops one and gives the block back to the pool when none is left. The rest of stage
    1's interface (``is_free``, ``num_free_blocks``, ``num_total_blocks``) passes through.
    """

    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockAllocator(num_blocks)
        # BEGIN SOLUTION one counter per block, all zero
        self._ref_counts = [0] * num_blocks
        # END SOLUTION

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def is_free(self, block_id: int) -> bool:
        return self.pool.is_free(block_id)

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id`` (0 when it is free)."""
        if self.pool.is_free(block_id):  # ValueError for an id outside the pool
            return 0
        # BEGIN SOLUTION
        return self._ref_counts[block_id]
        # END SOLUTION

    def allocate(self, num_blocks: int = 1) -> list[int]:
        """Take ``num_blocks`` blocks from the pool (all or nothing), one reference each."""
        # BEGIN SOLUTION allocate from the pool, then give each block one reference
        ids = self.pool.allocate(num_blocks)
        for block_id in ids:
            self._ref_counts[block_id] = 1
        return ids
        # END SOLUTION

    def incref(self, block_id: int) -> None:
        """Add a reference to a block in use (sharing it); ``ValueError`` for a free block."""
        if self.pool.is_free(block_id):
            raise ValueError(f"block {block_id} is free; only a block in use can be shared")
        # BEGIN SOLUTION
        self._ref_counts[block_id] += 1
        # END SOLUTION

    def free(self, block_id: int) -> None:
        """Drop one reference; the block goes back to the pool when it was the last.

        ``ValueError`` for a free block or a foreign id, and nothing changes.
        """
        if self.pool.is_free(block_id):
            raise ValueError(f"block {block_id} is already free (double free)")
        # BEGIN SOLUTION decrement, return the block to the pool at zero
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self.pool.free(block_id)
        # END SOLUTION


class RefCountingAllocator(Allocator, Protocol):
    """An allocator that counts references: a ``RefCountedBlockAllocator``, or one that wraps it."""

    def ref_count(self, block_id: int) -> int: ...

    def incref(self, block_id: int) -> None: ...


class CowBlockSpaceManager(BlockSpaceManager):
    """A ``BlockSpaceManager`` whose sequences share blocks: fork and copy-on-write.

    Its allocator must count references: a ``RefCountedBlockAllocator`` (or one that wraps it).
    """

    allocator: RefCountingAllocator

    def __init__(self, allocator: RefCountingAllocator, block_size: int = 16) -> None:
        super().__init__(allocator, block_size)
        self.pending_copies: list[tuple[int, int]] = []  # (source, destination), for the runner

    def ref_count(self, block_id: int) -> int:
        return self.allocator.ref_count(block_id)

    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable) -> BlockTable:
        """Give ``child_seq_id`` the parent's blocks, shared: one more reference each.

        ``KeyError`` for an unknown parent, ``ValueError`` if the child already has a table.
        """
        parent = self.table(parent_seq_id)
        if child_seq_id in self.block_tables:
            raise ValueError(f"sequence {child_seq_id!r} already has a block table")
        # BEGIN SOLUTION copy the table (not the blocks) and incref every block
        for block_id in parent.block_ids:
            self.allocator.incref(block_id)
        child = BlockTable(list(parent.block_ids), parent.num_tokens)
        self.block_tables[child_seq_id] = child
        return child
        # END SOLUTION

    def needs_new_block(self, seq_id: Hashable) -> bool:
        """Whether appending a token to ``seq_id`` takes a block: its last block is full, or shared."""
        table = self.table(seq_id)
        # BEGIN SOLUTION
        full = table.num_tokens % self.block_size == 0
        return full or self.ref_count(table.block_ids[-1]) > 1
        # END SOLUTION

    def can_append_slot(self, seq_id: Hashable) -> bool:
        return not self.needs_new_block(seq_id) or self.num_free_blocks > 0

    def append_slot(self, seq_id: Hashable) -> int:
        """Make room for one more token; copy-on-write if the last block is shared.

        When the token goes into a partly filled last block that other sequences hold,
        the sequence gets a private block instead, and the pair ``(shared, private)`` is
        queued for ``take_copies``. Returns the new token's slot.
        """
        table = self.table(seq_id)
        # BEGIN SOLUTION copy-on-write the shared, partly filled last block, then append as in stage 2
        if table.num_tokens % self.block_size != 0:
            last = table.block_ids[-1]
            if self.ref_count(last) > 1:
                (private,) = self.allocator.allocate(1)
                self.allocator.free(last)  # drop this sequence's reference to the shared block
                table.block_ids[-1] = private
                self.pending_copies.append((last, private))
        return super().append_slot(seq_id)
        # END SOLUTION

    def append_slots(self, seq_id: Hashable, n: int) -> list[int]:
        """As stage 2's; a shared, partly filled last block is copied on write first (``append_slot``)."""
        if n > 0 and self.table(seq_id).num_tokens % self.block_size and self.needs_new_block(seq_id):
            self.append_slot(seq_id)
            n -= 1
        return super().append_slots(seq_id, n)

    def take_copies(self) -> list[tuple[int, int]]:
        """The ``(source, destination)`` block copies queued since the last call."""
        copies, self.pending_copies = self.pending_copies, []
        return copies


class CowPagedKVCache(PagedKVCache):
    """A ``PagedKVCache`` that can copy blocks, for copy-on-write."""

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each source block's K/V into its destination block, on every layer."""
        if not pairs:
            return
        # BEGIN SOLUTION one indexed copy per layer for all the pairs
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.key_cache[0].device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.key_cache[0].device)
        for cache in (*self.key_cache, *self.value_cache):
            cache[dst] = cache[src]
        # END SOLUTION
