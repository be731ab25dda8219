"""Stage 15 — a hybrid KV cache: sliding-window layers beside full-attention layers, each group of
layers with its own block table, and the blocks a window has left given back.

A layer with a sliding window ``W`` (stages 0, 4 and 5 attend with one) never reads a key more than
``W - 1`` positions behind its query. Once every query still to come is past a block, the block
holds nothing any of them reads: a paged cache can give it back while the sequence runs on. A
model that mixes such layers with full-attention ones (Gemma 2 and 3, gpt-oss) keeps a block table
per group of layers of one kind, as vLLM V1's hybrid KV cache manager does. ``stage15_kv_cache_groups``
holds the groups and a manager for each; this file puts them over one pool of blocks:

* **A coordinator** (``vllm/v1/core/kv_cache_coordinator.py``) over the managers: a request gets its
  blocks only when every group's blocks fit in the free pool, all or nothing; with prefix caching,
  a new request skips the longest prefix every group can serve (the groups asked again within the
  shortest hit until they agree).
* ``HybridKVCacheManager``: stage 10's ``KVCacheManager`` for such a model, with the same methods;
  block ids go to the runner one list per group (vLLM's ``tuple[list[int], ...]``).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence

from minipaged.common.sequence import Sequence as Seq
from minipaged.stage1_block_allocator import BlockAllocator
from minipaged.stage9_prefix_caching import ROOT, PrefixCachingAllocator, block_hash
from minipaged.stage15_kv_cache_groups import KVCacheGroupSpec, SlidingWindowManager, cdiv, manager_for


class HybridKVCacheCoordinator:
    """The groups' managers over one pool of blocks (with ``enable_caching``, a prefix cache's); block 0
    is the null block."""

    def __init__(self, groups: list[KVCacheGroupSpec], num_blocks: int, enable_caching: bool = False) -> None:
        self.groups, self.enable_caching = groups, enable_caching
        self.allocator = PrefixCachingAllocator(num_blocks) if enable_caching else BlockAllocator(num_blocks)
        self.null_block = self.allocator.allocate(1)[0]  # taken for good, never written
        self.managers = [manager_for(g.spec, self.allocator, self.null_block, i) for i, g in enumerate(groups)]

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_length: int) -> tuple[tuple[list[int], ...], int]:
        """The longest prefix that every group can skip, and each group's blocks for it. A group's hit
        may be shorter than another's, and a sliding group's hit within a shorter length is not its
        hit cut short: ask every group again within the shortest, until all agree."""
        length, size = max_length, self.groups[0].spec.block_size
        # BEGIN SOLUTION every group within the shortest hit, until they all agree
        while True:
            hits = tuple(m.find_longest_cache_hit(block_hashes, length) for m in self.managers)
            shortest = min(len(h) for h in hits)
            if all(len(h) == shortest for h in hits):
                return hits, shortest * size
            length = shortest * size
        # END SOLUTION

    def allocate_slots(self, req_id: Hashable, num_computed_tokens: int,
                       num_tokens: int) -> tuple[list[int], ...] | None:
        """Room for the request to hold ``num_tokens`` tokens: first the blocks before the window of
        position ``num_computed_tokens`` go back, then the new blocks of each group, or None (nothing
        taken) when the groups together need more blocks than are free."""
        # BEGIN SOLUTION give back what the windows left, count every group's need, then take all or nothing
        for manager in self.managers:
            manager.remove_skipped_blocks(req_id, num_computed_tokens)
        needed = sum(m.get_num_blocks_to_allocate(req_id, num_tokens) for m in self.managers)
        if needed > self.allocator.num_free_blocks:
            return None
        return tuple(m.allocate_new_blocks(req_id, num_tokens) for m in self.managers)
        # END SOLUTION

    def num_blocks_to_allocate(self, req_id: Hashable, num_computed_tokens: int, num_tokens: int) -> int:
        """The blocks ``allocate_slots`` would take, less those the windows would give back first."""
        size = self.groups[0].spec.block_size
        freed = 0
        for manager in self.managers:
            if isinstance(manager, SlidingWindowManager):
                skipped = manager.get_num_skipped_tokens(num_computed_tokens) // size  # whole blocks
                freed += sum(self.goes_back(b) for b in manager.req_to_blocks.get(req_id, [])[:skipped])
        return sum(m.get_num_blocks_to_allocate(req_id, num_tokens) for m in self.managers) - freed

    def goes_back(self, block: int) -> bool:
        """Whether freeing ``block`` gives it back to the pool: not the null block, nor one another
        request shares (prefix caching)."""
        if block == self.null_block:
            return False
        return not isinstance(self.allocator, PrefixCachingAllocator) or self.allocator.ref_count(block) == 1

    def block_ids(self, req_id: Hashable) -> tuple[list[int], ...]:
        return tuple(list(m.req_to_blocks.get(req_id, [])) for m in self.managers)

    def free(self, req_id: Hashable) -> None:
        for manager in self.managers:
            manager.free(req_id)


class HybridKVCacheManager:
    """Stage 10's ``KVCacheManager`` over a hybrid cache: the same methods, block ids one list per group.
    It is also the ``manager`` the scheduler counts blocks with (``num_total_blocks``, the null block
    left out; ``num_free_blocks``; ``blocks_needed``: what a request of so many tokens may hold at once)."""

    def __init__(self, coordinator: HybridKVCacheCoordinator, max_num_batched_tokens: int) -> None:
        self.coordinator, self.max_num_batched_tokens = coordinator, max_num_batched_tokens
        self.manager, self.allocator = self, coordinator.allocator
        self.block_size = coordinator.groups[0].spec.block_size
        self.prefix_cache = self.allocator if coordinator.enable_caching else None
        self.num_tokens: dict[Hashable, int] = {}  # tokens each request's blocks hold
        self.block_hashes: dict[Hashable, list[bytes]] = {}  # with prefix caching: its full blocks' names
        self.num_cached_blocks: dict[Hashable, int] = {}  # ... and how many of them are findable
        self.uncached_reads: weakref.WeakValueDictionary[Hashable, Seq] = weakref.WeakValueDictionary()

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_total_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds at most at once, every group together."""
        return sum(g.spec.max_num_blocks(num_tokens, self.max_num_batched_tokens) for g in self.coordinator.groups)

    # A block manager's names for what it holds, as the live page reads them (``serving.engine_client``):
    cpu_allocator = None  # no CPU pool: V1 recomputes what it preempts
    swapped_tables: dict[Hashable, list[int]] = {}  # so nothing is swapped out

    @property
    def block_tables(self) -> dict[Hashable, list[int]]:
        """Each request holding blocks, with the blocks it holds (``get_block_table``)."""
        return {seq_id: self.get_block_table(seq_id) for seq_id in self.num_tokens}

    def get_block_table(self, seq_id: Hashable) -> list[int]:
        """The blocks the request holds, every group's in turn, the null block left out (a block manager's
        one table; ``block_ids`` gives them per group, in their places)."""
        return [b for blocks in self.coordinator.block_ids(seq_id) for b in blocks if b != self.coordinator.null_block]

    def skip_cache_reads(self, seq: Seq) -> None:
        """``seq`` reads no cached block (it asked for ``prompt_logprobs``)."""
        self.uncached_reads[seq.seq_id] = seq

    def allocate_prompt(self, seq: Seq) -> int | None:
        """Blocks, in every group, for the tokens of a new (or recomputed) sequence that its first step
        may compute: the cached prefix every group can skip (with prefix caching), then at most
        ``max_num_batched_tokens`` more (each later chunk takes its own, as a decode does, once the
        window has given back what it left). The tokens found computed; None if too few blocks are free."""
        coordinator, seq_id, computed = self.coordinator, seq.seq_id, 0
        if coordinator.enable_caching:
            tokens, size, digest = seq.token_ids, self.block_size, ROOT
            hashes = self.block_hashes[seq_id] = []
            for start in range(0, len(tokens) // size * size, size):
                digest = block_hash(digest, tokens[start:start + size])
                hashes.append(digest)
            reads = 0 if seq_id in self.uncached_reads else (len(tokens) - 1) // size * size  # the last token: computed
            hits, computed = coordinator.find_longest_cache_hit(hashes, reads)
            for manager, blocks in zip(coordinator.managers, hits):
                manager.save_computed_blocks(seq_id, blocks)
            self.num_cached_blocks[seq_id] = computed // size
        first = min(len(seq), computed + self.max_num_batched_tokens)
        if coordinator.allocate_slots(seq_id, computed, first) is None:
            self.free(seq)  # the cached blocks found go back
            return None
        self.num_tokens[seq_id] = first
        return computed

    def allocate_slots(self, seq: Seq, num_new_tokens: int) -> tuple[list[int], ...] | None:
        """Stage 10's: each group's new block ids (``()`` when no group takes one), or None."""
        total = max(self.num_tokens[seq.seq_id], seq.num_computed_tokens + num_new_tokens)
        new = self.coordinator.allocate_slots(seq.seq_id, seq.num_computed_tokens, total)
        if new is None:
            return None
        self.num_tokens[seq.seq_id] = total
        return new if any(new) else ()

    def can_allocate_slots(self, seq: Seq, num_new_tokens: int) -> bool:
        """Whether ``allocate_slots`` would find its blocks, counting those the windows give back first."""
        total = max(self.num_tokens[seq.seq_id], seq.num_computed_tokens + num_new_tokens)
        return self.coordinator.num_blocks_to_allocate(seq.seq_id, seq.num_computed_tokens,
                                                       total) <= self.allocator.num_free_blocks

    def cache_blocks(self, seq: Seq, num_computed_tokens: int) -> None:
        """With prefix caching, the full blocks of the first ``num_computed_tokens`` tokens the sequence
        was allocated with become findable, in every group (stage 10's rule: as soon as a step is
        scheduled to compute them)."""
        hashes = self.block_hashes.get(seq.seq_id)
        if hashes is None:
            return
        start, stop = self.num_cached_blocks[seq.seq_id], min(num_computed_tokens // self.block_size, len(hashes))
        for manager in self.coordinator.managers:
            manager.cache_blocks(seq.seq_id, hashes, start, stop)
        self.num_cached_blocks[seq.seq_id] = max(start, stop)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (after a step that failed)."""
        if isinstance(self.allocator, PrefixCachingAllocator):
            self.allocator.reset_prefix_cache()

    def free(self, seq: Seq) -> None:
        self.coordinator.free(seq.seq_id)
        for held in (self.num_tokens, self.block_hashes, self.num_cached_blocks):
            held.pop(seq.seq_id, None)

    def block_ids(self, seq: Seq) -> tuple[list[int], ...]:
        return self.coordinator.block_ids(seq.seq_id)

    def num_slots(self) -> tuple[int, int]:
        """(slots holding K/V a query may still read, slots held), over every group's blocks, without
        walking them: a group's list for a request covers its tokens (null blocks too) and only its
        last block can be part full, so the slack is one sum over the requests."""
        size, groups = self.block_size, len(self.coordinator.managers)
        held = (self.allocator.num_total_blocks - self.allocator.num_free_blocks - 1) * size
        slack = groups * sum(cdiv(n, size) * size - n for n in self.num_tokens.values())
        return held - slack, held
