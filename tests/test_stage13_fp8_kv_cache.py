"""Stage 13: an FP8 KV cache, checked against stage 4 on the dequantised values (equal, within float32's
order of summation) and against the unquantised cache (within the bound derived from e4m3's 3-bit
mantissa); the engine against an engine whose cache holds the same rounded values in float32."""

import math
from functools import partial

import helpers_tolerances as tolerances
import pytest
import torch
from helpers_attention import make_paged_inputs
from hypothesis import given, settings
from hypothesis import strategies as st
from test_stage10_v1_scheduler import one_thread  # noqa: F401 (one_thread: an autouse fixture)

from minipaged import LLM, SamplingParams
from minipaged.stage3_copy_on_write import RefCountedBlockAllocator
from minipaged.stage4_reference_attention import paged_attention_ref
from minipaged.stage6_swapping import SwapBlockSpaceManager, SwapPagedKVCache
from minipaged.stage13_fp8_kv_cache import (
    FP8_DTYPE,
    FP8_MAX,
    K_SCALE_CONSTANT,
    V_SCALE_CONSTANT,
    FP8PagedKVCache,
    attention_error_bound,
    dequantize_fp8,
    dequantized_blocks,
    fp8_rounding_bound,
    paged_attention_fp8_ref,
    paged_attention_fp8_triton,
    quantize_fp8,
)

pytestmark = pytest.mark.stage13

FP8LLM = partial(LLM, "tiny", kv_cache_dtype="fp8")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
PROMPTS = ["The cat sat on the", "Paged attention stores the KV cache in blocks of sixteen tokens",
           "One two three four five six seven eight nine ten eleven twelve thirteen"]
CASES = [  # heads, kv_heads, head_dim, block_size, seq_lens, query_lens
    (4, 4, 16, 4, [9, 1, 17], None),  # MHA, decode
    (6, 2, 32, 16, [40, 5], None),  # GQA
    (4, 1, 16, 3, [11, 4, 7], [5, 4, 1]),  # MQA, a prompt, a chunk and a decode
]


def call(backend, fp8, **kwargs):
    """``backend`` on ``(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)``."""
    return backend(*fp8[:5], query_start_loc=fp8[5], **kwargs)


def quantised_inputs(heads, kv_heads, head_dim, block_size, seq_lens, query_lens, k_scale=0.02, v_scale=0.03,
                     seed=0):
    """Random paged inputs, their caches quantised: (fp8 args, the unquantised args, contiguous K/V)."""
    args, contiguous = make_paged_inputs(heads, kv_heads, head_dim, block_size, seq_lens, query_lens, seed=seed)
    query, key_cache, value_cache, tables, lens, starts = args
    fp8 = (query, quantize_fp8(key_cache, k_scale), quantize_fp8(value_cache, v_scale), tables, lens, starts)
    return fp8, args, contiguous


# --- against the stage below: stage 4 on the dequantised values, and the unquantised cache


@pytest.mark.parametrize("case", CASES)
def test_attention_over_fp8_equals_the_reference_over_the_dequantised_values(case):
    k_scale, v_scale = 0.02, 0.03
    (query, k8, v8, tables, lens, starts), _, _ = quantised_inputs(*case, k_scale, v_scale)
    got = paged_attention_fp8_ref(query, k8, v8, tables, lens, query_start_loc=starts, k_scale=k_scale,
                                  v_scale=v_scale)
    keys, values = dequantize_fp8(k8, k_scale), dequantize_fp8(v8, v_scale)
    want = paged_attention_ref(query, keys, values, tables, lens, query_start_loc=starts)
    torch.testing.assert_close(got, want, **tolerances.attention(query, keys, values, max(case[4])))


@pytest.mark.parametrize("case", CASES)
def test_attention_over_fp8_is_within_the_derived_bound_of_the_unquantised_cache(case):
    k_scale, v_scale = 0.02, 0.03
    fp8, (query, key_cache, value_cache, tables, lens, starts), contiguous = quantised_inputs(*case, k_scale, v_scale)
    got = call(paged_attention_fp8_ref, fp8, k_scale=k_scale, v_scale=v_scale)
    exact = paged_attention_ref(query, key_cache, value_cache, tables, lens, query_start_loc=starts)
    float32 = tolerances.attention(query, key_cache, value_cache, max(case[4]))["atol"]
    for keys, values, row in contiguous:
        bound = attention_error_bound(query[row], keys, values, k_scale, v_scale)
        assert ((got[row] - exact[row]).abs() <= bound + float32).all()
    assert (got - exact).abs().max() > 100 * float32  # the rounding shows: this is not the unquantised cache


def test_the_bound_is_not_vacuous():
    """Smaller than the values themselves (what any convex combination is within), and its V term alone
    is V's rounding bound."""
    (query, *_), _, [(keys, values, _)] = quantised_inputs(4, 4, 16, 4, [30], None)
    bound = attention_error_bound(query, keys, values, 0.02, 0.03)
    assert bound.shape == query.shape and bound.max() < values.abs().max()
    zero_q = attention_error_bound(torch.zeros_like(query), keys, values, 0.02, 0.03)  # every score 0: K cannot move it
    assert torch.equal(zero_q[0], fp8_rounding_bound(values, 0.03).amax(0))  # MHA: head h reads KV head h


# --- the rounding: scale, saturation, the bound of a 3-bit mantissa


@settings(max_examples=200, deadline=None)
@given(st.floats(-1e4, 1e4, allow_nan=False), st.floats(1e-3, 10.0))
def test_a_value_comes_back_within_the_rounding_bound(x, scale):
    t = torch.tensor([x])
    back = dequantize_fp8(quantize_fp8(t, scale), scale)
    if abs(x) <= FP8_MAX * scale:
        assert (back - t).abs() <= fp8_rounding_bound(t, scale) * (1 + 2**-20)
    else:  # saturated: the largest finite value of its sign, never NaN or infinity
        assert back.item() == pytest.approx(math.copysign(FP8_MAX * scale, x), rel=2**-20)


def test_the_rounding_bound_is_reached():
    """Half a step: values halfway between two e4m3 neighbours come back that far off, at every exponent."""
    scale = 0.01
    x = torch.linspace(-FP8_MAX * scale, FP8_MAX * scale, 200_001)
    error = (dequantize_fp8(quantize_fp8(x, scale), scale) - x).abs()
    ratio = error / fp8_rounding_bound(x, scale)
    assert ratio.max() <= 1 + 2**-20 and ratio.max() > 0.9


def test_quantising_divides_by_the_scale_and_saturates():
    x = torch.tensor([0.5, -1.25, 3.0, 900.0, -1e6, float("inf")])
    assert quantize_fp8(x, 0.5).dtype == FP8_DTYPE
    assert quantize_fp8(x, 0.5).float().tolist() == [1.0, -2.5, 6.0, FP8_MAX, -FP8_MAX, FP8_MAX]
    assert dequantize_fp8(quantize_fp8(x[:3], 0.25), 0.25).tolist() == [0.5, -1.25, 3.0]  # representable: exact
    assert dequantize_fp8(quantize_fp8(x, 0.5), 0.5, torch.bfloat16).dtype == torch.bfloat16


def test_the_smallest_values_keep_their_subnormal_step():
    """Below 2**-6 (times the scale) e4m3 has no exponent left: steps of 2**-9."""
    x = torch.tensor([2**-9, 3 * 2**-9, 2**-10 * 1.01, 2**-11])
    assert dequantize_fp8(quantize_fp8(x, 1.0), 1.0).tolist() == [2**-9, 3 * 2**-9, 2**-9, 0.0]


# --- the cache: quantise on write with the layer's scales, dequantise on read, move bytes unchanged


def cache_with_scales(num_layers=2, num_blocks=8, block_size=4, calculate=False, cpu_blocks=0):
    cache = FP8PagedKVCache(num_layers, num_blocks, block_size, 2, 8, num_cpu_blocks=cpu_blocks,
                            calculate_kv_scales=calculate)
    if not calculate:
        cache.k_scale, cache.v_scale = [0.05, 0.5], [0.2, 0.004]  # every scale different
    return cache


def write_random(cache, layer, slots, seed=0, magnitude=(1.0, 1.0)):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(len(slots), 2, 8, generator=gen) * magnitude[0]
    v = torch.randn(len(slots), 2, 8, generator=gen) * magnitude[1]
    cache.write(layer, torch.tensor(slots), k, v)
    return k, v


@pytest.mark.parametrize("layer", [0, 1])
def test_the_cache_stores_e4m3_with_its_layers_k_and_v_scales(layer):
    cache = cache_with_scales()
    k, v = write_random(cache, layer, [0, 1, 2, 5, 6], magnitude=(2.0, 0.3))
    assert cache.key_cache[layer].dtype == FP8_DTYPE and cache.key_cache[layer].element_size() == 1
    keys, values = cache.gather(layer, [0, 1], 7)
    assert keys.dtype == torch.float32
    keep = [0, 1, 2, 5, 6]
    assert ((keys[keep] - k).abs() <= fp8_rounding_bound(k, cache.k_scale[layer])).all()
    assert ((values[keep] - v).abs() <= fp8_rounding_bound(v, cache.v_scale[layer])).all()
    raw = cache.key_cache[layer].view(-1, 2, 8)[keep]
    assert torch.equal(raw.float(), quantize_fp8(k, cache.k_scale[layer]).float())


def test_calibration_sets_each_layers_scales_from_its_first_batch_only():
    cache = cache_with_scales(calculate=True)
    k0, v0 = write_random(cache, 0, [0, 1, 2], seed=1, magnitude=(3.0, 0.5))
    assert cache.k_scale[0] == pytest.approx(float(k0.abs().max()) / K_SCALE_CONSTANT, rel=1e-6)
    assert cache.v_scale[0] == pytest.approx(float(v0.abs().max()) / V_SCALE_CONSTANT, rel=1e-6)
    assert (cache.k_scale[1], cache.v_scale[1]) == (1.0, 1.0)  # layer 1 has not written yet
    k1, v1 = write_random(cache, 1, [0, 1], seed=2, magnitude=(0.1, 7.0))
    assert cache.k_scale[1] == pytest.approx(float(k1.abs().max()) / K_SCALE_CONSTANT, rel=1e-6)
    assert cache.v_scale[1] == pytest.approx(float(v1.abs().max()) / V_SCALE_CONSTANT, rel=1e-6)
    before = (list(cache.k_scale), list(cache.v_scale))
    write_random(cache, 0, [3, 4], seed=3, magnitude=(50.0, 50.0))  # a later, larger batch: scales kept
    assert (cache.k_scale, cache.v_scale) == before
    keys, _ = cache.gather(0, [0], 3)
    assert ((keys - k0).abs() <= fp8_rounding_bound(k0, cache.k_scale[0])).all()


def test_calibration_on_zeros_keeps_the_scales_usable():
    cache = cache_with_scales(calculate=True)
    cache.write(0, torch.tensor([0, 1]), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8))
    assert (cache.k_scale[0], cache.v_scale[0]) == (1.0, 1.0)


def test_copy_on_write_copies_and_swaps_move_the_bytes_unchanged():
    cache = cache_with_scales(cpu_blocks=4)
    write_random(cache, 1, list(range(8)), seed=4)
    raw = [t.clone() for t in (*cache.key_cache, *cache.value_cache)]
    cache.copy_blocks([(0, 5)])
    cache.swap_out([(1, 2)])
    cache.swap_in([(2, 6)])
    for before, after in zip(raw, (*cache.key_cache, *cache.value_cache), strict=True):
        assert after.dtype == FP8_DTYPE
        assert torch.equal(after[5].view(torch.uint8), before[0].view(torch.uint8))
        assert torch.equal(after[6].view(torch.uint8), before[1].view(torch.uint8))
    assert cache.k_scale == [0.05, 0.5] and cache.v_scale == [0.2, 0.004]
    keys, values = cache.gather(1, [5, 6], 8)
    want_k, want_v = cache.gather(1, [0, 1], 8)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)


def test_a_forked_sequence_reads_its_parents_values_after_copy_on_write():
    manager = SwapBlockSpaceManager(RefCountedBlockAllocator(8), block_size=4)
    cache = cache_with_scales()
    manager.allocate("a", list(range(6)))
    k, v = write_random(cache, 0, manager.slot_mapping(["a"], [6]).tolist(), seed=5)
    manager.fork("a", "b")
    manager.append_slot("b")
    (copy,) = manager.take_copies()
    cache.copy_blocks([copy])
    a = cache.gather(0, manager.get_block_table("a"), 6)
    b = cache.gather(0, manager.get_block_table("b"), 6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert ((a[0] - k).abs() <= fp8_rounding_bound(k, cache.k_scale[0])).all()


def test_the_reference_dequantises_only_the_blocks_in_use():
    (query, k8, v8, tables, lens, _), _, _ = quantised_inputs(4, 2, 8, 4, [5, 1], None)
    tables = tables.clone()
    tables[1, 1:] = 10_000  # entries past a sequence's blocks may hold anything
    keys, values, renumbered = dequantized_blocks(k8, v8, tables, lens, 0.02, 0.03)
    assert keys.dtype == torch.float32 and keys.shape[0] == tables.numel()
    assert renumbered.tolist() == [list(range(i * tables.shape[1], (i + 1) * tables.shape[1]))
                                   for i in range(tables.shape[0])]
    assert torch.equal(keys[0], dequantize_fp8(k8[tables[0, 0]], 0.02))
    assert torch.equal(values[tables.shape[1]], dequantize_fp8(v8[tables[1, 0]], 0.03))
    narrow, _, _ = dequantized_blocks(k8, v8, tables, lens, 0.02, 0.03, max_seq_len=5)
    assert narrow.shape[0] == 2 * 2  # two blocks cover the longest sequence


# --- stage 5's kernels on e4m3 (Triton's interpreter without a GPU)


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("case", CASES[:2])
def test_the_kernels_over_fp8_equal_the_reference(case, version):
    k_scale, v_scale = 0.02, 0.03
    fp8, _, _ = quantised_inputs(*case, k_scale, v_scale)
    want = call(paged_attention_fp8_ref, fp8, k_scale=k_scale, v_scale=v_scale)
    got = call(paged_attention_fp8_triton, fp8, k_scale=k_scale, v_scale=v_scale, version=version)
    keys, values = dequantize_fp8(fp8[1], k_scale), dequantize_fp8(fp8[2], v_scale)
    torch.testing.assert_close(got, want, **tolerances.attention(fp8[0], keys, values, max(case[4])))


def test_the_prefill_kernel_over_fp8_equals_the_reference():
    k_scale, v_scale = 0.05, 0.01
    fp8, _, _ = quantised_inputs(*CASES[2], k_scale, v_scale)
    want = call(paged_attention_fp8_ref, fp8, k_scale=k_scale, v_scale=v_scale)
    got = call(paged_attention_fp8_triton, fp8, k_scale=k_scale, v_scale=v_scale)
    keys, values = dequantize_fp8(fp8[1], k_scale), dequantize_fp8(fp8[2], v_scale)
    torch.testing.assert_close(got, want, **tolerances.attention(fp8[0], keys, values, max(CASES[2][4])))


@pytest.mark.parametrize("backend", ["ref", "v1", "v2", "prefill"])
def test_a_sliding_window_over_fp8_equals_stage_4s_window_over_the_dequantised_values(backend):
    """A layer's window reaches the FP8 paths: both attend to the window alone, as stage 4 does."""
    k_scale, v_scale, window = 0.02, 0.03, 6
    case = CASES[2] if backend == "prefill" else CASES[1]
    fp8, _, _ = quantised_inputs(*case, k_scale, v_scale)
    keys, values = dequantize_fp8(fp8[1], k_scale), dequantize_fp8(fp8[2], v_scale)
    want = paged_attention_ref(fp8[0], keys, values, *fp8[3:5], query_start_loc=fp8[5], sliding_window=window)
    path = paged_attention_fp8_ref if backend == "ref" else paged_attention_fp8_triton
    kwargs = {"version": backend} if backend in ("v1", "v2") else {}
    got = call(path, fp8, k_scale=k_scale, v_scale=v_scale, sliding_window=window, **kwargs)
    torch.testing.assert_close(got, want, **tolerances.attention(fp8[0], keys, values, window))
    whole = call(path, fp8, k_scale=k_scale, v_scale=v_scale, **kwargs)
    assert not torch.allclose(got, whole)  # the window changed what was attended to


# --- the engine


def run(llm, prompts=PROMPTS, params=GREEDY):
    return llm.generate(prompts, params, use_tqdm=False)


def fake_quantised(llm, k_scale, v_scale):
    """Make ``llm``'s float32 cache hold exactly the values an FP8 cache with these scales stands for."""
    cache = llm.cache

    def write(layer, slot_mapping, key, value, *, checked=False):
        SwapPagedKVCache.write(cache, layer, slot_mapping, dequantize_fp8(quantize_fp8(key, k_scale[layer]),
                                                                          k_scale[layer]),
                               dequantize_fp8(quantize_fp8(value, v_scale[layer]), v_scale[layer]), checked=checked)
    cache.write = write
    return llm


@pytest.mark.parametrize("calculate", [False, True])
def test_the_engine_equals_one_whose_float32_cache_holds_the_same_rounded_values(calculate):
    fp8 = FP8LLM(calculate_kv_scales=calculate)
    got = run(fp8)
    assert fp8.cache.key_cache[0].dtype == FP8_DTYPE
    assert (fp8.cache.k_scale[0] != 1.0) == calculate
    want = run(fake_quantised(LLM("tiny"), fp8.cache.k_scale, fp8.cache.v_scale))
    tol = tolerances.logprobs(fp8.model_config, 64)
    for ours, theirs in zip(got, want, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
            common = a.keys() & b.keys()
            assert [a[t] for t in common] == pytest.approx([b[t] for t in common], **tol)


def test_prefix_cache_hits_read_the_fp8_blocks_another_request_wrote():
    shared = "A long shared system prompt that fills several blocks of the cache, " * 3
    prompts = [shared + "first", shared + "second"]
    cached = FP8LLM(calculate_kv_scales=True, block_size=4)
    run(cached, prompts[:1])
    hits = run(cached, prompts[1:])
    assert cached.stats.prefix_cache.hits > 0
    fresh = FP8LLM(calculate_kv_scales=True, block_size=4, enable_prefix_caching=False)
    run(fresh, prompts[:1])  # the same first batch: the same scales
    assert fresh.cache.k_scale == cached.cache.k_scale
    alone = run(fresh, prompts[1:])
    assert hits[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_swapped_and_forked_sequences_keep_their_fp8_values():
    """V0 with swapping and n=2 (copy-on-write) in too few blocks equals the same engine with room."""
    params = SamplingParams(n=2, max_tokens=14, temperature=0.8, seed=3, ignore_eos=True)
    common = dict(stage=13, scheduler="v0", block_size=4, calculate_kv_scales=True)
    roomy = run(FP8LLM(**common, num_gpu_blocks=256), PROMPTS, params)
    tight = FP8LLM(**common, num_gpu_blocks=24, preemption_mode="swap", num_cpu_blocks=64)
    got = run(tight, PROMPTS, params)
    assert tight.stats.scheduler.num_swapped_out_blocks > 0
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in roomy]


# --- on a GPU (sm_89 or later: Triton's fp8e4nv)

gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                         reason="needs a CUDA device of compute capability 8.9 or more")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("version", ["v1", "v2", "prefill"])
def test_on_the_gpu_the_kernels_over_fp8_equal_the_reference_in_bfloat16(version):
    case = (14, 2, 64, 16, [5, 700, 1200], [3, 1, 9] if version == "prefill" else None)
    k_scale, v_scale = 0.02, 0.03
    fp8, _, _ = quantised_inputs(*case, k_scale, v_scale)
    fp8 = tuple(None if t is None else t.cuda() for t in fp8)
    query = fp8[0].bfloat16()
    fp8 = (query, *fp8[1:])
    want = call(paged_attention_fp8_ref, fp8, k_scale=k_scale, v_scale=v_scale)
    kwargs = {} if version == "prefill" else {"version": version}
    got = call(paged_attention_fp8_triton, fp8, k_scale=k_scale, v_scale=v_scale, **kwargs)
    keys, values = dequantize_fp8(fp8[1], k_scale), dequantize_fp8(fp8[2], v_scale)
    torch.testing.assert_close(got.float(), want.float(),
                               **tolerances.attention(query, keys, values, 1200, reference_storage=torch.bfloat16))


@pytest.mark.gpu
@gpu
def test_on_the_gpu_values_past_448_saturate_and_come_back_within_the_bound():
    x = torch.tensor([0.37, -3.0, 500.0, -1e6, float("inf")], device="cuda")
    assert quantize_fp8(x, 1.0).float().tolist() == [0.375, -3.0, FP8_MAX, -FP8_MAX, FP8_MAX]
    y = torch.randn(10_000, device="cuda") * 3
    assert ((dequantize_fp8(quantize_fp8(y, 0.02), 0.02) - y).abs() <= fp8_rounding_bound(y, 0.02) * (1 + 2**-20)).all()


# -- the rules a correct result alone does not show ------------------------------------------------------------------

def test_a_half_precision_value_is_quantised_from_float32_rounded_once():
    """Divided in bf16 or fp16, a value is rounded twice (to its own dtype, then to e4m3): other codes."""
    gen = torch.Generator().manual_seed(13)
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(100_000, generator=gen) * 40).to(dtype)
        once = quantize_fp8(x.float(), 0.37)
        assert torch.equal(quantize_fp8(x, 0.37).view(torch.uint8), once.view(torch.uint8)), dtype


def test_the_cache_write_passes_checked_on_so_that_a_checked_slot_mapping_is_not_read_again(monkeypatch):
    seen = []
    original = SwapPagedKVCache.write

    def spy(self, layer, slot_mapping, key, value, *, checked=False):
        seen.append(checked)
        return original(self, layer, slot_mapping, key, value, checked=checked)

    monkeypatch.setattr(SwapPagedKVCache, "write", spy)
    cache = FP8PagedKVCache(1, 4, 2, 1, 4)
    kv = torch.ones(2, 1, 4)
    cache.write(0, torch.tensor([0, 1]), kv, kv, checked=True)
    cache.write(0, torch.tensor([2, 3]), kv, kv)
    assert seen == [True, False]


def test_only_the_blocks_a_batch_reads_are_dequantised(monkeypatch):
    """The work grows with the batch, not with the cache: 2 sequences of one block each in a 4,096-block cache."""
    import minipaged.stage13_fp8_kv_cache as s13

    sizes, original = [], s13.dequantize_fp8
    monkeypatch.setattr(s13, "dequantize_fp8", lambda x, *a, **k: (sizes.append(x.shape[0]), original(x, *a, **k))[1])
    cache = torch.zeros(4096, 4, 1, 8, dtype=FP8_DTYPE)
    tables = torch.tensor([[7], [4000]], dtype=torch.int32)
    dequantized_blocks(cache, cache, tables, torch.tensor([3, 4], dtype=torch.int32), 1.0, 1.0)
    assert sizes == [2, 2]  # keys, then values: the two blocks read


def test_the_table_entry_after_an_exactly_full_last_block_is_never_read():
    cache = torch.zeros(4, 4, 1, 8, dtype=FP8_DTYPE)
    tables = torch.tensor([[2, 99], [1, 3]], dtype=torch.int32)  # 99: no such block
    keys, _, _ = dequantized_blocks(cache, cache, tables, torch.tensor([4, 5], dtype=torch.int32), 1.0, 1.0)
    assert keys.shape[0] == 4


def test_the_triton_path_hands_stage_5_the_e4m3_cache_the_version_and_the_hosts_lengths(monkeypatch):
    """The kernels read e4m3 bytes (not a cache widened first), run the version asked for, and take the
    engine's host lengths (without them, stage 5 reads the longest query back from the device)."""
    import minipaged.stage5_triton_attention as s5

    calls = []
    monkeypatch.setattr(s5, "paged_attention_triton",
                        lambda q, k, v, *args, **kwargs: (calls.append((k.dtype, v.dtype, kwargs)), q.clone())[1])
    cache = torch.zeros(4, 4, 1, 8, dtype=FP8_DTYPE)
    query = torch.randn(2, 2, 8)
    paged_attention_fp8_triton(query, cache, cache, torch.tensor([[0], [1]], dtype=torch.int32),
                               torch.tensor([3, 4], dtype=torch.int32), version="v2", max_query_len=1,
                               max_seq_len=4)
    ((k_dtype, v_dtype, kwargs),) = calls
    assert k_dtype == v_dtype == FP8_DTYPE
    assert kwargs["version"] == "v2" and (kwargs["max_query_len"], kwargs["max_seq_len"]) == (1, 4)
