"""On a CUDA device: the engine equal to Hugging Face token for token, the sampler's seeds, a decode step
that waits for the device once, and the server. Skipped without CUDA (the CPU proves the same code
path with fake CUDA tensors: tests/test_device_discipline.py)."""

import gc
import warnings

import pytest
import torch
import transformers
from helpers_checkpoints import save_random_checkpoints

from minipaged import LLM
from minipaged.common.sampler import Sampler
from minipaged.common.sampling_params import SamplingParams
from minipaged.stage7_model_runner import sample

pytestmark = [pytest.mark.gpu, pytest.mark.rounding_free,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
ARCHITECTURES = {  # (transformers config class, its arguments)
    "llama": ("LlamaConfig", {**COMMON, "tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", {**COMMON, "tie_word_embeddings": True}),
    "gpt2": ("GPT2Config", dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256)),
}
PROMPTS = [[5, 17, 3], [9] * 17, list(range(40, 80)), [200]]
STEPS = 12
BF16_UNIT_ROUNDOFF = 2.0**-8  # bfloat16 keeps 8 bits of significand


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_random_checkpoints(tmp_path_factory, ARCHITECTURES)


def hf_model(path, dtype):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


def hf_greedy(model, prompt):
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def ours(llm):
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                          use_tqdm=False)]


@pytest.mark.parametrize("backend", ["ref", "triton"])
@pytest.mark.parametrize("front", ["stage7", "stage10"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_engine_equals_transformers_on_cuda_in_float32(checkpoints, arch, front, backend):
    llm = LLM(str(checkpoints[arch]), stage=int(front.removeprefix("stage")), device="cuda", dtype="float32",
              attention_backend=backend, num_gpu_blocks=64, block_size=8)
    hf = hf_model(checkpoints[arch], torch.float32)
    assert ours(llm) == [hf_greedy(hf, p) for p in PROMPTS]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_in_bfloat16_a_token_differs_only_where_the_two_best_are_within_rounding(checkpoints, arch):
    """Each engine rounds its logits to bfloat16's 8 bits: where float32 says two tokens are closer than
    one rounding of the largest logit on each side, either may win; nowhere else."""
    llm = LLM(str(checkpoints[arch]), device="cuda", dtype="bfloat16",
                                   attention_backend="triton", num_gpu_blocks=64, block_size=8)
    hf32 = hf_model(checkpoints[arch], torch.float32)
    hf16 = hf_model(checkpoints[arch], torch.bfloat16)
    for prompt, mine in zip(PROMPTS, ours(llm), strict=True):
        theirs = hf_greedy(hf16, prompt)
        same = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), None)
        if same is None:
            continue
        with torch.no_grad():
            logits = hf32(torch.tensor([prompt + mine[:same]], device="cuda")).logits[0, -1].float()
        gap = abs(float(logits[mine[same]] - logits[theirs[same]]))
        assert gap <= 2 * 2 * BF16_UNIT_ROUNDOFF * float(logits.abs().max()), (prompt, same, gap)


def test_a_seed_draws_the_same_tokens_on_the_device_and_the_batch_equals_one_row():
    torch.manual_seed(0)
    logits = torch.randn(3, 1000, device="cuda")
    params = [SamplingParams(temperature=0.8, top_k=50, seed=s) for s in (1, 2, 3)]

    class Row:
        def __init__(self, seed):
            self.prompt_token_ids, self.output_token_ids = [1], []
            self.generator = torch.Generator(device="cuda").manual_seed(seed)

    batch = Sampler()(logits.clone(), [Row(p.seed) for p in params], params).token_ids
    one_by_one = [sample(logits[i], p, torch.Generator(device="cuda").manual_seed(p.seed))
                  for i, p in enumerate(params)]
    assert batch == one_by_one
    assert batch == Sampler()(logits.clone(), [Row(p.seed) for p in params], params).token_ids
    llm = LLM("tiny", device="cuda", attention_backend="triton", num_gpu_blocks=256)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7)
    first = llm.generate(["The cat"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(["The cat"], seeded, use_tqdm=False)[0].outputs[0].token_ids == first


@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_a_decode_step_waits_for_the_device_at_most_twice(backend):
    """CUDA's own count: torch warns at every synchronizing call (set_sync_debug_mode)."""
    llm = LLM("tiny", device="cuda", attention_backend=backend, num_gpu_blocks=256)
    for i in range(8):
        llm.engine.add_request(i, {"prompt_token_ids": [3 + i, 4, 5]}, SamplingParams(max_tokens=10, temperature=0.5))
    for _ in range(3):
        llm.engine.step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 2, [str(w.message) for w in syncs]


def test_the_kv_cache_takes_what_gpu_memory_utilization_leaves():
    total = torch.cuda.mem_get_info()[1]
    small = LLM("tiny", device="cuda", gpu_memory_utilization=0.05)
    key_cache = small.cache.key_cache
    per_block = 2 * len(key_cache) * key_cache[0][0].numel() * key_cache[0].element_size()  # K and V, every layer
    small_blocks = small.config.num_gpu_blocks
    assert 0 < small_blocks * per_block <= 0.05 * total
    del small, key_cache
    gc.collect()  # an engine's objects refer to one another: collected, its memory is free for the next
    large = LLM("tiny", device="cuda", gpu_memory_utilization=0.10)
    assert large.config.num_gpu_blocks > 1.5 * small_blocks
    del large
    fixed = LLM("tiny", device="cuda", num_gpu_blocks=64, gpu_memory_utilization=0.9)
    assert fixed.config.num_gpu_blocks == 64  # an explicit size wins, as vLLM's num_gpu_blocks_override does


def test_the_server_answers_on_cuda():
    from fastapi.testclient import TestClient

    from minipaged.serving.app import build_app

    llm = LLM("tiny", device="cuda", attention_backend="triton", num_gpu_blocks=256)
    expected = llm.generate(["The cat"], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0]
    with TestClient(build_app(llm), base_url="http://127.0.0.1") as client:  # the server answers loopback only
        reply = client.post("/v1/completions", json={"model": "tiny", "prompt": "The cat", "max_tokens": 8,
                                                     "temperature": 0.0})
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["text"] == expected.outputs[0].text


@pytest.mark.parametrize("options", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
    {"async_scheduling": True},
    {"enable_prefix_caching": False, "max_num_batched_tokens": 8},
    {"scheduler": "v0", "enable_prefix_caching": True},
], ids=["drafts", "async", "chunks-without-prefix-caching", "v0-prefix-caching"])
def test_the_parts_a_configuration_chooses_combine_on_cuda(checkpoints, options):
    """The engine composed with drafts, async stepping, small chunks or V0's scheduler: float32 greedy
    tokens equal to transformers' on the device, as the plain engine's are."""
    llm = LLM(str(checkpoints["llama"]), device="cuda", dtype="float32", attention_backend="triton",
              num_gpu_blocks=64, block_size=8, **options)
    hf = hf_model(checkpoints["llama"], torch.float32)
    assert ours(llm) == [hf_greedy(hf, p) for p in PROMPTS]


def test_decode_steps_replayed_from_cuda_graphs_give_the_tokens_of_eager_ones():
    """vLLM's default on CUDA: decode steps replay a graph of their batch-size bucket; outputs token for
    token those of eager execution, for batches that shrink through every bucket."""
    prompts = [{"prompt_token_ids": [5 + i, 17, 90, 3, 42][: 1 + i % 5]} for i in range(21)]
    params = [SamplingParams(max_tokens=2 + i, temperature=0.0, ignore_eos=True) for i in range(21)]
    kwargs = dict(device="cuda", attention_backend="triton", num_gpu_blocks=256, max_num_seqs=24, max_model_len=64)
    eager = LLM("tiny", enforce_eager=True, **kwargs)
    graphs = LLM("tiny", **kwargs)
    assert [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert graphs.model.replays > 0 and graphs.model.sizes == [1, 2, 4, 8, 16, 24]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="Triton's fp8e4nv needs compute capability 8.9")
def test_an_fp8_cache_on_cuda_gives_the_references_tokens_with_the_kernels_and_the_graphs():
    """Stage 13 on the device: the Triton kernels over e4m3, eager and replayed from CUDA graphs, give the
    tokens of the reference over the same cache (float32 model, scales 1.0), and the cache is e4m3."""
    prompts = [{"prompt_token_ids": [5 + i, 17, 90, 3, 42][: 1 + i % 5]} for i in range(9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kwargs = dict(device="cuda", kv_cache_dtype="fp8", num_gpu_blocks=256, max_num_seqs=16, max_model_len=64)
    runs = {}
    for name, options in {"ref": dict(attention_backend="ref"),
                          "triton": dict(attention_backend="triton", enforce_eager=True),
                          "graphs": dict(attention_backend="triton")}.items():
        llm = LLM("tiny", **kwargs, **options)
        assert llm.cache.key_cache[0].dtype == torch.float8_e4m3fn
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runs["triton"] == runs["ref"] and runs["graphs"] == runs["ref"]
