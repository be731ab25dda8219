"""Micro-benchmarks of the block bookkeeping (pytest-benchmark; `make bench` runs them).

They time, they do not test: every function here returns nothing that is asserted on
beyond a sanity check. Run: pytest bench/micro --benchmark-only (with NANO_VLLM_PATH set to a
nano-vllm checkout, its BlockManager runs beside minipaged's).
"""

import importlib
import os
import sys
import types
from collections import deque
from pathlib import Path

import pytest
import torch

from minipaged.stage1_block_allocator import BlockAllocator
from minipaged.stage2_block_table import BlockSpaceManager
from minipaged.stage3_copy_on_write import CowBlockSpaceManager, RefCountedBlockAllocator
from minipaged.stage6_swapping import SwapBlockSpaceManager


def test_allocate_free_one_block(benchmark):
    allocator = BlockAllocator(4096)

    def cycle():
        allocator.free(allocator.allocate()[0])

    benchmark(cycle)


def test_allocate_free_4096_blocks(benchmark):
    allocator = BlockAllocator(4096)

    def cycle():
        ids = [allocator.allocate()[0] for _ in range(4096)]
        for block_id in ids:
            allocator.free(block_id)

    benchmark(cycle)


def test_append_slot_1024_tokens(benchmark):
    def grow():
        manager = BlockSpaceManager(BlockAllocator(1024), 16)
        manager.allocate("s", [1])
        for _ in range(1023):
            manager.append_slot("s")
        return manager

    assert benchmark(grow).block_tables["s"].num_tokens == 1024


def test_fork_and_free_a_tree_of_64(benchmark):
    def tree():
        manager = CowBlockSpaceManager(RefCountedBlockAllocator(4096), 16)
        manager.allocate(0, range(512))
        for child in range(1, 64):
            manager.fork(child // 2, child)
        for seq_id in range(63, -1, -1):
            manager.free(seq_id)
        return manager

    assert benchmark(tree).num_free_blocks == 4096


@pytest.mark.parametrize("tokens_each", [1, 64], ids=["decode", "prefill64"])
def test_slot_mapping_for_256_sequences(benchmark, tokens_each):
    manager = BlockSpaceManager(BlockAllocator(256 * 32), 16)
    seq_ids = list(range(256))
    for seq_id in seq_ids:
        manager.allocate(seq_id, range(300 + seq_id))
    mapping = benchmark(manager.slot_mapping, seq_ids, [tokens_each] * 256)
    assert mapping.numel() == 256 * tokens_each


def decode_steps(manager, seq_ids, steps=256):
    """What every decode step asks of the block manager: a slot per sequence, then the batch's
    slot mapping and block tables."""
    for _ in range(steps):
        for seq_id in seq_ids:
            manager.append_slot(seq_id)
        manager.slot_mapping(seq_ids, [1] * len(seq_ids))
        manager.block_tables_tensor(seq_ids)


class PlainBlockManager:
    """The baseline: the least a block manager can do, as a compact engine (nano-vllm) does it.
    A deque of free blocks, a list of block ids per sequence, no reference counts, no checks."""

    def __init__(self, num_blocks, block_size):
        self.free_ids, self.block_size = deque(range(num_blocks)), block_size
        self.tables, self.lengths = {}, {}

    def allocate(self, seq_id, token_ids):
        self.tables[seq_id] = [self.free_ids.popleft() for _ in range(-(-len(token_ids) // self.block_size))]
        self.lengths[seq_id] = len(token_ids)

    def append_slot(self, seq_id):
        if self.lengths[seq_id] % self.block_size == 0:
            self.tables[seq_id].append(self.free_ids.popleft())
        self.lengths[seq_id] += 1

    def slot_mapping(self, seq_ids, _):
        size = self.block_size
        return torch.tensor([self.tables[s][(self.lengths[s] - 1) // size] * size + (self.lengths[s] - 1) % size
                             for s in seq_ids], dtype=torch.int64)

    def block_tables_tensor(self, seq_ids):
        width = max(len(self.tables[s]) for s in seq_ids)
        return torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s in seq_ids], dtype=torch.int32)


def nano_vllm_block_manager():
    """nano-vllm's own ``BlockManager`` and ``Sequence``, from a checkout named by ``NANO_VLLM_PATH`` (never copied
    here); skipped without one. Its package ``__init__`` needs CUDA libraries, so its two modules load on their own."""
    path = os.environ.get("NANO_VLLM_PATH")
    if not path:
        pytest.skip("set NANO_VLLM_PATH to a nano-vllm checkout to measure its BlockManager beside minipaged's")
    pytest.importorskip("xxhash")
    for name in ("nanovllm", "nanovllm.engine"):  # empty packages: the two modules without their imports
        sys.modules.setdefault(name, types.ModuleType(name)).__path__ = [str(Path(path, *name.split(".")))]
    params = types.ModuleType("nanovllm.sampling_params")
    params.SamplingParams = lambda **kw: types.SimpleNamespace(temperature=1.0, max_tokens=64, ignore_eos=False)
    sys.modules["nanovllm.sampling_params"] = params
    sequence = importlib.import_module("nanovllm.engine.sequence")
    return importlib.import_module("nanovllm.engine.block_manager").BlockManager, sequence.Sequence


def nano_vllm_decode_steps(block_manager_class, sequence_class, steps=256):
    """What nano-vllm does per decode step for the same 256 sequences: the sampled token appended and
    ``may_append`` per sequence (its scheduler), then the slot mapping and block tables its runner's
    ``prepare_decode`` builds."""
    sequence_class.block_size = 16
    manager = block_manager_class(256 * 64, 16)
    seqs = [sequence_class(list(range(100 + i))) for i in range(256)]
    for seq in seqs:
        manager.allocate(seq)
    for _ in range(steps):
        for seq in seqs:
            seq.append_token(7)
            manager.may_append(seq)
        torch.tensor([s.block_table[-1] * 16 + s.last_block_num_tokens - 1 for s in seqs], dtype=torch.int32)
        width = max(len(s.block_table) for s in seqs)
        torch.tensor([s.block_table + [-1] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32)


@pytest.mark.parametrize("kind", ["plain-baseline", "nano-vllm", "minipaged"])
def test_256_decode_steps_of_256_sequences(benchmark, kind):
    """256 sequences of 100-355 prompt tokens, block size 16, 256 decode steps: minipaged's manager (stage 6,
    copy-on-write checks included: ``append_slot`` for every sequence, then ``slot_mapping`` and
    ``block_tables_tensor``) beside the plain baseline and, given a checkout, nano-vllm's own code, in one run."""
    if kind == "nano-vllm":
        classes = nano_vllm_block_manager()
        benchmark.pedantic(nano_vllm_decode_steps, classes, rounds=3, iterations=1)
        return

    def run():
        manager = (SwapBlockSpaceManager(RefCountedBlockAllocator(256 * 64), 16) if kind == "minipaged"
                   else PlainBlockManager(256 * 64, 16))
        seq_ids = list(range(256))
        for seq_id in seq_ids:
            manager.allocate(seq_id, range(100 + seq_id))
        decode_steps(manager, seq_ids)
        return manager

    benchmark.pedantic(run, rounds=3, iterations=1)
