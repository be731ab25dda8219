"""Models whose layers attend to a sliding window: the windows read from the config, and the
engine equal to transformers on prompts longer than the window, under the features that change
what a step attends over (chunks, preemption, cached prefixes, the kernels, tensor parallelism,
drafts, async scheduling)."""

import json
import shutil

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
from minipaged.models.config import ModelConfig
from minipaged.stage15_hybrid_kv_cache import HybridKVCacheManager

pytestmark = pytest.mark.common

WINDOW = 8
MODELS = sliding_window_architectures(WINDOW, num_layers=3, full_layers=1, max_position_embeddings=256)
COMMON = {k: v for k, v in MODELS["sliding"][1].items() if k != "sliding_window"}  # the shapes, no window
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
KEEP = dict(block_size=4, disable_hybrid_kv_cache_manager=True)  # every block kept: the windows alone (stage 15 frees)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return with_transformers_models(save_random_checkpoints(tmp_path_factory, MODELS))


def prompts(seed=0, lengths=(3, 21, 37, 9)):
    """Prompts shorter and longer than the window: the last ones slide past it in the prompt."""
    return random_prompts(seed, lengths)


def tokens(llm, batch, params=GREEDY):
    return generated_token_ids(llm, batch, params)


@pytest.mark.parametrize("hf, layer_types", [
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2),
     ("full_attention",) * 2 + ("sliding_attention",) * 2),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=8,
          layer_types=["sliding_attention", "full_attention"] * 2), ("sliding_attention", "full_attention") * 2),
    (dict(model_type="mistral", sliding_window=8), ("sliding_attention",) * 4),
    (dict(model_type="mistral", sliding_window=None), ()),
    (dict(model_type="qwen2", use_sliding_window=False, sliding_window=8), ()),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=4), ()),
    (dict(model_type="llama", sliding_window=8), ()),
], ids=["qwen2-from-max_window_layers", "qwen3-layer_types", "mistral", "mistral-none", "qwen2-off",
        "qwen2-no-layer-past-max", "llama"])
def test_each_layers_window_is_read_from_the_config_as_transformers_reads_it(hf, layer_types):
    config = ModelConfig.from_hf({**dict(COMMON, num_hidden_layers=4), **hf})
    assert config.layer_types == layer_types
    windows = [config.window_of(layer) for layer in range(4)]
    assert windows == [8 if t == "sliding_attention" else None for t in layer_types or ["full_attention"] * 4]


@pytest.mark.parametrize("layer_types", [["full_attention"] * 3, ["sliding_attention", "chunked_attention"] * 2])
def test_layer_types_that_do_not_fit_the_model_are_refused(layer_types):
    with pytest.raises(ValueError):
        ModelConfig.from_hf(dict(COMMON, num_hidden_layers=4, model_type="qwen2", use_sliding_window=True,
                                 sliding_window=8, layer_types=layer_types))


@pytest.mark.parametrize("name", list(MODELS))
def test_a_sliding_window_model_equals_transformers_past_its_window(checkpoints, name, tmp_path):
    path, hf_model = checkpoints[name]
    llm = LLM(path, num_gpu_blocks=64, **KEEP)
    assert_equal_to_hf(llm, hf_model, prompts(), steps=20)
    shutil.copytree(path, tmp_path / "full")  # the same weights, no layer sliding
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    config.update(sliding_window=None, layer_types=["full_attention"] * config["num_hidden_layers"])
    (tmp_path / "full" / "config.json").write_text(json.dumps(config))
    full = LLM(str(tmp_path / "full"), num_gpu_blocks=64, block_size=4)
    assert tokens(full, prompts()) != tokens(llm, prompts())  # the window changed what was attended to


@pytest.mark.parametrize("features", [
    dict(max_num_batched_tokens=6),  # prompts in chunks smaller than the window
    dict(num_gpu_blocks=24, max_model_len=64),  # preempted and recomputed
    dict(enable_prefix_caching=True),
    dict(attention_backend="triton"),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}),
    dict(async_scheduling=True),
    dict(stage=7),  # V0's scheduler
], ids=["chunked", "preempted", "prefix-cached", "triton", "drafts", "async", "v0"])
def test_the_features_that_change_a_steps_queries_keep_the_windowed_outputs(checkpoints, features):
    path, _ = checkpoints["mixed"]
    shared = prompts(seed=1, lengths=(30,))[0]
    batch = [shared + p for p in prompts(seed=2, lengths=(2, 11))] + prompts(seed=3, lengths=(19, 5, 40))
    kwargs = dict(num_gpu_blocks=96, **KEEP) | features
    plain = tokens(LLM(path, num_gpu_blocks=96, **(KEEP | dict(enable_prefix_caching=False))), batch)
    llm = LLM(path, **kwargs)
    assert tokens(llm, batch[:1]) + tokens(llm, batch[1:]) == plain[:1] + plain[1:]
    if "max_model_len" in features:
        assert llm.stats.num_preemptions > 0


def test_tensor_parallel_workers_keep_each_layers_window(checkpoints):
    path, _ = checkpoints["mixed"]
    batch = prompts(seed=4, lengths=(25, 12, 33))
    plain = tokens(LLM(path, num_gpu_blocks=64, **KEEP), batch)
    with LLM(path, num_gpu_blocks=64, tensor_parallel_size=2, **KEEP) as llm:
        assert tokens(llm, batch) == plain


@pytest.mark.parametrize("features", [
    dict(kv_transfer_config={"kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": "x"}}),
    dict(stage=14), dict(scheduler="v0"),
], ids=["connector", "stage-14", "v0"])
def test_where_the_hybrid_manager_is_not_served_every_block_is_kept_and_the_windows_still_hold(checkpoints, features,
                                                                                               tmp_path):
    """As vLLM turns its hybrid manager off (with a KV connector, say), the engine keeps every block of
    every layer, and each layer still attends to its window: the outputs do not change."""
    path, hf_model = checkpoints["mixed"]
    if "kv_transfer_config" in features:
        features["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"] = str(tmp_path)
    with LLM(path, num_gpu_blocks=64, block_size=4, **features) as llm:
        assert not isinstance(getattr(llm.scheduler, "kv_cache_manager", None), HybridKVCacheManager)
        assert_equal_to_hf(llm, hf_model, prompts(seed=3, lengths=(25, 9)), steps=12)
        assert llm.scheduler.block_manager.num_free_blocks == llm.scheduler.block_manager.num_total_blocks
