"""Stage 15 — a hybrid KV cache: sliding-window layers beside full-attention layers, each group of
layers with its own block table, and the blocks a window has left given back.

A layer with a sliding window ``W`` (stages 0, 4 and 5 attend with one) never reads a key more than
``W - 1`` positions behind its query. Once every query still to come is past a block, the block
holds nothing any of them reads: a paged cache can give it back while the sequence runs on. A
model that mixes such layers with full-attention ones (Gemma 2 and 3, gpt-oss) needs two kinds of
bookkeeping, as vLLM V1's hybrid KV cache manager keeps them:

* **Specs** (``vllm/v1/kv_cache_interface.py``): a layer's ``FullAttentionSpec`` or
  ``SlidingWindowSpec``. Layers of one spec are cut into **groups** of equal size
  (``kv_cache_groups``), and layer ``j`` of every group shares one K/V tensor
  (``hybrid_kv_cache``): a block id is a block of memory in ``group_size`` layers, whichever group
  holds it, so one pool of blocks serves every group.
* **A manager per group** (``vllm/v1/core/single_type_kv_cache_manager.py``), each with a block list
  per request: ``FullAttentionManager`` keeps every block; ``SlidingWindowManager`` frees, before a
  step, the blocks wholly before the window of the step's first query
  (``remove_skipped_blocks``), putting vLLM's **null block** in their place: a block of the pool
  taken once and never written, so that a table keeps its positions.
* **A coordinator** (``vllm/v1/core/kv_cache_coordinator.py``) over the managers: a request gets its
  blocks only when every group's blocks fit in the free pool, all or nothing.

``HybridKVCacheManager`` is stage 10's ``KVCacheManager`` for such a model, with the same methods;
block ids go to the runner one list per group (vLLM's ``tuple[list[int], ...]``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from minipaged.common.sequence import Sequence as Seq
from minipaged.stage1_block_allocator import BlockAllocator
from minipaged.stage2_block_table import PagedKVCache
from minipaged.stage9_prefix_caching import ROOT, PrefixCachingAllocator, block_hash
from minipaged.stage13_fp8_kv_cache import FP8PagedKVCache


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FullAttentionSpec:
    """A layer that attends to every token before its query."""

    block_size: int

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once in a group of this spec."""
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec:
    """A layer whose query reads the last ``sliding_window`` keys, itself included."""

    block_size: int
    sliding_window: int

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """A step's tokens and the window behind its first one, and a block more where they straddle
        a block's edge (vLLM's ``SlidingWindowSpec.max_memory_usage_bytes``)."""
        held = min(num_tokens, self.sliding_window - 1 + max_num_batched_tokens)
        return min(cdiv(num_tokens, self.block_size), cdiv(held, self.block_size) + 1)


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share a spec, and so one block table per request (vLLM's name)."""

    layer_ids: tuple[int, ...]
    spec: KVCacheSpec


def kv_cache_groups(windows: Sequence[int | None], block_size: int) -> list[KVCacheGroupSpec]:
    """The layers (``windows[i]``: layer ``i``'s sliding window, None for full attention) cut into
    groups of equal size, as vLLM cuts them: the size is the fewest layers of any spec (the most,
    when they differ by less than a quarter); each spec's layers are dealt round-robin into as many
    groups as that size needs (the last groups may be a layer short)."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer, window in enumerate(windows):
        spec: KVCacheSpec = FullAttentionSpec(block_size) if window is None else SlidingWindowSpec(block_size, window)
        by_spec.setdefault(spec, []).append(layer)
    # BEGIN SOLUTION the size from the fewest (or the most) layers of a spec; deal each spec's layers round-robin
    sizes = [len(layers) for layers in by_spec.values()]
    size = max(sizes) if max(sizes) < min(sizes) * 1.25 else min(sizes)
    groups = []
    for spec, layers in by_spec.items():
        num_groups = cdiv(len(layers), size)
        groups += [KVCacheGroupSpec(tuple(layers[i::num_groups]), spec) for i in range(num_groups)]
    return groups
    # END SOLUTION


def group_size(groups: list[KVCacheGroupSpec]) -> int:
    """Layers per group: the K/V tensors a hybrid cache holds, a block of each per block id."""
    return max(len(g.layer_ids) for g in groups)


def share_layers(cache: PagedKVCache, groups: list[KVCacheGroupSpec]) -> PagedKVCache:
    """``cache``, built with ``group_size(groups)`` layers, serving every layer of ``groups``: layer
    ``groups[g].layer_ids[j]`` uses tensor ``j``, as vLLM's hybrid cache shares one tensor among a layer
    of each group. Memory for ``group_size`` layers per block, not for every layer. Each layer gets its
    own view of its tensor, so that a layer is still told apart by its tensor (stage 13 keeps scales per
    layer: an FP8 cache is given a pair for every layer)."""
    # BEGIN SOLUTION each layer's tensor is the one of its place in its group
    slot = {layer: j for g in groups for j, layer in enumerate(g.layer_ids)}
    keys, values = cache.key_cache, cache.value_cache
    cache.num_layers = len(slot)
    cache.key_cache = [keys[slot[layer]].view_as(keys[slot[layer]]) for layer in range(len(slot))]
    cache.value_cache = [values[slot[layer]].view_as(values[slot[layer]]) for layer in range(len(slot))]
    # END SOLUTION
    if isinstance(cache, FP8PagedKVCache):  # its scales, one pair a layer, each layer found by its tensor
        n = len(slot)
        cache.k_scale, cache.v_scale, cache.needs_scales = [1.0] * n, [1.0] * n, cache.needs_scales[:1] * n
        cache.layers = {id(t): layer for layer, t in enumerate(cache.key_cache)}
    return cache


def hybrid_kv_cache(groups: list[KVCacheGroupSpec], kv_cache: Callable[..., PagedKVCache], num_layers: int,
                    *args: Any, **kwargs: Any) -> PagedKVCache:
    """The paged cache of a model whose layers keep ``groups``: ``kv_cache`` (stage 6's, or stage 13's)
    built for ``group_size`` layers with the rest of its arguments, then shared by every layer (here, or in
    each tensor-parallel worker, which is handed this function bound to its groups)."""
    held = sum(len(g.layer_ids) for g in groups)
    if num_layers != held:
        raise ValueError(f"a cache for {num_layers} layers, but the groups hold {held}")
    return share_layers(kv_cache(group_size(groups), *args, **kwargs), groups)


def block_hash_with_group_id(digest: bytes, group_id: int) -> bytes:
    """A block's name in one group's cache: its stage-9 hash and the group's index (vLLM's
    ``make_block_hash_with_group_id``); the same tokens hold different K/V in different layers."""
    return digest + group_id.to_bytes(4, "big")


class SingleTypeKVCacheManager:
    """One group's blocks: a list per request, position ``i`` holding tokens ``i * block_size ..``.
    With prefix caching (a ``PrefixCachingAllocator``), its full blocks are named and found again."""

    def __init__(self, spec: KVCacheSpec, allocator: BlockAllocator | PrefixCachingAllocator, null_block: int,
                 group_id: int = 0) -> None:
        self.spec, self.allocator, self.null_block, self.group_id = spec, allocator, null_block, group_id
        self.req_to_blocks: dict[Hashable, list[int]] = {}

    def get_num_blocks_to_allocate(self, req_id: Hashable, num_tokens: int) -> int:
        """Blocks to take for the request to hold ``num_tokens`` tokens."""
        return max(0, cdiv(num_tokens, self.spec.block_size) - len(self.req_to_blocks.get(req_id, ())))

    def allocate_new_blocks(self, req_id: Hashable, num_tokens: int) -> list[int]:
        new = self.allocator.allocate(self.get_num_blocks_to_allocate(req_id, num_tokens))
        self.req_to_blocks.setdefault(req_id, []).extend(new)
        return new

    def get_cached_block(self, block_hashes: Sequence[bytes], i: int) -> int | None:
        """The cached block of this group holding the request's block ``i``, or None."""
        assert isinstance(self.allocator, PrefixCachingAllocator)
        return self.allocator.get_cached_block(block_hash_with_group_id(block_hashes[i], self.group_id))

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int) -> list[int]:
        """The blocks that let a request skip computing its first ``len(result) * block_size`` tokens
        (at most ``max_length``) in this group: each cached, or the null block where no query reads it."""
        raise NotImplementedError

    def save_computed_blocks(self, req_id: Hashable, blocks: list[int]) -> None:
        """A new request's first blocks are the cached ones found: a reference to each."""
        for block in blocks:
            if block != self.null_block:
                assert isinstance(self.allocator, PrefixCachingAllocator)
                self.allocator.touch(block)
        self.req_to_blocks[req_id] = list(blocks)

    def cache_blocks(self, req_id: Hashable, block_hashes: Sequence[bytes], start: int, stop: int) -> None:
        """The request's blocks ``start .. stop - 1``, full and computed, become findable (a block a window
        gives back was named before: the step that computes a block names it)."""
        blocks = self.req_to_blocks[req_id]
        assert isinstance(self.allocator, PrefixCachingAllocator)
        for i in range(start, stop):
            self.allocator.cache(blocks[i], block_hash_with_group_id(block_hashes[i], self.group_id))

    def remove_skipped_blocks(self, req_id: Hashable, num_computed_tokens: int) -> None:
        """Give back the blocks no query from position ``num_computed_tokens`` on reads: none here."""

    def free(self, req_id: Hashable) -> None:
        """Every block of the request back to the pool (a cached one keeps its name), the null block excepted."""
        for block in reversed(self.req_to_blocks.pop(req_id, [])):
            if block != self.null_block:
                self.allocator.free(block)


class FullAttentionManager(SingleTypeKVCacheManager):
    """A full-attention group: a block stays until its request ends."""

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int) -> list[int]:
        """Every block from the first on is read: the cached blocks up to the first miss."""
        hits: list[int] = []
        # BEGIN SOLUTION from block 0, up to the first miss
        for i in range(max_length // self.spec.block_size):
            block = self.get_cached_block(block_hashes, i)
            if block is None:
                break
            hits.append(block)
        # END SOLUTION
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A sliding-window group: the blocks wholly before the window of the next query go back."""

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens that no query from position ``num_computed_tokens`` on reads: the query there sees
        ``num_computed_tokens - sliding_window + 1`` and after."""
        assert isinstance(self.spec, SlidingWindowSpec)
        # BEGIN SOLUTION everything before the next query's window
        return max(0, num_computed_tokens - self.spec.sliding_window + 1)
        # END SOLUTION

    def remove_skipped_blocks(self, req_id: Hashable, num_computed_tokens: int) -> None:
        """Free the blocks whose every token is skipped, each replaced by the null block; walking back
        from the last of them, the first null block met means the earlier ones went before."""
        blocks = self.req_to_blocks.get(req_id, [])
        # BEGIN SOLUTION whole blocks only; from the last skipped one back to the first null block
        for i in reversed(range(self.get_num_skipped_tokens(num_computed_tokens) // self.spec.block_size)):
            if blocks[i] == self.null_block:
                break
            self.allocator.free(blocks[i])
            blocks[i] = self.null_block
        # END SOLUTION

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int) -> list[int]:
        """vLLM's rule: a hit of ``L`` tokens needs only the blocks of the ``sliding_window - 1`` keys
        before position ``L`` (the next query's window), the null block before them. Walk back from
        ``max_length`` to the last run of that many cached blocks; without one, the run from block 0."""
        assert isinstance(self.spec, SlidingWindowSpec)
        hits = [self.null_block] * (max_length // self.spec.block_size)
        run = 0  # cached blocks in a row, from i on
        # BEGIN SOLUTION the blocks behind L's query; walk back; a miss starts the run again; enough ends it
        needed = cdiv(self.spec.sliding_window - 1, self.spec.block_size)
        for i in reversed(range(len(hits))):
            block = self.get_cached_block(block_hashes, i)
            if block is None:
                run = 0
                continue
            hits[i], run = block, run + 1
            if run >= needed:
                return hits[:i + run]
        return hits[:run]  # blocks 0 .. run - 1, every one cached
        # END SOLUTION


def manager_for(spec: KVCacheSpec, allocator: BlockAllocator | PrefixCachingAllocator, null_block: int,
                group_id: int = 0) -> SingleTypeKVCacheManager:
    cls = SlidingWindowManager if isinstance(spec, SlidingWindowSpec) else FullAttentionManager
    return cls(spec, allocator, null_block, group_id)


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

    def get_block_table(self, seq_id: Hashable) -> tuple[list[int], ...]:
        return self.coordinator.block_ids(seq_id)

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
