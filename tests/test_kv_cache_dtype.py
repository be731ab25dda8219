"""The K/V cache's dtype as a part of the engine (stage 13's FP8 cache): chosen by ``kv_cache_dtype``,
sized by its bytes, checked before anything runs."""

import pytest
import torch

from minipaged import LLM
from minipaged.common.config import EngineConfig
from minipaged.stage6_swapping import SwapPagedKVCache
from minipaged.stage13_fp8_kv_cache import (
    FP8_BACKENDS,
    FP8Attention,
    FP8PagedKVCache,
    check_fp8_attention_args,
    check_fp8_supported,
)

pytestmark = pytest.mark.common


@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_kv_cache_dtype_chooses_the_cache_and_the_attention_backend(backend):
    fp8 = LLM("tiny", num_gpu_blocks=32, kv_cache_dtype="fp8", attention_backend=backend)
    assert type(fp8.cache) is FP8PagedKVCache and fp8.cache.key_cache[0].dtype == torch.float8_e4m3fn
    assert isinstance(fp8.engine.runner.backend, FP8Attention)
    assert fp8.engine.runner.backend.backend is FP8_BACKENDS[backend]
    auto = LLM("tiny", num_gpu_blocks=32, attention_backend=backend)
    assert type(auto.cache) is SwapPagedKVCache and auto.cache.key_cache[0].dtype == torch.float32
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_torch_dtype == torch.float8_e4m3fn  # vLLM's alias
    assert EngineConfig(dtype="bfloat16").kv_cache_torch_dtype == torch.bfloat16


def test_the_same_memory_holds_twice_the_blocks_of_a_bfloat16_cache():
    auto = LLM("tiny", dtype="bfloat16", kv_cache_memory=2**20).config.num_gpu_blocks
    fp8 = LLM("tiny", kv_cache_dtype="fp8", dtype="bfloat16", kv_cache_memory=2**20).config.num_gpu_blocks
    assert fp8 == 2 * auto


@pytest.mark.parametrize("kwargs", [dict(kv_cache_dtype="fp16"), dict(kv_cache_dtype="fp8", calculate_kv_scales=1),
                                    dict(kv_cache_dtype="fp8_e5m2"), dict(kv_cache_dtype="fp8_e4m3", stage=7)])
def test_a_bad_cache_dtype_is_refused_where_the_configuration_is_made(kwargs):
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)


def fp8_args():
    key_cache = torch.zeros(4, 2, 1, 8, dtype=torch.float8_e4m3fn)
    return [torch.zeros(1, 2, 8), key_cache, key_cache.clone(), torch.zeros(1, 2, dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32), None]


def test_fp8_attention_checks_its_caches_and_scales_then_stage_4s_arguments():
    check_fp8_attention_args(*fp8_args(), 0.5, 2.0)
    for position, replace in ((1, torch.zeros(4, 2, 1, 8)), (2, torch.zeros(4, 2, 1, 8, dtype=torch.bfloat16)),
                              (4, torch.tensor([9], dtype=torch.int32)), (3, torch.zeros(1, 2))):
        args = fp8_args()
        args[position] = replace
        with pytest.raises(ValueError):
            check_fp8_attention_args(*args, 0.5, 2.0)
    for scales in ((0.0, 1.0), (1.0, -1.0), (float("inf"), 1.0), (float("nan"), 1.0), (True, 1.0), ("1", 1.0)):
        with pytest.raises(ValueError):
            check_fp8_attention_args(*fp8_args(), *scales)


def test_the_triton_kernels_refuse_fp8_below_compute_capability_8_9(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, refused in (((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        if refused:
            with pytest.raises(ValueError):
                check_fp8_supported("cuda", "triton")
        else:
            check_fp8_supported("cuda", "triton")
        check_fp8_supported("cuda", "ref")  # the reference dequantises with torch: any device
        check_fp8_supported("cpu", "triton")
