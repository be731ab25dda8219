"""Stage 8: parallel sampling and beam search on shared blocks, checked against transformers
and against the same work without sharing."""

from functools import partial

import helpers_tolerances as tolerances
import pytest
import torch
import transformers

from minipaged import LLM as _LLM
from minipaged.stage7_engine import SamplingParams
from minipaged.stage8_sharing import BeamSearchParams

LLM, UnsharedLLM = partial(_LLM, stage=8), partial(_LLM, stage=7)  # the engines as of stages 8 and 7


pytestmark = pytest.mark.stage8

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
ARCHITECTURES = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from minipaged.models import TINY_MODEL_DIR

    tiny = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    made = {"tiny": (TINY_MODEL_DIR, tiny)}
    for i, (name, config) in enumerate(ARCHITECTURES.items()):
        torch.manual_seed(10 + i)
        model = transformers.AutoModelForCausalLM.from_config(config()).eval()
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        made[name] = (path, model)
    return made


def hf_beams(model, prompt, params, eos):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=params.beam_width,
                         num_return_sequences=params.beam_width, do_sample=False,
                         max_new_tokens=params.max_tokens, length_penalty=params.length_penalty,
                         early_stopping=params.early_stopping, eos_token_id=eos, pad_token_id=eos or 0,
                         output_scores=True, return_dict_in_generate=True)
    beams = []
    for row in out.sequences[:, len(prompt):].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        beams.append(row)
    return beams, out.sequences_scores.tolist()


CASES = [  # architecture, beam width, length penalty, early stopping, with an end token
    ("llama", 4, 1.0, False, False), ("llama", 3, 1.0, False, True), ("qwen2", 2, 2.0, True, True),
    ("qwen2", 4, -0.5, "never", True), ("gpt2", 4, 0.0, False, True), ("tiny", 4, 1.0, False, True),
]


@pytest.mark.parametrize("name,width,penalty,early,with_eos", CASES,
                         ids=[f"{c[0]}-w{c[1]}-lp{c[2]}-{c[3]}-{'eos' if c[4] else 'len'}" for c in CASES])
def test_beam_search_equals_transformers(checkpoints, name, width, penalty, early, with_eos):
    path, hf_model = checkpoints[name]
    llm = LLM(str(path), num_gpu_blocks=200, block_size=4)
    prompt = torch.randint(0, 200, (7,), generator=torch.Generator().manual_seed(width)).tolist()
    params = BeamSearchParams(beam_width=width, max_tokens=12, length_penalty=penalty, early_stopping=early,
                              ignore_eos=not with_eos)
    eos = None
    if with_eos:  # an end token that the search really meets: the third token of the best beam without one
        eos = hf_beams(hf_model, prompt, BeamSearchParams(width, 12, penalty, early, True), None)[0][0][2]
        llm.engine.eos_token_ids = {eos}
    expected, scores = hf_beams(hf_model, prompt, params, eos)
    out = llm.beam_search([{"prompt_token_ids": prompt}], params)[0]
    assert [s.token_ids for s in out.sequences] == expected
    tol = tolerances.beam_score(llm.model_config, len(prompt) + params.max_tokens, params.max_tokens, penalty)
    assert [s.score for s in out.sequences] == pytest.approx(scores, **tol)
    assert llm.scheduler.block_manager.num_free_blocks == 200  # every beam freed


def test_beams_share_blocks(checkpoints):
    path, _ = checkpoints["llama"]
    llm = LLM(str(path), num_gpu_blocks=200, block_size=4)
    out = llm.beam_search([{"prompt_token_ids": list(range(1, 41))}], BeamSearchParams(4, 8, ignore_eos=True))[0]
    assert len(out.sequences) == 4
    unshared = 4 * -(-(40 + 8) // 4)  # four beams, each holding its own 48 tokens
    assert llm.stats.peak_blocks_used <= 10 + 4 * 3 < unshared  # the 10 prompt blocks once, then private blocks


@pytest.mark.parametrize("prompt_len,n,block_size", [(37, 4, 16), (32, 3, 8), (5, 6, 4)])
def test_n_samples_equal_n_unshared_requests_seeded_one_apart_in_fewer_blocks(checkpoints, prompt_len, n, block_size):
    """Sample i of a request seeded s draws as stage 7's request seeded s + i: the same tokens."""
    path, _ = checkpoints["qwen2"]
    prompt = {"prompt_token_ids": list(range(3, 3 + prompt_len))}
    runs = {}
    llm = LLM(str(path), num_gpu_blocks=256, block_size=block_size)
    params = SamplingParams(n=n, max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    runs[True] = ([c.token_ids for c in out.outputs], llm.stats.peak_blocks_used, llm.stats.prefill_tokens)
    unshared = UnsharedLLM(str(path), num_gpu_blocks=256, block_size=block_size)
    seeded = [SamplingParams(max_tokens=10, temperature=1.0, seed=11 + i, ignore_eos=True) for i in range(n)]
    outs = unshared.generate([prompt] * n, seeded, use_tqdm=False)
    runs[False] = ([o.outputs[0].token_ids for o in outs], unshared.stats.peak_blocks_used,
                   unshared.stats.prefill_tokens)
    assert runs[True][0] == runs[False][0]
    tol = tolerances.cumulative_logprob(llm.model_config, prompt_len + 10, 10)
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(
        [o.outputs[0].cumulative_logprob for o in outs], **tol)  # every sample's log-probability, its first token's too
    assert len({tuple(t) for t in runs[True][0]}) > 1  # the samples differ from each other
    stored = prompt_len + 10 - 1  # the last token's K/V is never written
    private = -(-stored // block_size) - prompt_len // block_size
    assert runs[True][1] == prompt_len // block_size + n * private  # full prompt blocks held once
    assert runs[False][1] == n * -(-stored // block_size)
    assert runs[True][2] == prompt_len and runs[False][2] == n * prompt_len  # the prompt prefilled once


def test_parallel_samples_survive_preemption_by_swap(checkpoints):
    path, _ = checkpoints["llama"]
    prompts = [{"prompt_token_ids": list(range(1 + i, 20 + i))} for i in range(4)]
    params = SamplingParams(n=3, max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
    roomy = LLM(str(path), num_gpu_blocks=256, block_size=4).generate(prompts, params, use_tqdm=False)
    tight = LLM(str(path), num_gpu_blocks=32, block_size=4, max_model_len=64, preemption_mode="swap")
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in squeezed] == [[c.token_ids for c in o.outputs] for o in roomy]
    assert tight.stats.num_preemptions > 0 and tight.stats.num_swapped_out_blocks > 0
    assert tight.scheduler.block_manager.num_free_blocks == 32


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beams_survive_preemption(checkpoints, mode):
    path, _ = checkpoints["llama"]
    prompts = [{"prompt_token_ids": list(range(1 + i, 12 + i))} for i in range(3)]
    params = BeamSearchParams(3, 12, ignore_eos=True)
    roomy = LLM(str(path), num_gpu_blocks=256, block_size=4).beam_search(prompts, params)
    tight = LLM(str(path), num_gpu_blocks=20, block_size=4, max_model_len=32, preemption_mode=mode)
    squeezed = tight.beam_search(prompts, params)
    assert [[s.token_ids for s in o.sequences] for o in squeezed] == [[s.token_ids for s in o.sequences] for o in roomy]
    assert tight.stats.num_preemptions > 0 and tight.scheduler.block_manager.num_free_blocks == 20


def test_a_request_wider_than_max_num_seqs_is_refused_and_groups_count_whole(checkpoints):
    path, _ = checkpoints["llama"]
    llm = LLM(str(path), num_gpu_blocks=256, block_size=4, max_num_seqs=8)
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(n=9), use_tqdm=False)
    steps = []
    original = llm.engine.runner.execute
    llm.engine.runner.execute = lambda out: steps.append(len(out.scheduled)) or original(out)
    params = SamplingParams(n=5, max_tokens=4, temperature=1.0, seed=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5, 6]}], params, use_tqdm=False)
    assert max(steps) == 5  # never both requests at once: 5 + 5 > 8


def test_bad_beam_search_requests_are_refused(checkpoints):
    path, _ = checkpoints["llama"]
    llm = LLM(str(path), num_gpu_blocks=8, block_size=4, max_model_len=32)
    with pytest.raises(ValueError):
        BeamSearchParams(beam_width=0)
    with pytest.raises(ValueError):
        BeamSearchParams(early_stopping="sometimes")
    with pytest.raises(ValueError):
        llm.beam_search([{"prompt_token_ids": [1] * 10}], BeamSearchParams(4, 10))  # 4 x 5 blocks > 8
    assert not llm.engine.has_unfinished_requests() and llm.scheduler.block_manager.num_free_blocks == 8
    assert llm.beam_search([{"prompt_token_ids": [1, 2]}], BeamSearchParams(1, 3, ignore_eos=True))[0].sequences


def test_samples_fork_once_and_keep_their_own_log_probabilities():
    """A sample that stops early is not forked again; each sample's logprobs are its own list."""
    prompt = {"prompt_token_ids": [21, 22, 23, 24, 25]}
    seeded = [SamplingParams(max_tokens=8, temperature=1.0, seed=5 + i, ignore_eos=True, logprobs=1) for i in range(3)]
    alone = [o.outputs[0].token_ids for o in UnsharedLLM("tiny").generate([prompt] * 3, seeded, use_tqdm=False)]
    stop = alone[0][1]  # sample 0 stops at its second token; the others go on, or stop where the same token comes
    unshared = UnsharedLLM("tiny").generate(
        [prompt] * 3, [SamplingParams(**{**vars(p), "stop_token_ids": [stop]}) for p in seeded], use_tqdm=False)
    out = LLM("tiny").generate([prompt], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True,
                                                        logprobs=1, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in unshared]
    assert len(out.outputs[0].token_ids) == 2 < max(len(c.token_ids) for c in out.outputs)
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        assert all(token in step for token, step in zip(c.token_ids, c.logprobs, strict=True))
    assert len({id(c.logprobs) for c in out.outputs}) == 3


E, A, B, C, D, F, G, H, K = 9, 10, 11, 12, 13, 14, 15, 16, 17  # E ends a beam
TREE = {  # generated tokens -> the probabilities of some next tokens; the rest spread evenly
    (): {A: 0.5, E: 0.3, B: 0.15},
    (A,): {C: 0.6, E: 0.3, D: 0.05},
    (B,): {F: 0.2},
    (A, C): {E: 0.5, G: 0.15},
    (B, F): {H: 0.9},
    (A, C, G): {E: 0.9},
    (B, F, H): {K: 0.3, E: 0.1},
}


def tree_logits(out, vocab):
    """The next-token log-probabilities of ``TREE`` for each scheduled sequence, as a runner returns them."""
    rows = []
    for seq, _ in out.scheduled:
        probs = TREE.get(tuple(seq.output_token_ids), {})
        row = torch.full((vocab,), (1 - sum(probs.values())) / (vocab - len(probs)), dtype=torch.float64)
        for token, p in probs.items():
            row[token] = p
        rows.append(row.log().float())
    return torch.stack(rows)


@pytest.mark.parametrize("early,expected,steps", [
    (True, [[A, E], [E]], 2),  # stops at the step that fills the two hypotheses
    (False, [[A, C, E], [A, E]], 3),  # step 3: the best beam, -3.10 / 3, cannot beat -0.95 at this length
    ("never", [[A, C, E], [A, C, G, E]], 4),  # step 3: -3.10 / 5 could: one step more finds A C G E
])
def test_early_stopping_decides_when_the_search_ends(early, expected, steps):
    """``True`` ends the search as soon as ``beam_width`` hypotheses are finished; ``False`` once the
    best running beam's log-probability, divided by the current length ** length_penalty, cannot beat
    the worst of them; ``"never"`` divides by ``max_tokens ** length_penalty`` instead."""
    llm = LLM("tiny")
    vocab = llm.model_config.vocab_size
    llm.engine.eos_token_ids = {E}
    forwards = []
    llm.engine.runner.execute = lambda out: forwards.append(out) or tree_logits(out, vocab)
    params = BeamSearchParams(beam_width=2, max_tokens=5, length_penalty=1.0, early_stopping=early)
    out = llm.beam_search([{"prompt_token_ids": [1, 2, 3]}], params)[0]
    assert [s.token_ids for s in out.sequences] == expected
    assert len(forwards) == steps  # no step runs once the search has ended
    for s in out.sequences:
        logprob = sum(torch.tensor(TREE[tuple(s.token_ids[:i])][t]).log().item() for i, t in enumerate(s.token_ids))
        assert s.score == pytest.approx(logprob / len(s.token_ids), rel=1e-5)
    assert llm.scheduler.block_manager.num_free_blocks == llm.scheduler.block_manager.num_total_blocks
