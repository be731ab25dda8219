"""Stage 1: the block allocator, checked against its own invariants."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minipaged.stage1_block_allocator import BlockAllocator, OutOfBlocksError

pytestmark = pytest.mark.stage1


@pytest.mark.parametrize("num_blocks", [1, 2, 7, 64])
def test_every_block_handed_out_exactly_once_then_all_come_back(num_blocks):
    allocator = BlockAllocator(num_blocks)
    ids = [block for _ in range(num_blocks) for block in allocator.allocate()]
    assert sorted(ids) == list(range(num_blocks))
    assert allocator.num_free_blocks == 0 and allocator.num_total_blocks == num_blocks
    with pytest.raises(OutOfBlocksError) as refused:
        allocator.allocate()
    assert (refused.value.num_requested, refused.value.num_free) == (1, 0)
    for block_id in reversed(ids):
        allocator.free(block_id)
    assert allocator.num_free_blocks == num_blocks
    assert all(allocator.is_free(b) for b in range(num_blocks))


def test_lowest_ids_first_and_freed_blocks_are_reused():
    allocator = BlockAllocator(4)
    assert [allocator.allocate() for _ in range(3)] == [[0], [1], [2]]
    allocator.free(1)
    assert allocator.allocate() == [1]


def test_the_most_recently_freed_block_is_handed_out_first():
    allocator = BlockAllocator(8)
    assert allocator.allocate(6) == [0, 1, 2, 3, 4, 5]
    allocator.free(2)
    allocator.free(5)
    assert allocator.allocate(1) == [5]  # last in, first out: not the lowest free id
    allocator.free(0)
    assert allocator.allocate(3) == [0, 2, 6]  # then the fresh ids, in increasing order


def test_allocate_is_all_or_nothing():
    allocator = BlockAllocator(5)
    assert allocator.allocate(3) == [0, 1, 2]
    with pytest.raises(OutOfBlocksError) as refused:
        allocator.allocate(3)
    assert (refused.value.num_requested, refused.value.num_free) == (3, 2)
    assert allocator.num_free_blocks == 2 and allocator.allocate(2) == [3, 4]
    assert allocator.allocate(0) == []
    with pytest.raises(ValueError):
        allocator.allocate(-1)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", None])
def test_bad_pool_sizes_are_refused(bad):
    with pytest.raises(ValueError):
        BlockAllocator(bad)
    assert BlockAllocator(3).allocate(3) == [0, 1, 2]  # a good size still makes a pool


@pytest.mark.parametrize("bad", [-1, 4, 100, "0", None, True, 1.0])
def test_foreign_ids_are_refused_and_change_nothing(bad):
    allocator = BlockAllocator(4)
    allocator.allocate(2)
    with pytest.raises(ValueError):
        allocator.free(bad)
    with pytest.raises(ValueError):
        allocator.is_free(bad)
    assert allocator.num_free_blocks == 2


def test_double_free_is_refused_and_changes_nothing():
    allocator = BlockAllocator(3)
    (block_id,) = allocator.allocate()
    allocator.free(block_id)
    with pytest.raises(ValueError):
        allocator.free(block_id)
    assert allocator.num_free_blocks == 3
    assert sorted(allocator.allocate(3)) == [0, 1, 2]  # no id was pushed twice


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / free / misuse; the pool must always add up."""

    def __init__(self):
        super().__init__()
        self.allocator = BlockAllocator(12)
        self.used: set[int] = set()

    @rule(n=st.integers(0, 5))
    def allocate(self, n):
        if n <= 12 - len(self.used):
            ids = self.allocator.allocate(n)
            assert not self.used & set(ids) and len(set(ids)) == n
            self.used |= set(ids)
        else:
            with pytest.raises(OutOfBlocksError):
                self.allocator.allocate(n)

    @precondition(lambda self: self.used)
    @rule(data=st.data())
    def free(self, data):
        block_id = data.draw(st.sampled_from(sorted(self.used)))
        self.allocator.free(block_id)
        self.used.remove(block_id)

    @rule(block_id=st.integers(-2, 14))
    def free_something_not_in_use(self, block_id):
        if block_id in self.used:
            return
        with pytest.raises(ValueError):
            self.allocator.free(block_id)

    @invariant()
    def free_plus_used_is_total(self):
        assert self.allocator.num_free_blocks + len(self.used) == self.allocator.num_total_blocks
        assert all(self.allocator.is_free(b) == (b not in self.used) for b in range(12))


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
