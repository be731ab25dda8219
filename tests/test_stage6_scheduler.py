"""Stage 6: the scheduler, checked against unlimited memory with a model that reads the cache."""

import random

import pytest
import torch
from helpers_scheduler import add, make, serve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged.common.sequence import Sequence, SequenceStatus
from minipaged.stage3_copy_on_write import RefCountedBlockAllocator
from minipaged.stage6_scheduler import Scheduler, SchedulerOutputs
from minipaged.stage6_swapping import SwapBlockSpaceManager, SwapPagedKVCache

pytestmark = pytest.mark.stage6


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
    moved = {"out": 0, "in": 0}

    def count_moves(_, out):
        moved["out"] += len(out.blocks_to_swap_out)
        moved["in"] += len(out.blocks_to_swap_in)

    squeezed, _ = serve(scheduler, cache, requests, check=count_moves)
    assert squeezed == unlimited
    assert scheduler.make_stats().num_preemptions >= 5  # the small cache really forced preemptions
    if mode == "swap":  # blocks really went to the CPU, and every one came back
        assert moved["out"] > 0 and moved["in"] == moved["out"]
    assert scheduler.block_manager.num_free_blocks == 18  # nothing leaked


def test_swap_round_trip_is_bit_exact():
    manager = SwapBlockSpaceManager(RefCountedBlockAllocator(8), 4, RefCountedBlockAllocator(8))
    cache = SwapPagedKVCache(2, 8, 4, 2, 3, num_cpu_blocks=8)
    manager.allocate("a", range(10))
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
    first = add(scheduler, [1, 2, 3], 5)
    out = scheduler.schedule()
    assert out.scheduled == [(first, 3)]
    first.append_token(7)
    second = add(scheduler, [4, 5], 5)
    out = scheduler.schedule()  # a decode and a prefill in one batch; their order in it is not a rule
    assert len(out.scheduled) == 2 and dict(out.scheduled) == {first: 1, second: 2}
    assert first.status is second.status is SequenceStatus.RUNNING


def test_budgets_limit_the_batch():
    scheduler, _ = make(64, max_num_seqs=2, max_num_batched_tokens=70)
    seqs = [add(scheduler, [1] * 30, 4) for _ in range(4)]
    out = scheduler.schedule()
    assert [s for s, _ in out.scheduled] == seqs[:2]  # max_num_seqs
    scheduler2, _ = make(64, max_num_batched_tokens=64)
    a, b, c = (add(scheduler2, [1] * 30, 4) for _ in range(3))
    assert [s for s, _ in scheduler2.schedule().scheduled] == [a, b]  # 3 x 30 > 64 tokens


def test_the_victim_is_the_newest_and_the_oldest_keeps_running():
    scheduler, _ = make(6, block_size=4, max_model_len=24)
    old, mid, new = (add(scheduler, [1] * 8, 12) for _ in range(3))  # 2 blocks each
    assert len(scheduler.schedule().scheduled) == 3
    for seq in (old, mid, new):
        seq.append_token(1)
    out = scheduler.schedule()  # each needs a third block; none is free
    assert [g.seqs for g in out.preempted] == [[new]]
    assert [s for s, _ in out.scheduled] == [old, mid]
    assert [g.seqs for g in scheduler.waiting] == [[new]] and new.num_computed_tokens == 0  # recompute
    assert new.output_token_ids == [1]


def test_requests_that_can_never_fit_are_refused_at_once():
    with pytest.raises(ValueError):
        make(10, max_model_len=64)  # 16 blocks of 4 needed
    with pytest.raises(ValueError):
        make(10, mode="drop", max_model_len=8)
    with pytest.raises(ValueError):
        make(10, mode="swap", max_model_len=8)  # no CPU pool
    with pytest.raises(ValueError):
        make(10, max_model_len=16, max_num_batched_tokens=8)
    scheduler, _ = make(20)
    with pytest.raises(ValueError):
        add(scheduler, [1] * 60, 5)  # 65 tokens > max_model_len=64
    with pytest.raises(ValueError):
        add(scheduler, [], 5)
    assert not scheduler.has_unfinished()
    seq = add(scheduler, [1] * 59, 5)  # the largest request that fits is served
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
        assert victim is max(scheduler.running, key=lambda g: g.arrival)
        original(victim, out)

    scheduler._preempt = preempt_newest
    outputs, model = serve(scheduler, cache, requests)
    assert outputs == unlimited
    assert model.first_admissions == sorted(model.first_admissions)
    assert scheduler.block_manager.num_free_blocks == num_blocks
    if scheduler.block_manager.cpu_allocator:
        assert scheduler.block_manager.cpu_allocator.num_free_blocks == 8


def fork_group(scheduler, prompt, width, max_tokens=8):
    """A request of ``width`` sequences sharing its prompt's blocks, prefilled and forked."""
    parent = add(scheduler, prompt, max_tokens, width=width)
    assert scheduler.schedule().scheduled == [(parent, len(prompt))]
    return fork_running(scheduler, parent, width)


def fork_running(scheduler, parent, width):
    """Give the running ``parent`` a generated token and fork it into ``width`` sequences of its group."""
    group = group_of(scheduler, parent)
    assert group.seqs == [parent] and parent.status is SequenceStatus.RUNNING
    parent.append_token(1)
    for _ in range(width - 1):
        child = Sequence(list(parent.prompt_token_ids), list(parent.output_token_ids),
                         status=SequenceStatus.RUNNING, num_computed_tokens=parent.num_computed_tokens)
        scheduler.block_manager.fork(parent.seq_id, child.seq_id)
        group.seqs.append(child)
    return group


def preempt(scheduler, group):
    """Force a running group out, as the scheduler does when memory runs out."""
    out = SchedulerOutputs()
    scheduler._preempt(group, out)
    return out


def test_a_group_moves_whole_its_shared_blocks_once_and_stays_shared():
    scheduler, _ = make(16, "swap", num_cpu_blocks=16, max_model_len=32)
    manager = scheduler.block_manager
    group = fork_group(scheduler, [1] * 9, width=3)  # blocks 0, 1 (full) and 2 (1 token) held by 3 sequences
    out = scheduler.schedule()  # every sequence decodes: two copy-on-writes of the shared last block
    assert len(out.scheduled) == 3 and len(out.blocks_to_copy) == 2
    for seq in group.seqs:
        seq.append_token(1)
    out = preempt(scheduler, group)
    assert scheduler.swapped == [group] and all(s.status is SequenceStatus.SWAPPED for s in group.seqs)
    assert len(out.blocks_to_swap_out) == 5  # 2 shared blocks + 3 last blocks, each moved once
    assert manager.num_free_blocks == 16 and manager.cpu_allocator.num_free_blocks == 11
    out = scheduler.schedule()
    assert out.scheduled_groups == [group] and len(out.blocks_to_swap_in) == 5
    tables = [manager.get_block_table(s.seq_id) for s in group.seqs]
    assert all(t[:2] == tables[0][:2] for t in tables)  # the prompt's full blocks are shared again
    assert all(manager.ref_count(b) == 3 for b in tables[0][:2])
    assert manager.cpu_allocator.num_free_blocks == 16


def test_max_num_seqs_counts_every_sequence_a_group_may_run():
    scheduler, _ = make(64, max_num_seqs=5)
    wide = add(scheduler, [1] * 4, 4, width=4)
    narrow = add(scheduler, [2] * 4, 4, width=2)
    out = scheduler.schedule()
    assert [s for s, _ in out.scheduled] == [wide]  # 4 + 2 > 5 even before the forks
    with pytest.raises(ValueError):
        add(scheduler, [3] * 4, 4, width=6)  # can never run
    assert narrow.status is SequenceStatus.WAITING


@pytest.mark.parametrize("where", ["waiting", "running", "swapped"])
def test_abort_frees_a_request_wherever_it_is(where):
    scheduler, _ = make(12, "swap", num_cpu_blocks=12, max_model_len=32)
    manager = scheduler.block_manager
    if where == "waiting":
        add(scheduler, [1] * 8, 4, request_id="r")
    else:
        group = fork_group(scheduler, [1] * 8, width=2)
        group.request_id = "r"
        if where == "swapped":
            preempt(scheduler, group)
    assert scheduler.abort("r") and not scheduler.abort("r")
    assert not scheduler.has_unfinished()
    assert manager.num_free_blocks == 12 and manager.cpu_allocator.num_free_blocks == 12
    seq = add(scheduler, [1] * 8, 4)
    assert scheduler.schedule().scheduled == [(seq, 8)]  # and the scheduler goes on


def test_a_recomputed_group_larger_than_the_token_budget_runs_alone():
    scheduler, _ = make(64, max_model_len=16, max_num_batched_tokens=16)
    group = fork_group(scheduler, [1] * 10, width=4, max_tokens=6)  # 4 sequences of 11 tokens
    preempt(scheduler, group)  # recompute: 44 tokens to prefill again, more than the budget of 16
    other = add(scheduler, [2] * 4, 2)
    out = scheduler.schedule()
    assert out.scheduled_groups == [group] and sum(n for _, n in out.scheduled) == 44
    assert other.status is SequenceStatus.WAITING  # nothing joins a batch already over budget


# One test per rule of the scheduler, each with a fixture in which breaking the rule changes the batch.


def admitted_then_decoding(scheduler, prompts, widths=None):
    """Admit requests of these prompt lengths in one step, then give each a generated token."""
    seqs = [add(scheduler, [i + 1] * n, 4, width=(widths or {}).get(i, 1)) for i, n in enumerate(prompts)]
    assert [s for s, _ in scheduler.schedule().scheduled] == seqs
    for seq in seqs:
        seq.append_token(1)
    return seqs


def group_of(scheduler, seq):
    return next(g for q in (scheduler.waiting, scheduler.running, scheduler.swapped) for g in q if seq in g.seqs)


def test_rule_victims_are_requeued_in_arrival_order():
    scheduler, _ = make(4, max_model_len=16)
    a, v = admitted_then_decoding(scheduler, [8, 7])  # 2 blocks each: the cache is full
    w = add(scheduler, [9] * 4, 4)  # arrives after v, waits for memory
    out = scheduler.schedule()  # a needs a third block: v, the newest running, is recomputed
    assert [g.seqs for g in out.preempted] == [[v]]
    assert [g.seqs for g in scheduler.waiting] == [[v], [w]]  # v arrived first, so it goes first


def step_that_preempts(mode):
    """a (2 blocks), g (1) and v (3) fill 6 blocks; g is pushed out; then a takes the only free block
    and v, needing one too, preempts itself, freeing 3 blocks — enough for g to come back."""
    scheduler, _ = make(6, mode, num_cpu_blocks=8 if mode == "swap" else 0, max_model_len=24)
    a, g, v = admitted_then_decoding(scheduler, [8, 4, 12])
    preempt(scheduler, group_of(scheduler, g))
    out = scheduler.schedule()
    assert [grp.seqs for grp in out.preempted] == [[v]] and out.scheduled == [(a, 1)]
    return scheduler, g


def test_rule_nothing_is_admitted_in_a_step_that_preempted():
    scheduler, g = step_that_preempts("recompute")
    assert g.status is SequenceStatus.WAITING  # it would fit now, but not in this step


def test_rule_nothing_is_swapped_in_in_a_step_that_preempted():
    scheduler, g = step_that_preempts("swap")
    assert g.status is SequenceStatus.SWAPPED


def test_rule_nothing_is_admitted_while_anything_waits_in_swap():
    scheduler, _ = make(5, "swap", num_cpu_blocks=8, max_model_len=20)
    a, s = admitted_then_decoding(scheduler, [4, 12])  # 1 + 3 blocks
    preempt(scheduler, group_of(scheduler, s))  # s waits in swap; it needs 3 blocks + 1 to grow
    small = add(scheduler, [7] * 4, 4)  # 1 block: it would fit
    out = scheduler.schedule()  # a grows into a new block: 3 free, too few for s
    assert out.scheduled == [(a, 1)] and s.status is SequenceStatus.SWAPPED
    assert small.status is SequenceStatus.WAITING  # it does not jump ahead of s


def test_rule_admission_keeps_the_watermark_free():
    scheduler, _ = make(20, max_model_len=80, watermark=0.1)  # a watermark of 2 blocks
    assert scheduler.watermark_blocks == 2
    (a,) = admitted_then_decoding(scheduler, [3])  # 1 block; 19 free
    big = add(scheduler, [5] * 72, 4)  # 18 blocks: they are free, but 18 + 2 > 19
    assert scheduler.schedule().scheduled == [(a, 1)] and big.status is SequenceStatus.WAITING
    scheduler.finish(a)
    assert scheduler.schedule().scheduled == [(big, 72)]  # nothing runs: the watermark would only block it


def test_rule_decodes_count_against_the_token_budget():
    scheduler, _ = make(64, max_model_len=40, max_num_batched_tokens=40)
    a, b = admitted_then_decoding(scheduler, [3, 3])
    late = add(scheduler, [5] * 39, 1)  # 39 tokens: 40 - 2 decodes leaves 38
    assert [s for s, _ in scheduler.schedule().scheduled] == [a, b] and late.status is SequenceStatus.WAITING


def test_rule_swap_in_respects_max_num_seqs():
    scheduler, _ = make(16, "swap", num_cpu_blocks=16, max_model_len=16, max_num_seqs=3)
    a, b, c = admitted_then_decoding(scheduler, [4, 4, 4])
    preempt(scheduler, group_of(scheduler, c))
    scheduler.max_num_seqs = 2  # as if the limit were lower now: a and b already use it
    out = scheduler.schedule()
    assert [s for s, _ in out.scheduled] == [a, b] and c.status is SequenceStatus.SWAPPED


def test_rule_swap_in_is_first_come_first_served():
    scheduler, _ = make(8, "swap", num_cpu_blocks=16, max_model_len=32)
    a, s1, s2 = admitted_then_decoding(scheduler, [4, 24, 4])  # 1 + 6 + 1 blocks
    preempt(scheduler, group_of(scheduler, s2))
    preempt(scheduler, group_of(scheduler, s1))
    assert [g.seqs for g in scheduler.swapped] == [[s1], [s2]]  # in arrival order
    out = scheduler.schedule()  # s1 needs 7 blocks, 6 are free: it waits, and s2 waits behind it
    assert out.scheduled == [(a, 1)] and s2.status is SequenceStatus.SWAPPED


def test_rule_a_full_cpu_pool_falls_back_to_recompute():
    scheduler, _ = make(6, "swap", num_cpu_blocks=2, max_model_len=24)
    a, v = admitted_then_decoding(scheduler, [8, 12])  # 2 + 3 blocks; v's 3 do not fit 2 CPU blocks
    out = scheduler.schedule()  # a fits its new block; v needs one, none is free: v is preempted
    assert [g.seqs for g in out.preempted] == [[v]] and not out.blocks_to_swap_out
    assert v.status is SequenceStatus.WAITING and v.num_computed_tokens == 0


def test_shared_blocks_need_cpu_room_once():
    manager = SwapBlockSpaceManager(RefCountedBlockAllocator(8), 4, RefCountedBlockAllocator(2))
    manager.allocate("a", range(8))  # 2 full blocks
    manager.fork("a", "b")
    manager.fork("a", "c")
    assert manager.can_swap_out(["a", "b", "c"])  # 2 distinct blocks, 2 CPU blocks
    assert len(manager.swap_out(["a", "b", "c"])) == 2


def with_free(manager, num_free):
    """Hold blocks so that exactly ``num_free`` GPU blocks are free; return the holder's id to free."""
    holder = object()
    manager.allocate(holder, range((manager.num_free_blocks - num_free) * manager.block_size))
    assert manager.num_free_blocks == num_free
    return holder


def test_can_swap_in_counts_distinct_blocks_each_next_token_and_the_watermark():
    manager = SwapBlockSpaceManager(RefCountedBlockAllocator(8), 4, RefCountedBlockAllocator(8))
    manager.allocate("a", range(9))  # blocks of 4, 4 and 1 tokens
    manager.fork("a", "b")
    manager.fork("a", "c")
    manager.allocate("d", range(8))  # two full blocks
    manager.swap_out(["a", "b", "c"])
    manager.swap_out(["d"])
    # a, b, c: 3 distinct blocks, and a new block each, since their last block is shared
    for num_free, fits in ((4, False), (6, True)):
        holder = with_free(manager, num_free)
        assert manager.can_swap_in(["a", "b", "c"]) is fits
        assert manager.can_swap_in(["a", "b", "c"], watermark=1) is False
        manager.free(holder)
    # d: 2 blocks, and a new one since its last block is full
    for num_free, fits in ((2, False), (3, True)):
        holder = with_free(manager, num_free)
        assert manager.can_swap_in(["d"]) is fits
        assert manager.can_swap_in(["d"], watermark=num_free - 2) is False
        manager.free(holder)


@pytest.mark.parametrize("num_decodes", [5, 6])
def test_rule_swap_in_stays_within_the_token_budget(num_decodes):
    scheduler, _ = make(32, "swap", num_cpu_blocks=16, max_model_len=8, max_num_batched_tokens=8)
    parent = add(scheduler, [1, 1], 4, width=3)
    others = [add(scheduler, [2], 4) for _ in range(num_decodes)]
    assert len(scheduler.schedule().scheduled) == 1 + num_decodes  # 2 + 6 tokens at most: all admitted
    group = fork_running(scheduler, parent, 3)
    for seq in others:
        seq.append_token(1)
    preempt(scheduler, group)  # 3 sequences in swap, one token each to come back
    out = scheduler.schedule()  # the decodes leave 8 - num_decodes tokens of the budget
    swapped_in = num_decodes + 3 <= 8
    assert len(out.scheduled) == num_decodes + 3 * swapped_in
    assert all(s.status is (SequenceStatus.RUNNING if swapped_in else SequenceStatus.SWAPPED) for s in group.seqs)


def test_rule_swap_in_keeps_the_watermark_free():
    scheduler, _ = make(20, "swap", num_cpu_blocks=8, max_model_len=64, watermark=0.1)  # a watermark of 2
    a, f, s = admitted_then_decoding(scheduler, [2, 55, 12])  # 1 + 14 + 3 blocks
    preempt(scheduler, group_of(scheduler, s))  # s needs 3 blocks + 1 for its next token; 5 are free
    out = scheduler.schedule()  # a and f decode in blocks they hold: 5 free, but 4 + 2 > 5
    assert [q for q, _ in out.scheduled] == [a, f] and s.status is SequenceStatus.SWAPPED


def swapped_alone(scheduler, prompt, width):
    """A group of ``width`` sequences, swapped out, with nothing running."""
    parent = add(scheduler, prompt, 4, width=width)
    assert scheduler.schedule().scheduled == [(parent, len(prompt))]
    group = fork_running(scheduler, parent, width)
    preempt(scheduler, group)
    assert not scheduler.running and scheduler.swapped == [group]
    return group


@pytest.mark.parametrize("prompt_len", [5, 6])
def test_rule_swap_ins_count_against_the_admission_budget(prompt_len):
    scheduler, _ = make(32, "swap", num_cpu_blocks=16, max_model_len=8, max_num_batched_tokens=8)
    group = swapped_alone(scheduler, [1, 1], width=3)
    late = add(scheduler, [2] * prompt_len, 2)
    out = scheduler.schedule()  # 3 swap-ins leave 5 tokens of the budget
    assert out.scheduled_groups[0] is group
    assert (late.status is SequenceStatus.RUNNING) is (prompt_len <= 5)


def test_rule_swap_ins_count_against_max_num_seqs():
    scheduler, _ = make(32, "swap", num_cpu_blocks=16, max_model_len=8, max_num_seqs=4)
    group = swapped_alone(scheduler, [1, 1], width=3)
    late = add(scheduler, [2] * 3, 2, width=2)  # 3 + 2 > 4 sequences
    assert scheduler.schedule().scheduled_groups == [group] and late.status is SequenceStatus.WAITING


def test_rule_the_watermark_applies_once_a_swap_in_runs():
    scheduler, _ = make(10, "swap", num_cpu_blocks=8, max_model_len=24, watermark=0.2)  # a watermark of 2
    group = swapped_alone(scheduler, [1] * 12, width=1)  # 3 blocks + 1 to grow: in without a watermark
    late = add(scheduler, [2] * 20, 4)  # 5 blocks: 6 are free after the swap-in, but 5 + 2 > 6
    assert scheduler.schedule().scheduled_groups == [group] and late.status is SequenceStatus.WAITING


def test_rule_the_watermark_applies_once_an_admission_runs():
    scheduler, _ = make(10, max_model_len=28, watermark=0.2)  # a watermark of 2
    first = add(scheduler, [1] * 12, 4)  # 3 blocks, nothing runs: no watermark
    second = add(scheduler, [2] * 24, 4)  # 6 blocks: 7 are free, but 6 + 2 > 7
    assert scheduler.schedule().scheduled == [(first, 12)] and second.status is SequenceStatus.WAITING


def test_counters_count_the_blocks_swapped_out_and_in():
    scheduler, _ = make(16, "swap", num_cpu_blocks=16, max_model_len=32)
    group = fork_group(scheduler, [1] * 9, width=3)  # 3 blocks, all shared
    preempt(scheduler, group)
    stats = scheduler.make_stats()
    assert (stats.num_swapped_out_blocks, stats.num_swapped_in_blocks) == (3, 0)  # each block once
    scheduler.schedule()
    assert (scheduler.make_stats().num_swapped_out_blocks, scheduler.make_stats().num_swapped_in_blocks) == (3, 3)


class FourCachedTokens(SwapBlockSpaceManager):
    """A manager that reports the first 4 tokens of every new sequence as already in the cache."""

    def allocate(self, seq_id, token_ids):
        super().allocate(seq_id, token_ids)
        return min(4, len(token_ids) - 1)


def test_rule_admission_schedules_and_spends_only_the_tokens_not_in_the_cache():
    manager = FourCachedTokens(RefCountedBlockAllocator(32), 4)
    scheduler = Scheduler(manager, max_model_len=16, max_num_batched_tokens=16)
    a = add(scheduler, [1] * 12, 4)
    b = add(scheduler, [2] * 8, 4)  # 8 tokens: they fit the 16 - 8 left after a's uncached ones
    out = scheduler.schedule()
    assert dict(out.scheduled) == {a: 8, b: 4}
    assert a.num_computed_tokens == b.num_computed_tokens == 4


def test_rule_an_empty_batch_keeps_no_watermark():
    scheduler, _ = make(10, "swap", num_cpu_blocks=10, max_model_len=40, watermark=0.2)  # a watermark of 2
    big = add(scheduler, [1] * 36, 4)  # 9 blocks of 10: 9 + 2 > 10, but nothing runs to free any
    assert scheduler.schedule().scheduled == [(big, 36)]
    scheduler.finish(big)
    group = swapped_alone(scheduler, [2] * 32, width=1)  # 8 blocks + 1 to grow: 9 + 2 > 10
    assert scheduler.schedule().scheduled_groups == [group]  # swapped in alone, with no watermark


def test_rule_a_recomputed_sequence_counts_its_generated_tokens_against_the_budget():
    scheduler, _ = make(64, max_model_len=16, max_num_batched_tokens=16)
    a, b, v = admitted_then_decoding(scheduler, [1, 1, 12])
    for _ in range(2):
        for seq, _ in scheduler.schedule().scheduled:
            seq.append_token(1)
    assert (len(v.prompt_token_ids), len(v)) == (12, 15)
    preempt(scheduler, group_of(scheduler, v))  # recompute: 15 tokens to prefill again
    out = scheduler.schedule()  # 2 decodes leave 14 tokens of the budget: 12 would fit, 15 do not
    assert out.scheduled == [(a, 1), (b, 1)] and v.status is SequenceStatus.WAITING
    scheduler.finish(a)
    scheduler.finish(b)
    assert scheduler.schedule().scheduled == [(v, 15)]
