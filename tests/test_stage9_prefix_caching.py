"""Stage 9: automatic prefix caching, checked against the same engine without caching."""

import random
from functools import partial

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minipaged import LLM as _LLM
from minipaged.stage1_block_allocator import OutOfBlocksError
from minipaged.stage3_copy_on_write import CowPagedKVCache
from minipaged.stage7_engine import SamplingParams
from minipaged.stage8_sharing import BeamSearchParams
from minipaged.stage9_prefix_caching import (
    ROOT,
    PrefixCachingAllocator,
    PrefixCachingBlockSpaceManager,
    block_hash,
)

LLM, UncachedLLM = partial(_LLM, stage=9), partial(_LLM, stage=8)  # the engines as of stages 9 and 8

pytestmark = pytest.mark.stage9

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def tokens(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1, 2000) for _ in range(n)]


def run(llm, batches):
    """Serve several generate calls in turn (later calls can hit what earlier ones cached)."""
    return [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY,
                                                          use_tqdm=False)] for batch in batches]


SYSTEM = tokens(0, 70)
FEW_SHOT = [tokens(1, 45), tokens(2, 90)]
WORKLOADS = {
    "system-prompt": [[SYSTEM + tokens(10, 5)], [SYSTEM + tokens(i, 3 + i) for i in range(11, 17)]],
    "few-shot": [[FEW_SHOT[i % 2] + tokens(20 + i, 8) for i in range(4)],
                 [FEW_SHOT[i % 2] + tokens(30 + i, 6) for i in range(6)]],
    "no-sharing": [[tokens(40 + i, 20 + 7 * i) for i in range(5)], [tokens(50 + i, 33) for i in range(5)]],
}


# The allocator on its own first: quick, and a learner's first feedback.
def test_the_allocator_keeps_a_freed_named_block_until_it_is_found_again():
    allocator = PrefixCachingAllocator(3)
    named, plain = allocator.allocate(2)
    allocator.cache(named, block_hash(ROOT, [1, 2]))
    allocator.free(plain)
    allocator.free(named)
    assert allocator.num_free_blocks == 3 and list(allocator.evictor) == [named]  # free, K/V kept
    with pytest.raises(ValueError):
        allocator.free(named)  # a double free, even of a block in the evictor
    assert allocator.num_free_blocks == 3


def test_a_lookup_shares_a_block_in_use_and_revives_one_in_the_evictor():
    allocator = PrefixCachingAllocator(2)
    (block,) = allocator.allocate(1)
    name = block_hash(ROOT, [1, 2])
    allocator.cache(block, name)
    assert allocator.lookup(name) == block and allocator.ref_count(block) == 2  # shared
    allocator.free(block)
    allocator.free(block)
    assert allocator.lookup(name) == block and allocator.ref_count(block) == 1  # revived
    assert list(allocator.evictor) == [] and allocator.num_free_blocks == 1
    assert allocator.lookup(block_hash(ROOT, [2, 1])) is None
    assert (allocator.make_stats().queries, allocator.make_stats().hits) == (3, 2)


def test_the_allocator_evicts_only_when_the_free_blocks_run_out_and_then_forgets_the_name():
    allocator = PrefixCachingAllocator(3)
    blocks = allocator.allocate(2)
    names = [block_hash(ROOT, [b]) for b in blocks]
    for block, name in zip(blocks, names):
        allocator.cache(block, name)
    allocator.free(blocks[1])
    allocator.free(blocks[0])  # the evictor holds blocks[1], then blocks[0]: oldest first
    (fresh,) = allocator.allocate(1)
    assert fresh not in blocks and allocator.make_stats().evictions == 0  # a never-named block first
    assert allocator.allocate(1) == [blocks[1]] and allocator.make_stats().evictions == 1  # the least recent
    assert allocator.lookup(names[1]) is None and allocator.lookup(names[0]) == blocks[0]
    with pytest.raises(OutOfBlocksError):
        allocator.allocate(1)
    assert allocator.ref_count(blocks[1]) == 1  # the evicted block is its new owner's


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_outputs_with_caching_equal_outputs_without(workload):
    batches = WORKLOADS[workload]
    plain = UncachedLLM("tiny", num_gpu_blocks=256)
    cached = LLM("tiny", num_gpu_blocks=256, enable_prefix_caching=True)
    assert run(cached, batches) == run(plain, batches)
    stats, base = cached.stats, plain.stats
    if workload == "no-sharing":
        assert stats.prefix_cache_hits == 0 and stats.prefill_tokens == base.prefill_tokens
    else:
        assert stats.prefix_cache_hits > 0 and stats.prefill_tokens < base.prefill_tokens


def test_same_outputs_under_memory_pressure_with_evictions_and_preemptions():
    batches = [[SYSTEM + tokens(60 + i, 10) for i in range(6)], [SYSTEM + tokens(70 + i, 12) for i in range(6)],
               [tokens(80 + i, 60) for i in range(4)], [SYSTEM + tokens(90, 4)]]
    plain = UncachedLLM("tiny", num_gpu_blocks=400)
    cached = LLM("tiny", num_gpu_blocks=14, max_model_len=128, enable_prefix_caching=True)
    assert run(cached, batches) == run(plain, batches)
    assert cached.stats.num_preemptions > 0 and cached.stats.prefix_cache_hits > 0
    assert cached.scheduler.block_manager.num_free_blocks == 14 and cached.stats.prefix_cache.evictions > 0


def test_the_prefill_of_a_cached_prefix_is_skipped():
    llm = LLM("tiny", num_gpu_blocks=64, enable_prefix_caching=True)
    run(llm, [[SYSTEM + [5, 6, 7]]])
    before = llm.stats.prefill_tokens
    run(llm, [[SYSTEM + [8, 9]]])  # 70 shared tokens: 4 full blocks of 16 are cached
    assert llm.stats.prefill_tokens - before == 72 - 64
    assert llm.stats.prefix_cache_hits == 4


def test_a_request_asking_for_prompt_logprobs_reads_no_cached_block_and_gets_every_position():
    """vLLM V1's rule: a cached position has K/V but no logits, so such a request computes its prompt
    whole; its values equal those of the first request, which found nothing cached."""
    llm = LLM("tiny", num_gpu_blocks=64, enable_prefix_caching=True)
    prompt = {"prompt_token_ids": SYSTEM + [5, 6, 7]}
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)  # a second token: blocks cached
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    hits, before = llm.stats.prefix_cache_hits, llm.stats.prefill_tokens
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert llm.stats.prefix_cache_hits == hits and llm.stats.prefill_tokens - before == len(SYSTEM) + 3
    assert again.prompt_logprobs == first.prompt_logprobs  # the same computation: bitwise the same
    plain = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)[0]  # its blocks were cached
    assert plain.prompt_logprobs is None and llm.stats.prefix_cache_hits > hits


def test_the_hash_names_the_whole_prefix():
    first = block_hash(ROOT, [1, 2, 3])
    assert len(first) == 32 and first == block_hash(ROOT, (1, 2, 3))
    assert block_hash(first, [4, 5, 6]) != block_hash(block_hash(ROOT, [9, 9, 9]), [4, 5, 6])  # other parent
    assert block_hash(ROOT, [1, 2, 3]) != block_hash(ROOT, [3, 2, 1]) != block_hash(ROOT, [1, 2, 3, 0])


def test_a_reused_block_never_hands_back_another_prefixs_kv():
    """A block evicted and refilled with other tokens: a prompt whose second block matches the old
    prefix's second block, but not its first, must get no hit at all."""
    manager = PrefixCachingBlockSpaceManager(PrefixCachingAllocator(3), 2)
    manager.allocate("a", [1, 1, 2, 2, 9])  # blocks 0, 1 full; block 2 holds token 9
    manager.append_slot("a")  # its prompt is computed: blocks 0 and 1 become findable
    manager.free("a")
    manager.allocate("b", [5, 5, 6])  # two blocks: block 2, then the least recently used cached one
    manager.append_slot("b")
    manager.free("b")
    assert manager.allocate("c", [5, 5, 2, 2, 7]) == 2  # [5, 5] is cached again; [2, 2] after it is not
    assert manager.get_block_table("c") == [2, 1, 0]  # block 0, once [1, 1], was evicted and reused
    manager.free("c")
    assert manager.allocate("d", [1, 1, 2, 2, 8]) == 0  # [1, 1] is gone, so [2, 2] after it is never reached


def test_appending_several_slots_at_once_makes_the_prompts_blocks_findable_too():
    manager = PrefixCachingBlockSpaceManager(PrefixCachingAllocator(6), 2)
    manager.allocate("a", [1, 1, 2, 2, 9])
    manager.append_slots("a", 3)  # its prompt is computed: blocks 0 and 1 become findable
    manager.free("a")
    assert manager.allocate("b", [1, 1, 2, 2, 7]) == 4


def test_a_block_becomes_findable_only_once_its_tokens_are_all_computed():
    """V1 makes a block findable as soon as a step is scheduled to fill it: a half-computed block is not."""
    manager = PrefixCachingBlockSpaceManager(PrefixCachingAllocator(8), 2)
    manager.allocate("a", [1, 1, 2, 2, 9])
    manager.cache_computed_blocks("a", 3)  # block 0 is full; block 1 holds one computed token of two
    assert manager.allocate("b", [1, 1, 2, 2, 7]) == 2
    manager.cache_computed_blocks("a", 4)
    assert manager.allocate("c", [1, 1, 2, 2, 7]) == 4
    manager.cache_computed_blocks("a", 5)  # the last, partial block is never named
    assert manager.allocate("d", [1, 1, 2, 2, 9, 3]) == 4


def test_eviction_is_least_recently_used_and_last_blocks_first():
    manager = PrefixCachingBlockSpaceManager(PrefixCachingAllocator(5), 2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    assert manager.allocate("a", prompt) == 0
    manager.append_slot("a")  # blocks 0, 1, 2 are full and computed: findable; block 3 holds tokens 7, 8
    manager.free("a")
    assert list(manager.allocator.evictor) == [2, 1, 0] and manager.num_free_blocks == 5
    taken = manager.allocator.allocate(3)  # the free blocks 3 and 4, then the oldest cached: 2
    assert taken == [3, 4, 2] and manager.allocator.make_stats().evictions == 1
    for block_id in taken:
        manager.allocator.free(block_id)
    assert manager.allocate("b", [1, 2, 3, 4, 9]) == 4  # blocks 0 and 1 still hit
    assert manager.get_block_table("b")[:2] == [0, 1]
    with pytest.raises(OutOfBlocksError):
        manager.allocate("c", [1, 2, 3, 4, 5, 6, 8, 8, 8])  # 2 hits, needs 3 more blocks, 2 free
    assert manager.allocator.ref_count(0) == 1  # the refused call gave its hits back


def test_beam_search_and_parallel_samples_hit_the_cache_too():
    llm = LLM("tiny", num_gpu_blocks=128, enable_prefix_caching=True)
    run(llm, [[SYSTEM + [5, 6, 7]]])
    hits = llm.stats.prefix_cache_hits
    beams = llm.beam_search([{"prompt_token_ids": SYSTEM + [8, 9]}], BeamSearchParams(3, 6, ignore_eos=True))
    assert llm.stats.prefix_cache_hits == hits + 4  # 70 shared tokens: 4 full blocks of 16
    plain = UncachedLLM("tiny", num_gpu_blocks=128)
    expected = plain.beam_search([{"prompt_token_ids": SYSTEM + [8, 9]}], BeamSearchParams(3, 6, ignore_eos=True))
    assert [s.token_ids for s in beams[0].sequences] == [s.token_ids for s in expected[0].sequences]
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    sampled = llm.generate([{"prompt_token_ids": SYSTEM + [4]}], params, use_tqdm=False)[0]
    assert llm.stats.prefix_cache_hits == hits + 8
    again = plain.generate([{"prompt_token_ids": SYSTEM + [4]}], params, use_tqdm=False)[0]
    assert [c.token_ids for c in sampled.outputs] == [c.token_ids for c in again.outputs]
    assert llm.scheduler.block_manager.num_free_blocks == 128


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admissions from a few shared prefixes, appends and frees; K/V checked against a shadow."""

    def __init__(self):
        super().__init__()
        self.manager = PrefixCachingBlockSpaceManager(PrefixCachingAllocator(12), 2)
        self.cache = CowPagedKVCache(1, 12, 2, 1, 1, dtype=torch.float64)
        self.seqs: dict[int, list[int]] = {}
        self.counter = 0

    def _write(self, seq_id, start):
        toks = self.seqs[seq_id]
        values = torch.tensor([t * 1000.0 + p for p, t in enumerate(toks)], dtype=torch.float64)[start:]
        n = len(toks) - start
        self.cache.write(0, self.manager.slot_mapping([seq_id], [n]), values.view(n, 1, 1), -values.view(n, 1, 1))

    @rule(prefix=st.sampled_from([(1, 2, 3, 4, 5), (1, 2, 3, 9), (7, 7, 7, 7, 7, 7)]),
          tail=st.lists(st.integers(1, 9), max_size=4))
    def admit(self, prefix, tail):
        self.counter += 1
        toks = list(prefix) + tail
        try:
            cached = self.manager.allocate(self.counter, toks)
        except OutOfBlocksError:
            return
        self.seqs[self.counter] = toks
        self._write(self.counter, cached)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(1, 9))
    def append(self, data, token):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        if not self.manager.can_append_slot(seq_id):
            return
        self.manager.append_slot(seq_id)
        self.cache.copy_blocks(self.manager.take_copies())
        self.seqs[seq_id].append(token)
        self._write(seq_id, len(self.seqs[seq_id]) - 1)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.manager.free(seq_id)
        del self.seqs[seq_id]

    @invariant()
    def books_are_consistent(self):
        allocator = self.manager.allocator
        held = [b for t in self.manager.block_tables.values() for b in t.block_ids]
        for block_id in range(12):
            assert allocator.ref_count(block_id) == held.count(block_id)
        assert all(allocator.hash_of[b] == h for h, b in allocator.cached.items())
        assert all(b in allocator.hash_of and allocator.ref_count(b) == 0 for b in allocator.evictor)
        assert self.manager.num_free_blocks + len(set(held)) == 12

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq_id, toks in self.seqs.items():
            k, _ = self.cache.gather(0, self.manager.get_block_table(seq_id), len(toks))
            assert k.flatten().tolist() == [t * 1000.0 + p for p, t in enumerate(toks)]

    def teardown(self):
        for seq_id in list(self.seqs):
            self.manager.free(seq_id)
        assert self.manager.num_free_blocks == 12


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)


def test_a_prompt_of_whole_blocks_still_computes_its_last_token():
    prompt = tokens(5, 64)  # exactly 4 blocks of 16
    llm = LLM("tiny", num_gpu_blocks=64, enable_prefix_caching=True)
    first = run(llm, [[prompt]])
    before = llm.stats.prefill_tokens
    assert run(llm, [[prompt]]) == first
    assert llm.stats.prefill_tokens - before == 16  # 3 blocks hit; the block of the last token is computed


def test_the_walk_stops_at_the_first_miss():
    """A block equal to a cached first block, but after other tokens, is another prefix: no hit."""
    block, other = tokens(6, 16), tokens(7, 16)
    plain = UncachedLLM("tiny", num_gpu_blocks=64)
    cached = LLM("tiny", num_gpu_blocks=64, enable_prefix_caching=True)
    batches = [[block + tokens(8, 5)], [other + block + tokens(9, 5)]]
    assert run(cached, batches) == run(plain, batches)
    assert cached.stats.prefix_cache_hits == 0


def test_a_blocks_name_never_runs_its_token_ids_together():
    from minipaged.stage9_prefix_caching import ROOT, block_hash

    assert block_hash(ROOT, [1, 23]) != block_hash(ROOT, [12, 3])
    assert block_hash(ROOT, [1, 2, 3]) != block_hash(ROOT, [12, 3, 0])
    parent = block_hash(ROOT, [5, 6])
    assert block_hash(parent, [7, 89]) != block_hash(parent, [78, 9])
