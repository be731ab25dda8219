"""Stage 10, V1's front end: a request of n samples fans out into n requests of one, beam search runs as
one-token requests; their common blocks shared through the prefix cache, within a step too."""

from functools import cache
from pathlib import Path

import pytest
from test_stage10_v1_scheduler import one_thread  # noqa: F401 (one_thread: an autouse fixture)

from minipaged import LLM, BeamSearchParams, RequestOutputKind, SamplingParams
from minipaged.common.sampling_params import CompletionOutput, RequestOutput
from minipaged.stage10_front_end import ChildRequestId, ParentRequest

pytestmark = pytest.mark.stage10

DOCS = Path(__file__).resolve().parent.parent / "docs"
PROMPT = {"prompt_token_ids": [(7 * i) % 1500 + 3 for i in range(64)]}  # 4 blocks of 16


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_n_greedy_samples_equal_one_greedy_sample_n_times():
    llm = LLM("tiny")
    one = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    four = llm.generate([PROMPT], SamplingParams(n=4, max_tokens=8, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    assert [c.index for c in four[0].outputs] == [0, 1, 2, 3]
    assert tokens(four) == [[one[0].outputs[0].token_ids] * 4]


def test_seeded_samples_repeat_differ_from_each_other_and_equal_stage_8s():
    """Child i draws with a generator seeded seed + i: its own, as stage 8's sample i does."""
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    llm = LLM("tiny")
    first, again = (tokens(llm.generate([PROMPT], params, use_tqdm=False)) for _ in range(2))
    assert first == again
    assert len({tuple(t) for t in first[0]}) > 1  # four generators, not one
    assert first == tokens(LLM("tiny", scheduler="v0").generate([PROMPT], params, use_tqdm=False))


def test_an_unseeded_request_draws_one_seed_for_all_its_children():
    llm = LLM("tiny", seed=3)
    engine = llm.engine
    engine.add_request("r", PROMPT, SamplingParams(n=3, max_tokens=2))
    seeds = [engine.requests[ChildRequestId("r", i)].seed for i in range(3)]
    assert seeds == [seeds[0], seeds[0] + 1, seeds[0] + 2]
    engine.abort_request("r")
    assert not engine.requests and not engine.parents


@cache
def peak_blocks() -> tuple[int, int, int, int]:
    """n=4 over the 64-token prompt, 8 new tokens each: the peak blocks under V1, V1 without prefix caching and
    V0 (stage 8's forks), and V1's prefix-cache hits."""
    params = SamplingParams(n=4, max_tokens=8, temperature=0.0, ignore_eos=True)
    llms = [LLM("tiny", block_size=16, num_gpu_blocks=64, **kwargs)
            for kwargs in ({}, {"enable_prefix_caching": False}, {"scheduler": "v0"})]
    for llm in llms:
        llm.generate([PROMPT], params, use_tqdm=False)
    return (*(llm.stats.peak_blocks_used for llm in llms), llms[0].stats.prefix_cache_hits)


def test_four_samples_share_their_prompts_blocks_within_the_step():
    """By vLLM's rule a hit stops before the last prompt token's block: the first child holds its 4 prompt
    blocks and 1 for its tokens, each other child its own 4th block and 1 for its tokens: 11 at the peak.
    V0's copy-on-write holds 8; with nothing shared it is 20."""
    assert peak_blocks() == (11, 20, 8, 3 * 3)


def test_the_stage_pages_give_the_peaks_computed_here():
    v1, off, v0, _ = peak_blocks()
    for page, header in (("10_v1_scheduler.md", "| | peak blocks |"), ("10_v1_scheduler.zh.md", "| | 块占用峰值 |")):
        text = (DOCS / "stages" / page).read_text()
        rows = text[text.index(header):].split("\n")[2:5]
        assert [int(row.rsplit("|", 2)[1]) for row in rows] == [v1, off, v0], page
    assert (f"{v1} blocks at the peak under V1, {off} with prefix caching off, {v0} under V0's forks"
            in " ".join((DOCS / "stages" / "9_prefix_caching.md").read_text().split()))
    assert (f"V1 下块占用峰值 {v1} 块，关掉前缀缓存 {off} 块，V0 的 fork 下 {v0} 块"
            in (DOCS / "stages" / "9_prefix_caching.zh.md").read_text().replace("\n", ""))


def test_four_identical_prompts_sent_together_share_as_four_samples_do():
    llm = LLM("tiny", block_size=16, num_gpu_blocks=64)
    llm.generate([PROMPT] * 4, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert llm.stats.peak_blocks_used == 11


def test_cumulative_outputs_gather_every_child_in_index_order_and_aborting_the_parent_aborts_them():
    llm = LLM("tiny", num_gpu_blocks=64, block_size=16)
    engine = llm.engine
    engine.add_request("r", PROMPT, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=0, ignore_eos=True,
                                                   output_kind=RequestOutputKind.CUMULATIVE))
    (first,) = engine.step()
    assert first.request_id == "r" and [c.index for c in first.outputs] == [0, 1, 2] and not first.finished
    assert all(len(c.token_ids) == 1 for c in first.outputs)
    engine.abort_request("r")
    assert not engine.has_unfinished_requests() and not engine.parents
    assert llm.scheduler.block_manager.num_free_blocks == 64


def test_a_final_only_parent_answers_once_when_every_child_is_done():
    engine = LLM("tiny").engine
    engine.add_request("r", PROMPT, SamplingParams(n=2, max_tokens=5, temperature=0.0, ignore_eos=True,
                                                   output_kind=RequestOutputKind.FINAL_ONLY))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (output,) = outputs
    assert output.finished and [len(c.token_ids) for c in output.outputs] == [5, 5]


def child_output(index, tokens, finished):
    return RequestOutput(ChildRequestId("r", index), None, [1, 2], [CompletionOutput(0, "", tokens, -1.0, None)],
                         finished)


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE])
def test_a_parent_request_answers_in_index_order_and_when_its_kind_says(kind):
    parent = ParentRequest("r", SamplingParams(n=2, seed=5, output_kind=kind))
    assert [parent.child_params(i).seed for i in range(2)] == [5, 6] and parent.child_params(1).n == 1
    parent.add_output(child_output(1, [7, 8], True))  # the second child ends first
    early = parent.make_output()
    if kind is RequestOutputKind.FINAL_ONLY:
        assert early is None
    else:
        assert [(c.index, c.token_ids) for c in early.outputs] == [(0, []), (1, [7, 8])] and not early.finished
    parent.add_output(child_output(0, [3], True))
    done = parent.make_output()
    assert done.finished and done.request_id == "r"
    assert [(c.index, c.token_ids) for c in done.outputs] == [(0, [3]), (1, [7, 8])]


BEAM_PROMPTS = [{"prompt_token_ids": [(5 * i + 3 * k) % 1900 + 2 for i in range(length)]}
                for k, length in enumerate((3, 17, 40))]


def beams(outputs):
    return [[(s.token_ids, s.cumulative_logprob, s.score) for s in o.sequences] for o in outputs]


def assert_same_beams(ours, theirs):
    for mine, expected in zip(beams(ours), beams(theirs), strict=True):
        assert [t for t, _, _ in mine] == [t for t, _, _ in expected]
        assert [lp for _, lp, _ in mine] == pytest.approx([lp for _, lp, _ in expected], rel=1e-5)


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_v1_beam_search_in_the_front_end_equals_stage_8s(length_penalty, early_stopping):
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    v1 = LLM("tiny", block_size=4, num_gpu_blocks=256)
    assert_same_beams(v1.beam_search(BEAM_PROMPTS, params),
                      LLM("tiny", stage=8, block_size=4, num_gpu_blocks=256).beam_search(BEAM_PROMPTS, params))
    assert v1.stats.prefix_cache_hits > 0  # the beams' common blocks, found again
    assert v1.scheduler.block_manager.num_free_blocks == 256


def test_v1_beam_search_ends_a_beam_at_an_end_token_as_stage_8_does():
    """The tiny model's end token is rarely among the best: make the token the first beam takes first an end
    token, in both engines, so that hypotheses end early."""
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    v1, v0 = LLM("tiny", block_size=4), LLM("tiny", stage=8, block_size=4)
    first = v1.generate(BEAM_PROMPTS[1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    for llm in (v1, v0):
        llm.engine.eos_token_ids = {first[1]}
    ours, theirs = v1.beam_search(BEAM_PROMPTS[1], params), v0.beam_search(BEAM_PROMPTS[1], params)
    assert any(first[1] in tokens for tokens, _, _ in beams(theirs)[0])  # the fixture ends a hypothesis
    assert_same_beams(ours, theirs)
