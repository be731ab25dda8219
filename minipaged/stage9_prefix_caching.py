"""Stage 9 — automatic prefix caching: reuse the K/V of any prefix computed before.

Requests often begin with the same tokens — a system prompt, the examples of a few-shot
prompt, the history of a conversation. Their K/V are the same too, so they could be
computed once. Stage 3 shared blocks *within* a request (forks); this stage shares them
*across* requests, found by content:

* Every **full** block gets a hash of (its parent block's hash, its token ids) — so a
  block's hash names the whole prefix up to its end, not just its own tokens. A hash
  table maps hashes to physical blocks.
* A new request walks its prompt block by block; while the hash is in the table, it takes
  that block (one more reference) instead of a new one. The model then computes only the
  rest of the prompt: a chunk of queries attending over the cached context (stage 4's
  variable-length attention). At least the last token is always computed, for its logits.
* A block whose last reference goes **keeps its contents and its hash**: it waits in an
  evictor, still findable, until a new block is needed and none is free; then the least
  recently freed goes first — and since a finished sequence frees its last blocks first,
  a shared prefix outlives the tails that hung off it.
* A hit is checked, not trusted: the cached block's own token ids and its parent block
  must match, so a hash collision can never hand back wrong K/V.

Checked against the engine without caching: same outputs on shared system prompts,
few-shot prefixes, unrelated prompts, and under memory pressure with evictions and
preemptions — while computing fewer prefill tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from minipaged.stage1_block_allocator import OutOfBlocksError
from minipaged.stage2_block_table import BlockTable
from minipaged.stage3_copy_on_write import RefCountedBlockAllocator
from minipaged.stage6_scheduler import SchedulerOutput, Sequence, SwapBlockSpaceManager
from minipaged.stage8_sharing import LLM as SharingLLM
from minipaged.stage8_sharing import ForkingScheduler


def block_hash(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    """The name of a full block: its parent's hash and its own token ids, hashed together."""
    return hash((parent_hash, tokens))


class CachingBlockAllocator(RefCountedBlockAllocator):
    """Blocks with reference counts, whose contents can outlive their last reference."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.evictor: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.table: dict[int, int] = {}  # hash -> block
        self.hash_of: dict[int, int] = {}  # block -> hash
        self.tokens_of: dict[int, tuple[int, ...]] = {}  # block -> its token ids
        self.parent_of: dict[int, int | None] = {}  # block -> the block before it in its sequence
        self.evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return super().num_free_blocks + len(self.evictor)

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        # BEGIN SOLUTION free blocks first; then evict the least recently used cached ones
        if num_blocks > self.num_free_blocks:
            raise OutOfBlocksError(f"asked for {num_blocks} block(s) but only {self.num_free_blocks} of "
                                   f"{self.num_total_blocks} are free")
        fresh = min(num_blocks, super().num_free_blocks)
        ids = super().allocate_blocks(fresh)
        while len(ids) < num_blocks:
            block_id, _ = self.evictor.popitem(last=False)
            self.forget(block_id)
            self.evictions += 1
            self._is_free[block_id], self._ref_counts[block_id] = False, 1
            ids.append(block_id)
        return ids
        # END SOLUTION

    def free(self, block_id: int) -> None:
        # BEGIN SOLUTION at the last reference, a cached block goes to the evictor instead of the free stack
        if block_id in self.hash_of and self._ref_counts[block_id] == 1:
            self._ref_counts[block_id] = 0
            self._is_free[block_id] = True
            self.evictor[block_id] = None
            return
        super().free(block_id)
        # END SOLUTION

    def forget(self, block_id: int) -> None:
        """Drop a block's hash (it is being reused for other tokens)."""
        digest = self.hash_of.pop(block_id, None)
        if digest is not None and self.table.get(digest) == block_id:
            del self.table[digest]
        self.tokens_of.pop(block_id, None)
        self.parent_of.pop(block_id, None)

    def lookup(self, digest: int, tokens: tuple[int, ...], parent: int | None) -> int | None:
        """The cached block for ``digest``, if its tokens and parent really match; takes a reference."""
        # BEGIN SOLUTION find, verify (a collision must not pass), then revive or share the block
        block_id = self.table.get(digest)
        if block_id is None or self.tokens_of[block_id] != tokens or self.parent_of[block_id] != parent:
            return None
        if block_id in self.evictor:
            del self.evictor[block_id]
            self._is_free[block_id], self._ref_counts[block_id] = False, 1
        else:
            self.incref(block_id)
        return block_id
        # END SOLUTION

    def register(self, block_id: int, digest: int, tokens: tuple[int, ...], parent: int | None) -> None:
        """Make a full, computed block findable by its hash (the first block with a hash keeps it)."""
        if digest in self.table or block_id in self.hash_of:
            return
        self.table[digest], self.hash_of[block_id] = block_id, digest
        self.tokens_of[block_id], self.parent_of[block_id] = tokens, parent


class PrefixCachingBlockSpaceManager(SwapBlockSpaceManager):
    """Stage 6's manager whose full blocks are found again by the hash of their prefix."""

    allocator_class = CachingBlockAllocator

    def __init__(self, num_blocks: int, block_size: int = 16, num_cpu_blocks: int = 0) -> None:
        super().__init__(num_blocks, block_size, num_cpu_blocks)
        self._hashed: dict[Hashable, tuple[int, int | None]] = {}  # seq -> (blocks hashed, last hash)
        self.hit_blocks = self.looked_up_blocks = 0

    @property
    def evictions(self) -> int:
        return self.allocator.evictions

    def allocate_cached(self, seq_id: Hashable, token_ids: list[int]) -> int:
        """Allocate for a new sequence, reusing cached blocks of its prefix; return the tokens reused.

        Like ``allocate``: a refused call (``OutOfBlocksError``) changes nothing.
        """
        if seq_id in self.block_tables or not token_ids:
            raise ValueError(f"sequence {seq_id!r} already has a block table, or has no tokens")
        size, allocator = self.block_size, self.allocator
        reused, digest, parent = [], None, None
        # BEGIN SOLUTION follow the chain of hashes over the full blocks (never the last token's block)
        for start in range(0, (len(token_ids) - 1) // size * size, size):
            tokens = tuple(token_ids[start : start + size])
            candidate = block_hash(digest, tokens)
            self.looked_up_blocks += 1
            block_id = allocator.lookup(candidate, tokens, parent)
            if block_id is None:
                break
            reused.append(block_id)
            digest, parent = candidate, block_id
        # END SOLUTION
        try:
            fresh = allocator.allocate_blocks(self.blocks_needed(len(token_ids)) - len(reused))
        except OutOfBlocksError:
            for block_id in reused:  # give back what the lookups took
                allocator.free(block_id)
            raise
        self.hit_blocks += len(reused)
        self.block_tables[seq_id] = BlockTable(reused + fresh, len(token_ids))
        self._hashed[seq_id] = (len(reused), digest)
        return len(reused) * size

    def commit(self, seq_id: Hashable, token_ids: list[int], num_computed: int) -> None:
        """Hash the blocks of ``seq_id`` that are now full and computed, so others can find them."""
        table, size = self.block_tables[seq_id], self.block_size
        done, digest = self._hashed.get(seq_id, (0, None))
        parent = table.block_ids[done - 1] if done else None
        while (done + 1) * size <= num_computed:
            tokens = tuple(token_ids[done * size : (done + 1) * size])
            digest = block_hash(digest, tokens)
            block_id = table.block_ids[done]
            self.allocator.register(block_id, digest, tokens, parent)
            parent, done = block_id, done + 1
        self._hashed[seq_id] = (done, digest)

    def free(self, seq_id: Hashable) -> None:
        """Free a sequence's blocks, its last blocks first: they are evicted before its prefix."""
        table = self._table(seq_id)
        for block_id in reversed(table.block_ids):
            self.allocator.free(block_id)
        del self.block_tables[seq_id]
        self._hashed.pop(seq_id, None)

    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable):
        child = super().fork(parent_seq_id, child_seq_id)
        self._hashed[child_seq_id] = self._hashed.get(parent_seq_id, (0, None))
        return child


class PrefixCachingScheduler(ForkingScheduler):
    """Admission takes the cached prefix; only the rest of the prompt is computed."""

    block_manager_class = PrefixCachingBlockSpaceManager

    def _allocate(self, seq: Sequence) -> int:
        cached = self.block_manager.allocate_cached(seq.seq_id, seq.token_ids)
        seq.num_computed_tokens = cached
        return len(seq) - cached


class LLM(SharingLLM):
    """The whole engine: ``LLM(enable_prefix_caching=True)`` reuses cached prefixes."""

    def __init__(self, model: str = "tiny", *, enable_prefix_caching: bool = False, **kwargs) -> None:
        self.enable_prefix_caching = enable_prefix_caching
        if enable_prefix_caching:
            self.scheduler_class = PrefixCachingScheduler
        super().__init__(model, **kwargs)

    def execute_model(self, out: SchedulerOutput):
        logits = super().execute_model(out)
        if self.enable_prefix_caching:  # the K/V of every scheduled token is written now
            for seq, _ in out.scheduled:
                self.scheduler.block_manager.commit(seq.seq_id, seq.token_ids, len(seq))
        return logits

    @property
    def stats(self) -> dict:
        stats = super().stats
        manager = self.scheduler.block_manager
        if self.enable_prefix_caching:
            stats["prefix_cache_hits"] = manager.hit_blocks
            stats["prefix_cache_hit_rate"] = manager.hit_blocks / max(manager.looked_up_blocks, 1)
        return stats
