"""Stage 2: block tables and the paged KV cache, checked against stage 0's contiguous cache."""

import random

import numpy as np
import pytest
import torch
from helpers_kv import ShadowedKVMachine, assert_same_kv
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from minipaged.stage0_contiguous import CacheUsage, ContiguousKVCache
from minipaged.stage1_block_allocator import BlockAllocator, OutOfBlocksError
from minipaged.stage2_block_table import BlockSpaceManager, PagedKVCache

pytestmark = pytest.mark.stage2

HEADS, DIM, LAYERS = 2, 4, 2


@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_cache_reads_back_what_the_contiguous_cache_holds(block_size, seed):
    """Many sequences grow token by token, interleaved, and some finish and are replaced:
    physical blocks end up scattered, yet every gather equals stage 0 bit for bit."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    max_len = 80
    contiguous = ContiguousKVCache(4096, max_len, "max", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
    manager = BlockSpaceManager(BlockAllocator(4096 // block_size), block_size)
    paged = PagedKVCache(LAYERS, 4096 // block_size, block_size, HEADS, DIM)

    def write_both(seq_id, contiguous_slots, n):
        paged_slots = manager.slot_mapping([seq_id], [n])
        for layer in range(LAYERS):
            k, v = torch.randn(2, n, HEADS, DIM)
            contiguous.write(layer, contiguous_slots, k, v)
            paged.write(layer, paged_slots, k, v)

    def start(seq_id):
        prompt = rng.randint(1, 40)
        contiguous.allocate(seq_id, prompt, max_len - prompt)
        manager.allocate(seq_id, range(prompt))
        write_both(seq_id, contiguous.append(seq_id, prompt), prompt)

    live = list(range(12))
    for seq_id in live:
        start(seq_id)
    next_id = len(live)
    for _ in range(300):
        seq_id = rng.choice(live)
        if contiguous.slabs[seq_id].num_tokens == max_len or rng.random() < 0.02:
            contiguous.free(seq_id)
            manager.free(seq_id)
            live.remove(seq_id)
            start(next_id)
            live.append(next_id)
            next_id += 1
            continue
        manager.append_slot(seq_id)
        write_both(seq_id, contiguous.append(seq_id), 1)
    assert next_id > 12  # some sequences ended and others took their blocks
    for seq_id in live:
        table = manager.get_block_table(seq_id)
        n = contiguous.slabs[seq_id].num_tokens
        for layer in range(LAYERS):
            k_ref, v_ref = contiguous.read(layer, seq_id)
            k, v = paged.gather(layer, table, n)
            assert_same_kv((k, v), (k_ref, v_ref), seq=seq_id, layer=layer)


def test_tensor_layout_and_slot_formula():
    cache = PagedKVCache(3, 10, 4, 2, 8, dtype=torch.float16)
    assert len(cache.key_cache) == 3 and cache.key_cache[0].shape == (10, 4, 2, 8)
    assert cache.value_cache[2].dtype == torch.float16
    manager = BlockSpaceManager(BlockAllocator(10), 4)
    manager.allocate("a", range(3))
    manager.allocate("b", range(6))
    assert manager.get_block_table("a") == [0] and manager.get_block_table("b") == [1, 2]
    assert [manager.slot_of("b", p) for p in range(6)] == [4, 5, 6, 7, 8, 9]
    assert manager.slot_mapping(["a", "b"], [3, 2]).tolist() == [0, 1, 2, 8, 9]
    assert manager.slot_mapping(["b"], [1]).dtype == torch.int64


def test_append_slot_takes_a_block_only_when_the_last_is_full():
    manager = BlockSpaceManager(BlockAllocator(4), 4)
    manager.allocate("a", range(3))
    assert manager.num_free_blocks == 3
    assert manager.append_slot("a") == 3 and manager.num_free_blocks == 3  # fills block 0
    assert manager.append_slot("a") == 4 and manager.num_free_blocks == 2  # block 1, offset 0
    assert manager.get_block_table("a") == [0, 1]
    assert manager.block_tables["a"].num_tokens == 5


def test_append_slots_is_append_slot_n_times_and_a_refusal_changes_nothing():
    one, bulk = BlockSpaceManager(BlockAllocator(6), 4), BlockSpaceManager(BlockAllocator(6), 4)
    for manager in (one, bulk):
        manager.allocate("a", range(3))
    for n in (1, 0, 4, 1, 7):
        before = one.get_block_table("a")
        for _ in range(n):
            one.append_slot("a")
        assert bulk.append_slots("a", n) == one.get_block_table("a")[len(before):]  # the blocks taken, if any
        assert bulk.get_block_table("a") == one.get_block_table("a")
        assert bulk.block_tables["a"].num_tokens == one.block_tables["a"].num_tokens
    assert bulk.num_free_blocks == one.num_free_blocks == 2  # 16 tokens: blocks 0-3; two blocks left
    with pytest.raises(OutOfBlocksError):
        bulk.append_slots("a", 9)  # three blocks
    assert bulk.block_tables["a"].num_tokens == 16 and bulk.num_free_blocks == 2


def test_out_of_blocks_changes_nothing_and_free_returns_everything():
    manager = BlockSpaceManager(BlockAllocator(3), 2)
    manager.allocate("a", range(4))
    manager.allocate("b", range(2))
    assert not manager.can_allocate(1) and not manager.can_append_slot("b")
    with pytest.raises(OutOfBlocksError):
        manager.append_slot("b")
    with pytest.raises(OutOfBlocksError):
        manager.allocate("c", range(1))
    assert manager.block_tables["b"].num_tokens == 2 and "c" not in manager.block_tables
    manager.free("a")
    assert manager.can_allocate(4) and not manager.can_allocate(5)
    manager.free("b")
    assert manager.num_free_blocks == 3


def test_bad_requests_are_refused_with_a_reason():
    manager = BlockSpaceManager(BlockAllocator(4), 16)
    with pytest.raises(ValueError):
        manager.allocate("huge", range(65))
    with pytest.raises(ValueError):
        manager.allocate("empty", range(0))
    manager.allocate("a", range(1))
    with pytest.raises(ValueError):
        manager.allocate("a", range(1))
    manager.free("a")
    with pytest.raises(KeyError):
        manager.free("a")
    with pytest.raises(KeyError):
        manager.append_slot("ghost")
    with pytest.raises(ValueError):
        BlockSpaceManager(BlockAllocator(4), 0)
    with pytest.raises(ValueError):
        PagedKVCache(1, 4, 16, 2, 0)
    assert manager.num_free_blocks == 4


def test_write_skips_minus_one_and_checks_shapes():
    cache = PagedKVCache(1, 2, 2, 1, 1)
    k = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    cache.write(0, torch.tensor([3, -1, 0]), k, -k)
    assert cache.key_cache[0].flatten().tolist() == [3.0, 0.0, 0.0, 1.0]
    assert cache.value_cache[0].flatten().tolist() == [-3.0, 0.0, 0.0, -1.0]
    with pytest.raises(ValueError):
        cache.write(0, torch.tensor([0]), k, k)
    with pytest.raises(ValueError):
        cache.write(0, torch.tensor([4]), k[:1], k[:1])
    with pytest.raises(ValueError):
        cache.gather(0, [1], 3)


def test_a_checked_write_reads_nothing_back_and_an_unchecked_one_checks_the_slots():
    """Checked once per step, because each check waits for the device: a write told that its mapping
    was checked on the host (``checked=True``) reads none of its values; one that was not checks them."""
    from helpers_device import count_host_syncs

    cache = PagedKVCache(1, 2, 2, 1, 1)
    k = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    with count_host_syncs() as count:
        cache.write(0, torch.tensor([3, 2, 0]), k, -k, checked=True)
    assert count.total == 0, dict(count.calls)
    assert cache.key_cache[0].flatten().tolist() == [3.0, 0.0, 2.0, 1.0]
    with count_host_syncs() as count:
        cache.write(0, torch.tensor([1]), k[:1], k[:1])
    assert count.total > 0
    cache.check_slot_mapping(torch.tensor([3, -1, 0]))
    for slots, skip in (([4], True), ([-2], True), ([0, -1], False)):
        with pytest.raises(ValueError):
            cache.check_slot_mapping(torch.tensor(slots), skip=skip)
        with pytest.raises(ValueError):
            cache.check_slot_mapping(np.array(slots), skip=skip)


def test_usage_counts_only_the_slack_of_last_blocks():
    manager = BlockSpaceManager(BlockAllocator(8), 4)
    manager.allocate("a", range(5))  # 2 blocks, 3 slots of slack
    manager.allocate("b", range(4))  # 1 full block
    assert manager.usage() == CacheUsage(total=32, token=9, reserved=0, internal=3, external=0, free=20)
    tables = manager.block_tables_tensor(["a", "b"])
    assert tables.dtype == torch.int32 and tables.tolist() == [[0, 1], [2, 0]]


class PagedCacheMachine(ShadowedKVMachine):
    """Random allocate / append / free, with a shadow of every sequence's K/V."""

    def __init__(self):
        super().__init__(BlockSpaceManager(BlockAllocator(10), 3), PagedKVCache(1, 10, 3, 1, 1), 10)

    def _write(self, seq_id, n):
        values = [float(self.counter * 1000 + i) for i in range(n)]
        self.counter += 1
        kv = torch.tensor(values).view(n, 1, 1)
        self.cache.write(0, self.manager.slot_mapping([seq_id], [n]), kv, -kv)
        self.shadow[seq_id].extend(values)

    @rule(n=st.integers(1, 12))
    def allocate(self, n):
        seq_id = self.counter
        if self.manager.can_allocate(n):
            self.manager.allocate(seq_id, range(n))
            self.shadow[seq_id] = []
            self._write(seq_id, n)
        else:
            with pytest.raises(OutOfBlocksError):
                self.manager.allocate(seq_id, range(n))
            self.counter += 1

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def append(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.shadow)))
        if self.manager.can_append_slot(seq_id):
            self.manager.append_slot(seq_id)
            self._write(seq_id, 1)
        else:
            with pytest.raises(OutOfBlocksError):
                self.manager.append_slot(seq_id)

    @invariant()
    def bookkeeping_adds_up(self):
        held = [b for t in self.manager.block_tables.values() for b in t.block_ids]
        assert len(held) == len(set(held))  # no block in two tables (no sharing yet)
        assert self.manager.num_free_blocks + len(held) == 10
        for seq_id, table in self.manager.block_tables.items():
            assert len(table.block_ids) == self.manager.blocks_needed(table.num_tokens)
            assert table.num_tokens == len(self.shadow[seq_id])



TestPagedCacheMachine = PagedCacheMachine.TestCase
TestPagedCacheMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_slot_of_refuses_positions_outside_the_sequence():
    manager = BlockSpaceManager(BlockAllocator(4), 4)
    manager.allocate("a", range(6))  # blocks [0, 1]; block 1 holds 2 of 4 slots
    assert manager.slot_of("a", 5) == 5
    for position in (6, 7, -1, 8):  # past the last token (even inside its last block), or before the first
        with pytest.raises(IndexError):
            manager.slot_of("a", position)


def test_gather_never_reads_the_table_entry_past_an_exactly_full_last_block():
    cache = PagedKVCache(1, 4, 4, 1, 2)
    cache.key_cache[0].copy_(torch.arange(4 * 4 * 2, dtype=torch.float32).view(4, 4, 1, 2))
    cache.value_cache[0].copy_(cache.key_cache[0] + 100)
    table = torch.tensor([2, 0, 99])  # 99: a poisoned entry, past the sequence's 2 blocks
    keys, values = cache.gather(0, table, 8)  # 8 tokens: both blocks exactly full
    assert torch.equal(keys, torch.cat([cache.key_cache[0][2], cache.key_cache[0][0]]))
    assert torch.equal(values, keys + 100)


def test_the_cache_lives_on_the_device_asked_for():
    cache = PagedKVCache(2, 4, 4, 1, 2, device="meta")  # "meta" shows it without a GPU
    assert all(t.device.type == "meta" for t in cache.key_cache + cache.value_cache)


def test_allocate_says_how_many_prompt_tokens_are_computed_none_here():
    manager = BlockSpaceManager(BlockAllocator(8), 4)
    assert manager.allocate("a", list(range(10))) == 0
    assert manager.allocate("b", [1]) == 0
