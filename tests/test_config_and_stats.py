"""What every stage shares: one EngineConfig, checked where it is made and resolved against the
model; statistics objects that the components return and LLM.stats joins."""

import dataclasses

import pytest

from minipaged import LLM, SamplingParams
from minipaged.common.config import EngineConfig
from minipaged.common.stats import EngineStats, PrefixCacheStats, SchedulerStats, Stats
from minipaged.models import load_config

pytestmark = pytest.mark.common

TINY = load_config("tiny")


@pytest.mark.parametrize("kwargs", [
    {"block_size": 0}, {"block_size": True}, {"num_gpu_blocks": 0}, {"num_cpu_blocks": -1},
    {"max_model_len": 0}, {"max_num_seqs": 0}, {"max_num_batched_tokens": 2.0}, {"kv_cache_memory": 0},
    {"seed": 1.5}, {"attention_backend": "flash"}, {"preemption_mode": "drop"},
    {"enable_prefix_caching": "yes"}, {"dtype": "int8"}, {"device": "gpu0"}, {"model": 3},
    {"gpu_memory_utilization": 0}, {"gpu_memory_utilization": 1.01}, {"gpu_memory_utilization": "0.9"},
])
def test_a_bad_argument_is_a_value_error_before_anything_loads(kwargs):
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)


def test_resolve_derives_what_depends_on_the_model():
    per_block = 16 * TINY.kv_bytes_per_token(EngineConfig().torch_dtype)
    config = EngineConfig(kv_cache_memory=10 * per_block + 1).resolve(TINY)
    assert config.num_gpu_blocks == 10  # as many whole blocks as the memory holds
    assert config.max_model_len == min(TINY.max_position_embeddings, 10 * 16)
    assert config.num_cpu_blocks == 0  # no swap space without swapping
    swap = EngineConfig(num_gpu_blocks=12, scheduler="v0", preemption_mode="swap").resolve(TINY)
    assert swap.num_cpu_blocks == 12
    assert EngineConfig(num_gpu_blocks=12, num_cpu_blocks=3).resolve(TINY).num_cpu_blocks == 3
    assert EngineConfig(num_gpu_blocks=64, max_model_len=100).resolve(TINY).max_model_len == 100  # given, kept
    with pytest.raises(ValueError):
        EngineConfig(max_model_len=TINY.max_position_embeddings + 1).resolve(TINY)


def test_on_cuda_the_cache_is_sized_by_what_gpu_memory_utilization_leaves_unless_a_size_is_given():
    """vLLM's rule: one process on CUDA profiles its memory; a size given, a CPU, or workers that each
    hold a GPU do not (a CPU keeps the 256 MiB default)."""
    assert EngineConfig(device="cuda").profiles_kv_cache
    for kwargs in ({"device": "cpu"}, {"device": "cuda", "num_gpu_blocks": 8},
                   {"device": "cuda", "kv_cache_memory": 2**20}, {"device": "cuda", "tensor_parallel_size": 2}):
        assert not EngineConfig(**kwargs).profiles_kv_cache
    per_block = 16 * TINY.kv_bytes_per_token(EngineConfig().torch_dtype)
    assert EngineConfig().resolve(TINY).num_gpu_blocks == 256 * 2**20 // per_block


def test_llm_is_built_from_its_resolved_config():
    llm = LLM("tiny", num_gpu_blocks=24, block_size=8, max_num_seqs=3, seed=5)
    assert (llm.config.num_gpu_blocks, llm.config.block_size, llm.config.max_num_seqs) == (24, 8, 3)
    assert llm.scheduler.block_manager.num_total_blocks == 24 and llm.scheduler.max_num_seqs == 3
    assert llm.max_model_len == llm.config.max_model_len == min(TINY.max_position_embeddings, 24 * 8)
    with pytest.raises(TypeError):  # an argument no configuration has
        LLM("tiny", num_blocks=24)


def test_stats_are_snapshots_that_the_components_return():
    llm = LLM("tiny", num_gpu_blocks=64, enable_prefix_caching=True)
    before = llm.stats
    prompt = {"prompt_token_ids": list(range(1, 40))}
    for _ in range(2):  # the second finds the first's blocks
        llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    after = llm.stats
    assert isinstance(after, Stats) and isinstance(after.engine, EngineStats)
    assert (before.steps, before.prefill_tokens) == (0, 0) and after.steps > 0  # before did not move
    assert after.decode_tokens == 2 * 2 and after.prefill_tokens > 0
    assert after.prefix_cache == llm.scheduler.block_manager.allocator.make_stats() and after.prefix_cache_hits > 0
    assert after.scheduler == llm.scheduler.make_stats() and after.scheduler.num_running_reqs == 0  # none left running
    flat = after.as_dict()
    assert flat["steps"] == after.steps and flat["prefix_cache_hits"] == after.prefix_cache.hits
    assert flat["num_preemptions"] == after.num_preemptions and 0 < flat["kv_utilization"] <= 1


def test_the_statistics_objects_compute_their_ratios():
    assert SchedulerStats(num_gpu_blocks=8, num_used_blocks=2).kv_cache_usage == 0.25
    assert SchedulerStats().kv_cache_usage == 0.0 and PrefixCacheStats().hit_rate == 0.0
    assert PrefixCacheStats(queries=4, hits=3).hit_rate == 0.75
    stats = EngineStats()
    stats.record_step(prefill_tokens=5, decode_tokens=2, token_slots=30, held_slots=40)
    stats.record_step(prefill_tokens=0, decode_tokens=2, token_slots=32, held_slots=40)
    assert dataclasses.astuple(stats) == (2, 5, 4, 62, 80) and stats.kv_utilization == 62 / 80


def test_bad_values_of_the_options_that_choose_parts_are_refused():
    for bad in ({"tensor_parallel_size": 0}, {"tensor_parallel_size": 1.5}, {"distributed_executor_backend": "ray"},
                {"async_scheduling": "yes"}, {"enable_prefix_caching": 1}, {"scheduler": "v2"}, {"stage": 6},
                {"stage": 16}, {"stage": 9.5}, {"disable_hybrid_kv_cache_manager": "yes"}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
