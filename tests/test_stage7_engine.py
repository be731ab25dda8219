"""Stage 7: the engine, checked against Hugging Face transformers on the same weights."""

import dataclasses
import json
from functools import partial

import helpers_tolerances as tolerances
import pytest
import torch
import transformers

from minipaged import LLM as _LLM
from minipaged.stage7_engine import SamplingParams
from minipaged.stage7_model_runner import process_logits, sample

LLM = partial(_LLM, stage=7)  # the engine as of stage 7

pytestmark = pytest.mark.stage7

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
ARCHITECTURES = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE),
    "llama-mha-bias": lambda: transformers.LlamaConfig(**{**COMMON, "num_key_value_heads": 4}, attention_bias=True,
                                                       mlp_bias=True,
                                                       rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**{**COMMON, "num_key_value_heads": 1}, head_dim=32),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256),
}
PROMPT_LENGTHS = (3, 17, 40, 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A seeded, randomly initialised transformers model per architecture, saved with save_pretrained."""
    made = {}
    for i, (name, config) in enumerate(ARCHITECTURES.items()):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(config()).eval()
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        made[name] = (path, model)
    return made


def hf_greedy(model, prompt, steps):
    ids = torch.tensor([prompt])  # an explicit mask: else transformers takes pad tokens for padding
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0].log_softmax(-1)


def prompts_for(vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def assert_equal_to_hf(llm, hf_model, prompts, steps):
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, logprobs = hf_greedy(hf_model, prompt, steps)
        assert output.outputs[0].token_ids == tokens
        assert output.outputs[0].finish_reason == "length"
        tol = tolerances.logprobs(llm.model_config, len(prompt) + steps)
        for step, ours in enumerate(output.outputs[0].logprobs):
            assert list(ours.values()) == pytest.approx([logprobs[step, t].item() for t in ours], **tol)


def test_sampling_matches_its_definitions():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    gen = torch.Generator().manual_seed(0)

    def frequencies(params, draws=6000):
        counts = torch.bincount(torch.tensor([sample(logits, params, gen) for _ in range(draws)]), minlength=5)
        return counts.float() / draws

    for temperature in (0.5, 1.0, 2.0):
        want = torch.softmax(logits / temperature, -1)
        assert (frequencies(SamplingParams(temperature=temperature)) - want).abs().max() < 0.025
    top_k = frequencies(SamplingParams(top_k=2))
    assert top_k[2:].sum() == 0 and abs(top_k[0] - torch.softmax(logits[:2], -1)[0]) < 0.025
    probs = torch.softmax(logits, -1)  # 0.563, 0.207, 0.126, 0.076, 0.028
    kept = process_logits(logits, SamplingParams(top_p=0.8)).isfinite()
    assert kept.tolist() == [True, True, True, False, False]  # 0.563 + 0.207 < 0.8 <= 0.896
    assert process_logits(logits, SamplingParams(top_p=probs[0].item())).isfinite().sum() == 1
    assert process_logits(logits, SamplingParams(top_p=1.0)).isfinite().all()
    assert sample(logits, SamplingParams(temperature=0), gen) == 0


def kept(logits, **params):
    """The indices that ``process_logits`` leaves finite."""
    return process_logits(torch.tensor(logits), SamplingParams(**params)).isfinite().nonzero().flatten().tolist()


def test_sampling_cuts_apply_in_order_temperature_then_top_k_then_top_p():
    logits = [2.0, 1.0, 0.5, 0.0, -1.0]  # probabilities 0.563, 0.207, 0.126, 0.076, 0.028
    # top-k first: the two left hold 0.731 and 0.269, and 0.731 alone reaches 0.7;
    # top-p first would keep 0.563 + 0.207 (two tokens), which top-k then keeps too
    assert kept(logits, top_k=2, top_p=0.7) == [0]
    # temperature first: at 0.5 the top token holds 0.829 >= 0.8 alone; before it, three tokens are needed
    assert kept(logits, temperature=0.5, top_p=0.8) == [0]
    out = process_logits(torch.tensor(logits), SamplingParams(temperature=0.5, top_k=3))
    # the kept logits are the tempered ones: a division (or a product by 1 / T), two roundings at most
    assert torch.allclose(out[:3], torch.tensor(logits[:3]) / 0.5, rtol=tolerances.apart(tolerances.gamma(2)), atol=0)


def test_top_k_keeps_the_ties_at_the_k_th_value():
    assert kept([1.0, 3.0, 2.0, 2.0, 0.0], top_k=2) == [1, 2, 3]
    assert kept([1.0, 3.0, 2.0, 2.0, 0.0], top_k=5) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_set_of_most_likely_tokens_that_reaches_it():
    logits = [0.0, -1.0, 2.0, 0.5, 1.0]  # the fixture above, shuffled: 0.076, 0.028, 0.563, 0.126, 0.207
    assert kept(logits, top_p=0.8) == [2, 3, 4]  # 0.563 + 0.207 < 0.8 <= + 0.126: the crossing token is kept
    assert kept(logits, top_p=1e-6) == [2]  # a tiny p keeps exactly the most likely token
    assert kept(logits, top_p=0.76) == [2, 4]  # 0.563 < 0.76 <= 0.563 + 0.207
    # ties: four equal tokens; half the mass is reached by two of them, so exactly two are kept
    assert len(kept([0.0, 0.0, 0.0, 0.0], top_p=0.5)) == 2
    assert len(kept([0.0, 0.0, 0.0, 0.0], top_p=0.6)) == 3


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_greedy_tokens_and_logprobs_equal_transformers(checkpoints, name):
    path, hf_model = checkpoints[name]
    llm = LLM(str(path), num_gpu_blocks=64, block_size=8)
    assert_equal_to_hf(llm, hf_model, prompts_for(256, seed=len(name)), steps=32)


def assert_prompt_logprobs_equal_hf(llm, hf_model, prompts, k=2):
    """Prompt log-probabilities (raw: the model's log-softmax) equal ``model(ids).logits.log_softmax``."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # (len, vocab)
        tol = tolerances.logprobs(llm.model_config, len(prompt))
        assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
        for i, ours in enumerate(output.prompt_logprobs[1:], start=1):
            assert prompt[i] in ours and len(ours) in (k, k + 1)  # the prompt's token, and the top k
            assert list(ours.values()) == pytest.approx([ref[i - 1, t].item() for t in ours], **tol)
            kth = torch.topk(ref[i - 1], k).values[-1].item()
            assert all(v >= kth - tol["abs"] * max(1, abs(kth)) for t, v in ours.items() if t != prompt[i])


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_prompt_logprobs_equal_transformers(checkpoints, name):
    path, hf_model = checkpoints[name]
    llm = LLM(str(path), num_gpu_blocks=64, block_size=8)
    assert_prompt_logprobs_equal_hf(llm, hf_model, prompts_for(256, seed=len(name)))


def test_prompt_logprobs_are_asked_for_and_other_requests_get_none():
    llm = LLM("tiny")
    prompts = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": [8, 9, 10]}]
    params = [SamplingParams(max_tokens=2, prompt_logprobs=0), SamplingParams(max_tokens=2)]
    asked, plain = llm.generate(prompts, params, use_tqdm=False)
    assert plain.prompt_logprobs is None
    assert [None if d is None else list(d) for d in asked.prompt_logprobs] == [None, [17], [99], [3]]


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_are_the_models_unless_processed_ones_are_asked_for(mode):
    """A +100 ``logit_bias`` makes token 7 certain: processed, its log-probability is 0; raw (the
    default, vLLM V1's), it is what the model gives it, as in a request without the bias."""
    kwargs = {} if mode == "raw_logprobs" else {"logprobs_mode": mode}
    llm = LLM("tiny", **kwargs)
    prompt = {"prompt_token_ids": [5, 17, 99, 3]}
    biased = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logit_bias={7: 100.0}, logprobs=1),
                          use_tqdm=False)[0].outputs[0]
    scored = llm.generate({"prompt_token_ids": prompt["prompt_token_ids"] + [7]},  # the model's, unbiased
                          SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert biased.token_ids == [7]
    want = 0.0 if mode == "processed_logprobs" else scored.prompt_logprobs[-1][7]
    assert biased.logprobs[0][7] == pytest.approx(want, abs=1e-5)
    assert biased.cumulative_logprob == pytest.approx(want, abs=1e-5)


def test_the_triton_backend_equals_transformers_too(checkpoints):
    path, hf_model = checkpoints["qwen2"]
    llm = LLM(str(path), num_gpu_blocks=64, block_size=8, attention_backend="triton")
    assert_equal_to_hf(llm, hf_model, prompts_for(256)[:3], steps=12)


def test_the_tiny_default_model_equals_transformers_and_writes_words():
    from minipaged.models import TINY_MODEL_DIR

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    llm = LLM("tiny", num_gpu_blocks=128)
    assert_equal_to_hf(llm, hf_model, prompts_for(llm.model_config.vocab_size, seed=3), steps=32)
    out = llm.generate(["Return the number of"], SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0]
    words = out.outputs[0].text.split()
    assert out.prompt == "Return the number of" and len(words) >= 3
    assert sum(w.strip(".,:;()'\"").isalpha() for w in words) >= len(words) // 2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemptions_do_not_change_a_single_token(checkpoints, mode):
    path, _ = checkpoints["llama"]
    prompts = [{"prompt_token_ids": p} for p in prompts_for(256, seed=5) * 3]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = LLM(str(path), num_gpu_blocks=256, block_size=4).generate(prompts, params, use_tqdm=False)
    tight = LLM(str(path), num_gpu_blocks=18, block_size=4, max_model_len=64, preemption_mode=mode)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids for o in roomy]
    assert tight.stats.num_preemptions >= 3
    if mode == "swap":
        assert tight.stats.num_swapped_out_blocks > 0
    assert tight.scheduler.block_manager.num_free_blocks == 18


def test_seeded_sampling_is_reproducible_and_seeds_differ(checkpoints):
    path, _ = checkpoints["qwen3"]
    llm = LLM(str(path), num_gpu_blocks=64, block_size=8, seed=1)
    prompt = [{"prompt_token_ids": [5, 6, 7]}]

    def run(**kw):
        params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, ignore_eos=True, **kw)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    assert run(seed=123) == run(seed=123)
    assert run(seed=123) != run(seed=124)
    again = LLM(str(path), num_gpu_blocks=64, block_size=8, seed=1)
    first = again.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert first[0].outputs[0].token_ids == LLM(str(path), num_gpu_blocks=64, block_size=8, seed=1).generate(
        prompt, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids


def test_stop_tokens_and_finish_reasons():
    llm = LLM("tiny", num_gpu_blocks=64)
    free = llm.generate(["The"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    tokens = free.outputs[0].token_ids
    stop_at = tokens[5]
    stopped = llm.generate(["The"], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == tokens[: tokens.index(stop_at) + 1] and stopped.finish_reason == "stop"
    assert free.outputs[0].finish_reason == "length"
    assert free.outputs[0].cumulative_logprob < 0


def test_stop_strings_cut_the_text_and_end_the_output_as_vllms_do():
    llm = LLM("tiny", num_gpu_blocks=64)
    greedy = dict(max_tokens=24, temperature=0, ignore_eos=True)
    free = llm.generate(["The"], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    text, tokens = free.text, free.token_ids
    first = text[len(text) // 3:][:3]  # a string from the middle of the text
    at = text.find(first)
    assert first.strip() and at > 0
    k = next(k for k in range(1, len(tokens) + 1) if first in llm.engine.text(tokens[:k]))  # the token completing it

    def run(**kw):
        return llm.generate(["The"], SamplingParams(**greedy, **kw), use_tqdm=False)[0].outputs[0]

    cut = run(stop=[first[1:], first])  # both end on the same token: the one beginning first wins
    assert (cut.text, cut.token_ids, cut.finish_reason, cut.stop_reason) == (text[:at], tokens[:k], "stop", first)
    kept = run(stop=first, include_stop_str_in_output=True)  # a str is a list of one
    assert (kept.text, kept.token_ids, kept.stop_reason) == (text[:at + len(first)], tokens[:k], first)
    held = run(stop=[first], min_tokens=k + 1)  # no stop before min_tokens, and an earlier occurrence no longer counts
    nxt = text.find(first, at + 1)
    assert held.token_ids == tokens[:len(held.token_ids)] and len(held.token_ids) > k
    assert (held.text, held.finish_reason) == ((text[:nxt], "stop") if nxt >= 0 else (text, "length"))
    never = run(stop=["\u2603 not in this text"])
    assert (never.text, never.finish_reason, never.stop_reason) == (text, "length", None)
    by_token = run(stop_token_ids=[tokens[4]])
    assert by_token.stop_reason == tokens[4] and by_token.finish_reason == "stop"
    with pytest.raises(ValueError):
        SamplingParams(stop=[""])
    bare = LLM("tiny", num_gpu_blocks=64)
    bare.engine.processor.tokenizer = None  # a model folder without tokenizer.json: stop strings cannot be found
    with pytest.raises(ValueError):
        bare.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(stop=["a"]), use_tqdm=False)


@pytest.mark.parametrize(
    "call,error",
    [(lambda llm: llm.generate([""], use_tqdm=False), ValueError),
     (lambda llm: llm.generate([{"prompt_token_ids": [1, 99999]}], use_tqdm=False), ValueError),
     (lambda llm: llm.generate(["a"], SamplingParams(max_tokens=0)), ValueError),
     (lambda llm: llm.generate(["a"], SamplingParams(temperature=-1)), ValueError),
     (lambda llm: llm.generate(["a"], SamplingParams(top_p=0)), ValueError),
     (lambda llm: llm.generate(["a"], SamplingParams(top_p=1.5)), ValueError),
     (lambda llm: llm.generate(["a"], SamplingParams(top_k=0)), ValueError),
     (lambda llm: llm.generate(["a"], SamplingParams(top_k=3.5)), ValueError),
     (lambda llm: llm.generate(["a"], SamplingParams(n=2.0)), ValueError),
     (lambda llm: llm.generate(["a"], SamplingParams(logprobs=5000)), ValueError),  # the vocabulary has 2048
     (lambda llm: llm.generate(["a", {"prompt_token_ids": [1] * 500}], SamplingParams(max_tokens=20)), ValueError),
     (lambda llm: llm.generate([42]), TypeError),
     (lambda llm: llm.generate(["a"], {"max_tokens": 3}), TypeError),
     (lambda llm: LLM("tiny", attention_backend="flash"), ValueError),
     (lambda llm: LLM("tiny", preemption_mode="drop"), ValueError),
     (lambda llm: LLM("tiny", dtype="int8"), ValueError),
     (lambda llm: LLM("meta-llama/Llama-3-8B"), ValueError),
     (lambda llm: LLM("tiny", block_size=0), ValueError),
     (lambda llm: LLM("tiny", num_gpu_blocks=4, max_model_len=512), ValueError),  # 32 blocks of 16 needed
     (lambda llm: LLM("tiny", max_model_len=10**6), ValueError)],  # beyond the model's position table
    ids=["empty", "vocab", "max_tokens", "temperature", "top_p0", "top_p", "top_k", "top_k-float", "n-float",
         "logprobs", "too-long", "type", "params-type", "backend", "mode", "dtype", "hub-id", "block_size", "cache",
         "positions"],
)
def test_bad_input_is_refused_before_anything_runs(call, error):
    llm = LLM("tiny", num_gpu_blocks=64)
    good = {"prompt_token_ids": [1, 2]}
    with pytest.raises(error):
        call(llm)
    assert not llm.engine.has_unfinished_requests() and llm.stats.steps == 0
    assert llm.scheduler.block_manager.num_free_blocks == 64
    assert llm.generate([good], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("at", ["runner", "sampler"])
def test_an_exception_inside_a_step_leaves_the_engine_usable_with_every_block_back(fault, at, monkeypatch):
    llm = LLM("tiny", num_gpu_blocks=32, block_size=4, max_model_len=64)
    prompts = [{"prompt_token_ids": list(range(1, 10 + i))} for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    part = llm.engine.runner if at == "runner" else llm.engine
    name = "execute" if at == "runner" else "sampler"
    original, calls = getattr(part, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise fault("boom")
        return original(*args, **kwargs)

    monkeypatch.setattr(part, name, failing)
    with pytest.raises(fault):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(part, name, original)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    assert llm.scheduler.block_manager.num_free_blocks == 32
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_sharded_checkpoints_and_half_precision_load(checkpoints, tmp_path):
    _, hf_model = checkpoints["llama"]
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert_equal_to_hf(LLM(str(tmp_path), num_gpu_blocks=64, block_size=8), hf_model, prompts_for(256)[:2], steps=8)
    for dtype in ("bfloat16", "float16"):
        llm = LLM(str(tmp_path), num_gpu_blocks=64, block_size=8, dtype=dtype)
        assert llm.cache.key_cache[0].dtype == getattr(torch, dtype)
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_a_final_only_request_has_one_output_when_it_finishes_and_generate_asks_for_that():
    from minipaged.common.sampling_params import RequestOutputKind

    llm = LLM("tiny")
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    expected = llm.generate([{"prompt_token_ids": [3, 4, 5]}], greedy, use_tqdm=False)[0]
    llm.engine.add_request("final", {"prompt_token_ids": [3, 4, 5]},
                           dataclasses.replace(greedy, output_kind=RequestOutputKind.FINAL_ONLY))
    llm.engine.add_request("each", {"prompt_token_ids": [3, 4, 5]}, greedy)
    seen = [[o.request_id for o in llm.engine.step()] for _ in range(5)]
    assert seen == [["each"]] * 4 + [["final", "each"]] or seen == [["each"]] * 4 + [["each", "final"]]
    llm.generate([{"prompt_token_ids": [1]}], greedy, use_tqdm=False)
    assert greedy.output_kind is RequestOutputKind.CUMULATIVE  # generate changes a copy, not the caller's params
    assert expected.outputs[0].token_ids == LLM("tiny").generate([{"prompt_token_ids": [3, 4, 5]}], greedy,
                                                                 use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final_only")


class CacheSnapshot:
    """A stand-in model: no K/V of its own, it only returns a hidden row per token."""

    def __call__(self, ids, positions, cache, meta):
        return torch.zeros(len(ids), 1)


def kv_of(mark, n):
    k = torch.tensor([mark * 100.0 + p for p in range(n)], dtype=torch.float64).view(n, 1, 1)
    return k, -k


@pytest.mark.parametrize("moved", ["swap-in", "swap-out"])
def test_block_moves_run_before_the_copy_on_write_copies(moved):
    """A copy's source may be a block swapped in in this step; its destination may be a block a
    swap-out in this step has just freed. Swap-outs and swap-ins first, the copies after them."""
    from minipaged.common.sequence import Sequence, SequenceGroup, SequenceStatus
    from minipaged.stage3_copy_on_write import RefCountedBlockAllocator
    from minipaged.stage6_scheduler import Scheduler, SchedulerOutputs
    from minipaged.stage6_swapping import SwapBlockSpaceManager, SwapPagedKVCache
    from minipaged.stage7_model_runner import ModelRunner

    manager = SwapBlockSpaceManager(RefCountedBlockAllocator(6), 4, RefCountedBlockAllocator(8))
    scheduler = Scheduler(manager, preemption_mode="swap", max_model_len=20)
    cache = SwapPagedKVCache(1, 6, 4, 1, 1, dtype=torch.float64, num_cpu_blocks=8)
    runner = ModelRunner(CacheSnapshot(), cache, manager, backend=None)
    runner.compute_logits = lambda out, hidden, rows: hidden[rows]
    x = Sequence([1] * 6)  # 2 blocks; forked below, its last block shared by its two sequences
    group = SequenceGroup("x", [x], 2, 2)
    scheduler.add(group)
    y = Sequence([2] * 16)  # 4 full blocks: with x's, the whole cache
    if moved == "swap-out":
        scheduler.add(SequenceGroup("y", [y], 1))
    prefill = scheduler.schedule()
    assert [s for s, _ in prefill.scheduled] == ([x] if moved == "swap-in" else [x, y])
    for seq, n in prefill.scheduled:
        cache.write(0, manager.slot_mapping([seq.seq_id], [n]), *kv_of(seq.prompt_token_ids[0], n))
        seq.append_token(3)
    child = Sequence(list(x.prompt_token_ids), list(x.output_token_ids), status=SequenceStatus.RUNNING,
                     num_computed_tokens=x.num_computed_tokens)
    manager.fork(x.seq_id, child.seq_id)
    group.seqs.append(child)
    if moved == "swap-in":  # x's group goes out and comes back; its GPU blocks are reused meanwhile
        gone = SchedulerOutputs()
        scheduler._preempt(group, gone)
        cache.swap_out(gone.blocks_to_swap_out)
        cache.key_cache[0].fill_(float("nan"))
        cache.value_cache[0].fill_(float("nan"))
    out = scheduler.schedule()  # x's first sequence copies its shared last block before it grows
    assert len(out.blocks_to_copy) == 1
    if moved == "swap-in":
        assert out.blocks_to_swap_in and out.blocks_to_copy[0][0] in dict(out.blocks_to_swap_in).values()
    else:  # x needs a block for the copy: y, the newest, is swapped out, and x copies into a block of y's
        assert [g.seqs for g in out.preempted] == [[y]]
        assert out.blocks_to_copy[0][1] in dict(out.blocks_to_swap_out)
    runner.execute(out)
    for seq in (x, child):
        k, v = cache.gather(0, manager.get_block_table(seq.seq_id), 6)
        torch.testing.assert_close((k, v), kv_of(1, 6), rtol=0, atol=0)
    if moved == "swap-out":
        ids = manager.swapped_tables[y.seq_id].block_ids
        k = cache.cpu_key_cache[0][ids].flatten(0, 1)[:16]
        torch.testing.assert_close(k, kv_of(2, 16)[0], rtol=0, atol=0)
