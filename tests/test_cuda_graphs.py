"""Decode steps replayed from CUDA graphs: the buckets, the static buffers and the scratch block,
checked on a CPU with a stand-in that replays by running what the graph recorded; on a GPU, the
real graphs equal eager execution token for token (tests/test_gpu.py)."""

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.common.config import EngineConfig
from minipaged.models.cuda_graphs import CUDAGraphModel, capture_sizes

pytestmark = pytest.mark.device


class Replay:
    """A CUDA graph's stand-in on a CPU: replaying runs the forward the graph would have recorded,
    over the same buffers."""

    def __init__(self, model: CUDAGraphModel, size: int) -> None:
        self.model, self.size = model, size

    def replay(self) -> None:
        self.model.run_static(self.size)


@pytest.fixture
def graphs_on_a_cpu(monkeypatch):
    monkeypatch.setattr(EngineConfig, "uses_cuda_graphs", property(lambda self: not self.enforce_eager))

    def capture(self):
        for size in reversed(self.sizes):
            self.run_static(size)
            self.graphs[size] = Replay(self, size)

    monkeypatch.setattr(CUDAGraphModel, "capture", capture)


def test_capture_sizes_are_vllms():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(6) == [1, 2, 4] and capture_sizes(1) == [1] and capture_sizes(20) == [1, 2, 4, 8, 16]


def test_graphs_are_used_on_cuda_with_the_triton_kernels_in_one_process_unless_eager():
    assert EngineConfig(device="cuda", attention_backend="triton").uses_cuda_graphs
    for off in (dict(device="cpu", attention_backend="triton"), dict(device="cuda"),
                dict(device="cuda", attention_backend="triton", enforce_eager=True),
                dict(device="cuda", attention_backend="triton", tensor_parallel_size=2)):
        assert not EngineConfig(**off).uses_cuda_graphs, off
    with pytest.raises(ValueError):
        EngineConfig(enforce_eager="no")


@pytest.mark.parametrize("options", [dict(stage=10), dict(stage=10, async_scheduling=True), dict(stage=7)])
def test_replayed_decode_steps_give_the_tokens_of_eager_ones(graphs_on_a_cpu, options):
    """Batches of every size between the buckets, padded up to the next one; the padded rows write into
    the scratch block, which no sequence is given, and change nothing."""
    prompts = [{"prompt_token_ids": [5 + i, 17, 90, 3][: 1 + i % 4]} for i in range(11)]
    params = [SamplingParams(max_tokens=2 + i, temperature=0.0, ignore_eos=True) for i in range(11)]  # 11 down to 1
    kwargs = dict(num_gpu_blocks=48, block_size=4, max_num_seqs=11, max_model_len=32, **options)
    eager = LLM("tiny", enforce_eager=True, **kwargs)
    graphs = LLM("tiny", **kwargs)
    assert isinstance(graphs.engine.runner.model, CUDAGraphModel) and not isinstance(eager.model, CUDAGraphModel)
    assert graphs.cache.key_cache[0].shape[0] == 49 and graphs.scheduler.block_manager.num_total_blocks == 48
    scratch = graphs.model.scratch_block
    tokens = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)] == tokens
    assert graphs.model.replays > 0 and graphs.model.sizes == [1, 2, 4, 8]  # 11 > 8: the largest steps eagerly
    for layer in range(len(eager.cache.key_cache)):  # every block a sequence holds: the same K/V
        torch.testing.assert_close(graphs.cache.key_cache[layer][:48], eager.cache.key_cache[layer][:48])
    assert scratch == 48


def test_a_prefill_or_a_chunk_runs_eagerly(graphs_on_a_cpu):
    llm = LLM("tiny", stage=10, num_gpu_blocks=32, block_size=4, max_num_seqs=4, max_model_len=32,
              max_num_batched_tokens=3)
    llm.generate([{"prompt_token_ids": [5, 17, 90, 3, 42]}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.model.replays == 0  # chunks of 3, then nothing to decode
    llm.generate([{"prompt_token_ids": [5, 17]}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert llm.model.replays == 2  # the prompt eagerly, then two decodes replayed


def test_a_replayed_step_reads_nothing_back_beyond_the_samplers_one_copy(graphs_on_a_cpu):
    """The step's inputs go into the graph's buffers device to device: the forward still reads nothing
    back, and the step reads the device once (the sampled tokens), as an eager step does."""
    from helpers_device import count_host_syncs

    llm = LLM("tiny", stage=10, num_gpu_blocks=32, block_size=4, max_num_seqs=4, max_model_len=32)
    for i in range(3):
        llm.engine.add_request(i, {"prompt_token_ids": [5 + i, 6, 7]}, SamplingParams(max_tokens=8, temperature=0.5))
    llm.engine.step()  # the prompts, eagerly
    replays = llm.model.replays
    with count_host_syncs(llm.model.model) as count:
        llm.engine.step()
    assert llm.model.replays == replays + 1
    assert count.forward == 0, dict(count.in_forward)
    assert count.total == 1, dict(count.calls)


def test_a_hybrid_cache_replays_with_a_slot_mapping_and_block_tables_per_group(graphs_on_a_cpu, tmp_path_factory):
    """Stage 15's KV cache groups: the graphs' buffers hold each group's slots and tables, and each layer
    reads its group's, as in an eager step."""
    from helpers_checkpoints import random_prompts, save_random_checkpoints, sliding_window_architectures

    from minipaged.stage15_hybrid_kv_cache import HybridKVCacheManager

    mixed = sliding_window_architectures(8, num_layers=4, full_layers=2)["mixed"]
    paths = save_random_checkpoints(tmp_path_factory, {"mixed": mixed})
    prompts = [{"prompt_token_ids": p} for p in random_prompts(0, (3, 21, 12, 30, 5))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kwargs = dict(num_gpu_blocks=96, block_size=4, max_num_seqs=8, max_model_len=64)
    eager = LLM(paths["mixed"], enforce_eager=True, **kwargs)
    graphs = LLM(paths["mixed"], **kwargs)
    assert isinstance(graphs.model, CUDAGraphModel) and isinstance(graphs.scheduler.kv_cache_manager,
                                                                   HybridKVCacheManager)
    assert graphs.model.block_tables.shape[0] == len(graphs.kv_cache_groups) == 2
    tokens = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)] == tokens
    assert graphs.model.replays > 0
    manager = graphs.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_total_blocks
