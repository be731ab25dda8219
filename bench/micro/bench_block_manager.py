"""Micro-benchmarks of the block bookkeeping (pytest-benchmark; `make bench` runs them).

They time, they do not test: every function here returns nothing that is asserted on
beyond a sanity check. Run: pytest bench/micro --benchmark-only
"""

import pytest

from minipaged.stage1_block_allocator import BlockAllocator
from minipaged.stage2_block_table import BlockSpaceManager
from minipaged.stage3_copy_on_write import CowBlockSpaceManager


def test_allocate_free_one_block(benchmark):
    allocator = BlockAllocator(4096)

    def cycle():
        allocator.free(allocator.allocate())

    benchmark(cycle)


def test_allocate_free_4096_blocks(benchmark):
    allocator = BlockAllocator(4096)

    def cycle():
        ids = [allocator.allocate() for _ in range(4096)]
        for block_id in ids:
            allocator.free(block_id)

    benchmark(cycle)


def test_append_slot_1024_tokens(benchmark):
    def grow():
        manager = BlockSpaceManager(1024, 16)
        manager.allocate("s", 1)
        for _ in range(1023):
            manager.append_slot("s")
        return manager

    assert benchmark(grow).block_tables["s"].num_tokens == 1024


def test_fork_and_free_a_tree_of_64(benchmark):
    def tree():
        manager = CowBlockSpaceManager(4096, 16)
        manager.allocate(0, 512)
        for child in range(1, 64):
            manager.fork(child // 2, child)
        for seq_id in range(63, -1, -1):
            manager.free(seq_id)
        return manager

    assert benchmark(tree).num_free_blocks == 4096


@pytest.mark.parametrize("tokens_each", [1, 64], ids=["decode", "prefill64"])
def test_slot_mapping_for_256_sequences(benchmark, tokens_each):
    manager = BlockSpaceManager(256 * 32, 16)
    seq_ids = list(range(256))
    for seq_id in seq_ids:
        manager.allocate(seq_id, 300 + seq_id)
    mapping = benchmark(manager.slot_mapping, seq_ids, [tokens_each] * 256)
    assert mapping.numel() == 256 * tokens_each
