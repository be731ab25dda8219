"""Stage 10, async scheduling: step N + 1 scheduled while step N runs gives synchronous stepping's outputs."""

import random
from functools import partial

import pytest
from test_stage10_v1_scheduler import assert_same, one_thread  # noqa: F401 (one_thread: an autouse fixture)

from minipaged import LLM as _LLM
from minipaged.stage7_engine import SamplingParams

LLM = partial(_LLM, stage=10)  # the engine as of stage 10


pytestmark = pytest.mark.stage10


def workload(seed, n=14):
    """Prompts sharing prefixes; greedy and seeded rows; stop tokens that end some requests early."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 2000) for _ in range(9)]
    prompts = [{"prompt_token_ids": (system if rng.random() < 0.5 else [])
                + [rng.randrange(1, 2000) for _ in range(rng.randrange(1, 20))]} for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 24), temperature=rng.choice([0.0, 0.9]), seed=i,
                             logprobs=2, stop_token_ids=[rng.randrange(2048) for _ in range(40)])
              for i in range(n)]
    return prompts, params


@pytest.mark.parametrize(("budget", "num_blocks"), [(4096, 64), (8, 64), (4096, 16), (3, 14)],
                         ids=["roomy", "small budget", "preempting", "both"])
@pytest.mark.parametrize("seed", range(3))
def test_async_scheduling_gives_the_outputs_of_synchronous_stepping(seed, budget, num_blocks):
    prompts, params = workload(seed)
    kwargs = dict(block_size=4, num_gpu_blocks=num_blocks, max_model_len=56, max_num_batched_tokens=budget,
                  max_num_seqs=6)
    sync, asynchronous = LLM("tiny", **kwargs), LLM("tiny", async_scheduling=True, **kwargs)
    expected = sync.generate(prompts, params, use_tqdm=False)
    got = asynchronous.generate(prompts, params, use_tqdm=False)
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.outputs[0].finish_reason == theirs.outputs[0].finish_reason
        assert_same(mine.outputs[0], theirs.outputs[0], sync)
    assert asynchronous.scheduler.block_manager.num_free_blocks == num_blocks
    if num_blocks == 16:
        assert asynchronous.stats.num_preemptions > 0  # the fixture preempts, or it proves nothing about them


def test_a_step_is_scheduled_while_the_one_before_runs():
    llm = LLM("tiny", async_scheduling=True, max_num_batched_tokens=4096)
    engine, seen = llm.engine, []
    schedule = engine.scheduler.schedule

    def watched():
        seen.append(engine.in_flight is not None)  # a step in flight when the scheduler runs
        return schedule()

    engine.scheduler.schedule = watched
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    # the prompt's step runs alone (the first decode waits for it), then every step is scheduled during the last
    assert seen[:3] == [False, True, False] and all(seen[3:]) and len(seen) >= 9


def test_no_token_is_computed_for_a_request_whose_last_token_is_in_flight():
    """With end tokens ignored, every request's length is known: async computes exactly what sync computes."""
    prompts = [{"prompt_token_ids": list(range(1, 3 + i))} for i in range(6)]
    params = [SamplingParams(max_tokens=1 + i, temperature=0.0, ignore_eos=True) for i in range(6)]
    counts = []
    for flag in (False, True):
        llm = LLM("tiny", async_scheduling=flag, max_num_batched_tokens=4096)
        llm.generate(prompts, params, use_tqdm=False)
        counts.append((llm.stats.prefill_tokens, llm.stats.decode_tokens))
    assert counts[0] == counts[1]


def test_a_prompts_first_decode_waits_for_the_step_that_computes_its_prompt():
    """Its first decode makes the prompt's blocks findable (stage 9): not before their K/V are written."""
    llm = LLM("tiny", async_scheduling=True, block_size=4, max_num_batched_tokens=4096)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": list(range(1, 10))},
                       SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    first = engine.scheduler.schedule()
    engine.launch(first)  # the prompt's step, in flight
    assert "a" not in engine.scheduler.schedule().num_scheduled_tokens


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_when_a_steps_tokens_are_read_the_next_step_is_already_launched(async_scheduling, monkeypatch):
    """vLLM's batch queue: when the host reads step k's tokens, the forward pass has been launched k + 1
    times, in every steady step; so when ``step()`` hands back a request's token k, token k + 1 is on its
    way. Synchronous stepping has launched k."""
    llm = LLM("tiny", async_scheduling=async_scheduling)
    engine, forwards, reads, returned = llm.engine, [], [], []
    forward, sample_async = engine.runner.forward, engine.sampler.sample_async

    def counted(out):
        forwards.append(out)
        return forward(out)

    def traced(*args, **kwargs):
        pending = sample_async(*args, **kwargs)
        result = pending.result

        def read():
            reads.append(len(forwards))  # the forward passes launched when this step's tokens are read
            return result()

        pending.result = read
        return pending

    monkeypatch.setattr(engine.runner, "forward", counted)
    monkeypatch.setattr(engine.sampler, "sample_async", traced)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=12, temperature=0.0,
                                                                             ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            returned.append((len(out.outputs[0].token_ids), len(forwards)))
    # the first token waits for the prompt's step, alone; the last is not followed by another
    steady = [(k, n) for k, n in enumerate(reads, start=1) if 2 <= k < 11]
    assert len(steady) == 9 and all(n == k + async_scheduling for k, n in steady), reads
    assert all(n == k + async_scheduling for k, n in returned if 2 <= k < 11), returned


def test_a_stopped_request_gets_no_token_from_the_step_it_was_scheduled_in_after_stopping():
    prompt = {"prompt_token_ids": [11, 12, 13]}
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = LLM("tiny").generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[3]])
    out = LLM("tiny", async_scheduling=True).generate([prompt], stop, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:tokens.index(tokens[3]) + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("at", ["forward", "schedule"])
def test_an_exception_in_either_step_leaves_the_engine_usable_with_every_block_back(fault, at, monkeypatch):
    llm = LLM("tiny", async_scheduling=True, num_gpu_blocks=32, block_size=4, max_model_len=64,
              max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": list(range(1, 10 + i))} for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    part = llm.engine.runner if at == "forward" else llm.engine.scheduler
    name = "execute_model" if at == "forward" else "schedule"
    original, calls = getattr(part, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise fault("boom")
        return original(*args, **kwargs)

    monkeypatch.setattr(part, name, failing)
    with pytest.raises(fault):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(part, name, original)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    assert llm.scheduler.block_manager.num_free_blocks == 32
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    # the runner holds a row only for a request it will be told to drop at the next step: none is lost
    assert set(llm.engine.runner.input_batch.req_ids) <= set(llm.scheduler.finished_req_ids)
