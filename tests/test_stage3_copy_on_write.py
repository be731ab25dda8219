"""Stage 3: shared blocks, checked against unshared caches (stages 2 and 0)."""

import random

import pytest
import torch
from helpers_kv import ShadowedKVMachine, assert_same_kv
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from minipaged.stage0_contiguous import ContiguousKVCache
from minipaged.stage1_block_allocator import BlockAllocator, OutOfBlocksError
from minipaged.stage2_block_table import BlockSpaceManager, PagedKVCache
from minipaged.stage3_copy_on_write import (
    CowBlockSpaceManager,
    CowPagedKVCache,
    RefCountedBlockAllocator,
)

pytestmark = pytest.mark.stage3

HEADS, DIM, LAYERS = 2, 4, 2


def _step(manager, cache, seq_id, kv_of_token):
    """Append one token of ``seq_id`` the way an engine does: copies first, then the write."""
    slot = manager.append_slot(seq_id)
    cache.copy_blocks(manager.take_copies())
    n = manager.block_tables[seq_id].num_tokens
    for layer in range(LAYERS):
        k, v = kv_of_token(seq_id, n - 1, layer).unsqueeze(1)  # each (1, HEADS, DIM)
        cache.write(layer, torch.tensor([slot]), k, v)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_branch_of_a_fork_tree_reads_its_own_unshared_cache(block_size, seed):
    """A random fork tree: each branch must read exactly what a cache of its own would hold
    (stage 2 without sharing, and stage 0), while the tree uses fewer physical blocks."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    history: dict[int, list[torch.Tensor]] = {}  # seq -> per token, (LAYERS, 2, HEADS, DIM)

    def kv_of_token(seq_id, position, layer):
        return history[seq_id][position][layer]

    shared = CowBlockSpaceManager(RefCountedBlockAllocator(2000), block_size)
    cache = CowPagedKVCache(LAYERS, 2000, block_size, HEADS, DIM)
    prompt = rng.randint(1, 3 * block_size + 2)
    history[0] = [torch.randn(LAYERS, 2, HEADS, DIM) for _ in range(prompt)]
    shared.allocate(0, range(prompt))
    slots = shared.slot_mapping([0], [prompt])
    for layer in range(LAYERS):
        k, v = torch.stack([t[layer] for t in history[0]]).unbind(1)
        cache.write(layer, slots, k, v)
    for _ in range(120):
        live = sorted(shared.block_tables)
        seq_id = rng.choice(live)
        if rng.random() < 0.2 and len(live) < 10:  # fork a new branch
            child = max(history) + 1
            shared.fork(seq_id, child)
            history[child] = list(history[seq_id])
        elif rng.random() < 0.05 and len(live) > 1:  # a branch is dropped
            shared.free(seq_id)
        else:  # a branch generates its own next token
            history[seq_id].append(torch.randn(LAYERS, 2, HEADS, DIM))
            _step(shared, cache, seq_id, kv_of_token)

    live = sorted(shared.block_tables)
    unshared = BlockSpaceManager(BlockAllocator(2000), block_size)
    plain = PagedKVCache(LAYERS, 2000, block_size, HEADS, DIM)
    contiguous = ContiguousKVCache(2000 * block_size, 2000, "oracle", num_layers=LAYERS,
                                   num_kv_heads=HEADS, head_dim=DIM)
    for seq_id in live:
        n = len(history[seq_id])
        assert shared.block_tables[seq_id].num_tokens == n
        unshared.allocate(seq_id, range(n))
        contiguous.allocate(seq_id, n, 0)
        c_slots, p_slots = contiguous.append(seq_id, n), unshared.slot_mapping([seq_id], [n])
        for layer in range(LAYERS):
            k, v = torch.stack([t[layer] for t in history[seq_id]]).unbind(1)
            plain.write(layer, p_slots, k, v)
            contiguous.write(layer, c_slots, k, v)
        for layer in range(LAYERS):
            got = cache.gather(layer, shared.get_block_table(seq_id), n)
            own = plain.gather(layer, unshared.get_block_table(seq_id), n)
            ref = contiguous.read(layer, seq_id)
            assert_same_kv(got, own, seq=seq_id, layer=layer)
            assert_same_kv(got, ref, seq=seq_id, layer=layer)
    used_shared = shared.num_total_blocks - shared.num_free_blocks
    distinct = {b for s in live for b in shared.get_block_table(s)}
    assert used_shared == len(distinct)
    assert used_shared <= unshared.num_total_blocks - unshared.num_free_blocks
    if len(live) > 1:
        assert used_shared < unshared.num_total_blocks - unshared.num_free_blocks


def test_shared_system_prompt_is_held_once():
    """Eight requests forked from one 100-token system prompt (block 16): the 6 full
    blocks are held once; the partial 7th is copied on write by each writer but the last."""
    manager = CowBlockSpaceManager(RefCountedBlockAllocator(64), 16)
    manager.allocate("system", range(100))
    for i in range(8):
        manager.fork("system", i)
    manager.free("system")
    assert manager.num_total_blocks - manager.num_free_blocks == 7
    partial = manager.get_block_table(0)[6]
    copies = []
    for i in range(8):
        manager.append_slot(i)
        copies += manager.take_copies()
    table0 = manager.get_block_table(0)
    assert all(manager.get_block_table(i)[:6] == table0[:6] for i in range(8))
    assert all(manager.ref_count(b) == 8 for b in table0[:6])
    assert len(copies) == 7 and {src for src, _ in copies} == {partial}
    assert manager.get_block_table(7)[6] == partial  # the last writer keeps the original
    assert manager.num_total_blocks - manager.num_free_blocks == 6 + 8  # unshared: 8 * 7 = 56


def test_copy_on_write_only_for_a_shared_partial_last_block():
    manager = CowBlockSpaceManager(RefCountedBlockAllocator(10), 4)
    manager.allocate("p", range(6))  # blocks [0, 1]; block 1 holds 2 of 4
    manager.fork("p", "c")
    assert manager.ref_count(0) == 2 and manager.ref_count(1) == 2
    slot = manager.append_slot("c")
    assert manager.take_copies() == [(1, 2)] and manager.get_block_table("c") == [0, 2]
    assert slot == 2 * 4 + 2 and manager.ref_count(1) == 1
    manager.append_slot("p")  # block 1 is p's alone now: written in place
    assert manager.take_copies() == [] and manager.get_block_table("p") == [0, 1]
    manager.allocate("q", range(4))  # one full block
    manager.fork("q", "r")
    manager.append_slot("r")  # full last block: a new block, nothing to copy
    assert manager.take_copies() == [] and manager.get_block_table("r")[0] == manager.get_block_table("q")[0]


def test_append_slots_copies_a_shared_partial_last_block_on_write_first():
    manager = CowBlockSpaceManager(RefCountedBlockAllocator(10), 4)
    manager.allocate("p", range(6))  # blocks [0, 1]; block 1 holds 2 of 4
    manager.fork("p", "c")
    assert manager.append_slots("c", 3) == [3]  # two tokens into a private copy of block 1, one into block 3
    assert manager.take_copies() == [(1, 2)] and manager.get_block_table("c") == [0, 2, 3]
    assert manager.ref_count(1) == 1 and manager.block_tables["c"].num_tokens == 9
    assert manager.append_slots("p", 2) == [] and manager.take_copies() == []  # block 1 is p's alone now


def test_copy_blocks_copies_every_layer():
    cache = CowPagedKVCache(3, 4, 2, 1, 2)
    for layer in range(3):
        cache.key_cache[layer][1] = layer + 1.0
        cache.value_cache[layer][3] = -(layer + 1.0)
    cache.copy_blocks([(1, 0), (3, 2)])
    for layer in range(3):
        assert torch.equal(cache.key_cache[layer][0], cache.key_cache[layer][1])
        assert torch.equal(cache.value_cache[layer][2], cache.value_cache[layer][3])
    cache.copy_blocks([])


def test_reference_counts_return_a_block_only_at_zero():
    allocator = RefCountedBlockAllocator(2)
    (block,) = allocator.allocate()
    allocator.incref(block)
    allocator.incref(block)
    assert allocator.ref_count(block) == 3
    allocator.free(block)
    allocator.free(block)
    assert not allocator.is_free(block) and allocator.num_free_blocks == 1
    allocator.free(block)
    assert allocator.is_free(block) and allocator.ref_count(block) == 0
    with pytest.raises(ValueError):
        allocator.free(block)
    with pytest.raises(ValueError):
        allocator.incref(block)


def test_refused_fork_and_cow_change_nothing():
    manager = CowBlockSpaceManager(RefCountedBlockAllocator(2), 4)
    manager.allocate("p", range(6))
    manager.fork("p", "c")
    with pytest.raises(ValueError):
        manager.fork("p", "c")
    with pytest.raises(KeyError):
        manager.fork("ghost", "x")
    assert not manager.can_append_slot("c")  # copy-on-write needs a free block; none is left
    with pytest.raises(OutOfBlocksError):
        manager.append_slot("c")
    assert manager.get_block_table("c") == [0, 1] and manager.ref_count(1) == 2
    assert manager.block_tables["c"].num_tokens == 6 and manager.take_copies() == []


class OtherPool:
    """Another correct block allocator, with nothing private in common with minipaged's."""

    def __init__(self, num_blocks):
        self.total, self.free_ids = num_blocks, set(range(num_blocks))

    num_total_blocks = property(lambda self: self.total)
    num_free_blocks = property(lambda self: len(self.free_ids))

    def is_free(self, block_id):
        if not isinstance(block_id, int) or not 0 <= block_id < self.total:
            raise ValueError(block_id)
        return block_id in self.free_ids

    def allocate(self, n=1):
        if n > len(self.free_ids):
            raise OutOfBlocksError(n, len(self.free_ids))
        ids = sorted(self.free_ids)[:n]
        self.free_ids -= set(ids)
        return ids

    def free(self, block_id):
        if self.is_free(block_id):
            raise ValueError(block_id)
        self.free_ids.add(block_id)


def test_reference_counts_wrap_any_correct_pool_through_its_public_methods(monkeypatch):
    monkeypatch.setattr("minipaged.stage3_copy_on_write.BlockAllocator", OtherPool)
    manager = CowBlockSpaceManager(RefCountedBlockAllocator(6), 4)
    cache = CowPagedKVCache(1, 6, 4, 1, 1, dtype=torch.float64)
    manager.allocate("p", range(6))
    cache.write(0, manager.slot_mapping(["p"], [6]), torch.arange(6.0).view(6, 1, 1), torch.zeros(6, 1, 1))
    manager.fork("p", "c")
    manager.append_slot("c")  # copy-on-write of the shared, partly filled block 1
    copies = manager.take_copies()
    assert copies == [(1, 2)] and manager.num_free_blocks == 3
    cache.copy_blocks(copies)
    assert cache.gather(0, manager.get_block_table("c"), 6)[0].flatten().tolist() == list(range(6))
    manager.free("p")
    manager.free("c")
    assert manager.num_free_blocks == 6


class SharingMachine(ShadowedKVMachine):
    """Random allocate / append / fork / free against a shadow of every sequence."""

    def __init__(self):
        super().__init__(CowBlockSpaceManager(RefCountedBlockAllocator(12), 3), CowPagedKVCache(1, 12, 3, 1, 1), 12)

    def _new_id(self):
        self.counter += 1
        return self.counter

    @rule(n=st.integers(1, 10))
    def allocate(self, n):
        seq_id = self._new_id()
        if not self.manager.can_allocate(n):
            with pytest.raises(OutOfBlocksError):
                self.manager.allocate(seq_id, range(n))
            return
        self.manager.allocate(seq_id, range(n))
        values = [float(seq_id * 1000 + i) for i in range(n)]
        kv = torch.tensor(values).view(n, 1, 1)
        self.cache.write(0, self.manager.slot_mapping([seq_id], [n]), kv, -kv)
        self.shadow[seq_id] = values

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def append(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.shadow)))
        if not self.manager.can_append_slot(seq_id):
            with pytest.raises(OutOfBlocksError):
                self.manager.append_slot(seq_id)
            return
        slot = self.manager.append_slot(seq_id)
        self.cache.copy_blocks(self.manager.take_copies())
        value = float(self._new_id() * 1000)
        self.cache.write(0, torch.tensor([slot]), torch.tensor([[[value]]]), torch.tensor([[[-value]]]))
        self.shadow[seq_id].append(value)

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.shadow)))
        child = self._new_id()
        self.manager.fork(parent, child)
        self.shadow[child] = list(self.shadow[parent])

    @invariant()
    def ref_counts_equal_references(self):
        held = [b for t in self.manager.block_tables.values() for b in t.block_ids]
        for block_id in range(12):
            assert self.manager.ref_count(block_id) == held.count(block_id)
            assert self.manager.allocator.is_free(block_id) == (block_id not in held)
        assert self.manager.num_free_blocks + len(set(held)) == 12



TestSharingMachine = SharingMachine.TestCase
TestSharingMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
