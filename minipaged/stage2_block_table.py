"""Stage 2 — block tables: logical blocks mapped to physical blocks.

A sequence sees its KV cache as consecutive *logical* blocks: tokens 0..15 in logical
block 0, tokens 16..31 in logical block 1, and so on (block size 16). Where those blocks
really are is written in its **block table**, like a page table: logical block i lives
in physical block ``block_table[i]``, anywhere in memory. Token ``t`` of a sequence
therefore lives in slot::

    slot = block_table[t // block_size] * block_size + t % block_size

This stage adds three pieces, with vLLM's names:

* ``BlockTable`` — one sequence's physical block ids, in logical order, and its length.
* ``BlockSpaceManager(allocator, block_size)`` — the bookkeeping, over any allocator
  with stage 1's interface: ``allocate`` blocks for a prompt, ``append_slot`` for each
  generated token (a new block only when the last one is full), ``free``, and, for a
  batch, the ``slot_mapping`` that tells the model where to write K/V and the
  ``block_tables_tensor`` that tells attention where to read. Nothing is reserved
  ahead: at most ``block_size - 1`` slots per sequence sit idle.
* ``PagedKVCache`` — the tensors: per layer, ``key_cache`` and ``value_cache`` of shape
  ``(num_blocks, block_size, num_kv_heads, head_dim)``; ``write`` through a slot mapping,
  ``gather`` a sequence's K/V back into one contiguous tensor.

It is checked against stage 0: for any interleaving of growing sequences, what the paged
cache gathers equals, bit for bit, what the contiguous cache holds.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from minipaged.common.checks import check_int
from minipaged.stage0_contiguous import CacheUsage
from minipaged.stage1_block_allocator import OutOfBlocksError


class Allocator(Protocol):
    """What a ``BlockSpaceManager`` uses of its allocator: stage 1's ``BlockAllocator``, or one that wraps it."""

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_total_blocks(self) -> int: ...

    def allocate(self, num_blocks: int = 1) -> list[int]: ...

    def free(self, block_id: int) -> None: ...


@dataclass
class BlockTable:
    """One sequence's physical blocks, in logical order, and how many tokens it holds."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


class BlockSpaceManager:
    """Maps each sequence's logical blocks to physical blocks of ``allocator``.

    ``block_tables`` maps each sequence id to its ``BlockTable``. The allocator is used
    through stage 1's public methods only: ``allocate(n)``, ``free(id)``,
    ``num_free_blocks``, ``num_total_blocks``.
    """

    def __init__(self, allocator: Allocator, block_size: int = 16) -> None:
        check_int("block_size", block_size, 1)
        self.allocator, self.block_size = allocator, block_size
        self.block_tables: dict[Hashable, BlockTable] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_total_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        # BEGIN SOLUTION
        return -(-num_tokens // self.block_size)
        # END SOLUTION

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens gets its blocks now."""
        # BEGIN SOLUTION
        return self.blocks_needed(num_tokens) <= self.num_free_blocks
        # END SOLUTION

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Give a new sequence the blocks for its prompt ``token_ids``, all at once.

        Returns how many of those tokens already have their K/V in the cache: 0 here,
        every block being new (the model computes them all). ``ValueError`` for a
        duplicate id, an empty prompt or one larger than the whole cache;
        ``OutOfBlocksError`` when too few blocks are free now. A refused call changes nothing.
        """
        needed = self.check_new(seq_id, len(token_ids))
        # BEGIN SOLUTION take every block at once from the allocator, record the table
        self.block_tables[seq_id] = BlockTable(self.allocator.allocate(needed), len(token_ids))
        return 0
        # END SOLUTION

    def check_new(self, seq_id: Hashable, num_tokens: int) -> int:
        """The blocks a new sequence of ``num_tokens`` tokens needs; ``ValueError`` for a duplicate
        id, no tokens, or more blocks than the whole cache has (it could never fit)."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        if num_tokens < 1:
            raise ValueError("a sequence needs at least one token")
        needed = self.blocks_needed(num_tokens)
        if needed > self.num_total_blocks:
            raise ValueError(f"sequence {seq_id!r} needs {needed} blocks; the cache has {self.num_total_blocks}")
        return needed

    def table(self, seq_id: Hashable) -> BlockTable:
        """The ``BlockTable`` of ``seq_id``; ``KeyError`` if it has none (never allocated, or freed)."""
        if seq_id not in self.block_tables:
            raise KeyError(f"sequence {seq_id!r} has no block table (never allocated, or freed)")
        return self.block_tables[seq_id]

    def can_append_slot(self, seq_id: Hashable) -> bool:
        """Whether ``append_slot`` would succeed now."""
        # BEGIN SOLUTION a free block is needed only when the last block is full
        return self.table(seq_id).num_tokens % self.block_size != 0 or self.num_free_blocks > 0
        # END SOLUTION

    def append_slot(self, seq_id: Hashable) -> int:
        """Make room for one more token of ``seq_id``; return its slot.

        A new block is taken only when the last block is full. ``OutOfBlocksError`` if one
        is needed and none is free (the sequence is unchanged).
        """
        table = self.table(seq_id)
        # BEGIN SOLUTION take a new block if the last one is full, then count the token
        if table.num_tokens % self.block_size == 0:
            table.block_ids += self.allocator.allocate(1)
        table.num_tokens += 1
        return self.slot_of(seq_id, table.num_tokens - 1)
        # END SOLUTION

    def append_slots(self, seq_id: Hashable, n: int) -> list[int]:
        """Room for ``n`` more tokens at once, as ``append_slot`` ``n`` times (nano-vllm's ``may_append``):
        the blocks taken (none while the last block has room). ``OutOfBlocksError``, nothing changed, if
        too few are free."""
        table = self.table(seq_id)
        # BEGIN SOLUTION the blocks the new length needs beyond those held, in one call; then count the tokens
        needed = self.blocks_needed(table.num_tokens + n) - len(table.block_ids)
        taken = self.allocator.allocate(needed) if needed > 0 else []
        table.block_ids += taken
        table.num_tokens += n
        return taken
        # END SOLUTION

    def slot_of(self, seq_id: Hashable, position: int) -> int:
        """The slot of token ``position`` of ``seq_id``: block id * block_size + offset.

        ``IndexError`` for a position outside ``0 .. num_tokens - 1``.
        """
        table = self.table(seq_id)
        # BEGIN SOLUTION check the position, then look its block up in the table
        if not 0 <= position < table.num_tokens:
            raise IndexError(f"position {position} outside sequence {seq_id!r} of {table.num_tokens} tokens")
        return table.block_ids[position // self.block_size] * self.block_size + position % self.block_size
        # END SOLUTION

    def free(self, seq_id: Hashable) -> None:
        """Give every block of ``seq_id`` back to the allocator, its last block first."""
        table = self.table(seq_id)
        for block_id in reversed(table.block_ids):  # a stack hands them out again in order
            self.allocator.free(block_id)
        del self.block_tables[seq_id]

    def get_block_table(self, seq_id: Hashable) -> list[int]:
        """The physical block ids of ``seq_id``, in logical order (a copy)."""
        return list(self.table(seq_id).block_ids)

    def slot_mapping(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]) -> torch.Tensor:
        """The slots of the last ``num_new_tokens[i]`` tokens of each ``seq_ids[i]``, concatenated.

        This is what a forward pass over a batch needs: where to write each new token's K/V.
        Returns int64 ``(sum(num_new_tokens),)``.
        """
        size, slots = self.block_size, []
        # BEGIN SOLUTION the new tokens are the last ones: positions num_tokens - n .. num_tokens - 1
        for seq_id, n in zip(seq_ids, num_new_tokens, strict=True):
            table = self.table(seq_id)
            ids, end = table.block_ids, table.num_tokens
            slots += [ids[p // size] * size + p % size for p in range(end - n, end)]
        # END SOLUTION
        return torch.from_numpy(np.array(slots, dtype=np.int64))

    def block_tables_tensor(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """int32 ``(num_seqs, max_blocks_per_seq)``; entries past a sequence's blocks are 0."""
        tables = [self.table(s).block_ids for s in seq_ids]
        width, flat = max(map(len, tables), default=0), []
        for ids in tables:  # one flat list, padded, then one conversion: no tensor per row
            flat += ids
            flat += [0] * (width - len(ids))
        return torch.from_numpy(np.array(flat, dtype=np.int32)).view(len(tables), width)

    def usage(self) -> CacheUsage:
        """Stage 0's breakdown for the paged cache: internal = the slack in last blocks.

        Nothing is reserved ahead and any free block fits anyone, so ``reserved`` and
        ``external`` are 0. A block held by several sequences counts once.
        """
        filled: dict[int, int] = {}  # physical block -> slots holding K/V
        for table in self.block_tables.values():
            for i, block_id in enumerate(table.block_ids):
                used = min(self.block_size, table.num_tokens - i * self.block_size)
                filled[block_id] = max(filled.get(block_id, 0), used)
        token = sum(filled.values())
        total = self.num_total_blocks * self.block_size
        internal = len(filled) * self.block_size - token
        return CacheUsage(total, token, 0, internal, 0, total - token - internal)


class PagedKVCache:
    """The K/V tensors, per layer ``(num_blocks, block_size, num_kv_heads, head_dim)``, on ``device``."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        # BEGIN SOLUTION check the sizes, then allocate key_cache and value_cache per layer
        sizes = dict(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                     num_kv_heads=num_kv_heads, head_dim=head_dim)
        for name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # END SOLUTION

    def check_slot_mapping(self, slot_mapping: torch.Tensor | np.ndarray, *, skip: bool = True) -> None:
        """``ValueError`` unless every entry is a slot of this cache (``0 .. num_slots - 1``), or -1
        where ``skip`` allows it. It reads every value: on a GPU, checking a device tensor waits for
        the device, so an engine checks its step's mapping once, on the host, before the forward."""
        slots = slot_mapping.cpu().numpy() if isinstance(slot_mapping, torch.Tensor) else np.asarray(slot_mapping)
        num_slots = self.key_cache[0].shape[0] * self.key_cache[0].shape[1]
        if slots.size and (slots.max() >= num_slots or slots.min() < (-1 if skip else 0)):
            raise ValueError(f"slots must be in 0 .. {num_slots - 1}{' or -1' if skip else ''}; "
                             f"got {slots.min()} .. {slots.max()}")

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
              checked: bool = False) -> None:
        """Store K/V ``(num_tokens, num_kv_heads, head_dim)`` at ``slot_mapping``; -1 = skip.

        Shapes are checked on every call: they are known on the host. The slots' values are checked
        (``check_slot_mapping``) and the -1 entries skipped here unless ``checked``: the caller has
        checked the mapping on the host already and it holds no -1, so nothing is read back, and the
        model's layers write without waiting for the device.
        """
        # BEGIN SOLUTION view the cache as (num_slots, heads, dim), check, scatter the kept rows
        k_flat = self.key_cache[layer].view(-1, *self.key_cache[layer].shape[2:])
        v_flat = self.value_cache[layer].view(-1, *self.value_cache[layer].shape[2:])
        expected = (slot_mapping.numel(), *k_flat.shape[1:])
        for name, t in (("key", key), ("value", value)):
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
        if not checked:  # each of these reads the mapping back: once per call, never per layer in an engine
            self.check_slot_mapping(slot_mapping)
            keep = slot_mapping >= 0
            if not bool(keep.all()):  # -1: a token whose K/V are not stored
                slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
        k_flat[slot_mapping] = key.to(k_flat.dtype)
        v_flat[slot_mapping] = value.to(v_flat.dtype)
        # END SOLUTION

    def gather(self, layer: int, block_table: Sequence[int] | torch.Tensor,
               seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K/V, each ``(seq_len, num_kv_heads, head_dim)``, read through its table."""
        table = torch.as_tensor(block_table, dtype=torch.int64, device=self.key_cache[layer].device)
        if table.numel() < -(-seq_len // self.block_size):
            raise ValueError(f"seq_len {seq_len} needs {-(-seq_len // self.block_size)} blocks; "
                             f"the table has {table.numel()}")
        return gather_kv(self.key_cache[layer], self.value_cache[layer], table, seq_len)


def gather_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
              seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K/V, each ``(seq_len, num_kv_heads, head_dim)``, in logical order.

    ``key_cache``/``value_cache``: one layer, ``(num_blocks, block_size, num_kv_heads, head_dim)``;
    ``block_table``: the sequence's block ids. Only its first ``ceil(seq_len / block_size)`` entries
    are read: when the last block is exactly full, the entry after it may hold anything.
    """
    # BEGIN SOLUTION index the blocks in logical order, flatten blocks x slots, keep seq_len tokens
    num_blocks = -(-seq_len // key_cache.shape[1])
    ids = block_table[:num_blocks].long()
    keys = key_cache[ids].flatten(0, 1)[:seq_len]  # (num_blocks * block_size, kv_heads, dim) -> (seq_len, ...)
    values = value_cache[ids].flatten(0, 1)[:seq_len]
    return keys, values
    # END SOLUTION


__all__ = ["BlockTable", "BlockSpaceManager", "PagedKVCache", "OutOfBlocksError", "gather_kv"]
