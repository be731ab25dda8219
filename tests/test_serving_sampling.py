"""SamplingParams with vLLM's rules, and the logits processors checked against hand computations."""

import math
from functools import partial

import pytest
import torch

from minipaged import LLM as _LLM
from minipaged import SamplingParams
from minipaged.common.logits_processors import apply_logits_processors, process_row

LLM = partial(_LLM, scheduler="v0")  # V0's scheduler (stage 6): n > 1, beams and swap, as this file serves them

pytestmark = pytest.mark.serving


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", num_gpu_blocks=64, max_model_len=128)


def test_tiny_temperatures_are_greedy_and_small_ones_raised_as_vllm_does():
    for t in (0, 0.0, 1e-300, 1e-38, 9e-6):
        p = SamplingParams(temperature=t, top_k=5, top_p=0.5, min_p=0.3)
        assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.0, -1, 1.0, 0.0)
    assert SamplingParams(temperature=2e-5).temperature == 1e-2
    assert SamplingParams(temperature=0.5).temperature == 0.5


@pytest.mark.parametrize("bad", [
    {"seed": 2**64 - 1}, {"seed": 2**63}, {"seed": -(2**63) - 1}, {"temperature": math.inf},
    {"temperature": math.nan}, {"presence_penalty": 2.5}, {"frequency_penalty": -2.01},
    {"repetition_penalty": 0}, {"min_p": 1.5}, {"min_tokens": -1}, {"min_tokens": 20, "max_tokens": 10},
    {"logit_bias": {-1: 1.0}}, {"logit_bias": {3: math.nan}}, {"n": 2**16 + 1}, {"stop_token_ids": [-4]},
])
def test_out_of_range_fields_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_edge_seeds_run_for_every_sample(llm):
    for seed in (2**63 - 1, -(2**63)):
        out = llm.generate(["hello"], SamplingParams(n=3, max_tokens=3, seed=seed), use_tqdm=False)[0]
        assert len(out.outputs) == 3 and all(o.token_ids for o in out.outputs)


def test_a_tiny_temperature_gives_the_greedy_tokens(llm):
    greedy = llm.generate(["hello"], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    tiny = llm.generate(["hello"], SamplingParams(max_tokens=6, temperature=1e-300), use_tqdm=False)[0]
    assert tiny.outputs[0].token_ids == greedy.outputs[0].token_ids


def hand(row, prompt, output, **kw):
    """The processors written out one token at a time, for comparison."""
    p = SamplingParams(**kw)
    row = list(row)
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | ({0} if not p.ignore_eos else set()):
            row[t] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    for t in range(len(row)):
        if t in prompt or t in output:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        count = output.count(t)
        row[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    if p.min_p and p.temperature:
        probs = torch.softmax(torch.tensor(row) / p.temperature, -1).tolist()
        row = [-math.inf if q < p.min_p * max(probs) else v for v, q in zip(row, probs, strict=True)]
    return row


@pytest.mark.parametrize("kw", [
    {"repetition_penalty": 1.5}, {"repetition_penalty": 0.7}, {"frequency_penalty": 0.8},
    {"presence_penalty": -1.2}, {"frequency_penalty": 0.5, "presence_penalty": 1.0, "repetition_penalty": 1.3},
    {"logit_bias": {1: 5.0, 4: -100.0}}, {"min_tokens": 3}, {"min_tokens": 3, "stop_token_ids": [2]},
    {"min_tokens": 3, "ignore_eos": True, "stop_token_ids": [5]}, {"min_tokens": 2},
    {"min_p": 0.2, "temperature": 0.7}, {"min_p": 0.2, "temperature": 0.0},
])
def test_each_processor_equals_the_hand_computation(kw):
    row = torch.tensor([1.0, -2.0, 3.0, 0.5, -0.5, 2.5])
    prompt, output = [2, 3], [1, 5] if "min_tokens" in kw else [1, 1, 5]  # min_tokens=2: reached, no effect
    got = process_row(row, prompt, output, SamplingParams(**kw), eos_token_ids={0}).tolist()
    want = hand(row.tolist(), prompt, output, **kw)
    assert got == pytest.approx(want)
    assert got != row.tolist() or kw.get("min_tokens") == 2 or kw.get("temperature") == 0.0


def test_processors_apply_in_place_only_to_rows_that_ask():
    class Seq:
        prompt_token_ids, output_token_ids = [0, 1], [2]

    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    apply_logits_processors(logits, [Seq(), Seq()], [SamplingParams(), SamplingParams(presence_penalty=2.0)])
    assert logits.tolist() == [[1.0, 2.0, 3.0], [1.0, 2.0, 1.0]]


def test_generate_applies_logit_bias_min_tokens_and_penalties(llm):
    forced = llm.generate(["hello"], SamplingParams(max_tokens=5, temperature=0, logit_bias={7: 100.0}),
                          use_tqdm=False)[0]
    assert forced.outputs[0].token_ids == [7] * 5
    # the end token is token 0: with a huge bias on it, greedy ends at once, unless min_tokens holds it back
    ended = llm.generate(["hello"], SamplingParams(max_tokens=8, temperature=0, logit_bias={0: 100.0}),
                         use_tqdm=False)[0]
    assert ended.outputs[0].token_ids == [0] and ended.outputs[0].finish_reason == "stop"
    held = llm.generate(["hello"], SamplingParams(max_tokens=8, temperature=0, logit_bias={0: 100.0}, min_tokens=4),
                        use_tqdm=False)[0]
    assert len(held.outputs[0].token_ids) == 5 and held.outputs[0].token_ids[-1] == 0
    # a large presence penalty forbids repeats in greedy decoding
    plain = llm.generate(["hello"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    fresh = llm.generate(["hello"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                   presence_penalty=2.0, logit_bias={t: -50.0 for t in range(1)}),
                         use_tqdm=False)
    assert len(set(plain[0].outputs[0].token_ids)) < 24  # the plain text repeats itself
    ids = fresh[0].outputs[0].token_ids
    assert len(ids) == 24 and len(set(ids)) > len(set(plain[0].outputs[0].token_ids))


def test_parallel_samples_see_the_processors_from_their_first_token(llm):
    out = llm.generate(["hello"], SamplingParams(n=4, max_tokens=3, seed=1, logit_bias={9: 100.0}), use_tqdm=False)
    assert [o.token_ids for o in out[0].outputs] == [[9, 9, 9]] * 4


def test_a_bad_logit_bias_token_fails_its_request_only(llm):
    with pytest.raises(ValueError):
        llm.generate(["hello"], SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.scheduler.block_manager.num_free_blocks == 64
