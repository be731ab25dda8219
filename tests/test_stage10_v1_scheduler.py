"""Stage 10: V1's scheduling — one token budget, chunked prefill, recompute, a persistent batch —
checked against stage 9, token for token, for any budget."""

import random
from functools import partial

import helpers_tolerances as tolerances
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import LLM as _LLM
from minipaged.stage7_engine import Request, SampledSequence, SamplingParams
from minipaged.stage9_prefix_caching import PrefixCachingAllocator, PrefixCachingBlockSpaceManager
from minipaged.stage10_kv_cache_manager import KVCacheManager
from minipaged.stage10_v1_scheduler import V1Scheduler

LLM, Stage9LLM = partial(_LLM, stage=10), partial(_LLM, stage=9)  # the engines as of stages 10 and 9

pytestmark = pytest.mark.stage10


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model's matrices are small: one thread is faster than two fighting over a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tokens(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1, 2000) for _ in range(n)]


SYSTEM = tokens(0, 22)
POOL = [SYSTEM + tokens(1, 5), tokens(2, 31), SYSTEM + tokens(3, 14), tokens(4, 3), SYSTEM + tokens(5, 9),
        tokens(6, 17), SYSTEM[:16] + tokens(7, 20), [9], SYSTEM + tokens(1, 5) + tokens(8, 4)]
MAX_TOKENS = 6


def params(i, sampled):
    """Request i's parameters: greedy, or seeded sampling (its own seed, whatever the arrival order)."""
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9 if sampled else 0.0, seed=100 + i,
                          ignore_eos=True, logprobs=3)


def serve(llm, arrivals, sampled, max_steps=3000):
    """Requests ``[(pool index, arrival step)]`` added to the engine as their steps come: outputs by index."""
    engine, pending, done, step = llm.engine, sorted(arrivals, key=lambda a: a[1]), {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1] <= step:
            i, _ = pending.pop(0)
            engine.add_request(i, {"prompt_token_ids": POOL[i]}, params(i, sampled))
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0]
        step += 1
        assert step < max_steps, "no progress"
    return done


@pytest.fixture(scope="module")
def stage9_outputs(one_thread):
    """Stage 9's outputs for every prompt of the pool, greedy and sampled, with and without prefix caching."""
    found = {}
    for sampled in (False, True):
        for caching in (False, True):
            llm = Stage9LLM("tiny", num_gpu_blocks=256, enable_prefix_caching=caching)
            outs = llm.generate([{"prompt_token_ids": p} for p in POOL], [params(i, sampled) for i in range(len(POOL))],
                                use_tqdm=False)
            found[sampled, caching] = [o.outputs[0] for o in outs]
        assert [o.token_ids for o in found[sampled, False]] == [o.token_ids for o in found[sampled, True]]
    return found


def assert_same(got, expected, llm):
    """The same tokens; the same log-probabilities, to float32 rounding (batches differ in shape)."""
    assert got.token_ids == expected.token_ids
    summed = tolerances.cumulative_logprob(llm.model_config, llm.max_model_len, len(expected.token_ids))
    assert got.cumulative_logprob == pytest.approx(expected.cumulative_logprob, **summed)
    each = tolerances.logprobs(llm.model_config, llm.max_model_len)
    for mine, theirs in zip(got.logprobs, expected.logprobs, strict=True):
        assert mine.keys() == theirs.keys()
        assert [mine[t] for t in theirs] == pytest.approx(list(theirs.values()), **each)


@settings(max_examples=25, deadline=None)
@given(budget=st.one_of(st.integers(1, 6), st.integers(7, 48), st.just(4096)), num_blocks=st.integers(12, 40),
       order=st.permutations(range(len(POOL))), steps=st.lists(st.integers(0, 12), min_size=len(POOL),
                                                               max_size=len(POOL)),
       sampled=st.booleans())
def test_outputs_equal_stage_9_for_any_budget_arrival_order_and_cache_size(
        stage9_outputs, budget, num_blocks, order, steps, sampled):
    llm = LLM("tiny", block_size=4, num_gpu_blocks=num_blocks, max_model_len=48, max_num_batched_tokens=budget)
    chosen = order[:6]
    done = serve(llm, [(i, steps[k]) for k, i in enumerate(chosen)], sampled)
    for i in chosen:
        for caching in (False, True):
            assert_same(done[i], stage9_outputs[sampled, caching][i], llm)
    assert llm.scheduler.block_manager.num_free_blocks == num_blocks  # every block back


def test_same_outputs_under_heavy_preemption_at_every_budget(stage9_outputs):
    for budget in (1, 3, 16, 4096):
        llm = LLM("tiny", block_size=4, num_gpu_blocks=13, max_model_len=48, max_num_batched_tokens=budget)
        done = serve(llm, [(i, 0) for i in range(len(POOL))], sampled=False)
        for i in range(len(POOL)):
            assert_same(done[i], stage9_outputs[False, True][i], llm)
        if budget >= 16:
            assert llm.stats.num_preemptions > 0
        assert llm.scheduler.block_manager.num_free_blocks == 13


# The scheduler alone: requests of made-up tokens, a "model" that appends token 7 to every request
# whose tokens are all computed. Each rule of ``V1Scheduler.schedule`` bites here.

def make(num_blocks=32, block_size=4, budget=8, max_num_seqs=256):
    manager = PrefixCachingBlockSpaceManager(PrefixCachingAllocator(num_blocks), block_size)
    return V1Scheduler(KVCacheManager(manager), max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                       max_model_len=num_blocks * block_size)


def add(scheduler, name, prompt, max_tokens=4):
    request = Request(name, [SampledSequence(list(prompt))], max_tokens)
    scheduler.add(request)
    return request


def step(scheduler):
    """Schedule one step and play the model: ``{request: tokens}`` scheduled, finished requests freed."""
    out = scheduler.schedule()
    for request in out.scheduled:
        seq = request.seqs[0]
        if seq.num_computed_tokens == len(seq):  # the prompt is done: one new token
            seq.append_token(7)
            if len(seq.output_token_ids) == request.max_tokens:
                scheduler.finish(seq)
    return out.num_scheduled_tokens, out


def test_a_prompt_longer_than_the_budget_runs_in_chunks_and_samples_after_its_last():
    scheduler = make(budget=4)
    a = add(scheduler, "a", range(10, 20))
    chunks = [step(scheduler)[0]["a"] for _ in range(3)]
    assert chunks == [4, 4, 2]
    assert a.seqs[0].output_token_ids == [7]  # one token, after the last chunk only
    assert step(scheduler)[0] == {"a": 1}  # then decodes


def test_decodes_come_off_the_same_budget():
    scheduler = make(budget=4)
    for name in "abc":
        add(scheduler, name, [ord(name)], max_tokens=9)
    step(scheduler)  # three one-token prompts, each sampling its first token
    add(scheduler, "d", range(30, 40))
    scheduled, _ = step(scheduler)
    assert scheduled == {"a": 1, "b": 1, "c": 1, "d": 1}  # 3 decodes leave 1 token of 4 for the prompt


def test_running_requests_first_oldest_first_then_waiting_ones_the_last_with_a_partial_chunk():
    scheduler = make(budget=5)
    add(scheduler, "a", range(10, 18))
    add(scheduler, "b", range(20, 28))
    add(scheduler, "c", range(30, 38))
    assert step(scheduler)[0] == {"a": 5}
    assert list(step(scheduler)[0].items()) == [("a", 3), ("b", 2)]
    assert list(step(scheduler)[0].items()) == [("a", 1), ("b", 4)]
    assert list(step(scheduler)[0].items()) == [("a", 1), ("b", 2), ("c", 2)]


def test_max_num_seqs_caps_the_running_requests():
    scheduler = make(budget=64, max_num_seqs=2)
    for name in "abc":
        add(scheduler, name, [ord(name), 1])
    assert list(step(scheduler)[0]) == ["a", "b"]


def test_the_newest_running_request_is_preempted_by_recompute_to_the_front_of_waiting():
    scheduler = make(num_blocks=6, budget=64)
    a = add(scheduler, "a", range(10, 18), max_tokens=8)  # 2 full blocks of 4; a decode needs a third
    b = add(scheduler, "b", range(20, 28), max_tokens=8)
    step(scheduler)
    add(scheduler, "c", [5, 6])  # arrives after b
    scheduled, out = step(scheduler)  # a, b decode into their third blocks: 4 + 2 = 6
    assert scheduled == {"a": 1, "b": 1} and scheduler.waiting[0].request_id == "c"
    for _ in range(3):
        step(scheduler)  # both fill their third blocks; the next decode needs 2 blocks, 0 are free
    scheduled, out = step(scheduler)
    assert [r.request_id for r in out.preempted] == ["b"] and out.preempted_req_ids == ["b"]
    assert scheduled == {"a": 1}  # b, at the head of waiting, does not fit; c may not pass it
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]  # the front of waiting, before c
    assert b.seqs[0].num_computed_tokens == 0 and len(b.seqs[0].output_token_ids) == 5  # kept, to recompute
    assert scheduler.make_stats().num_preemptions == 1 and a.seqs[0].output_token_ids == [7] * 6


def test_a_recomputed_request_is_prefilled_with_its_generated_tokens():
    scheduler = make(num_blocks=6, budget=64)
    add(scheduler, "a", range(10, 18), max_tokens=6)
    b = add(scheduler, "b", range(20, 28), max_tokens=8)
    for _ in range(6):
        step(scheduler)  # b is preempted in the sixth step; a finishes in it
    assert scheduler.waiting[0] is b
    scheduled, out = step(scheduler)
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "b" and new.token_ids == list(range(20, 28)) + [7] * 5 and out.finished_req_ids == ["a"]
    assert new.num_computed_tokens == 8 and scheduled == {"b": 13 - 8}  # its 2 prompt blocks, found cached
    assert len(new.block_ids) == 1 and len(new.block_ids[0]) == 4  # one KV cache group


def test_a_request_starts_at_its_first_uncached_token():
    scheduler = make(budget=64)
    add(scheduler, "a", range(100, 118), max_tokens=2)  # 4 full blocks and 2 tokens
    while scheduler.has_unfinished():
        step(scheduler)
    add(scheduler, "b", list(range(100, 110)) + [1, 2, 3])  # shares 2 full blocks, then differs
    scheduled, out = step(scheduler)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8 and scheduled == {"b": 13 - 8}


def test_a_full_cache_hit_still_computes_the_last_token():
    scheduler = make(budget=64)
    add(scheduler, "a", range(100, 116), max_tokens=2)  # exactly 4 blocks
    while scheduler.has_unfinished():
        step(scheduler)
    add(scheduler, "b", range(100, 116))
    scheduled, out = step(scheduler)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12 and scheduled == {"b": 4}


def test_admission_stops_at_the_first_request_the_blocks_cannot_hold():
    scheduler = make(num_blocks=6, budget=64)
    add(scheduler, "a", range(10, 26), max_tokens=4)  # 4 blocks
    add(scheduler, "b", range(30, 42), max_tokens=4)  # 3 blocks: 2 are left
    add(scheduler, "c", [1])  # would fit, but comes after b
    assert step(scheduler)[0] == {"a": 16}
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.block_manager.num_free_blocks == 2


def test_a_decode_takes_a_block_only_when_one_is_free():
    """The last free block goes to a decode; with none left the newest is preempted, never earlier."""
    scheduler = make(num_blocks=5, budget=64)
    add(scheduler, "a", range(10, 18), max_tokens=4)
    add(scheduler, "b", range(20, 26), max_tokens=4)  # 2 blocks, room for 2 more tokens
    step(scheduler)
    _, out = step(scheduler)  # a's decode takes the last free block
    assert not out.preempted and scheduler.block_manager.num_free_blocks == 0


# The engine on the tiny model: chunks, the forward pass, and the persistent batch.

def test_a_chunked_prefill_writes_the_same_kv_and_logits_as_a_whole_one():
    prompt = tokens(11, 45)
    want = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=2048)  # the whole vocabulary
    kv, firsts = [], []
    for budget in (7, 4096):
        llm = LLM("tiny", block_size=4, num_gpu_blocks=64, max_num_batched_tokens=budget)
        llm.engine.add_request("r", {"prompt_token_ids": prompt}, want)
        seq, steps = llm.engine.requests["r"].seqs[0], 0
        while not seq.output_token_ids:
            outputs = llm.engine.step()
            steps += 1
            assert (outputs == []) != bool(seq.output_token_ids)  # no output before the prompt's last chunk
        assert steps == (-(-45 // 7) if budget == 7 else 1)
        table = llm.scheduler.block_manager.get_block_table(seq.seq_id)
        kv.append([torch.cat(llm.cache.gather(layer, table, 45)) for layer in range(llm.model_config.num_layers)])
        firsts.append(seq.logprobs[0])
    for layer, (chunked, whole) in enumerate(zip(*kv, strict=True)):
        torch.testing.assert_close(chunked, whole, **tolerances.kv(llm.model_config, 45, layer, whole))
    assert firsts[0].keys() == firsts[1].keys()
    assert [firsts[0][t] for t in firsts[1]] == pytest.approx(list(firsts[1].values()),
                                                               **tolerances.logprobs(llm.model_config, 45))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_come_chunk_by_chunk_equal_to_stage_7s_and_read_no_cached_block(async_scheduling):
    """Any budget: each chunk's positions give their rows, and together they are stage 7's whole
    prompt (which stage 7's tests hold equal to transformers'). A cached prefix is not read."""

    prompts = [tokens(12, 45), tokens(13, 9), tokens(12, 30) + tokens(14, 5)]  # the third shares 28 tokens
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    whole = _LLM("tiny", stage=7).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tol = tolerances.logprobs(LLM("tiny").model_config, 45)
    for budget in (1, 7, 4096):
        llm = LLM("tiny", block_size=4, num_gpu_blocks=64, max_num_batched_tokens=budget,
                  async_scheduling=async_scheduling)
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2), use_tqdm=False)  # cached now
        hits = llm.stats.prefix_cache_hits
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.stats.prefix_cache_hits == hits
        for ours, theirs in zip(got, whole, strict=True):
            assert ours.prompt_logprobs[0] is None and theirs.prompt_logprobs[0] is None
            for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:], strict=True):
                assert a.keys() == b.keys()
                assert [a[t] for t in b] == pytest.approx(list(b.values()), **tol)


def test_the_persistent_batch_keeps_its_arrays_and_applies_only_the_differences():
    llm = LLM("tiny", block_size=4, num_gpu_blocks=64, max_num_batched_tokens=6)
    batch, manager = llm.engine.runner.input_batch, llm.scheduler.block_manager
    arrays = (batch.token_ids, batch.block_table, batch.num_computed_tokens)
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.engine.add_request("a", {"prompt_token_ids": tokens(1, 9)}, short)
    llm.engine.add_request("b", {"prompt_token_ids": tokens(2, 5)}, SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(8):
        llm.engine.step()
        for rid in set(batch.req_ids) & set(llm.engine.requests):  # each row: the request's tokens and blocks
            row, seq = batch.row_of[rid], llm.engine.requests[rid].seqs[0]
            known = len(seq) - (1 if seq.output_token_ids else 0)  # the token just sampled comes next step
            assert int(batch.num_tokens[row]) == known
            assert batch.token_ids[row, :known].tolist() == seq.token_ids[:known]
            blocks = batch.block_table[row, 0, :int(batch.num_blocks[row, 0])]  # its one group's table
            assert blocks.tolist() == manager.get_block_table(seq.seq_id)
            assert int(batch.num_computed_tokens[row]) == seq.num_computed_tokens
    kept = (batch.token_ids, batch.block_table, batch.num_computed_tokens)
    assert all(now is first for now, first in zip(kept, arrays, strict=True))  # written in place, never replaced
    assert batch.req_ids == ["b"] and batch.row_of == {"b": 0}  # a finished: b moved into its row


def test_kv_utilisation_counts_what_stage_2s_usage_counts_without_walking_the_tables():
    llm = LLM("tiny", block_size=4, num_gpu_blocks=16, max_num_batched_tokens=7)
    manager, counters = llm.scheduler.block_manager, llm.engine.stats
    for i in (0, 2, 4, 8, 1):  # shared prefixes, chunks and preemptions in a small cache
        llm.engine.add_request(i, {"prompt_token_ids": POOL[i]}, params(i, False))
    seen = 0
    while llm.engine.has_unfinished_requests():
        before = counters.token_slots, counters.held_slots
        llm.engine.step()
        usage = manager.usage()
        assert (counters.token_slots - before[0], counters.held_slots - before[1]) == (
            usage.token, usage.token + usage.internal)
        seen += usage.internal > 0
    assert seen > 5 and llm.scheduler.make_stats().num_preemptions > 0


def test_a_running_request_reaches_the_runner_as_its_new_token_and_new_blocks_only():
    manager = PrefixCachingBlockSpaceManager(PrefixCachingAllocator(16), 4)
    scheduler = V1Scheduler(KVCacheManager(manager), max_num_batched_tokens=64, max_model_len=64)
    add(scheduler, "a", range(10, 14), max_tokens=6)
    _, out = step(scheduler)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a"] and out.scheduled_cached_reqs.num_reqs == 0
    _, out = step(scheduler)  # its first decode: token 7, into a new block; 4 tokens computed before the step
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["a"] and cached.new_token_ids == [[7]] and cached.num_computed_tokens == [4]
    assert cached.new_block_ids == [(manager.get_block_table(scheduler.running[0].seqs[0].seq_id)[1:],)]
    _, out = step(scheduler)
    cached = out.scheduled_cached_reqs
    assert (cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens) == ([[7]], [()], [5])


def test_one_sequence_per_request_and_recompute_only():
    """The scheduler holds requests of one sequence: n samples come to it as n requests (V1's front end)."""
    llm = LLM("tiny", num_gpu_blocks=16)
    widths, add = [], llm.scheduler.add
    llm.scheduler.add = lambda request: (widths.append(len(request.seqs)), add(request))[1]
    (served,) = llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(n=2, max_tokens=2), use_tqdm=False)
    assert [len(c.token_ids) for c in served.outputs] == [2, 2] and widths == [1, 1]
    with pytest.raises(ValueError):
        LLM("tiny", num_gpu_blocks=16, preemption_mode="swap")
    with pytest.raises(ValueError):
        LLM("tiny", num_gpu_blocks=16, max_num_batched_tokens=0)
    assert llm.scheduler.block_manager.num_free_blocks == 16


def test_the_runner_drops_the_rows_of_finished_requests_even_when_no_step_follows():
    """A step that schedules nothing still owes the runner the rows to drop: they come with the next one."""
    llm = LLM("tiny", max_num_seqs=4)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for _ in range(3):
        llm.generate([{"prompt_token_ids": [i + 1, i + 2]} for i in range(4)], params, use_tqdm=False)
        assert llm.engine.step() == []  # nothing left to run
        assert set(llm.engine.runner.input_batch.req_ids) <= set(llm.scheduler.finished_req_ids)


def test_the_persistent_batch_appends_new_tokens_after_the_rows_known_tokens_not_its_computed_ones():
    """A row whose computed count differs from its known tokens (a prompt part computed, as under
    prefix caching or a chunk): the update goes after the known tokens; the computed count is the
    runner's to move, never the update's."""
    from minipaged.stage10_model_runner import InputBatch
    from minipaged.stage10_sched_output import NewRequestData

    batch = InputBatch(max_num_reqs=2, max_model_len=32, max_blocks_per_req=8)
    batch.add_request(NewRequestData("r", [5, 6, 7, 8, 9], ([3, 4],), num_computed_tokens=2))
    batch.update_request("r", [11, 12], ([7],))
    row = batch.row_of["r"]
    assert batch.token_ids[row, :7].tolist() == [5, 6, 7, 8, 9, 11, 12] and int(batch.num_tokens[row]) == 7
    assert batch.block_table[row, 0, :3].tolist() == [3, 4, 7] and int(batch.num_blocks[row, 0]) == 3
    assert int(batch.num_computed_tokens[row]) == 2

