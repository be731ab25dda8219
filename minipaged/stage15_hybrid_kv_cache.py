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

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from minipaged.common.sequence import Sequence as Seq
from minipaged.stage1_block_allocator import BlockAllocator
from minipaged.stage2_block_table import PagedKVCache


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
    of each group. Memory for ``group_size`` layers per block, not for every layer."""
    # BEGIN SOLUTION each layer's tensor is the one of its place in its group
    slot = {layer: j for g in groups for j, layer in enumerate(g.layer_ids)}
    keys, values = cache.key_cache, cache.value_cache
    cache.num_layers = len(slot)
    cache.key_cache = [keys[slot[layer]] for layer in range(len(slot))]
    cache.value_cache = [values[slot[layer]] for layer in range(len(slot))]
    return cache
    # END SOLUTION


class SingleTypeKVCacheManager:
    """One group's blocks: a list per request, position ``i`` holding tokens ``i * block_size ..``."""

    def __init__(self, spec: KVCacheSpec, allocator: BlockAllocator, null_block: int) -> None:
        self.spec, self.allocator, self.null_block = spec, allocator, null_block
        self.req_to_blocks: dict[Hashable, list[int]] = {}

    def get_num_blocks_to_allocate(self, req_id: Hashable, num_tokens: int) -> int:
        """Blocks to take for the request to hold ``num_tokens`` tokens."""
        return max(0, cdiv(num_tokens, self.spec.block_size) - len(self.req_to_blocks.get(req_id, ())))

    def allocate_new_blocks(self, req_id: Hashable, num_tokens: int) -> list[int]:
        new = self.allocator.allocate(self.get_num_blocks_to_allocate(req_id, num_tokens))
        self.req_to_blocks.setdefault(req_id, []).extend(new)
        return new

    def remove_skipped_blocks(self, req_id: Hashable, num_computed_tokens: int) -> None:
        """Give back the blocks no query from position ``num_computed_tokens`` on reads: none here."""

    def free(self, req_id: Hashable) -> None:
        """Every block of the request back to the pool, the null block excepted."""
        for block in reversed(self.req_to_blocks.pop(req_id, [])):
            if block != self.null_block:
                self.allocator.free(block)


class FullAttentionManager(SingleTypeKVCacheManager):
    """A full-attention group: a block stays until its request ends."""


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


def manager_for(spec: KVCacheSpec, allocator: BlockAllocator, null_block: int) -> SingleTypeKVCacheManager:
    cls = SlidingWindowManager if isinstance(spec, SlidingWindowSpec) else FullAttentionManager
    return cls(spec, allocator, null_block)


class HybridKVCacheCoordinator:
    """The groups' managers over one pool of blocks; block 0 is the null block."""

    def __init__(self, groups: list[KVCacheGroupSpec], num_blocks: int) -> None:
        self.groups = groups
        self.allocator = BlockAllocator(num_blocks)
        self.null_block = self.allocator.allocate(1)[0]  # taken for good, never written
        self.managers = [manager_for(g.spec, self.allocator, self.null_block) for g in groups]

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
                freed += sum(b != self.null_block for b in manager.req_to_blocks.get(req_id, [])[:skipped])
        return sum(m.get_num_blocks_to_allocate(req_id, num_tokens) for m in self.managers) - freed

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
        self.prefix_cache = None  # no prefix cache: a model with sliding windows is served without one
        self.num_tokens: dict[Hashable, int] = {}  # tokens each request's blocks hold
        self.num_skipped_blocks: dict[Hashable, int] = {}  # null blocks in its lists, every group together

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

    def allocate_prompt(self, seq: Seq) -> int | None:
        """Blocks, in every group, for the tokens of a new (or recomputed) sequence that its first step
        may compute: at most ``max_num_batched_tokens`` (each later chunk takes its own, as a decode
        does, once the window has given back what it left). 0 tokens found computed; None if too few
        blocks are free."""
        first = min(len(seq), self.max_num_batched_tokens)
        if self.coordinator.allocate_slots(seq.seq_id, 0, first) is None:
            return None
        self.num_tokens[seq.seq_id] = first
        return 0

    def allocate_slots(self, seq: Seq, num_new_tokens: int) -> tuple[list[int], ...] | None:
        """Stage 10's: each group's new block ids (``()`` when no group takes one), or None."""
        total = max(self.num_tokens[seq.seq_id], seq.num_computed_tokens + num_new_tokens)
        new = self.coordinator.allocate_slots(seq.seq_id, seq.num_computed_tokens, total)
        if new is None:
            return None
        self.num_tokens[seq.seq_id] = total
        computed, size = seq.num_computed_tokens, self.block_size  # the null blocks: the whole blocks skipped
        self.num_skipped_blocks[seq.seq_id] = sum(
            min(len(m.req_to_blocks[seq.seq_id]), m.get_num_skipped_tokens(computed) // size)
            for m in self.coordinator.managers if isinstance(m, SlidingWindowManager))
        return new if any(new) else ()

    def can_allocate_slots(self, seq: Seq, num_new_tokens: int) -> bool:
        """Whether ``allocate_slots`` would find its blocks, counting those the windows give back first."""
        total = max(self.num_tokens[seq.seq_id], seq.num_computed_tokens + num_new_tokens)
        return self.coordinator.num_blocks_to_allocate(seq.seq_id, seq.num_computed_tokens,
                                                       total) <= self.allocator.num_free_blocks

    def cache_blocks(self, seq: Seq, num_computed_tokens: int) -> None:
        """No prefix cache: nothing to name."""

    def reset_prefix_cache(self) -> None:
        """No prefix cache: nothing to forget."""

    def free(self, seq: Seq) -> None:
        self.coordinator.free(seq.seq_id)
        self.num_tokens.pop(seq.seq_id, None)
        self.num_skipped_blocks.pop(seq.seq_id, None)

    def block_ids(self, seq: Seq) -> tuple[list[int], ...]:
        return self.coordinator.block_ids(seq.seq_id)

    def num_slots(self) -> tuple[int, int]:
        """(slots holding K/V a query may still read, slots held), over every group's blocks: one sum
        over the requests, not a walk over their blocks."""
        size, groups = self.block_size, len(self.coordinator.managers)
        held = (self.allocator.num_total_blocks - self.allocator.num_free_blocks - 1) * size
        holding = groups * sum(self.num_tokens.values()) - size * sum(self.num_skipped_blocks.values())
        return holding, held
