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
``ValueError`` and changes nothing. Higher stages *wrap* it (stage 3 adds reference
counts, stage 9 a cache of blocks by content) and call only its public methods, so any
allocator that passes this stage's tests works under all of them.
"""

from __future__ import annotations

from minipaged.common.checks import check_int


class OutOfBlocksError(RuntimeError):
    """Fewer blocks are free than were asked for; nothing was allocated.

    ``num_requested`` and ``num_free`` say how many were asked for and how many were free.
    """

    def __init__(self, num_requested: int, num_free: int) -> None:
        super().__init__(f"asked for {num_requested} block(s) but only {num_free} are free")
        self.num_requested, self.num_free = num_requested, num_free


class BlockAllocator:
    """A pool of ``num_blocks`` physical blocks, ids ``0 .. num_blocks - 1``.

    Free blocks sit on a stack: ``allocate`` pops, ``free`` pushes, both O(1) per block. A
    flag per block tells, in O(1) too, whether an id is currently free (so a double free is
    caught). Its public interface is all that higher stages use: ``allocate``, ``free``,
    ``is_free``, ``num_free_blocks`` and ``num_total_blocks``.
    """

    def __init__(self, num_blocks: int) -> None:
        check_int("num_blocks", num_blocks, 1)
        # BEGIN SOLUTION build the free stack (lowest id on top) and the free flags
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
        """Whether ``block_id`` is free; ``ValueError`` for an id outside the pool."""
        self._check_id(block_id)
        # BEGIN SOLUTION
        return self._is_free[block_id]
        # END SOLUTION

    def allocate(self, num_blocks: int = 1) -> list[int]:
        """Take ``num_blocks`` free blocks off the top of the free stack and return their ids.

        The order is last in, first out: a fresh pool hands out ``0, 1, 2, ...``; a freed block
        goes back on top, so the most recently freed block comes out first (after ``free(2)``,
        ``free(5)``, ``allocate(2)`` returns ``[5, 2]``), as vLLM V0's naive allocator does.

        All or nothing: ``OutOfBlocksError`` (with ``num_requested`` and ``num_free``) if
        fewer are free, and then nothing is taken. ``ValueError`` for a negative count.
        """
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an integer >= 0, got {num_blocks!r}")
        # BEGIN SOLUTION check first, then pop num_blocks ids and mark them used
        if num_blocks > len(self._free_stack):
            raise OutOfBlocksError(num_blocks, len(self._free_stack))
        ids = [self._free_stack.pop() for _ in range(num_blocks)]
        for block_id in ids:
            self._is_free[block_id] = False
        return ids
        # END SOLUTION

    def free(self, block_id: int) -> None:
        """Give a block back to the pool.

        Raises ``ValueError`` for an id outside the pool or a block that is already free
        (a double free); the pool is unchanged then.
        """
        self._check_id(block_id)
        # BEGIN SOLUTION refuse a double free, push the block back
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
