"""Stage 10 — V1's KV cache manager: the blocks of requests, for a scheduler that counts tokens.

vLLM V1's scheduler asks its ``KVCacheManager`` for a new request's cached prefix
(``get_computed_blocks``) and for room for the tokens it schedules (``allocate_slots``); it
never touches blocks itself. Here a block manager of stage 6 or 9 (prefix caching) does the
work underneath: ``allocate_prompt`` takes the blocks of a whole sequence (the cached prefix
reused), ``allocate_slots`` the slots a step adds, and ``num_slots`` counts what is held.
"""

from __future__ import annotations

from collections.abc import Iterable

from minipaged.common.sequence import Sequence
from minipaged.stage1_block_allocator import OutOfBlocksError
from minipaged.stage6_swapping import SwapBlockSpaceManager
from minipaged.stage9_prefix_caching import PrefixCachingBlockSpaceManager


class KVCacheManager:
    """V1's name for the blocks of requests; here a block manager of stage 6 or 9 (prefix caching) does the work."""

    def __init__(self, manager: SwapBlockSpaceManager) -> None:
        self.manager = manager

    def allocate_prompt(self, seq: Sequence) -> int | None:
        """Blocks for all of a new (or recomputed) sequence's tokens, the cached prefix reused: the
        number of tokens found computed (V1: ``get_computed_blocks``); None if too few blocks are free."""
        # BEGIN SOLUTION the manager's allocate finds the cached prefix (stage 9); a refusal changes nothing
        try:
            return self.manager.allocate(seq.seq_id, seq.token_ids)
        except OutOfBlocksError:
            return None
        # END SOLUTION

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[int] | None:
        """Room for ``num_new_tokens`` more computed tokens: the new block ids (often none); None,
        and nothing taken, if that needs more blocks than are free."""
        manager, table = self.manager, self.manager.table(seq.seq_id)
        missing = seq.num_computed_tokens + num_new_tokens - table.num_tokens  # slots to add
        # BEGIN SOLUTION refuse when the blocks are short; else append the slots at once
        needed = manager.blocks_needed(table.num_tokens + missing) - len(table.block_ids)
        if needed > 0 and needed > manager.num_free_blocks:
            return None
        return manager.append_slots(seq.seq_id, missing) if missing > 0 else []
        # END SOLUTION

    def cache_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """With prefix caching, the full blocks of the sequence's first ``num_computed_tokens`` tokens become
        findable as soon as a step is scheduled to compute them (vLLM's ``cache_blocks``, which
        ``allocate_slots`` calls): a request admitted after this one, in the same step too, finds them."""
        if isinstance(self.manager, PrefixCachingBlockSpaceManager):
            self.manager.cache_computed_blocks(seq.seq_id, num_computed_tokens)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (after a step that failed, whose blocks may never have been written)."""
        if isinstance(self.manager, PrefixCachingBlockSpaceManager):
            self.manager.allocator.reset_prefix_cache()

    def free(self, seq: Sequence) -> None:
        self.manager.free(seq.seq_id)

    def num_slots(self, seqs: Iterable[Sequence]) -> tuple[int, int]:
        """(slots holding K/V, slots held), as stage 2's ``usage()`` counts them, without walking
        every block: only a table's last block can be part full, and prefix caching shares full
        blocks only, so the slack is a sum over sequences and the rest is the used blocks."""
        manager, size = self.manager, self.manager.block_size
        held = (manager.num_total_blocks - manager.num_free_blocks) * size
        slack = 0
        for seq in seqs:
            table = manager.table(seq.seq_id)
            slack += len(table.block_ids) * size - table.num_tokens
        return held - slack, held
