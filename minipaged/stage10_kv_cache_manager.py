"""Stage 10 — V1's KV cache manager: the blocks of requests, for a scheduler that counts tokens.

vLLM V1's scheduler asks its ``KVCacheManager`` for a new request's cached prefix
(``get_computed_blocks``) and for room for the tokens it schedules (``allocate_slots``); it
never touches blocks itself. Here a block manager of stage 6 or 9 (prefix caching) does the
work underneath: ``allocate_prompt`` takes the blocks of a whole sequence (the cached prefix
reused), ``allocate_slots`` the slots a step adds, and ``num_slots`` counts what is held. Block ids
are handed out one list per KV cache group, as vLLM hands them: here every layer is of one group.
"""

from __future__ import annotations

from minipaged.common.sequence import Sequence
from minipaged.stage1_block_allocator import OutOfBlocksError
from minipaged.stage6_swapping import SwapBlockSpaceManager
from minipaged.stage9_prefix_caching import PrefixCachingBlockSpaceManager


class KVCacheManager:
    """V1's name for the blocks of requests; here a block manager of stage 6 or 9 (prefix caching) does the work."""

    def __init__(self, manager: SwapBlockSpaceManager) -> None:
        self.manager = manager
        # with prefix caching, the manager that names blocks (else None)
        self.prefix_cache = manager if isinstance(manager, PrefixCachingBlockSpaceManager) else None

    def allocate_prompt(self, seq: Sequence) -> int | None:
        """Blocks for all of a new (or recomputed) sequence's tokens, the cached prefix reused: the
        number of tokens found computed (V1: ``get_computed_blocks``); None if too few blocks are free."""
        # BEGIN SOLUTION the manager's allocate finds the cached prefix (stage 9); a refusal changes nothing
        try:
            return self.manager.allocate(seq.seq_id, seq.token_ids)
        except OutOfBlocksError:
            return None
        # END SOLUTION

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> tuple[list[int], ...] | None:
        """Room for ``num_new_tokens`` more computed tokens: the new block ids of each group (often
        ``()``: none in any group); None, and nothing taken, if that needs more blocks than are free."""
        manager, table = self.manager, self.manager.table(seq.seq_id)
        missing = seq.num_computed_tokens + num_new_tokens - table.num_tokens  # slots to add
        if 0 < missing and table.num_tokens + missing <= len(table.block_ids) * manager.block_size:
            table.num_tokens += missing  # the last block has room (15 steps in 16): the slots are only counted
            return ()  # (it is this sequence's own: V1 forks nothing, and prefix caching shares only full blocks)
        # BEGIN SOLUTION refuse when the blocks are short; else append the slots at once
        needed = manager.blocks_needed(table.num_tokens + missing) - len(table.block_ids)
        if needed > 0 and needed > manager.num_free_blocks:
            return None
        return (manager.append_slots(seq.seq_id, missing),) if missing > 0 else ()
        # END SOLUTION

    def can_allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``allocate_slots(seq, num_new_tokens)`` would find its blocks free."""
        manager, table = self.manager, self.manager.table(seq.seq_id)
        total = max(table.num_tokens, seq.num_computed_tokens + num_new_tokens)
        return manager.blocks_needed(total) - len(table.block_ids) <= manager.num_free_blocks

    def block_ids(self, seq: Sequence) -> tuple[list[int], ...]:
        """The sequence's block ids, one list per group."""
        return (self.manager.get_block_table(seq.seq_id),)

    def cache_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """With prefix caching, the full blocks of the sequence's first ``num_computed_tokens`` tokens become
        findable as soon as a step is scheduled to compute them (vLLM's ``cache_blocks``, which
        ``allocate_slots`` calls): a request admitted after this one, in the same step too, finds them."""
        if self.prefix_cache is not None:
            self.prefix_cache.cache_computed_blocks(seq.seq_id, num_computed_tokens)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (after a step that failed, whose blocks may never have been written)."""
        if self.prefix_cache is not None:
            self.prefix_cache.allocator.reset_prefix_cache()

    def free(self, seq: Sequence) -> None:
        self.manager.free(seq.seq_id)

    def num_slots(self) -> tuple[int, int]:
        """(slots holding K/V, slots held), as stage 2's ``usage()`` counts them, without walking
        every block: only a table's last block can be part full, and prefix caching shares full
        blocks only, so the slack is one sum over the tables and the rest is the used blocks."""
        manager, size = self.manager, self.manager.block_size
        held = (manager.num_total_blocks - manager.num_free_blocks) * size
        tables = manager.block_tables.values()
        slack = sum(len(t.block_ids) for t in tables) * size - sum(t.num_tokens for t in tables)
        return held - slack, held
