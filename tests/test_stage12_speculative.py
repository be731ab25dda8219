"""Stage 12: speculative decoding, checked against stage 10: greedy outputs identical, sampled ones
drawn from the same distribution, drafts inside the token budget and the free blocks, and nothing of
a rejected draft left where it could be read."""

import random
from functools import partial

import helpers_tolerances as tolerances
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from test_stage10_v1_scheduler import one_thread  # noqa: F401 (one_thread: an autouse fixture)

from minipaged import LLM
from minipaged.common.sampling_params import SamplingParams
from minipaged.stage9_prefix_caching import ROOT, block_hash
from minipaged.stage12_rejection_sampler import NgramProposer, RejectionSampler

Stage10LLM = partial(LLM, stage=10)  # the engine as of stage 10: no drafts

pytestmark = pytest.mark.stage12

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
REPEATS = [5, 17, 90, 3, 42, 8, 25, 11, 7]


def prompts(seed=0):
    rng = random.Random(seed)
    return [REPEATS * 4, [1, 2, 3, 1, 2, 3, 1, 2], [rng.randrange(2048) for _ in range(30)],
            [rng.randrange(50) for _ in range(60)], REPEATS[:5] * 6 + [99]]


def run(llm, prompt_ids, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)


def assert_same(got, expected, llm, context=256):
    tol = tolerances.logprobs(llm.model_config, context)
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.outputs[0].finish_reason == theirs.outputs[0].finish_reason
        if theirs.outputs[0].logprobs:
            for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
                common = a.keys() & b.keys()
                assert [a[t] for t in common] == pytest.approx([b[t] for t in common], **tol)


# --- the proposer


def brute_force(tokens, k, longest, shortest):
    for n in range(min(longest, len(tokens) - 1), shortest - 1, -1):
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=30), st.integers(1, 5), st.integers(1, 4), st.integers(0, 3))
def test_the_proposer_takes_what_followed_the_first_occurrence_of_the_longest_repeated_suffix(tokens, k, low, extra):
    proposer = NgramProposer(k, low + extra, low)
    assert proposer.propose(tokens) == brute_force(tokens, k, low + extra, low)


def test_the_proposer_prefers_a_longer_suffix_and_its_first_occurrence():
    proposer = NgramProposer(3, 3, 1)
    assert proposer.propose([7, 1, 2, 8, 9, 2, 5, 1, 2]) == [8, 9, 2]  # [1, 2] beats [2]
    assert proposer.propose([1, 2, 3, 1, 2, 4, 1, 2]) == [3, 1, 2]  # the first [1, 2], not the last
    assert proposer.propose([1, 2, 3, 4]) == []
    assert NgramProposer(2, 4, 2).propose([5, 6, 5]) == []  # a 1-gram is below prompt_lookup_min


# --- the rejection sampler


def target_probs(sampler, logits, params):
    from minipaged.stage12_rejection_sampler import Context

    return torch.softmax(sampler.target_logits(logits, Context([1], []), params), dim=-1)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
def test_the_kept_token_has_exactly_the_targets_distribution_whatever_the_draft(params):
    """Over many seeded draws, the first kept token's frequencies are p's: a draft the target likes
    and one it does not (outside the top-k: never kept) give the same distribution."""
    vocab, trials = 12, 20000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3)) * 2
    sampler = RejectionSampler()
    p = target_probs(sampler, logits[0], params)
    for draft in (int(p.argmax()), int(p.argmin())):
        counts = torch.zeros(vocab)
        generator = torch.Generator().manual_seed(draft)
        for _ in range(trials):
            counts[sampler(logits, [1], [], generator, params, [draft]).token_ids[0]] += 1
        freq = counts / trials
        bound = 5 * torch.sqrt(p * (1 - p) / trials) + 1e-9  # five standard deviations, per token
        assert bool(((freq - p).abs() <= bound).all()), (draft, freq, p)


def test_greedy_keeps_drafts_while_they_are_the_argmax_then_adds_the_targets_token():
    logits = torch.full((4, 10), -5.0)
    for j, best in enumerate([3, 4, 6, 8]):
        logits[j, best] = 5.0
    sampler, greedy = RejectionSampler(), SamplingParams(temperature=0.0)
    assert sampler(logits, [1], [], None, greedy, [3, 4, 5]).token_ids == [3, 4, 6]  # the third is replaced
    kept = sampler(logits, [1], [], None, greedy, [3, 4, 6])
    assert kept.token_ids == [3, 4, 6, 8] and kept.num_accepted == 3  # all kept, and one more
    assert sampler(logits, [1], [], None, greedy, [9, 4, 6]).token_ids == [3]


def test_penalties_see_the_drafts_accepted_before_them():
    """Position 1's repetition penalty counts the draft kept at position 0, as a decode would."""
    logits = torch.tensor([[0.0, 3.0, 2.9], [0.0, 3.0, 2.9]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert RejectionSampler()(logits, [0], [], None, params, [1]).token_ids == [1, 2]


def test_accept_or_resample_gives_p_for_any_q_and_accepts_as_often_as_the_overlap():
    """The definition, on hand-made p and q: q one-hot (an n-gram draft), q = p (always kept), q
    another distribution. The kept token is distributed as p; the draft is kept with probability
    sum(min(p, q)) (five standard deviations: a false failure below 1e-6 per token)."""
    vocab, trials = 6, 20000
    p = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.2, 0.0])
    one_hot = torch.zeros(vocab)
    one_hot[3] = 1.0
    cases = [one_hot, p.clone(), torch.tensor([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])]
    for q in cases:
        generator, counts, kept = torch.Generator().manual_seed(1), torch.zeros(vocab), 0
        for _ in range(trials):
            draft = int(torch.multinomial(q, 1, generator=generator))  # the proposer's draw from q
            token = RejectionSampler.accept_or_resample(p, q, draft, generator)
            counts[token] += 1
            kept += token == draft
        freq, sd = counts / trials, torch.sqrt(p * (1 - p) / trials)
        assert bool(((freq - p).abs() <= 5 * sd + 1e-9).all()), (q, freq)
        overlap = float(torch.minimum(p, q).sum())
        assert abs(kept / trials - overlap) <= 5 * (overlap * (1 - overlap) / trials) ** 0.5 + 1e-9


# --- the engine


@pytest.mark.parametrize("budget,blocks", [(2048, 256), (7, 256), (1, 256), (64, 40)])
def test_greedy_outputs_equal_stage_10s_for_any_budget_and_cache(budget, blocks):
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2)
    kwargs = dict(block_size=4, num_gpu_blocks=blocks, max_num_batched_tokens=budget, max_model_len=160)
    expected = run(Stage10LLM("tiny", **kwargs), prompts(), params)
    llm = LLM("tiny", speculative_config=NGRAM, **kwargs)
    assert_same(run(llm, prompts(), params), expected, llm)
    stats = llm.stats.spec_decoding
    assert llm.stats.spec_decoding == stats and llm.stats.as_dict()["spec_decode_num_drafts"] == stats.num_drafts
    if budget == 1:  # no room for a draft beside the last token: plain decoding
        assert stats.num_drafts == 0
    else:
        assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    manager = llm.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_total_blocks


def assert_blocks_accounted_for(llm):
    """Every block's reference count is the number of tables that hold it (cached free blocks: 0)."""
    manager = llm.scheduler.block_manager
    held = {}
    for table in manager.block_tables.values():
        for block_id in table.block_ids:
            held[block_id] = held.get(block_id, 0) + 1
    for block_id in range(manager.num_total_blocks):
        assert manager.allocator.ref_count(block_id) == held.get(block_id, 0), block_id


# No shrinking: each example builds two engines, and a failing one is reported as it was drawn.
@settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(seed=st.integers(0, 2**16), k=st.integers(1, 8), budget=st.sampled_from([3, 9, 64]),
       blocks=st.sampled_from([40, 256]), stop=st.sampled_from([None, "e", " a"]))
def test_greedy_outputs_equal_stage_10s_for_any_k_budget_cache_and_stop(seed, k, budget, blocks, stop):
    """Random and repetitive prompts (drafts kept, kept in part, rejected), k from 1 to 8, any budget,
    preemption by recompute in a small cache, prefix caching, stops inside a kept run; and after
    every step no block leaks."""
    rng = random.Random(seed)
    base = [rng.randrange(2048) for _ in range(rng.randrange(3, 12))]
    prompt_ids = [base * rng.randrange(1, 5), [rng.randrange(2048) for _ in range(20)], base * 3 + base[:2]]
    params = SamplingParams(max_tokens=rng.randrange(1, 30), temperature=0.0, logprobs=1, stop=stop,
                            ignore_eos=rng.random() < 0.5)
    kwargs = dict(block_size=4, num_gpu_blocks=blocks, max_num_batched_tokens=budget, max_model_len=160)
    expected = run(Stage10LLM("tiny", **kwargs), prompt_ids, params)
    llm = LLM("tiny", speculative_config={**NGRAM, "num_speculative_tokens": k}, **kwargs)
    for i, p in enumerate(prompt_ids):
        llm.engine.add_request(i, {"prompt_token_ids": p}, params)
    outputs = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                outputs[out.request_id] = out
        assert_blocks_accounted_for(llm)
    got = [outputs[i] for i in range(len(prompt_ids))]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert_same(got, expected, llm)
    manager = llm.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_total_blocks


def test_sampled_tokens_follow_stage_10s_distribution():
    """The second to fourth tokens of 3000 seeded requests, with drafts and without: a chi-square test
    of homogeneity per position at a false-failure probability of 1e-4 (the seeds are fixed, so a
    run always gives the same verdict). The prompt repeats the model's own greedy continuation, so
    the proposer's drafts are often right: kept about half the time."""
    from scipy.stats import chi2_contingency

    n = 3000
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=6, seed=s, ignore_eos=True) for s in range(n)]
    start = LLM("tiny").tokenizer.encode(".. versionchanged::").ids
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompt = start + run(Stage10LLM("tiny"), [start], greedy)[0].outputs[0].token_ids + start
    kwargs = dict(num_gpu_blocks=2048, max_num_seqs=512)
    plain = run(Stage10LLM("tiny", **kwargs), [prompt] * n, params)
    llm = LLM("tiny", speculative_config=NGRAM, **kwargs)
    spec = run(llm, [prompt] * n, params)
    stats = llm.stats.spec_decoding
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens > 0  # drafts kept, and rejected too
    for position in (1, 2, 3):
        tokens = sorted({o.outputs[0].token_ids[position] for o in plain + spec})
        table = [[sum(o.outputs[0].token_ids[position] == t for o in outs) for t in tokens] for outs in (plain, spec)]
        keep = [j for j in range(len(tokens)) if table[0][j] + table[1][j] >= 10]  # chi-square needs counts
        table = [[row[j] for j in keep] + [sum(row) - sum(row[j] for j in keep)] for row in table]
        assert chi2_contingency(table).pvalue > 1e-4, (position, table)


def test_sampling_parameters_and_stops_apply_as_without_drafts():
    """Penalties, logit_bias, min_tokens, stop tokens and max_tokens: where a stop falls among the
    kept tokens the output ends there."""
    cases = [SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
             SamplingParams(max_tokens=30, temperature=0.0, logit_bias={7: 3.0}, min_tokens=5),
             SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[42, 11]),
             SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)]
    for params in cases:
        expected = run(Stage10LLM("tiny"), prompts(), params)
        llm = LLM("tiny", speculative_config=NGRAM)
        assert_same(run(llm, prompts(), params), expected, llm)


def test_seeded_sampling_with_drafts_repeats_itself():
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_k=8, seed=s) for s in range(3)]
    llm = LLM("tiny", speculative_config=NGRAM)
    first = [o.outputs[0].token_ids for o in run(llm, [REPEATS * 4] * 3, params)]
    again = [o.outputs[0].token_ids for o in run(llm, [REPEATS * 4] * 3, params)]
    assert first == again and llm.stats.spec_decoding.num_drafts > 0


def test_a_request_with_drafts_takes_one_plus_its_drafts_of_the_budget_and_never_more():
    llm = LLM("tiny", block_size=4, num_gpu_blocks=256, max_num_batched_tokens=6, speculative_config=NGRAM)
    engine = llm.engine
    for i, prompt in enumerate([REPEATS * 3, REPEATS * 3 + [1]]):
        engine.add_request(i, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=20, ignore_eos=True,
                                                                           temperature=0.0))
    seen_drafts = False
    while engine.has_unfinished_requests():
        engine.step()
        out = engine.last_scheduler_output
        assert out.total_num_scheduled_tokens <= 6
        for req_id, drafts in out.scheduled_spec_decode_tokens.items():
            seen_drafts = True
            assert out.num_scheduled_tokens[req_id] == 1 + len(drafts) <= 1 + NGRAM["num_speculative_tokens"]
    assert seen_drafts


class RepeatLast:
    """A proposer that always has drafts: the last token, four times."""

    def propose(self, token_ids):
        return [token_ids[-1]] * 4


def test_drafts_whose_slots_do_not_fit_are_dropped_and_preempt_no_one():
    """Request a's drafts need a sixth block, and none is free: a decodes its one token alone, and
    b, the newest, which a's drafts would have preempted, runs on."""
    llm = LLM("tiny", block_size=4, num_gpu_blocks=7, max_model_len=28, speculative_config=NGRAM)
    engine, params = llm.engine, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": REPEATS[:6] * 3}, params)  # 18 tokens: 5 blocks, 2 slots left
    engine.add_request("b", {"prompt_token_ids": [1000, 1001, 1002, 1003, 1004, 1005, 1006]}, params)  # 2 blocks
    engine.step()  # both prompts; each samples its first token
    assert llm.scheduler.block_manager.num_free_blocks == 0
    engine.spec_decoder.proposer = RepeatLast()  # drafts for every request, whatever it sampled
    engine.step()
    out = engine.last_scheduler_output
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and not out.scheduled_spec_decode_tokens
    assert llm.stats.num_preemptions == 0


def test_after_a_step_the_rejected_drafts_are_rolled_back_and_never_named_by_the_prefix_cache():
    llm = LLM("tiny", block_size=4, num_gpu_blocks=256, speculative_config=NGRAM)
    engine, prompt = llm.engine, REPEATS * 3 + [60, 61]
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=30, temperature=0.0,
                                                                         ignore_eos=True))
    seq, rejected = engine.requests["r"].seqs[0], 0
    while "r" in engine.requests and not engine.requests["r"].is_finished():
        before = llm.stats.spec_decoding
        engine.step()
        after = llm.stats.spec_decoding
        rejected += (after.num_draft_tokens - before.num_draft_tokens) - (after.num_accepted_tokens
                                                                          - before.num_accepted_tokens)
        if seq.finish_reason is None:  # the verified tokens are computed, all but the last
            assert seq.num_computed_tokens == len(seq) - 1
    assert rejected > 0
    tokens, digest, names = seq.token_ids, ROOT, set()
    for start in range(0, len(prompt) // 4 * 4, 4):
        digest = block_hash(digest, tokens[start:start + 4])
        names.add(digest)
    allocator = llm.scheduler.block_manager.allocator
    assert set(allocator.cached) <= names  # only the prompt's full blocks were ever named


def test_speculative_config_is_checked_and_refused_below_stage_12():
    for bad in ({"method": "eagle"}, {"num_speculative_tokens": 0}, {"prompt_lookup_min": 3, "prompt_lookup_max": 2},
                {"typo": 1}, "ngram"):
        with pytest.raises(ValueError):
            LLM("tiny", speculative_config=bad)
    with pytest.raises(ValueError):
        Stage10LLM("tiny", speculative_config=NGRAM)
    with pytest.raises(ValueError):
        LLM("tiny", speculative_config=NGRAM, async_scheduling=True)
    lookup = {**NGRAM, "prompt_lookup_min": 1, "prompt_lookup_max": 1}  # the bounds may meet
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM("tiny", speculative_config=lookup)
    assert_same(run(llm, prompts(), params), run(Stage10LLM("tiny"), prompts(), params), llm)
    assert llm.stats.spec_decoding.num_drafts > 0


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
def test_an_exception_inside_a_verifying_step_leaves_the_engine_usable_with_every_block_back(fault, monkeypatch):
    llm = LLM("tiny", speculative_config=NGRAM)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = run(llm, prompts(), params)
    calls = []
    original = llm.engine.spec_decoder.rejection_sampler.__class__.__call__

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise fault("boom")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(llm.engine.spec_decoder.rejection_sampler), "__call__", failing)
    with pytest.raises(fault):
        run(llm, prompts(), params)
    monkeypatch.undo()
    manager = llm.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_total_blocks
    assert_same(run(llm, prompts(), params), expected, llm)


@pytest.mark.rounding_free
def test_serve_with_speculative_config_answers_and_counts_its_drafts_in_metrics():
    """``minipaged serve --scheduler v1 --speculative-config '{...}'``: stage 10's completion, and
    vLLM's counters of drafts, draft tokens and accepted tokens in /metrics."""
    import json

    import httpx
    import openai

    from minipaged.serving.launcher import start_server

    process, url = start_server("--num-gpu-blocks", "256", "--max-model-len", "256", "--scheduler", "v1",
                                "--speculative-config", json.dumps(NGRAM), timeout=180)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(model="tiny", prompt=REPEATS * 4, max_tokens=24, temperature=0)
        want = run(Stage10LLM("tiny"), [REPEATS * 4], SamplingParams(max_tokens=24, temperature=0.0))[0]
        assert got.choices[0].text == want.outputs[0].text
        metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in
                   httpx.get(f"{url}/metrics", timeout=10).text.splitlines() if line.startswith("minipaged:spec")}
        drafts, tokens, accepted = (metrics[f"minipaged:spec_decode_num_{name}_total"]
                                    for name in ("drafts", "draft_tokens", "accepted_tokens"))
        assert drafts > 0 and 0 < accepted <= tokens
    finally:
        process.terminate()
        process.wait(60)


def test_seeded_requests_repeat_whatever_torchs_global_generator_holds():
    """Every draw of a seeded request, the acceptance draws included, comes from its own generator. The
    prompt repeats the model's own greedy continuation, so that drafts are often likely enough to be
    accepted by a draw, not by certainty."""
    start = LLM("tiny").tokenizer.encode(".. versionchanged::").ids
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompt = start + run(Stage10LLM("tiny"), [start], greedy)[0].outputs[0].token_ids + start
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_k=6, seed=s, ignore_eos=True) for s in range(24)]
    runs = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        llm = LLM("tiny", speculative_config=NGRAM)
        runs.append([o.outputs[0].token_ids for o in run(llm, [prompt] * len(params), params)])
        assert llm.stats.spec_decoding.num_accepted_tokens > 0
    assert runs[0] == runs[1]


def test_a_stop_token_among_the_accepted_drafts_ends_the_request_there():
    """A stop token that comes inside a run of accepted drafts, not at its end: the output ends at it,
    as stage 10's does, and the tokens accepted after it are dropped. The prompt repeats the model's
    own greedy continuation, so that drafts are accepted."""
    start = LLM("tiny").tokenizer.encode(".. versionchanged::").ids
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompt = start + run(Stage10LLM("tiny"), [start], greedy)[0].outputs[0].token_ids + start
    llm = LLM("tiny", speculative_config=NGRAM)
    llm.engine.add_request("r", {"prompt_token_ids": prompt}, greedy)
    seq, steps = llm.engine.requests["r"].seqs[0], []  # the tokens each step added
    while llm.engine.has_unfinished_requests():
        before = len(seq.output_token_ids)
        llm.engine.step()
        steps.append(seq.output_token_ids[before:])
    output = [t for step in steps for t in step]
    inside, at = [], 0
    for step in steps:
        inside += [t for j, t in enumerate(step[:-1]) if t not in output[:at + j]]  # a first appearance, more after
        at += len(step)
    assert inside, steps
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[inside[0]])
    want = run(Stage10LLM("tiny"), [prompt], params)[0].outputs[0]
    got = run(LLM("tiny", speculative_config=NGRAM), [prompt], params)[0].outputs[0]
    assert (got.token_ids, got.finish_reason, got.stop_reason) == (want.token_ids, "stop", inside[0])
    assert got.token_ids[-1] == inside[0] and len(got.token_ids) < len(output)
