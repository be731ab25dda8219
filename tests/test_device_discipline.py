"""The GPU path, proven on a CPU: every tensor of a step on the engine's device, and no host sync in the forward.

Two tools (``helpers_device``): ``fake_cuda`` runs a component on ``device="cuda"`` tensors that
have no data, so that a host tensor meeting a device one raises, and so does any read of a
value (a host sync); ``count_host_syncs`` counts the reads made from minipaged's code in a real
step on the CPU. A decode step reads the device once (the sampled tokens and their
log-probabilities), and the forward never.
"""

import traceback

import numpy as np
import pytest
import torch
from helpers_device import count_host_syncs, fake_cuda, fake_cuda_generator, fake_cuda_module
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorDeviceMismatchError

from minipaged import LLM
from minipaged.common.prompt_logprobs import fill_prompt_logprobs
from minipaged.common.sampler import Sampler, compute_logprobs
from minipaged.common.sampling_params import SamplingParams
from minipaged.models import AttentionMetadata, ModelConfig, build_model
from minipaged.stage2_block_table import PagedKVCache
from minipaged.stage4_reference_attention import paged_attention_ref
from minipaged.stage12_rejection_sampler import Context, RejectionSampler
from minipaged.stage13_fp8_kv_cache import FP8_BACKENDS, FP8Attention, FP8PagedKVCache

pytestmark = pytest.mark.device

VOCAB = 64
CONFIGS = {
    "llama": ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, norm_eps=1e-6,
                         qk_norm=True, qkv_bias=True),
    "gpt2": ModelConfig(model_type="gpt2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=4, head_dim=8, hidden_act="gelu_new", norm_eps=1e-5,
                        max_position_embeddings=64, tie_word_embeddings=True),
}
EVERY_RULE = [  # one row of each kind the sampler treats differently
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=2),
    SamplingParams(temperature=0.7, min_p=0.1, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2),
    SamplingParams(temperature=0.0, logit_bias={3: 2.0}, min_tokens=2, logprobs=3),
]


class Row:
    def __init__(self, generator):
        self.prompt_token_ids, self.output_token_ids, self.generator = [1, 2, 3], [4, 4], generator


def raised_at(error: BaseException) -> str:
    """``function:line text`` of the last frame of minipaged's code in ``error``'s traceback."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "/minipaged/" in f.filename]
    return f"{frames[-1].name}: {frames[-1].line}"


# -- a real step on the CPU: the host syncs counted -------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["ref", "triton"])
@pytest.mark.parametrize("front", ["stage7", "stage10", "stage10-async"])
def test_a_decode_step_reads_the_device_once_and_never_inside_the_forward(front, backend):
    kwargs = dict(attention_backend=backend, num_gpu_blocks=64, block_size=4)
    if front == "stage7":
        llm = LLM("tiny", stage=7, **kwargs)
    else:
        llm = LLM("tiny", stage=10, **kwargs, async_scheduling=front.endswith("async"))
    engine = llm.engine
    for i, params in enumerate(EVERY_RULE[:4]):
        engine.add_request(i, {"prompt_token_ids": [5 + i, 6, 7, 8, 9][: 2 + i]},
                           SamplingParams(**{**params.__dict__, "max_tokens": 12}))
    for _ in range(3):  # the prompts, then decodes
        engine.step()
    with count_host_syncs(llm.model) as count:  # async: reads the step launched before, launches the next
        engine.step()
    assert count.forward == 0, dict(count.in_forward)
    assert 1 <= count.total <= 2, dict(count.calls)


@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_a_hybrid_decode_step_reads_the_device_once_with_metadata_per_group(backend, tmp_path_factory):
    """Stage 15: two KV cache groups, a slot mapping and block tables for each, built from host arrays
    and uploaded; each layer reads its group's, and the forward still reads nothing back."""
    from helpers_checkpoints import save_random_checkpoints, sliding_window_architectures

    mixed = sliding_window_architectures(8, num_layers=4, full_layers=2)["mixed"]
    paths = save_random_checkpoints(tmp_path_factory, {"mixed": mixed})
    llm = LLM(paths["mixed"], attention_backend=backend, num_gpu_blocks=64, block_size=4, max_model_len=64)
    assert len(llm.kv_cache_groups) == 2
    for i, params in enumerate(EVERY_RULE[:4]):
        llm.engine.add_request(i, {"prompt_token_ids": list(range(5 + i, 17 + 3 * i))},
                               SamplingParams(**{**params.__dict__, "max_tokens": 12}))
    for _ in range(3):  # the prompts, then decodes past the window: blocks given back
        llm.engine.step()
    with count_host_syncs(llm.model) as count:
        llm.engine.step()
    assert count.forward == 0, dict(count.in_forward)
    assert count.total == 1, dict(count.calls)


def test_logprobs_asked_for_cost_one_more_read_and_no_more():
    llm = LLM("tiny", stage=7, num_gpu_blocks=64, block_size=4)
    llm.engine.add_request(0, "The cat", SamplingParams(max_tokens=8, logprobs=4, temperature=0.5, top_k=10))
    llm.engine.step()
    with count_host_syncs(llm.model) as count:
        llm.engine.step()
    assert (count.forward, count.total) == (0, 2), dict(count.calls)


def test_the_counter_sees_a_sync_inside_the_forward(monkeypatch):
    """The rule bites: the value check that stage 2's write makes unless told the mapping is checked."""
    llm = LLM("tiny", stage=7, num_gpu_blocks=64, block_size=4)
    write = PagedKVCache.write
    monkeypatch.setattr(PagedKVCache, "write", lambda self, *a, checked=False: write(self, *a, checked=False))
    llm.engine.add_request(0, "The cat", SamplingParams(max_tokens=4))
    llm.engine.step()
    with count_host_syncs(llm.model) as count:
        llm.engine.step()
    assert count.forward >= llm.model_config.num_layers


def test_an_unchecked_mapping_is_refused_before_the_forward():
    """The checks moved from the layers to the step's metadata: a slot outside the cache still raises."""
    cache = PagedKVCache(1, 4, 2, 1, 8)
    from minipaged.stage7_model_runner import build_attention_metadata

    good = dict(block_tables=np.array([[0, 1]], np.int32), seq_lens=np.array([3], np.int32), query_start_loc=None)
    build_attention_metadata(cache, np.array([2]), **good, backend=paged_attention_ref)
    for slots, tables in (([8], [[0, 1]]), ([-1], [[0, 1]]), ([2], [[0, 4]])):
        with pytest.raises(ValueError):
            build_attention_metadata(cache, np.array(slots), **{**good, "block_tables": np.array(tables, np.int32)},
                                     backend=paged_attention_ref)


# -- fake CUDA: every component of a step, no host tensor and no read until the sampler's copy -----------------------

def fake_step(config: ModelConfig, backend, num_new: list[int], context: list[int], block_size: int = 4,
              fp8: bool = False):
    """One forward of a randomly shaped model on fake CUDA: its metadata built as the runners build it
    (``fp8``: over stage 13's cache, with its attention backend wrapping ``backend``)."""
    model = build_model(config).eval()
    with fake_cuda():
        params = fake_cuda_module(model)
        sizes = (config.num_layers, 32, block_size, config.num_kv_heads, config.head_dim)
        cache = FP8PagedKVCache(*sizes, device="cuda") if fp8 else PagedKVCache(*sizes, device="cuda")
        if fp8:
            backend = FP8Attention(backend, cache)
        tables = np.arange(len(context) * 8, dtype=np.int32).reshape(len(context), 8)
        ends = np.cumsum(num_new)
        positions = np.concatenate([np.arange(c - n, c) for c, n in zip(context, num_new, strict=True)])
        owner = np.repeat(np.arange(len(context)), num_new)
        slots = tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
        meta = AttentionMetadata.from_host(slots, tables, np.array(context, np.int32),
                                           None if max(num_new) == 1 else np.concatenate([[0], ends]).astype(np.int32),
                                           backend, torch.device("cuda"))
        ids = torch.zeros(len(slots), dtype=torch.int64, device="cuda")
        with torch.inference_mode():
            inputs = (ids, torch.from_numpy(positions).to("cuda"), cache, meta)
            hidden = torch.func.functional_call(model, params, inputs, tie_weights=False)
            last = hidden.index_select(0, torch.from_numpy(ends - 1).to("cuda"))
            logits = torch.nn.functional.linear(last, params["lm_head.weight"])  # compute_logits
        return hidden, logits, cache


@pytest.mark.parametrize("arch", CONFIGS)
def test_a_decode_forward_runs_on_cuda_with_the_reference_backend(arch):
    hidden, logits, cache = fake_step(CONFIGS[arch], paged_attention_ref, [1, 1, 1], [7, 2, 9])
    assert hidden.device.type == "cuda" and hidden.shape == (3, CONFIGS[arch].hidden_size)
    assert logits.device.type == "cuda" and logits.shape == (3, VOCAB)
    assert cache.key_cache[0].device.type == "cuda"


def test_a_decode_forward_over_two_kv_cache_groups_runs_on_cuda():
    """Stage 15 in a tensor-parallel worker: each group's slots and tables stacked on a first axis, uploaded
    once and split into a metadata per group (views); a full layer and a sliding one, each its group's."""
    import dataclasses

    from minipaged.models import GroupedAttentionMetadata

    config = dataclasses.replace(CONFIGS["llama"], sliding_window=4,
                                 layer_types=("full_attention", "sliding_attention"))
    model, block_size, context, num_new = build_model(config).eval(), 4, [7, 2, 9], [1, 1, 1]
    with fake_cuda():
        params = fake_cuda_module(model)
        cache = PagedKVCache(2, 64, block_size, config.num_kv_heads, config.head_dim, device="cuda")
        tables = np.arange(2 * len(context) * 8, dtype=np.int32).reshape(2, len(context), 8)  # a table per group
        positions = np.concatenate([np.arange(c - n, c) for c, n in zip(context, num_new, strict=True)])
        owner = np.repeat(np.arange(len(context)), num_new)
        slots = np.stack([t[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
                          for t in tables])
        meta = AttentionMetadata.from_host(slots, tables, np.array(context, np.int32), None, paged_attention_ref,
                                           torch.device("cuda")).per_group([0, 1])
        assert isinstance(meta, GroupedAttentionMetadata) and meta[1].block_tables.shape == (len(context), 8)
        ids = torch.zeros(len(positions), dtype=torch.int64, device="cuda")
        with torch.inference_mode():
            inputs = (ids, torch.from_numpy(positions).to("cuda"), cache, meta)
            hidden = torch.func.functional_call(model, params, inputs, tie_weights=False)
    assert hidden.device.type == "cuda" and hidden.shape == (len(positions), config.hidden_size)


@pytest.mark.parametrize("arch", CONFIGS)
def test_a_decode_forward_over_an_fp8_cache_runs_on_cuda(arch):
    """Stage 13: quantised on write, the step's blocks dequantised on read, the scales host numbers."""
    hidden, logits, cache = fake_step(CONFIGS[arch], FP8_BACKENDS["ref"], [1, 1, 1], [7, 2, 9], fp8=True)
    assert hidden.device.type == "cuda" and logits.shape == (3, VOCAB)
    assert cache.key_cache[0].device.type == "cuda" and cache.key_cache[0].dtype == torch.float8_e4m3fn


def test_fp8_calibration_reads_the_device_on_the_first_step_only():
    llm = LLM("tiny", kv_cache_dtype="fp8", calculate_kv_scales=True, num_gpu_blocks=64, block_size=4)
    llm.engine.add_request(0, "The cat", SamplingParams(max_tokens=8))
    with count_host_syncs(llm.model) as first:
        llm.engine.step()
    calibration = sum(n for call, n in first.calls.items() if call.startswith("stage13"))
    assert calibration == llm.model_config.num_layers  # max|K| and max|V| together, once per layer
    llm.engine.step()  # the first decode (the prompt's step walked the reference's prompts on the host)
    with count_host_syncs(llm.model) as later:
        llm.engine.step()
    assert later.forward == 0, dict(later.in_forward)


def test_the_reference_walks_a_step_with_prompts_on_the_host():
    """Stated on stage 4's page: with prompts in the step, the reference reads query_start_loc back
    (the definition, sequence by sequence); stage 5's prefill kernel does not (below)."""
    with pytest.raises(DataDependentOutputException) as error:
        fake_step(CONFIGS["llama"], paged_attention_ref, [3, 1, 5], [7, 2, 9])
    assert raised_at(error.value).startswith("paged_attention_ref")


def test_a_host_tensor_in_the_forward_is_caught(monkeypatch):
    """The rule bites: RoPE frequencies left on the host meet the device's positions."""
    model = build_model(CONFIGS["llama"])
    with fake_cuda():
        params = fake_cuda_module(model)
        params["inv_freq"] = model.inv_freq  # a host tensor
        cache = PagedKVCache(2, 8, 4, 2, 8, device="cuda")
        meta = AttentionMetadata.from_host(np.array([0]), np.array([[0]], np.int32), np.array([1], np.int32), None,
                                           paged_attention_ref, torch.device("cuda"))
        with pytest.raises(FakeTensorDeviceMismatchError), torch.inference_mode():
            torch.func.functional_call(model, params, (torch.zeros(1, dtype=torch.long, device="cuda"),
                                                       torch.zeros(1, dtype=torch.long, device="cuda"), cache, meta),
                                       tie_weights=False)


class Launches:
    """Stand-ins for stage 5's kernels: each launch checks that every tensor it gets is on CUDA."""

    def __init__(self):
        self.launched = []

    def kernel(self, name):
        parent = self

        class Kernel:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                    assert tensors and all(t.device.type == "cuda" for t in tensors)
                    assert all(isinstance(g, int) for g in grid)  # the grid is known on the host
                    parent.launched.append(name)
                return launch
        return Kernel()


@pytest.mark.parametrize("num_new,context,expected", [
    ([1, 1], [7, 2], ["_decode_v1_kernel"]),  # one partition covers the longest: v1
    ([1, 1], [600, 3], ["_decode_v2_partial_kernel", "_decode_v2_reduce_kernel"]),  # 2 partitions, 8 heads: v2
    ([3, 1, 5], [7, 2, 9], ["_prefill_kernel"]),
])
def test_the_triton_backend_prepares_its_launches_on_cuda(monkeypatch, num_new, context, expected):
    from minipaged import stage5_triton_attention as s5

    launches = Launches()
    for name in ("_decode_v1_kernel", "_decode_v2_partial_kernel", "_decode_v2_reduce_kernel", "_prefill_kernel"):
        monkeypatch.setattr(s5, name, launches.kernel(name))
    fake_step(CONFIGS["llama"], s5.paged_attention_triton, num_new, context, block_size=128)
    assert launches.launched == expected * CONFIGS["llama"].num_layers
    launches.launched.clear()  # the same launches over stage 13's FP8 cache
    fake_step(CONFIGS["llama"], FP8_BACKENDS["triton"], num_new, context, block_size=128, fp8=True)
    assert launches.launched == expected * CONFIGS["llama"].num_layers


def test_the_sampler_runs_every_rule_on_cuda_up_to_its_one_copy_to_the_host():
    params = EVERY_RULE * 2
    with fake_cuda():
        logits = torch.empty(len(params), VOCAB, device="cuda")
        rows = [Row(fake_cuda_generator(i) if p.temperature > 0 else None) for i, p in enumerate(params)]
        with pytest.raises(DataDependentOutputException) as error:
            Sampler(eos_token_ids=[0])(logits, rows, params)
    assert "tolist()" in raised_at(error.value) and raised_at(error.value).startswith("result")


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "processed_logits"])
def test_every_logprobs_mode_stays_on_cuda(mode):
    with fake_cuda():
        logits = torch.empty(2, VOCAB, device="cuda")
        rows = [Row(fake_cuda_generator()), Row(None)]
        with pytest.raises(DataDependentOutputException) as error:
            Sampler(logprobs_mode=mode)(logits, rows, [SamplingParams(temperature=0.5, top_p=0.5, logprobs=2),
                                                       SamplingParams(temperature=0.0)])
    assert raised_at(error.value).startswith("result")


def test_a_generator_on_the_host_is_refused_for_cuda_logits():
    """The rule bites: what a CPU generator does to a CUDA draw (CUDA refuses it too)."""
    with fake_cuda():
        logits = torch.empty(1, VOCAB, device="cuda")
        with pytest.raises(RuntimeError, match="generator"):
            Sampler()(logits, [Row(torch.Generator())], [SamplingParams(temperature=1.0)])


def test_prompt_logprobs_stay_on_cuda_up_to_the_copy():
    with fake_cuda():
        logits = torch.empty(4, VOCAB, device="cuda")
        with pytest.raises(DataDependentOutputException) as error:
            fill_prompt_logprobs([None] * 5, logits, [1, 2, 3, 4, 5], range(1, 5), 2)
    assert raised_at(error.value).startswith("result")
    with fake_cuda(), pytest.raises(DataDependentOutputException):
        compute_logprobs(torch.empty(2, VOCAB, device="cuda"), [1, 2], [None, None])


def test_the_rejection_sampler_builds_its_targets_on_cuda_and_stops_at_the_draw():
    sampler = RejectionSampler(eos_token_ids=[0])
    params = SamplingParams(temperature=0.9, top_k=4, top_p=0.8, repetition_penalty=1.1, min_tokens=5)
    with fake_cuda():
        target = sampler.target_logits(torch.empty(VOCAB, device="cuda"), Context([1, 2], [3]), params)
        assert target.device.type == "cuda"
        with pytest.raises(DataDependentOutputException):  # accept or resample: a host decision per position
            sampler(torch.empty(3, VOCAB, device="cuda"), [1, 2], [3], fake_cuda_generator(), params, [5, 6])


def test_speculative_decoding_steps_are_counted_too():
    """A verification step reads the device once per position it decides (the rejection sampler's rule is
    sequential), never inside the forward."""
    llm = LLM("tiny", num_gpu_blocks=64, block_size=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                          "prompt_lookup_max": 2})
    llm.engine.add_request(0, {"prompt_token_ids": [5, 6, 5, 6, 5, 6, 5]}, SamplingParams(max_tokens=10))
    llm.engine.step()
    with count_host_syncs(llm.model) as count:
        llm.engine.step()
    assert count.forward == 0, dict(count.in_forward)


def test_each_tensor_parallel_rank_takes_its_own_gpu(monkeypatch):
    """NCCL wants one GPU per rank: "cuda" means GPU ``LOCAL_RANK`` (torchrun's) or the rank."""
    from minipaged.stage11_worker import Worker

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert Worker.rank_device(torch.device("cuda"), 3) == torch.device("cuda", 3)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert Worker.rank_device(torch.device("cuda"), 5) == torch.device("cuda", 1)
    assert Worker.rank_device(torch.device("cuda", 2), 0) == torch.device("cuda", 2)  # named: kept
    assert Worker.rank_device(torch.device("cpu"), 3) == torch.device("cpu")


class FakeCudaModel:
    """A model's forward and ``compute_logits`` over fake CUDA stand-ins for its weights (a runner
    calls nothing else of it)."""

    def __init__(self, model):
        self.model, self.params = model, fake_cuda_module(model)

    def __call__(self, *inputs):
        return torch.func.functional_call(self.model, self.params, inputs, tie_weights=False)

    def compute_logits(self, hidden):
        return torch.nn.functional.linear(hidden, self.params["lm_head.weight"])


@pytest.mark.parametrize("front", ["stage7", "stage10"])
def test_a_whole_step_runs_on_cuda_from_the_schedulers_output_to_the_samplers_one_copy(front, monkeypatch):
    """The runner's input preparation (flat inputs, slot mapping, tables, lengths: built on the host,
    checked, copied once), the forward, the logits and the sampler, every tensor on the device."""
    from minipaged import stage5_triton_attention as s5
    from minipaged.stage6_swapping import SwapPagedKVCache
    from minipaged.stage7_model_runner import ModelRunner
    from minipaged.stage10_model_runner import V1ModelRunner

    llm = LLM("tiny", stage=int(front.removeprefix("stage")), num_gpu_blocks=32, block_size=4)
    engine, mc = llm.engine, llm.model_config
    for i, params in enumerate(EVERY_RULE[:3]):
        engine.add_request(i, {"prompt_token_ids": [5 + i, 6, 7, 8, 9, 10][: 3 + i]}, params)
    out = llm.scheduler.schedule()  # the prompts: the prefill kernel's launch, stood in for
    launches = Launches()
    monkeypatch.setattr(s5, "_prefill_kernel", launches.kernel("_prefill_kernel"))
    with fake_cuda():
        cache = SwapPagedKVCache(mc.num_layers, 32, 4, mc.num_kv_heads, mc.head_dim, device="cuda")
        model = FakeCudaModel(llm.model)
        if front == "stage7":
            logits = ModelRunner(model, cache, llm.scheduler.block_manager, s5.paged_attention_triton).execute(out)
        else:
            runner = V1ModelRunner(model, cache, 4, 8, llm.max_model_len, s5.paged_attention_triton)
            _, logits = runner.execute_model(out)
        assert logits.device.type == "cuda" and logits.shape == (3, mc.vocab_size)
        assert launches.launched == ["_prefill_kernel"] * mc.num_layers
        rows = [Row(fake_cuda_generator(i)) for i in range(3)]
        with pytest.raises(DataDependentOutputException) as error:
            Sampler()(logits, rows, EVERY_RULE[:3])
    assert raised_at(error.value).startswith("result")


def test_a_batch_queue_step_takes_its_placeholders_tokens_on_cuda(monkeypatch):
    """Async scheduling: step N + 1 is scheduled before N's tokens are known; its runner fills the
    placeholders from N's sampled tokens on the device (``prepare_input_ids``), with no read back."""
    from minipaged import stage5_triton_attention as s5
    from minipaged.stage6_swapping import SwapPagedKVCache
    from minipaged.stage10_model_runner import V1ModelRunner

    llm = LLM("tiny", async_scheduling=True, num_gpu_blocks=32, block_size=4)
    mc = llm.model_config
    for i in range(3):
        llm.engine.add_request(i, {"prompt_token_ids": [5 + i, 6, 7, 8, 9][: 3 + i]},
                               SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    steps = [llm.scheduler.schedule()]  # the prompts
    for request in steps[0].scheduled:  # their first tokens, as the engine appends them
        llm.engine.append_token(request, request.seqs[0], 7, 0.0, None)
    steps.append(llm.scheduler.schedule())  # the first decodes, of tokens known on the host
    steps.append(llm.scheduler.schedule())  # one placeholder each: the token the step before samples
    assert [len(out.num_scheduled_tokens) for out in steps] == [3, 3, 3]
    assert steps[2].scheduled_cached_reqs.new_token_ids == [[], [], []]  # nothing new: placeholders
    launches = Launches()
    monkeypatch.setattr(s5, "_prefill_kernel", launches.kernel("_prefill_kernel"))
    monkeypatch.setattr(s5, "_decode_v1_kernel", launches.kernel("_decode_v1_kernel"))
    with fake_cuda():
        cache = SwapPagedKVCache(mc.num_layers, 32, 4, mc.num_kv_heads, mc.head_dim, device="cuda")
        runner = V1ModelRunner(FakeCudaModel(llm.model), cache, 4, 8, llm.max_model_len, s5.paged_attention_triton)
        for out in steps:
            req_ids, logits = runner.execute_model(out)
            runner.set_prev_sampled(req_ids, logits.max(dim=-1).indices)  # on the device, never read
        assert logits.device.type == "cuda" and logits.shape == (3, mc.vocab_size)
    assert launches.launched == ["_prefill_kernel"] * mc.num_layers + ["_decode_v1_kernel"] * 2 * mc.num_layers


# -- stage 14: a KV connector's loads and saves stay out of the forward ----------------------------------------------

@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer"])
def test_a_connectors_loads_and_saves_read_no_device_value_inside_the_forward(kv_role, tmp_path):
    """A producer's step that saves blocks and a consumer's step that loads them: the forward reads nothing
    back; the saves come to the host after it (``wait_for_save``)."""
    prompt = {"prompt_token_ids": list(range(40, 53))}  # 3 blocks of 4 travel
    store = {"kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    params = SamplingParams(max_tokens=2, temperature=0.0)
    if kv_role == "kv_consumer":
        LLM("tiny", block_size=4, num_gpu_blocks=32, kv_transfer_config={"kv_role": "kv_producer", **store}
            ).generate([prompt], params, use_tqdm=False)
    llm = LLM("tiny", block_size=4, num_gpu_blocks=32, attention_backend="triton",  # the reference walks prompts
              kv_transfer_config={"kv_role": kv_role, **store})
    llm.engine.add_request(0, prompt, params)
    with count_host_syncs(llm.model) as count:
        llm.engine.step()
    transfer = llm.stats.kv_transfer
    assert (transfer.num_saved_blocks, transfer.num_loaded_blocks) == ((3, 0) if kv_role == "kv_producer" else (0, 3))
    assert count.forward == 0, dict(count.in_forward)


def test_a_connectors_step_runs_on_cuda_up_to_the_saves_copy_to_the_host(tmp_path, monkeypatch):
    """On fake CUDA tensors: the loads copied into the cache, the forward, each layer's blocks gathered on
    the device; the first read of a value is the saves' copy to the host, after the forward."""
    from minipaged import stage5_triton_attention as s5
    from minipaged.stage6_swapping import SwapPagedKVCache
    from minipaged.stage10_model_runner import V1ModelRunner
    from minipaged.stage14_disaggregated_prefill import KVConnectorAttention, KVConnectorWorker
    from minipaged.stage14_kv_connector import KVConnectorRole, create_connector, model_identity

    store = {"kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    first = {"prompt_token_ids": list(range(60, 69))}
    LLM("tiny", block_size=4, num_gpu_blocks=32, kv_transfer_config={"kv_role": "kv_producer", **store}
        ).generate([first], SamplingParams(max_tokens=1), use_tqdm=False)  # 2 blocks on disk
    llm = LLM("tiny", block_size=4, num_gpu_blocks=32, kv_transfer_config={"kv_role": "kv_both", **store})
    mc = llm.model_config
    llm.engine.add_request(0, first, SamplingParams(max_tokens=2))  # loads 2 blocks
    llm.engine.add_request(1, {"prompt_token_ids": list(range(80, 89))}, SamplingParams(max_tokens=2))  # saves 2
    out = llm.scheduler.schedule()
    connector = create_connector(llm.config.kv_transfer_config, KVConnectorRole.WORKER, 4, model_identity(llm.model))
    launches = Launches()
    monkeypatch.setattr(s5, "_prefill_kernel", launches.kernel("_prefill_kernel"))
    with fake_cuda():
        cache = SwapPagedKVCache(mc.num_layers, 32, 4, mc.num_kv_heads, mc.head_dim, device="cuda")
        runner = V1ModelRunner(FakeCudaModel(llm.model), cache, 4, 8, llm.max_model_len,
                               KVConnectorAttention(s5.paged_attention_triton, cache, connector),
                               kv_connector=KVConnectorWorker(connector, cache))
        with pytest.raises((DataDependentOutputException, RuntimeError)) as error:  # a fake tensor has no bytes
            runner.execute_model(out)
    # the saves' copy to the host, however it is written (.cpu(), .to("cpu"), a host buffer's copy_), or their
    # bytes hashed on the host: the first read of a device value, after the forward
    assert raised_at(error.value).startswith(("checksum", "wait_for_save"))
    assert launches.launched == ["_prefill_kernel"] * mc.num_layers  # the whole forward ran first
    assert connector.make_stats().num_loaded_blocks == 2 and connector.metadata is None
