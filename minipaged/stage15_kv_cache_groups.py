"""Stage 15 — a hybrid KV cache, its parts: each layer's KV cache spec, the layers cut into groups that
share tensors, and a manager per group (vLLM's ``kv_cache_interface.py`` and
``single_type_kv_cache_manager.py``).

* **Specs**: a layer's ``FullAttentionSpec`` or ``SlidingWindowSpec``. Layers of one spec are cut
  into **groups** of equal size (``kv_cache_groups``), and layer ``j`` of every group shares one K/V
  tensor (``share_layers``, ``hybrid_kv_cache``): a block id is a block of memory in ``group_size``
  layers, whichever group holds it, so one pool of blocks serves every group.
* **A manager per group**, each with a block list per request: ``FullAttentionManager`` keeps every
  block; ``SlidingWindowManager`` frees, before a step, the blocks wholly before the window of the
  step's first query (``remove_skipped_blocks``), putting vLLM's **null block** in their place: a
  block of the pool taken once and never written, so that a table keeps its positions.
* **Prefix caching per group**: a full block is named by its stage-9 hash and its group
  (``block_hash_with_group_id``). A full group's hit runs from block 0 to the first miss; a sliding
  group's needs only the blocks of the window behind it (``find_longest_cache_hit``).

``stage15_hybrid_kv_cache`` puts the managers over one pool.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from minipaged.stage1_block_allocator import BlockAllocator
from minipaged.stage2_block_table import PagedKVCache
from minipaged.stage9_prefix_caching import PrefixCachingAllocator
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


def group_of_layer(groups: list[KVCacheGroupSpec]) -> list[int]:
    """Each layer's group, by layer: what the runner and the CUDA graphs hand each layer its table by."""
    group_of = {layer: g for g, group in enumerate(groups) for layer in group.layer_ids}
    return [group_of[layer] for layer in range(len(group_of))]


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
