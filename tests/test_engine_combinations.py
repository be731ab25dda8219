"""One engine, its parts chosen by its configuration: the parts each configuration builds, the
combinations that work (each equal to its reference), and those refused before any weight is read."""

import pytest
import torch
from test_stage10_v1_scheduler import one_thread  # noqa: F401 (one_thread: an autouse fixture)

import minipaged.llm
from minipaged import LLM, SamplingParams
from minipaged.common.config import COMBINATIONS_REFUSED, EngineConfig
from minipaged.stage6_scheduler import Scheduler
from minipaged.stage6_swapping import SwapBlockSpaceManager
from minipaged.stage7_engine import LLMEngine
from minipaged.stage7_model_runner import ModelRunner
from minipaged.stage8_sharing import SharingEngine
from minipaged.stage9_prefix_caching import PrefixCachingBlockSpaceManager, PrefixCachingEngine
from minipaged.stage10_async_scheduling import AsyncScheduler
from minipaged.stage10_engine_core import V1Engine
from minipaged.stage10_model_runner import V1ModelRunner
from minipaged.stage10_v1_scheduler import V1Scheduler
from minipaged.stage11_tensor_parallel import RemoteKVCache, StepHidden, TensorParallelModel
from minipaged.stage12_rejection_sampler import NgramProposer
from minipaged.stage12_speculative import SpecDecoder, SpecInputBatch
from minipaged.stage14_disaggregated_prefill import ConnectorKVCacheManager, KVConnectorAttention, KVConnectorWorker

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REPEATS = [5, 17, 90, 3, 42, 8, 25, 11, 7]
SHARED = REPEATS * 3  # a prefix of 27 tokens every prompt starts with
PROMPTS = [SHARED + [1, 2, 3, 1, 2, 3], SHARED + [60, 61], SHARED + REPEATS[:4] * 2, SHARED + [99]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SMALL = dict(block_size=4, num_gpu_blocks=128)
CONNECTOR = {"kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": "never-written"}}


def run(llm, prompts=PROMPTS, params=GREEDY):
    """The first prompt alone, then the others together (which may find its blocks cached): the tokens."""
    outputs = [llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
               for batch in (prompts[:1], prompts[1:])]
    return [o.outputs[0].token_ids for batch in outputs for o in batch]


# -- the parts each configuration builds ----------------------------------------------------------------------------

PARTS = [  # (config, engine, scheduler, block manager, runner): exactly these classes
    (dict(stage=7), LLMEngine, Scheduler, SwapBlockSpaceManager, ModelRunner),
    (dict(stage=8), SharingEngine, Scheduler, SwapBlockSpaceManager, ModelRunner),
    (dict(stage=9), SharingEngine, Scheduler, SwapBlockSpaceManager, ModelRunner),
    (dict(stage=9, enable_prefix_caching=True), PrefixCachingEngine, Scheduler, PrefixCachingBlockSpaceManager,
     ModelRunner),
    (dict(stage=10), V1Engine, V1Scheduler, PrefixCachingBlockSpaceManager, V1ModelRunner),
    (dict(stage=10, enable_prefix_caching=False), V1Engine, V1Scheduler, SwapBlockSpaceManager, V1ModelRunner),
    (dict(stage=10, async_scheduling=True), V1Engine, AsyncScheduler, PrefixCachingBlockSpaceManager,
     V1ModelRunner),
    (dict(scheduler="v0", preemption_mode="swap"), SharingEngine, Scheduler, SwapBlockSpaceManager, ModelRunner),
    (dict(), V1Engine, V1Scheduler, PrefixCachingBlockSpaceManager, V1ModelRunner),  # the top, without drafts
    (dict(speculative_config=NGRAM), V1Engine, V1Scheduler, PrefixCachingBlockSpaceManager, V1ModelRunner),
    (dict(kv_transfer_config=CONNECTOR), V1Engine, V1Scheduler, PrefixCachingBlockSpaceManager, V1ModelRunner),
    (dict(kv_transfer_config=CONNECTOR, enable_prefix_caching=False), V1Engine, V1Scheduler,
     SwapBlockSpaceManager, V1ModelRunner),
    (dict(kv_transfer_config=CONNECTOR, speculative_config=NGRAM, async_scheduling=False), V1Engine, V1Scheduler,
     PrefixCachingBlockSpaceManager, V1ModelRunner),
    (dict(kv_transfer_config=CONNECTOR, async_scheduling=True), V1Engine, AsyncScheduler,
     PrefixCachingBlockSpaceManager, V1ModelRunner),
]


@pytest.mark.common
@pytest.mark.parametrize(("kwargs", "engine", "scheduler", "block_manager", "runner"), PARTS)
def test_each_configuration_builds_the_parts_it_names(kwargs, engine, scheduler, block_manager, runner):
    llm = LLM("tiny", num_gpu_blocks=32, **kwargs)
    assert type(llm.engine) is engine and type(llm.scheduler) is scheduler
    assert type(llm.scheduler.block_manager) is block_manager and type(llm.engine.runner) is runner
    assert llm.engine.scheduler is llm.scheduler and llm.executor is None
    spec = getattr(llm.engine, "spec_decoder", None)  # one part, held by the engine, the scheduler and the runner
    assert isinstance(spec, SpecDecoder) == ("speculative_config" in kwargs)
    if spec is not None:
        assert isinstance(spec.proposer, NgramProposer)
        assert llm.scheduler.spec_decoder is llm.engine.runner.spec_decoder is spec
        assert isinstance(llm.engine.runner.input_batch, SpecInputBatch)
    connector = getattr(llm.scheduler, "connector", None)  # its scheduler side, and its worker side in the runner
    assert isinstance(connector, ConnectorKVCacheManager) == ("kv_transfer_config" in kwargs)
    if connector is not None:
        assert llm.scheduler.kv_cache_manager is connector
        assert isinstance(llm.engine.runner.kv_connector, KVConnectorWorker)
        assert isinstance(llm.engine.runner.backend, KVConnectorAttention)
    if isinstance(llm.engine, V1Engine):
        assert llm.engine.async_scheduling == kwargs.get("async_scheduling", False)


@pytest.mark.common
def test_the_defaults_follow_the_scheduler_as_in_vllm():
    """V1: prefix caching on and a token budget of 2048; V0: prefix caching off, the scheduler's own budget.
    The top of the ladder is V1's; each stage below 10 is V0's."""
    top, v0, stage9 = EngineConfig(), EngineConfig(scheduler="v0"), EngineConfig(stage=9)
    assert (top.scheduler, top.enable_prefix_caching, top.max_num_batched_tokens) == ("v1", True, 2048)
    assert (v0.scheduler, v0.enable_prefix_caching, v0.max_num_batched_tokens) == ("v0", False, None)
    assert (stage9.scheduler, stage9.enable_prefix_caching) == ("v0", False)
    assert EngineConfig(enable_prefix_caching=False).enable_prefix_caching is False  # vLLM's --no-enable-...


# -- refused, where the configuration is made ------------------------------------------------------------------------

REFUSED = [  # configurations that break the table's rules, every rule by at least one
    dict(stage=8, enable_prefix_caching=True),
    dict(stage=9, scheduler="v1"),
    dict(stage=9, async_scheduling=True),
    dict(stage=10, tensor_parallel_size=2),
    dict(stage=11, speculative_config=NGRAM),
    dict(preemption_mode="swap"),
    dict(scheduler="v0", async_scheduling=True),
    dict(scheduler="v0", speculative_config=NGRAM),
    dict(async_scheduling=True, speculative_config=NGRAM),
    dict(stage=12, kv_cache_dtype="fp8"),
    dict(attention_backend="triton", dtype="bfloat16"),
    dict(calculate_kv_scales=True),
    dict(kv_cache_dtype="fp8", calculate_kv_scales=True, device="cuda", attention_backend="triton"),
    dict(stage=13, kv_transfer_config=CONNECTOR),
    dict(scheduler="v0", kv_transfer_config=CONNECTOR),
    dict(kv_cache_dtype="fp8", calculate_kv_scales=True, kv_transfer_config=CONNECTOR),
]


@pytest.mark.common
def test_every_rule_of_the_table_has_a_configuration_that_breaks_it(monkeypatch):
    """Each refused configuration breaks a rule, and every rule has its configuration (so that the test
    below refuses each). The configurations are made with the table emptied, their defaults derived as
    always, then asked each rule."""
    import minipaged.common.config as config_module

    monkeypatch.setattr(config_module, "COMBINATIONS_REFUSED", [])
    broken = []
    for kwargs in REFUSED:
        config = EngineConfig(**kwargs)
        rules = [i for i, (rule, _) in enumerate(COMBINATIONS_REFUSED) if rule(config)]
        assert rules, kwargs
        broken += rules
    assert sorted(set(broken)) == list(range(len(COMBINATIONS_REFUSED)))


@pytest.mark.common
@pytest.mark.parametrize("kwargs", REFUSED)
def test_a_refused_combination_is_refused_before_any_weight_is_read(kwargs, monkeypatch):
    monkeypatch.setattr(minipaged.llm, "load_model", lambda *a: pytest.fail("weights read"))
    monkeypatch.setattr(minipaged.llm, "start_tensor_parallel", lambda *a: pytest.fail("workers started"))
    with pytest.raises(ValueError):
        LLM("tiny", **kwargs)


@pytest.mark.stage8
def test_beam_search_is_refused_below_stage_8_and_served_by_v1s_front_end():
    """vLLM V1 dropped beam search from its engine, not from its LLM: it runs in the front end."""
    with pytest.raises(ValueError):
        LLM("tiny", stage=7, num_gpu_blocks=32).beam_search(["The cat"])
    for kwargs in (dict(stage=8), dict()):
        assert LLM("tiny", num_gpu_blocks=64, **kwargs).beam_search(["The cat"])[0].sequences


# -- the combinations that work, each equal to its reference ---------------------------------------------------------

@pytest.mark.stage12
@pytest.mark.rounding_free
def test_tensor_parallelism_with_speculative_decoding_equals_one_process_without_drafts():
    expected = run(LLM("tiny", stage=10, **SMALL))
    with LLM("tiny", tensor_parallel_size=2, speculative_config=NGRAM, **SMALL) as llm:
        assert isinstance(llm.engine.runner.model, TensorParallelModel)
        assert run(llm) == expected
        assert llm.stats.spec_decoding.num_accepted_tokens > 0  # drafts were kept, through the workers


@pytest.mark.stage11
@pytest.mark.rounding_free
def test_tensor_parallelism_with_prefix_caching_and_chunked_prefill_equals_one_process():
    expected = run(LLM("tiny", stage=10, enable_prefix_caching=False, **SMALL))
    with LLM("tiny", stage=11, tensor_parallel_size=2, max_num_batched_tokens=8, **SMALL) as llm:
        assert isinstance(llm.cache, RemoteKVCache) and llm.config.enable_prefix_caching
        assert run(llm) == expected
        assert llm.stats.prefix_cache_hits > 0  # the shared prefix was found, in chunks of 8 tokens


@pytest.mark.stage13
@pytest.mark.rounding_free
def test_tensor_parallelism_over_an_fp8_cache_equals_one_process():
    """Each rank holds the e4m3 blocks of its KV heads; calibrating, the ranks agree on the largest value,
    so that every rank's scales are one process's: the same tokens, and the same K/V read back."""
    kwargs = dict(kv_cache_dtype="fp8", calculate_kv_scales=True, **SMALL)
    one = LLM("tiny", **kwargs)
    expected = run(one)
    with LLM("tiny", tensor_parallel_size=2, **kwargs) as llm:
        assert run(llm) == expected
        for layer in range(llm.model_config.num_layers):  # blocks 0 and 1: the first prompt's, in both engines
            pairs = zip(llm.cache.gather(layer, [0, 1], 8), one.cache.gather(layer, [0, 1], 8), strict=True)
            for ours, theirs in pairs:
                # the same scales; a value may round to the next e4m3 code where the ranks' sums differ in the last bit
                torch.testing.assert_close(ours, theirs, atol=0, rtol=2**-3)


@pytest.mark.stage12
def test_speculative_decoding_with_prefix_caching_equals_stage_10_without_either():
    expected = run(LLM("tiny", stage=10, enable_prefix_caching=False, **SMALL))
    llm = LLM("tiny", speculative_config=NGRAM, **SMALL)
    assert run(llm) == expected
    stats = llm.stats
    assert stats.prefix_cache_hits > 0 and stats.spec_decoding.num_accepted_tokens > 0


@pytest.mark.stage10
def test_async_scheduling_with_prefix_caching_equals_synchronous_stepping_without_it():
    expected = run(LLM("tiny", stage=10, enable_prefix_caching=False, **SMALL))
    llm = LLM("tiny", stage=10, async_scheduling=True, **SMALL)
    assert run(llm) == expected and llm.stats.prefix_cache_hits > 0


@pytest.mark.stage11
@pytest.mark.rounding_free
def test_async_scheduling_over_tensor_parallel_workers_equals_one_synchronous_process():
    expected = run(LLM("tiny", stage=10, **SMALL))
    with LLM("tiny", tensor_parallel_size=2, async_scheduling=True, max_num_batched_tokens=8, **SMALL) as llm:
        assert llm.engine.async_scheduling and isinstance(llm.engine.runner.model, TensorParallelModel)
        assert run(llm) == expected


def connector_config(tmp_path, role):
    return {"kv_role": role, "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}


@pytest.mark.stage14
@pytest.mark.parametrize("part", ["drafts", "async scheduling"])
def test_a_consumer_with_drafts_or_async_scheduling_equals_the_plain_engine(tmp_path, part):
    """The connector's parts stack with the drafts' and with the batch queue: a producer's blocks loaded,
    the same tokens as the plain engine, drafts kept or steps overlapped on the way."""
    expected = run(LLM("tiny", stage=10, **SMALL))
    run(LLM("tiny", kv_transfer_config=connector_config(tmp_path, "kv_producer"), **SMALL))
    extra = dict(speculative_config=NGRAM) if part == "drafts" else dict(async_scheduling=True)
    consumer = LLM("tiny", kv_transfer_config=connector_config(tmp_path, "kv_consumer"), **SMALL, **extra)
    assert run(consumer) == expected
    stats = consumer.stats
    assert stats.kv_transfer.num_loaded_blocks > 0 and stats.kv_transfer.num_failed_blocks == 0
    if part == "drafts":
        assert stats.spec_decoding.num_accepted_tokens > 0


@pytest.mark.stage14
def test_async_scheduling_recomputes_a_block_that_failed_to_load_and_keeps_the_outputs(tmp_path):
    """A stored block damaged: under the batch queue its request goes back and is computed again, the
    same tokens as the plain engine; a chunked prompt's next step, scheduled before the failure was
    known, samples nothing that is kept."""
    expected = run(LLM("tiny", stage=10, **SMALL))
    run(LLM("tiny", kv_transfer_config=connector_config(tmp_path, "kv_producer"), **SMALL))
    for path in sorted(tmp_path.rglob("*.safetensors"))[::2]:
        path.write_bytes(b"not a block")
    consumer = LLM("tiny", kv_transfer_config=connector_config(tmp_path, "kv_consumer"), async_scheduling=True,
                   max_num_batched_tokens=8, **SMALL)
    assert run(consumer) == expected
    stats = consumer.stats
    assert stats.kv_transfer.num_failed_blocks > 0 and stats.kv_transfer.num_recomputed_tokens > 0
    assert consumer.scheduler.block_manager.num_free_blocks == SMALL["num_gpu_blocks"]


@pytest.mark.stage10
def test_v1_without_prefix_caching_equals_v1_with_it_and_v0():
    plain = LLM("tiny", stage=10, enable_prefix_caching=False, **SMALL)
    assert run(plain) == run(LLM("tiny", stage=10, **SMALL)) == run(LLM("tiny", stage=9, **SMALL))
    assert plain.stats.prefix_cache_hits == 0


def preemption_keeps_the_outputs(scheduler, mode):
    """A cache too small for every request at once: preempted requests come back with the same tokens."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = run(LLM("tiny", scheduler=scheduler, block_size=4, num_gpu_blocks=256), params=params)
    tight = LLM("tiny", scheduler=scheduler, preemption_mode=mode, block_size=4, num_gpu_blocks=22, max_model_len=64,
                enable_prefix_caching=False)
    assert run(tight, params=params) == roomy
    assert tight.stats.num_preemptions > 0


@pytest.mark.stage6
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_under_v0_swaps_or_recomputes_and_keeps_the_outputs(mode):
    preemption_keeps_the_outputs("v0", mode)


@pytest.mark.stage10
def test_preemption_under_v1_recomputes_and_keeps_the_outputs():
    preemption_keeps_the_outputs("v1", "recompute")


@pytest.mark.common
def test_the_stand_in_gives_a_steps_rows_as_hidden_states_do():
    """The runner may pick the rows it samples by ``hidden.index_select(0, rows)`` or by ``hidden[rows]``:
    the model's stand-in answers both, with the same rows."""


    rows = torch.tensor([2, 0])
    hidden = torch.randn(3, 8)
    assert torch.equal(hidden.index_select(0, rows), hidden[rows])
    stand_in = StepHidden(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), None, None)
    assert torch.equal(stand_in.index_select(0, rows).logits_indices, stand_in[rows].logits_indices)
    assert stand_in[rows].hidden is stand_in
