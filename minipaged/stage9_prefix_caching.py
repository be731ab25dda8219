"""Stage 9 — automatic prefix caching: reuse the K/V of any prefix computed before.

Requests often begin with the same tokens — a system prompt, the examples of a few-shot
prompt, the history of a conversation. Their K/V are the same too, so they could be
computed once. Stage 3 shared blocks *within* a request (forks); this stage shares them
*across* requests, found by content. It is one component, the ``PrefixCachingAllocator``,
which wraps stage 3's reference-counted allocator through its public methods, and a
block manager that is given it:

* Every **full** block of a prompt is named by a collision-resistant hash (SHA-256) of
  its parent block's hash and its own token ids — so a block's hash names the whole
  prefix up to its end, as in vLLM. The allocator maps hashes to physical blocks.
* When a sequence is allocated, the manager walks its tokens block by block; while the
  hash is cached, it takes that block (one more reference) instead of a new one. Only the
  rest of the prompt is computed: a chunk of queries attending over the cached context
  (stage 4's variable-length attention). The block holding the last token is never
  taken from the cache, since its logits are needed. Every path that allocates goes
  through here: new prompts, recomputed ones, parallel samples and beams.
* A block becomes findable once its K/V are surely written: when its sequence appends
  its next token, after the step that computed it succeeded.
* A request that asks for ``prompt_logprobs`` reads no cached block (vLLM V1's rule): a
  cached position's K/V are there but its logits are not, so its whole prompt is computed.
  Its blocks are cached for the requests after it as usual.
* A cached block whose last reference goes **keeps its contents and its hash**: it waits
  in an evictor, still findable, until a block is needed and none is free; then the least
  recently freed goes first — and since a sequence frees its last blocks first, a shared
  prefix outlives the tails that hung off it.

Checked against the engine of stage 8 without caching: same outputs on shared system
prompts, few-shot prefixes, unrelated prompts, and under memory pressure with evictions
and preemptions — while computing fewer prefill tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol, runtime_checkable

from minipaged import stage8_sharing
from minipaged.common.sampling_params import SamplingParams
from minipaged.common.sequence import Sequence as Seq
from minipaged.common.stats import PrefixCacheStats
from minipaged.stage1_block_allocator import OutOfBlocksError
from minipaged.stage2_block_table import BlockTable
from minipaged.stage3_copy_on_write import RefCountedBlockAllocator
from minipaged.stage6_swapping import SwapBlockSpaceManager

ROOT = bytes(32)  # the parent hash of a first block


def block_hash(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The name of a full block: SHA-256 of its parent's hash and its own token ids, each as an 8-byte
    integer, so that token ids never run together (``[1, 23]`` and ``[12, 3]`` get different names)."""
    # BEGIN SOLUTION hash the parent's 32 bytes, then the token ids as 8-byte integers
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()
    # END SOLUTION


class PrefixCachingAllocator:
    """A reference-counted allocator whose full blocks can be found again by hash.

    Stage 3's interface (``allocate``, ``free``, ``incref``, ``ref_count``, ``is_free``,
    ``num_free_blocks``, ``num_total_blocks``) plus ``lookup`` and ``cache``. A cached
    block nobody holds is free (it counts in ``num_free_blocks``) yet keeps its K/V: the
    wrapped allocator still holds it, with one reference, until it is evicted.
    """

    def __init__(self, num_blocks: int) -> None:
        self.inner = RefCountedBlockAllocator(num_blocks)
        self.cached: dict[bytes, int] = {}  # hash -> block
        self.hash_of: dict[int, bytes] = {}  # block -> hash
        self.evictor: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; least recently used first
        self._stats = PrefixCacheStats()  # lookups, hits, evictions: make_stats()

    @property
    def num_total_blocks(self) -> int:
        return self.inner.num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.inner.num_free_blocks + len(self.evictor)

    def is_free(self, block_id: int) -> bool:
        return block_id in self.evictor or self.inner.is_free(block_id)

    def ref_count(self, block_id: int) -> int:
        return 0 if block_id in self.evictor else self.inner.ref_count(block_id)

    def incref(self, block_id: int) -> None:
        if block_id in self.evictor:
            raise ValueError(f"block {block_id} is free; only a block in use can be shared")
        self.inner.incref(block_id)

    def allocate(self, num_blocks: int = 1) -> list[int]:
        """Free blocks first; then the least recently used cached ones, forgotten. All or nothing.

        ``OutOfBlocksError`` if fewer than ``num_blocks`` are free, counting the evictor. An
        evicted block loses its hash (it can no longer be found) and counts as an eviction.
        """
        if num_blocks > self.num_free_blocks:
            raise OutOfBlocksError(num_blocks, self.num_free_blocks)
        ids = self.inner.allocate(min(num_blocks, self.inner.num_free_blocks))
        # BEGIN SOLUTION evict from the old end; an evicted block keeps its one reference, now its new owner's
        while len(ids) < num_blocks:
            block_id, _ = self.evictor.popitem(last=False)
            del self.cached[self.hash_of.pop(block_id)]
            self._stats.evictions += 1
            ids.append(block_id)
        return ids
        # END SOLUTION

    def free(self, block_id: int) -> None:
        """Drop a reference; at the last one, a cached block waits in the evictor instead of the pool."""
        if block_id in self.evictor:
            raise ValueError(f"block {block_id} is already free (double free)")
        # BEGIN SOLUTION
        if block_id in self.hash_of and self.inner.ref_count(block_id) == 1:
            self.evictor[block_id] = None  # the most recently used end
        else:
            self.inner.free(block_id)
        # END SOLUTION

    def lookup(self, digest: bytes) -> int | None:
        """The cached block named ``digest``, with one more reference for the caller; None if there is none.
        Counts the lookup, and the hit if it is one (``make_stats``)."""
        block_id = self.get_cached_block(digest)
        if block_id is not None:
            self.touch(block_id)
        return block_id

    def get_cached_block(self, digest: bytes) -> int | None:
        """The cached block named ``digest``, or None; no reference taken (vLLM's name). Counts the
        lookup, and the hit if it is one."""
        self._stats.queries += 1
        # BEGIN SOLUTION
        block_id = self.cached.get(digest)
        if block_id is not None:
            self._stats.hits += 1
        return block_id
        # END SOLUTION

    def touch(self, block_id: int) -> None:
        """One more reference to a cached block (vLLM's name): a block waiting in the evictor leaves it
        (its reference becomes the caller's); a block in use is shared (``incref``)."""
        # BEGIN SOLUTION revive it from the evictor, or share it
        if block_id in self.evictor:
            del self.evictor[block_id]
        else:
            self.inner.incref(block_id)
        # END SOLUTION

    def make_stats(self) -> PrefixCacheStats:
        """Its lookups, hits and evictions since it was made."""
        return dataclasses.replace(self._stats)

    def reset_prefix_cache(self) -> None:
        """Forget every hash (vLLM's ``reset_prefix_cache``): nothing can be found any more, and the cached
        blocks nobody holds go back to the pool."""
        for block_id in self.evictor:
            self.inner.free(block_id)
        self.evictor.clear()
        self.cached.clear()
        self.hash_of.clear()

    def cache(self, block_id: int, digest: bytes) -> None:
        """Make a full block, its K/V computed, findable by ``digest`` (the first block named so keeps it)."""
        if digest not in self.cached and block_id not in self.hash_of:
            self.cached[digest], self.hash_of[block_id] = block_id, digest


class PrefixCachingBlockSpaceManager(SwapBlockSpaceManager):
    """Stage 6's manager over a ``PrefixCachingAllocator``: prompts start from their cached prefix."""

    allocator: PrefixCachingAllocator

    def __init__(self, allocator: PrefixCachingAllocator, block_size: int = 16,
                 cpu_allocator: RefCountedBlockAllocator | None = None) -> None:
        super().__init__(allocator, block_size, cpu_allocator)
        self.uncached: dict[Hashable, tuple[list[int], int, bytes]] = {}  # seq -> (tokens, blocks cached, last hash)
        self.uncached_reads: weakref.WeakValueDictionary[Hashable, Seq] = weakref.WeakValueDictionary()

    def skip_cache_reads(self, seq: Seq) -> None:
        """``seq`` reads no cached block, for as long as it lives (its prompt is computed whole each
        time it is allocated, after a preemption too)."""
        self.uncached_reads[seq.seq_id] = seq

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Take the cached blocks of the prompt's prefix, new ones for the rest; return the tokens reused.

        The walk hashes the full blocks in order, chaining each hash on the one before, and
        stops at the first miss; the block holding the last token is never looked up (its
        logits are needed). A sequence that ``skip_cache_reads`` looks nothing up. A refused call
        (``OutOfBlocksError``) gives back what it took.
        """
        size, needed, hits, digest = self.block_size, self.check_new(seq_id, len(token_ids)), [], ROOT
        # BEGIN SOLUTION follow the chain of hashes over the full blocks before the last token's block
        reads = 0 if seq_id in self.uncached_reads else (len(token_ids) - 1) // size * size
        for start in range(0, reads, size):
            candidate = block_hash(digest, token_ids[start:start + size])
            block_id = self.allocator.lookup(candidate)
            if block_id is None:
                break
            hits.append(block_id)
            digest = candidate
        # END SOLUTION
        try:
            fresh = self.allocator.allocate(needed - len(hits))
        except OutOfBlocksError:
            for block_id in hits:  # a refused call changes nothing: give back what the lookups took
                self.allocator.free(block_id)
            raise
        self.block_tables[seq_id] = BlockTable(hits + fresh, len(token_ids))
        self.uncached[seq_id] = (list(token_ids), len(hits), digest)
        return len(hits) * size

    def append_slot(self, seq_id: Hashable) -> int:
        """As before; first, the full blocks of the prompt, computed by now, become findable."""
        self.cache_prompt_blocks(seq_id)
        return super().append_slot(seq_id)

    def append_slots(self, seq_id: Hashable, n: int) -> list[int]:
        self.cache_prompt_blocks(seq_id)
        return super().append_slots(seq_id, n)

    def cache_prompt_blocks(self, seq_id: Hashable) -> None:
        """The full blocks of a sequence's prompt, computed once it appends its first token, become findable."""
        if seq_id in self.uncached:
            self.cache_computed_blocks(seq_id, len(self.uncached[seq_id][0]))

    def cache_computed_blocks(self, seq_id: Hashable, num_tokens: int) -> None:
        """The full blocks among the first ``num_tokens`` tokens the sequence was allocated with become
        findable: their K/V are computed by now, or are being computed by the step about to run (a
        request of the same step reads them after they are written, layer by layer)."""
        if seq_id not in self.uncached:
            return
        tokens, done, digest = self.uncached[seq_id]
        block_ids, size = self.table(seq_id).block_ids, self.block_size
        # BEGIN SOLUTION the blocks full within num_tokens, past those cached, each named on the one before
        full = min(num_tokens, len(tokens)) // size
        for i in range(done, full):
            digest = block_hash(digest, tokens[i * size:(i + 1) * size])
            self.allocator.cache(block_ids[i], digest)
        # END SOLUTION
        if full >= len(tokens) // size:
            del self.uncached[seq_id]
        elif full > done:
            self.uncached[seq_id] = (tokens, full, digest)

    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable) -> BlockTable:
        child = super().fork(parent_seq_id, child_seq_id)
        if parent_seq_id in self.uncached:
            self.uncached[child_seq_id] = self.uncached[parent_seq_id]
        return child

    def free(self, seq_id: Hashable) -> None:
        self.uncached.pop(seq_id, None)
        super().free(seq_id)


@runtime_checkable
class CacheReader(Protocol):
    """A block manager whose sequences read a prefix cache, and can be told not to."""

    def skip_cache_reads(self, seq: Seq) -> None: ...


def skip_cache_reads_for_prompt_logprobs(block_manager: object, seqs: Iterable[Seq], params: SamplingParams) -> None:
    """A request asking for ``prompt_logprobs`` reads no cached block: its sequences are told so."""
    if params.prompt_logprobs is not None and isinstance(block_manager, CacheReader):
        for seq in seqs:
            block_manager.skip_cache_reads(seq)


class PrefixCachingEngine(stage8_sharing.SharingEngine):
    """Stage 8's engine; its requests that ask for ``prompt_logprobs`` read no cached block."""

    def make_request(self, request_id: Hashable, text: str | None, ids: list[int], params: SamplingParams,
                     seed: int) -> stage8_sharing.Request:
        request = super().make_request(request_id, text, ids, params, seed)
        skip_cache_reads_for_prompt_logprobs(self.scheduler.block_manager, request.seqs, params)
        return request
