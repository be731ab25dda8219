"""Stage 6: the scheduler, checked against unlimited memory with a model that reads the cache."""

import random

import pytest
import torch
from helpers_scheduler import serve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged.stage6_scheduler import (
    Scheduler,
    Sequence,
    SequenceStatus,
    SwapBlockSpaceManager,
    SwapPagedKVCache,
)

pytestmark = pytest.mark.stage6


def make(num_blocks, mode="recompute", num_cpu_blocks=0, block_size=4, **kwargs):
    kwargs.setdefault("max_model_len", 64)
    scheduler = Scheduler(num_blocks, block_size, num_cpu_blocks, preemption_mode=mode, **kwargs)
    cache = SwapPagedKVCache(1, num_blocks, block_size, 1, 1, dtype=torch.float64, num_cpu_blocks=num_cpu_blocks)
    return scheduler, cache


def workload(seed, n=24):
    rng = random.Random(seed)
    return [([rng.randrange(50) for _ in range(rng.randint(1, 30))], rng.randint(1, 30), rng.randint(0, 40))
            for _ in range(n)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outputs_under_preemption_equal_outputs_with_unlimited_memory(mode, seed):
    requests = workload(seed)
    unlimited, _ = serve(*make(4096), requests)
    scheduler, cache = make(18, mode, num_cpu_blocks=64 if mode == "swap" else 0)
    squeezed, _ = serve(scheduler, cache, requests)
    assert squeezed == unlimited
    assert scheduler.num_preemptions >= 5  # the small cache really forced preemptions
    if mode == "swap":
        assert scheduler.num_swapped_out_blocks > 0
        assert scheduler.num_swapped_in_blocks == scheduler.num_swapped_out_blocks
    assert scheduler.block_manager.num_free_blocks == 18  # nothing leaked


def test_swap_round_trip_is_bit_exact():
    manager = SwapBlockSpaceManager(8, 4, num_cpu_blocks=8)
    cache = SwapPagedKVCache(2, 8, 4, 2, 3, num_cpu_blocks=8)
    manager.allocate("a", 10)
    manager.fork("a", "b")  # shared blocks move once and stay shared
    for layer in range(2):
        cache.key_cache[layer].normal_()
        cache.value_cache[layer].normal_()
    before = [cache.gather(layer, manager.get_block_table("a"), 10) for layer in range(2)]
    assert manager.can_swap_out(["a", "b"])
    out_pairs = manager.swap_out(["a", "b"])
    assert len(out_pairs) == 3 and manager.num_free_blocks == 8
    cache.swap_out(out_pairs)
    for layer in range(2):  # the GPU blocks get reused and overwritten meanwhile
        cache.key_cache[layer].zero_()
        cache.value_cache[layer].zero_()
    assert manager.can_swap_in(["a", "b"])
    in_pairs = manager.swap_in(["a", "b"])
    cache.swap_in(in_pairs)
    assert manager.get_block_table("a") == manager.get_block_table("b")
    assert all(manager.ref_count(b) == 2 for b in manager.get_block_table("a"))
    assert manager.cpu_allocator.num_free_blocks == 8
    for layer in range(2):
        k, v = cache.gather(layer, manager.get_block_table("b"), 10)
        assert torch.equal(k, before[layer][0]) and torch.equal(v, before[layer][1])


def test_continuous_batching_admits_new_prompts_while_others_decode():
    scheduler, cache = make(64)
    first = scheduler.add_sequence([1, 2, 3], 5)
    out = scheduler.schedule()
    assert out.scheduled == [(first, 3)]
    scheduler.append_token(first, 7)
    second = scheduler.add_sequence([4, 5], 5)
    out = scheduler.schedule()
    assert out.scheduled == [(first, 1), (second, 2)]  # a decode and a prefill in one batch
    assert first.status is second.status is SequenceStatus.RUNNING


def test_budgets_limit_the_batch():
    scheduler, _ = make(64, max_num_seqs=2, max_num_batched_tokens=70)
    seqs = [scheduler.add_sequence([1] * 30, 4) for _ in range(4)]
    out = scheduler.schedule()
    assert [s for s, _ in out.scheduled] == seqs[:2]  # max_num_seqs
    scheduler2, _ = make(64, max_num_batched_tokens=64)
    a, b, c = (scheduler2.add_sequence([1] * 30, 4) for _ in range(3))
    assert [s for s, _ in scheduler2.schedule().scheduled] == [a, b]  # 3 x 30 > 64 tokens


def test_the_victim_is_the_newest_and_the_oldest_keeps_running():
    scheduler, _ = make(6, block_size=4, max_model_len=24)
    old, mid, new = (scheduler.add_sequence([1] * 8, 12) for _ in range(3))  # 2 blocks each
    assert len(scheduler.schedule().scheduled) == 3
    for seq in (old, mid, new):
        scheduler.append_token(seq, 1)
    out = scheduler.schedule()  # each needs a third block; none is free
    assert out.preempted == [new]
    assert [s for s, _ in out.scheduled] == [old, mid]
    assert scheduler.waiting == [new] and new.num_computed_tokens == 0  # recompute, outputs kept
    assert new.output_token_ids == [1]


def test_requests_that_can_never_fit_are_refused_at_once():
    with pytest.raises(ValueError, match="max_model_len=64 needs 16 blocks of 4; the cache has 10"):
        Scheduler(10, 4, max_model_len=64)
    with pytest.raises(ValueError, match="preemption_mode: expected 'recompute' or 'swap'"):
        Scheduler(10, 4, max_model_len=8, preemption_mode="drop")
    with pytest.raises(ValueError, match="needs num_cpu_blocks >= 1"):
        Scheduler(10, 4, max_model_len=8, preemption_mode="swap")
    with pytest.raises(ValueError, match="max_num_batched_tokens .8. must be >= max_model_len .16."):
        Scheduler(10, 4, max_model_len=16, max_num_batched_tokens=8)
    scheduler, _ = make(20)
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_tokens \(5\) exceeds max_model_len=64"):
        scheduler.add_sequence([1] * 60, 5)
    with pytest.raises(ValueError, match="the prompt is empty"):
        scheduler.add_sequence([], 5)
    assert not scheduler.has_unfinished()
    seq = scheduler.add_sequence([1] * 59, 5)  # the largest request that fits is served
    assert scheduler.schedule().scheduled == [(seq, 59)]


requests_strategy = st.lists(
    st.tuples(st.lists(st.integers(0, 49), min_size=1, max_size=20), st.integers(1, 20), st.integers(0, 30)),
    min_size=1, max_size=12,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests_strategy, mode=st.sampled_from(["recompute", "swap"]),
       num_blocks=st.integers(10, 16), block_size=st.sampled_from([1, 2, 4]))
def test_random_load_on_a_tiny_cache(requests, mode, num_blocks, block_size):
    """Everything finishes with the outputs of unlimited memory; no block leaks; admission
    is first come first served; every victim is the newest running sequence."""
    max_model_len = min(40, num_blocks * block_size)
    requests = [(p[: max_model_len - 1], min(m, max_model_len - len(p[: max_model_len - 1])), t)
                for p, m, t in requests]
    unlimited, _ = serve(*make(4096, block_size=block_size, max_model_len=max_model_len), requests)
    scheduler, cache = make(num_blocks, mode, num_cpu_blocks=8 if mode == "swap" else 0,
                            block_size=block_size, max_model_len=max_model_len)
    original = scheduler._preempt

    def preempt_newest(victim, out):
        assert victim is max(scheduler.running, key=Sequence.order)
        original(victim, out)

    scheduler._preempt = preempt_newest
    outputs, model = serve(scheduler, cache, requests)
    assert outputs == unlimited
    assert model.first_admissions == sorted(model.first_admissions)
    assert scheduler.block_manager.num_free_blocks == num_blocks
    if scheduler.block_manager.cpu_allocator:
        assert scheduler.block_manager.cpu_allocator.num_free_blocks == 8
