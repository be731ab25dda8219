"""Stage 1 — the block allocator: KV memory as a pool of fixed-size blocks.

Stage 0 lost most of its memory to reservation and fragmentation, because a request
needed one contiguous slab sized for its longest possible future. PagedAttention does
what an operating system does with RAM: it cuts the KV cache into fixed-size **blocks**
(16 token slots each, by default) and hands them out one at a time, from anywhere in
memory. A sequence that grows asks for one more block; a sequence that ends gives its
blocks back. Since every block is the same size, any free block fits any request:
there is no external fragmentation, and at most one partly filled block per sequence.

This stage is the pool itself, ``BlockAllocator``: physical block ids ``0 ..
num_blocks - 1``, a free list, ``allocate`` and ``free`` in O(1). It knows nothing of
tokens or sequences; stage 2 builds those on top. It is strict, because every later
stage trusts it: asking for more blocks than are free raises ``OutOfBlocksError`` (and
allocates none), and freeing a block twice or an id it never handed out raises
``ValueError`` and changes nothing.
"""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """Fewer blocks are free than were asked for; nothing was allocated."""


class BlockAllocator:
    """A pool of ``num_blocks`` physical blocks, ids ``0 .. num_blocks - 1``.

    Free blocks sit on a stack: ``allocate`` pops, ``free`` pushes, both O(1). A flag per
    block tells, in O(1) too, whether an id is currently free (so a double free is caught).
    """

    def __init__(self, num_blocks: int) -> None:
        # BEGIN SOLUTION check num_blocks; build the free stack (lowest id on top) and the free flags
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._free_stack = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first
        self._is_free = [True] * num_blocks
        # END SOLUTION

    @property
    def num_total_blocks(self) -> int:
        """Every block of the pool, free or not."""
        # BEGIN SOLUTION
        return self._num_blocks
        # END SOLUTION

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now."""
        # BEGIN SOLUTION
        return len(self._free_stack)
        # END SOLUTION

    def is_free(self, block_id: int) -> bool:
        """Whether ``block_id`` is on the free stack."""
        # BEGIN SOLUTION
        self._check_id(block_id)
        return self._is_free[block_id]
        # END SOLUTION

    def allocate(self) -> int:
        """Take one free block and return its id; ``OutOfBlocksError`` if none is free."""
        # BEGIN SOLUTION pop the free stack, mark the block used
        return self.allocate_blocks(1)[0]
        # END SOLUTION

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks at once, or none at all.

        Raises ``OutOfBlocksError`` saying how many were asked for and how many are free.
        """
        # BEGIN SOLUTION all or nothing: check first, then pop num_blocks ids
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an integer >= 0, got {num_blocks!r}")
        if num_blocks > len(self._free_stack):
            raise OutOfBlocksError(
                f"asked for {num_blocks} block(s) but only {len(self._free_stack)} of "
                f"{self._num_blocks} are free"
            )
        ids = [self._free_stack.pop() for _ in range(num_blocks)]
        for block_id in ids:
            self._is_free[block_id] = False
        return ids
        # END SOLUTION

    def free(self, block_id: int) -> None:
        """Give a block back to the pool.

        Raises ``ValueError`` for an id outside the pool or a block that is already free;
        the pool is unchanged then.
        """
        # BEGIN SOLUTION validate the id, refuse a double free, push the block back
        self._check_id(block_id)
        if self._is_free[block_id]:
            raise ValueError(f"block {block_id} is already free (double free)")
        self._is_free[block_id] = True
        self._free_stack.append(block_id)
        # END SOLUTION

    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or isinstance(block_id, bool) or not (
            0 <= block_id < self.num_total_blocks
        ):
            raise ValueError(
                f"block id {block_id!r} does not belong to this allocator "
                f"(valid ids: 0 .. {self.num_total_blocks - 1})"
            )
