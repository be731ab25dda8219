"""Stage 15: a hybrid KV cache, checked against the engine that keeps every block (stage 10's manager,
``disable_hybrid_kv_cache_manager=True``) and against transformers, with the free count."""

import pytest
from helpers_checkpoints import (
    generated_token_ids,
    random_prompts,
    save_random_checkpoints,
    sliding_window_architectures,
    with_transformers_models,
)
from test_stage7_engine import assert_equal_to_hf
from test_stage10_v1_scheduler import one_thread  # noqa: F401 (one_thread: an autouse fixture)

from minipaged import LLM, SamplingParams
from minipaged.common.sequence import Sequence
from minipaged.stage1_block_allocator import BlockAllocator
from minipaged.stage2_block_table import PagedKVCache
from minipaged.stage10_kv_cache_manager import KVCacheManager
from minipaged.stage15_hybrid_kv_cache import HybridKVCacheCoordinator, HybridKVCacheManager
from minipaged.stage15_kv_cache_groups import (
    FullAttentionSpec,
    SlidingWindowManager,
    SlidingWindowSpec,
    block_hash_with_group_id,
    group_size,
    kv_cache_groups,
    share_layers,
)

pytestmark = pytest.mark.stage15

W, BS = 8, 4  # the models' window, the engines' block size
MODELS = sliding_window_architectures(W, num_layers=4, full_layers=2)  # two full layers, two sliding; all sliding
HYBRID = dict(block_size=BS)  # the default engine: V1, prefix caching on
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return with_transformers_models(save_random_checkpoints(tmp_path_factory, MODELS))


def prompts(seed=0, lengths=(3, 21, 37, 9, 50)):
    return random_prompts(seed, lengths)


def tokens(llm, batch, params=GREEDY):
    return generated_token_ids(llm, batch, params)


# --- the groups, and the tensors they share


@pytest.mark.parametrize("windows, groups", [
    ([None, None, 8, 8], [((0, 1), None), ((2, 3), 8)]),
    ([8, None] * 3, [((0, 2, 4), 8), ((1, 3, 5), None)]),
    ([8] * 5 + [None] + [8] * 5 + [None],  # Gemma 3's 5:1: groups of 2, the sliding layers in five
     [((0, 6), 8), ((1, 7), 8), ((2, 8), 8), ((3, 9), 8), ((4, 10), 8), ((5, 11), None)]),
    ([8, 8, 8, None, None], [((0, 2), 8), ((1,), 8), ((3, 4), None)]),  # 3 is not under 2 * 1.25: groups of 2
    ([8] * 6 + [None] * 5, [(tuple(range(6)), 8), (tuple(range(6, 11)), None)]),  # 6 < 5 * 1.25: groups of 6
    ([8] * 4, [((0, 1, 2, 3), 8)]),
], ids=["halves", "alternating", "gemma3-5-to-1", "short-group", "padded", "all-sliding"])
def test_layers_are_grouped_as_vllm_groups_them(windows, groups):
    """vLLM's rule: groups as large as the fewest layers of one spec (the most, when the most is under
    1.25 times the fewest); each spec's layers dealt round-robin into as many groups as that needs."""
    spec = {None: FullAttentionSpec(BS), 8: SlidingWindowSpec(BS, 8)}
    found = kv_cache_groups(windows, BS)
    assert [(g.layer_ids, g.spec) for g in found] == [(layers, spec[w]) for layers, w in groups]
    assert group_size(found) == max(len(layers) for layers, _ in groups)


def test_a_layer_of_each_group_shares_one_tensor_so_a_block_holds_group_size_layers():
    groups = kv_cache_groups([8] * 5 + [None] + [8] * 5 + [None], BS)
    cache = share_layers(PagedKVCache(group_size(groups), 10, BS, 2, 16), groups)
    assert cache.num_layers == 12 and len({t.data_ptr() for t in cache.key_cache}) == 2
    for group in groups:
        for j, layer in enumerate(group.layer_ids):
            assert cache.key_cache[layer].data_ptr() == cache.key_cache[groups[0].layer_ids[j]].data_ptr()
            assert cache.value_cache[layer].data_ptr() == cache.value_cache[groups[0].layer_ids[j]].data_ptr()
    assert cache.key_cache[0].data_ptr() != cache.value_cache[0].data_ptr()
    assert len({id(t) for t in cache.key_cache}) == 12  # a view per layer: each layer still told apart


# --- one group's blocks: the window gives back what it left


def sliding(window=W, num_blocks=32):
    allocator = BlockAllocator(num_blocks)
    null = allocator.allocate(1)[0]
    return SlidingWindowManager(SlidingWindowSpec(BS, window), allocator, null), allocator, null


@pytest.mark.parametrize("computed, window, skipped", [(0, 8, 0), (7, 8, 0), (8, 8, 1), (20, 8, 13), (5, 1, 5),
                                                       (100, 64, 37)])
def test_the_tokens_skipped_are_those_before_the_next_querys_window(computed, window, skipped):
    """The query at position ``computed`` sees ``computed - window + 1`` and after."""
    manager, _, _ = sliding(window)
    assert manager.get_num_skipped_tokens(computed) == skipped


def test_a_block_goes_back_once_every_token_of_it_is_skipped_and_the_null_block_takes_its_place():
    manager, allocator, null = sliding()
    blocks = manager.allocate_new_blocks("r", 30)  # 8 blocks of 4: tokens 0 .. 29
    free = allocator.num_free_blocks
    manager.remove_skipped_blocks("r", 10)  # skips 0 .. 2: no block wholly
    assert manager.req_to_blocks["r"] == blocks and allocator.num_free_blocks == free
    manager.remove_skipped_blocks("r", 13)  # skips 0 .. 5: block 0 alone, block 1 still read
    assert manager.req_to_blocks["r"] == [null] + blocks[1:] and allocator.num_free_blocks == free + 1
    assert allocator.is_free(blocks[0])
    manager.remove_skipped_blocks("r", 13)  # again: nothing more
    assert allocator.num_free_blocks == free + 1
    manager.remove_skipped_blocks("r", 27)  # skips 0 .. 19: blocks 0 .. 4
    assert manager.req_to_blocks["r"] == [null] * 5 + blocks[5:] and allocator.num_free_blocks == free + 5
    manager.free("r")  # the null block is never given back
    assert allocator.num_free_blocks == allocator.num_total_blocks - 1 and not allocator.is_free(null)


# --- the coordinator: every group, all or nothing


def test_a_request_gets_its_blocks_only_when_every_group_finds_them_and_the_windows_give_back_first():
    groups = kv_cache_groups([None, None, W, W], BS)
    coordinator = HybridKVCacheCoordinator(groups, 1 + 11)  # the null block, and 11
    full, window = coordinator.managers
    new = coordinator.allocate_slots("a", 0, 20)  # 5 blocks in each group
    assert [len(b) for b in new] == [5, 5] and coordinator.allocator.num_free_blocks == 1
    assert coordinator.allocate_slots("b", 0, 4) is None  # 1 + 1 needed, 1 free: nothing taken
    assert coordinator.allocator.num_free_blocks == 1 and "b" not in full.req_to_blocks
    new = coordinator.allocate_slots("a", 20, 24)  # 1 + 1 needed: the window gives back 3 first (tokens 0 .. 12)
    assert [len(b) for b in new] == [1, 1] and coordinator.allocator.num_free_blocks == 2
    assert window.req_to_blocks["a"][:3] == [coordinator.null_block] * 3
    assert coordinator.null_block not in full.req_to_blocks["a"]
    coordinator.free("a")
    assert coordinator.allocator.num_free_blocks == 11


def test_the_kv_cache_manager_serves_stage_10s_scheduler_with_block_ids_per_group():
    """The same methods as stage 10's ``KVCacheManager``; a first step's blocks are at most
    ``max_num_batched_tokens`` tokens' worth, later chunks take theirs as they come."""
    groups = kv_cache_groups([None, W], BS)
    manager = HybridKVCacheManager(HybridKVCacheCoordinator(groups, 1 + 40), max_num_batched_tokens=8)
    seq = Sequence(list(range(30)), seq_id="s")
    assert manager.allocate_prompt(seq) == 0 and [len(b) for b in manager.block_ids(seq)] == [2, 2]
    seq.num_computed_tokens = 8
    assert [len(b) for b in manager.allocate_slots(seq, 8)] == [2, 2]  # tokens 8 .. 15; nothing skipped yet
    seq.num_computed_tokens = 16
    assert manager.can_allocate_slots(seq, 14)
    new = manager.allocate_slots(seq, 14)  # to 30 tokens; tokens 0 .. 8 skipped: 2 blocks back first
    assert [len(b) for b in new] == [4, 4] and manager.block_ids(seq)[1][:2] == [manager.coordinator.null_block] * 2
    assert manager.allocate_slots(seq, 0) == ()  # nothing new in any group
    assert manager.num_slots() == (30 + 30 - 8, (8 + 6) * BS)
    assert manager.blocks_needed(30) == 8 + 5  # full: every block; sliding: window - 1 + a step, and one more
    manager.free(seq)
    assert manager.num_free_blocks == manager.num_total_blocks == 40


# --- prefix caching: a sliding group's hit needs only the window's last blocks


def cached_coordinator(windows, num_blocks=64):
    """A coordinator with prefix caching, and a way to name block ``i`` of a request cached in a group."""
    coordinator = HybridKVCacheCoordinator(kv_cache_groups(windows, BS), num_blocks, enable_caching=True)
    hashes = [bytes([i]) * 32 for i in range(16)]  # stand-ins for stage 9's chained names

    def cache(group, indices):
        for i in indices:
            block = coordinator.allocator.allocate(1)[0]
            coordinator.allocator.cache(block, block_hash_with_group_id(hashes[i], group))
            coordinator.allocator.free(block)  # nobody holds it: it waits in the evictor, findable
    return coordinator, hashes, cache


def test_a_full_attention_group_hits_the_cached_blocks_up_to_the_first_miss():
    coordinator, hashes, cache = cached_coordinator([None])
    cache(0, [0, 1, 2, 4, 5])
    assert len(coordinator.managers[0].find_longest_cache_hit(hashes, 6 * BS)) == 3
    assert len(coordinator.managers[0].find_longest_cache_hit(hashes, 2 * BS + 3)) == 2  # whole blocks within
    cache(1, [3])  # another group's block of the same tokens: not this group's
    assert len(coordinator.managers[0].find_longest_cache_hit(hashes, 6 * BS)) == 3


@pytest.mark.parametrize("window, cached, max_blocks, hit", [
    (W, [0, 1, 2, 3, 4, 5], 6, 6),
    (5, [1, 3], 4, 4),  # window 5: one block behind token 16 (tokens 12 .. 15)
    (W, [4, 5], 6, 6),  # the first blocks evicted: the window behind token 24 is tokens 17 .. 23, blocks 4 and 5
    (W, [3, 5], 6, 0),  # never two in a row, and block 0 missing: nothing
    (W, [0, 3, 5], 6, 1),  # no two in a row: the run from block 0
    (W, [1, 2, 4], 6, 3),  # walking back: 4, a miss at 3, then 2 and 1
    (W, [1, 2, 4, 5], 4, 3),  # within 4 blocks: 5 and 4 are past the end
], ids=["all", "window-5", "early-evicted", "none", "run-from-0", "walk-back", "within"])
def test_a_sliding_group_hits_where_the_window_behind_the_hit_is_cached(window, cached, max_blocks, hit):
    """Window 8, blocks of 4: a hit of ``L`` tokens needs the blocks of tokens ``L - 7 .. L - 1``: two
    blocks; those before are the null block (window 5: one block)."""
    coordinator, hashes, cache = cached_coordinator([window])
    cache(0, cached)
    blocks = coordinator.managers[0].find_longest_cache_hit(hashes, max_blocks * BS)
    assert len(blocks) == hit
    behind = -(-(window - 1) // BS)
    real = set(range(hit - behind, hit)) if hit >= behind else set(range(hit))
    assert [b != coordinator.null_block for b in blocks] == [i in real for i in range(hit)]


def test_the_groups_agree_on_one_hit_asking_again_within_the_shortest():
    """A hit every group can skip. A sliding group's hit within a shorter length is not its longer hit
    cut short: two windows (8: two blocks; 4: one block) need three rounds here."""
    coordinator, hashes, cache = cached_coordinator([W, 4])
    cache(0, [0, 1, 2, 3, 5])  # window 8: blocks 2, 3 (hit 4), 1, 2 (hit 3)
    cache(1, [2, 5])  # window 4: block 5 (hit 6), block 2 (hit 3), never block 3 (hit 4)
    hits, length = coordinator.find_longest_cache_hit(hashes, 6 * BS)
    assert length == 3 * BS and [len(h) for h in hits] == [3, 3]
    assert hits[1][:2] == [coordinator.null_block] * 2 and hits[1][2] != coordinator.null_block
    coordinator, hashes, cache = cached_coordinator([None, W])
    cache(0, [0, 1, 2, 3])
    cache(1, [0, 1, 2, 3, 4, 5])
    assert coordinator.find_longest_cache_hit(hashes, 6 * BS)[1] == 4 * BS  # the full group's, the shorter


def test_a_new_request_takes_the_cached_blocks_found_and_gives_them_back_if_refused():
    groups = kv_cache_groups([None, W], BS)
    manager = HybridKVCacheManager(HybridKVCacheCoordinator(groups, 1 + 14, enable_caching=True), 32)
    first = Sequence(list(range(24)), seq_id="a")
    assert manager.allocate_prompt(first) == 0
    manager.cache_blocks(first, 24)  # its 6 full blocks named, in both groups
    held = manager.block_ids(first)
    manager.free(first)  # every block waits in the evictor, still findable
    assert manager.num_free_blocks == 14
    second = Sequence(list(range(24)) + [99] * 5, seq_id="b")
    assert manager.allocate_prompt(second) == 24  # 6 blocks of each group found
    full, window = manager.block_ids(second)
    null = manager.coordinator.null_block
    assert full[:6] == held[0] and window[:6] == [null] * 4 + held[1][4:]  # the window behind token 24
    assert manager.num_free_blocks == 14 - 8 - 2 * 2  # 6 + 2 found, 2 + 2 new for tokens 24 .. 28
    stats = manager.allocator.make_stats()
    assert stats.hits >= 8
    third = Sequence(list(range(24)) + [7] * 30, seq_id="c")  # the same 8 found, then 16 new: 2 are free
    assert manager.allocate_prompt(third) is None
    assert manager.num_free_blocks == 2 and "c" not in manager.coordinator.managers[0].req_to_blocks
    manager.reset_prefix_cache()  # nothing found any more
    manager.free(second)
    assert manager.allocate_prompt(Sequence(list(range(24)) + [1], seq_id="d")) == 0


def test_a_shared_block_the_window_leaves_does_not_count_as_given_back():
    """``can_allocate_slots`` counts a skipped block freed only when no other request holds it."""
    groups = kv_cache_groups([W], BS)
    manager = HybridKVCacheManager(HybridKVCacheCoordinator(groups, 1 + 8, enable_caching=True), 32)
    a, b = Sequence(list(range(17)), seq_id="a"), Sequence(list(range(16)) + [5], seq_id="b")
    manager.allocate_prompt(a)
    manager.cache_blocks(a, 17)
    assert manager.allocate_prompt(b) == 16  # blocks 2 and 3 (the window behind token 16) shared
    assert manager.num_free_blocks == 8 - 5 - 1
    a.num_computed_tokens = 17
    assert manager.allocate_slots(a, 8) is not None  # to 25 tokens: blocks 0 and 1 back, 2 new
    assert manager.num_free_blocks == 2
    a.num_computed_tokens = 25  # the window behind token 25 starts at 18: blocks 2 and 3 skipped, but b's too
    assert manager.can_allocate_slots(a, 7)  # to 32 tokens: 1 more
    assert not manager.can_allocate_slots(a, 15)  # to 40: 3 more, 2 free, none given back
    assert manager.allocate_slots(a, 15) is None


# --- the engine


@pytest.mark.parametrize("name", list(MODELS))
def test_the_hybrid_engine_equals_transformers_and_gives_back_what_the_windows_left(checkpoints, name):
    path, hf_model = checkpoints[name]
    llm = LLM(path, num_gpu_blocks=200, max_num_batched_tokens=16, **HYBRID)
    assert isinstance(llm.scheduler.kv_cache_manager, HybridKVCacheManager)
    assert_equal_to_hf(llm, hf_model, prompts(), steps=20)
    keep = LLM(path, num_gpu_blocks=200, max_num_batched_tokens=16, disable_hybrid_kv_cache_manager=True, **HYBRID)
    assert isinstance(keep.scheduler.kv_cache_manager, KVCacheManager)
    batch = prompts(seed=1)
    assert tokens(llm, batch) == tokens(keep, batch)
    layers = {"mixed": 2, "sliding": 4}[name]  # a block holds a group's layers: 2 of the mixed model's 4
    assert llm.stats.scheduler.peak_blocks_used * layers < keep.stats.scheduler.peak_blocks_used * 4
    manager = llm.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_total_blocks


def test_a_decoding_request_holds_a_windows_worth_of_blocks_in_a_sliding_group(checkpoints):
    path, _ = checkpoints["sliding"]
    llm = LLM(path, num_gpu_blocks=200, **HYBRID)
    llm.engine.add_request("r", {"prompt_token_ids": prompts(lengths=(30,))[0]}, GREEDY)
    held = []
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        request = llm.engine.requests.get("r")
        if request is not None and not request.is_finished():
            manager = llm.scheduler.kv_cache_manager
            blocks = manager.block_ids(request.seqs[0])[0]
            held.append(sum(b != manager.coordinator.null_block for b in blocks))
            real = [b for b in blocks if b != manager.coordinator.null_block]  # the slots counted, block by block
            tokens_held = manager.num_tokens[request.seqs[0].seq_id]
            assert manager.num_slots() == (tokens_held - (len(blocks) - len(real)) * BS, len(real) * BS)
    assert max(held[1:]) <= -(-(W - 1) // BS) + 1  # the window behind the next query, and the next slot's block
    assert llm.scheduler.block_manager.num_free_blocks == llm.scheduler.block_manager.num_total_blocks


@pytest.mark.parametrize("features", [
    dict(max_num_batched_tokens=6),
    dict(num_gpu_blocks=44, max_model_len=80),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}),
    dict(async_scheduling=True),
    dict(attention_backend="triton"),
    dict(kv_cache_dtype="fp8", calculate_kv_scales=True),  # scales per layer, though layers share a tensor
    dict(enable_prefix_caching=False),
], ids=["chunked", "preempted", "drafts", "async", "triton", "fp8", "uncached"])
def test_the_hybrid_engine_under_each_feature_equals_the_engine_that_keeps_every_block(checkpoints, features):
    path, _ = checkpoints["mixed"]
    batch = prompts(seed=2, lengths=(30, 12, 41, 7))
    kwargs = dict(num_gpu_blocks=96, max_model_len=128, **HYBRID) | features
    keep = tokens(LLM(path, **(kwargs | dict(num_gpu_blocks=96, disable_hybrid_kv_cache_manager=True))), batch)
    llm = LLM(path, **kwargs)
    assert isinstance(llm.scheduler.kv_cache_manager, HybridKVCacheManager)
    assert tokens(llm, batch) == keep
    if "num_gpu_blocks" in features:
        assert llm.stats.scheduler.num_preemptions > 0
    assert llm.scheduler.block_manager.num_free_blocks == llm.scheduler.block_manager.num_total_blocks


def test_tensor_parallel_workers_share_their_tensors_and_take_each_groups_tables(checkpoints):
    """Each worker builds its shard of the hybrid cache (``hybrid_kv_cache``: a group's layers, shared by
    every layer) and is sent each group's slots and tables: equal to one process, FP8 scales per layer too."""
    path, _ = checkpoints["mixed"]
    batch = prompts(seed=8, lengths=(30, 12, 41))
    for extra in (dict(), dict(kv_cache_dtype="fp8", calculate_kv_scales=True)):
        kwargs = dict(num_gpu_blocks=96, max_model_len=128, max_num_batched_tokens=16, **HYBRID, **extra)
        one = tokens(LLM(path, **kwargs), batch)
        with LLM(path, tensor_parallel_size=2, **kwargs) as llm:
            assert isinstance(llm.scheduler.kv_cache_manager, HybridKVCacheManager)
            assert tokens(llm, batch) == one
            assert llm.scheduler.block_manager.num_free_blocks == llm.scheduler.block_manager.num_total_blocks


@pytest.mark.parametrize("name", list(MODELS))
def test_with_prefix_caching_the_hybrid_engine_computes_what_stage_9_computes_and_the_same_tokens(checkpoints, name):
    """A shared prefix longer than the window, asked one request after another: each later request skips
    the prefix's whole blocks (the sliding groups holding only the window behind them), as the engine
    that keeps every block skips them."""
    path, _ = checkpoints[name]
    shared = prompts(seed=5, lengths=(37,))[0]
    batch = [shared + p for p in prompts(seed=6, lengths=(3, 12, 1, 20))]
    engines = {"hybrid": dict(), "keep": dict(disable_hybrid_kv_cache_manager=True),
               "uncached": dict(enable_prefix_caching=False)}
    outputs, prefill = {}, {}
    for key, kwargs in engines.items():
        llm = LLM(path, block_size=BS, num_gpu_blocks=200, max_model_len=128, max_num_batched_tokens=16, **kwargs)
        assert isinstance(llm.scheduler.kv_cache_manager, KVCacheManager if key == "keep" else HybridKVCacheManager)
        outputs[key] = [tokens(llm, [p])[0] for p in batch] + tokens(llm, batch)
        prefill[key] = llm.stats.engine.prefill_tokens
        manager = llm.scheduler.block_manager
        assert manager.num_free_blocks == manager.num_total_blocks
    assert outputs["hybrid"] == outputs["keep"] == outputs["uncached"]
    assert prefill["hybrid"] == prefill["keep"] < prefill["uncached"] - 6 * 36


def test_a_request_asking_for_prompt_logprobs_reads_no_cached_block(checkpoints):
    path, _ = checkpoints["mixed"]
    prompt = prompts(seed=7, lengths=(30,))[0]
    asked = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    found = {}
    for hybrid in (True, False):
        llm = LLM(path, num_gpu_blocks=200, max_model_len=128, disable_hybrid_kv_cache_manager=not hybrid, **HYBRID)
        tokens(llm, [prompt])
        before = llm.stats.engine.prefill_tokens
        out = llm.generate([{"prompt_token_ids": prompt}], asked, use_tqdm=False)[0]
        assert llm.stats.engine.prefill_tokens - before == len(prompt)  # the whole prompt computed
        found[hybrid] = [sorted(p.items()) if p else None for p in out.prompt_logprobs]
        before = llm.stats.engine.prefill_tokens
        tokens(llm, [prompt])  # the same prompt, asking for none: its whole blocks are found
        assert llm.stats.engine.prefill_tokens - before == len(prompt) - 28
    assert found[True] == found[False]


def test_at_the_same_memory_more_requests_run_at_once(checkpoints):
    """The seed's argument, one link on: the same bytes of K/V hold more requests at once when the
    windows give back what they left."""
    path, _ = checkpoints["sliding"]
    batch = prompts(seed=4, lengths=(40,) * 12)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    memory = dict(kv_cache_memory=32 * BS * 1024, max_model_len=96)  # 32 blocks of 4 layers (1 KiB a token)
    most = {}
    for hybrid in (True, False):
        llm = LLM(path, disable_hybrid_kv_cache_manager=not hybrid, **memory, **HYBRID)
        assert llm.scheduler.block_manager.num_total_blocks == 32 - hybrid  # the null block, taken for good
        for i, prompt in enumerate(batch):
            llm.engine.add_request(i, {"prompt_token_ids": prompt}, params)
        most[hybrid] = 0
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            most[hybrid] = max(most[hybrid], llm.scheduler.make_stats().num_running_reqs)
    assert most[True] >= 3 * most[False], most
