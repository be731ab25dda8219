"""Stage 11: tensor parallelism, checked against one process: the same tokens, the same K/V per head,
under preemption, prefix caching and chunked prefill; and workers that never hang and never linger."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from functools import partial

import helpers_tolerances as tolerances
import httpx
import numpy as np
import pytest
import torch
from helpers_checkpoints import save_random_checkpoints

from minipaged import LLM as _LLM
from minipaged.common.sampling_params import SamplingParams
from minipaged.stage11_tensor_parallel import WorkerDiedError

LLM = partial(_LLM, stage=11)  # the engine as of stage 11: V1's scheduler, tensor parallel
OneProcess = partial(_LLM, stage=10)  # the engine as of stage 10, in this process

V0LLM = V0OneProcess = partial(_LLM, stage=11, scheduler="v0")  # with V0's

pytestmark = pytest.mark.stage11

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
ARCHITECTURES = {  # name -> (transformers config class, its arguments)
    "llama-mha-bias": ("LlamaConfig", {**COMMON, "num_key_value_heads": 4, "attention_bias": True}),
    "llama-gqa": ("LlamaConfig", COMMON),  # 2 KV heads, split over 2 ranks
    "llama-replicated": ("LlamaConfig", {**COMMON, "num_attention_heads": 8}),  # 2 KV heads over 4 ranks
    "qwen2": ("Qwen2Config", {**COMMON, "tie_word_embeddings": True}),  # q/k/v biases
    "qwen3": ("Qwen3Config", {**COMMON, "num_key_value_heads": 1, "head_dim": 32}),  # 1 KV head over 2 ranks
    "gpt2": ("GPT2Config", dict(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128)),
}
PROMPTS = [[5, 17, 90, 3, 42, 8, 25, 11, 7] * 3, [1, 2, 3], [60, 61, 62, 63, 64, 65, 66]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


def generate(llm, prompts=PROMPTS, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_same(got, expected, llm, context=64):
    tol = tolerances.logprobs(llm.model_config, context)
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
            common = a.keys() & b.keys()
            assert [a[t] for t in common] == pytest.approx([b[t] for t in common], **tol)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_random_checkpoints(tmp_path_factory, ARCHITECTURES)


@pytest.mark.parametrize("name,tp", [("llama-mha-bias", 2), ("llama-gqa", 2), ("qwen2", 2), ("qwen3", 2),
                                     ("gpt2", 2), ("llama-replicated", 4)])
def test_tensor_parallel_equals_one_process_token_for_token(checkpoints, name, tp):
    kwargs = dict(block_size=4, num_gpu_blocks=64)
    expected = generate(OneProcess(checkpoints[name], **kwargs))
    with LLM(checkpoints[name], tensor_parallel_size=tp, **kwargs) as llm:
        assert_same(generate(llm), expected, llm)


@pytest.mark.parametrize("name,heads", [("llama-gqa", [[0], [1]]), ("qwen3", [[0], [0]])])
def test_each_rank_holds_its_kv_heads_slice_of_the_one_process_cache(checkpoints, name, heads):
    """Same block ids on every rank; each rank's K/V are its heads' slice of one process's (a model
    with fewer KV heads than ranks: every rank holds the one its query heads read)."""
    path, prompt = checkpoints[name], PROMPTS[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    one = OneProcess(path, block_size=4, num_gpu_blocks=64)
    with LLM(path, tensor_parallel_size=2, block_size=4, num_gpu_blocks=64) as llm:
        for engine in (one.engine, llm.engine):
            engine.add_request("r", {"prompt_token_ids": prompt}, params)
            for _ in range(3):
                engine.step()
        seqs = [e.requests["r"].seqs[0] for e in (one.engine, llm.engine)]
        tables = [x.scheduler.block_manager.get_block_table(s.seq_id) for x, s in zip((one, llm), seqs, strict=True)]
        assert tables[0] == tables[1]
        n = len(seqs[0]) - 1  # the last token's K/V are written by the next step
        for layer in range(one.model_config.num_layers):
            k1, v1 = one.cache.gather(layer, tables[0], n)
            shards = llm.executor.collective_rpc("gather", layer, tables[1], n)
            assert [held for _, _, held in shards] == heads
            for key, value, held in shards:
                for got, want in ((key, k1[:, held]), (value, v1[:, held])):
                    torch.testing.assert_close(torch.from_numpy(got), want,
                                               **tolerances.kv(one.model_config, n, layer, want))
            for got, want in zip(llm.cache.gather(layer, tables[1], n), (k1, v1), strict=True):  # heads together
                torch.testing.assert_close(got, want, **tolerances.kv(one.model_config, n, layer, want))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_same_under_preemption_and_prefix_caching_with_v0s_scheduler(mode):
    """A cache too small for the batch: sequences are preempted, their blocks swapped out and in on
    every rank (each its own shard), or recomputed; shared prefixes are found in the cache."""
    prompts = [PROMPTS[0] + [i] for i in range(6)]
    kwargs = dict(block_size=4, num_gpu_blocks=20, num_cpu_blocks=64, preemption_mode=mode,
                  enable_prefix_caching=True)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    one = V0OneProcess("tiny", **kwargs)
    expected = generate(one, prompts, params)
    assert one.stats.num_preemptions > 0 and one.stats.prefix_cache_hits > 0
    assert (one.stats.scheduler.num_swapped_out_blocks > 0) == (mode == "swap")
    with V0LLM("tiny", tensor_parallel_size=2, **kwargs) as llm:
        assert_same(generate(llm, prompts, params), expected, llm)
        assert llm.stats.num_preemptions == one.stats.num_preemptions
        assert llm.stats.scheduler.num_swapped_out_blocks == one.stats.scheduler.num_swapped_out_blocks


def test_forked_samples_copy_their_shared_block_on_every_rank():
    """``n=2`` forks after the prompt: the samples share its last, part-full block until each writes
    to it, and then copy-on-write copies it; every rank copies its own shard of that block."""
    prompts = [PROMPTS[0][:10], PROMPTS[2]]  # neither a multiple of the block size
    params = SamplingParams(n=2, max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    one = V0OneProcess("tiny", block_size=4, num_gpu_blocks=64)
    expected = generate(one, prompts, params)
    with V0LLM("tiny", tensor_parallel_size=2, block_size=4, num_gpu_blocks=64) as llm:
        got = generate(llm, prompts, params)
    for ours, theirs in zip(got, expected, strict=True):
        assert [o.token_ids for o in ours.outputs] == [o.token_ids for o in theirs.outputs]


def test_the_same_with_chunked_prefill_recompute_and_prompt_logprobs_with_v1s_scheduler():
    prompts = [PROMPTS[0] + [i] for i in range(5)]
    kwargs = dict(block_size=4, num_gpu_blocks=24, max_num_batched_tokens=7)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    one = OneProcess("tiny", **kwargs)
    expected = generate(one, prompts, params)
    assert one.stats.num_preemptions > 0
    with LLM("tiny", tensor_parallel_size=2, **kwargs) as llm:
        got = generate(llm, prompts, params)
        assert_same(got, expected, llm)
        tol = tolerances.logprobs(llm.model_config, 32)
        for prompt, ours, theirs in zip(prompts, got, expected, strict=True):
            assert ours.prompt_logprobs[0] is None
            for token, a, b in zip(prompt[1:], ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:], strict=True):
                assert token in a and token in b  # the prompt's own token, always; the top 1 beside it
                assert a[token] == pytest.approx(b[token], **tol)
                assert max(a.values()) == pytest.approx(max(b.values()), **tol)


@pytest.mark.rounding_free
def test_bad_sizes_are_refused_before_any_worker_starts_and_one_rank_is_the_engine_below(checkpoints):
    import multiprocessing

    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError):
        LLM(checkpoints["llama-gqa"], tensor_parallel_size=3)  # 4 heads over 3 ranks
    with pytest.raises(ValueError):
        LLM("tiny", tensor_parallel_size=0)
    with pytest.raises(ValueError):
        LLM("tiny", tensor_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(ValueError):
        OneProcess("tiny", tensor_parallel_size=2)  # stage 10 runs the model in one process
    assert set(multiprocessing.active_children()) == before
    single = LLM("tiny", tensor_parallel_size=1)  # no worker, no stand-in: stage 10's engine itself
    assert single.executor is None and set(multiprocessing.active_children()) == before
    expected = generate(OneProcess("tiny"))
    assert_same(generate(single), expected, single)
    with LLM("tiny", tensor_parallel_size=2) as llm:  # a size that divides the heads serves the same
        assert_same(generate(llm), expected, llm)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.rounding_free
def test_a_killed_worker_makes_the_driver_raise_within_seconds_and_leaves_no_process():
    llm = LLM("tiny", tensor_parallel_size=2)
    procs = list(llm.executor.procs)
    assert_same(generate(llm), generate(OneProcess("tiny")), llm)  # serving, until a worker dies
    wait_all = llm.executor.wait_all

    def kill_then_wait(*args):  # the step has been sent: worker 1 dies in the middle of it
        os.kill(procs[1].pid, signal.SIGKILL)
        return wait_all(*args)

    llm.executor.wait_all = kill_then_wait
    start = time.monotonic()
    with pytest.raises(WorkerDiedError):
        generate(llm, params=SamplingParams(max_tokens=50, ignore_eos=True))
    assert time.monotonic() - start < 15
    with pytest.raises(WorkerDiedError):
        llm.check_health()
    with pytest.raises(WorkerDiedError):  # and says so at once, every time after
        generate(llm)
    assert llm.scheduler.block_manager.num_free_blocks == llm.scheduler.block_manager.num_total_blocks
    assert all(not p.is_alive() for p in procs)


@pytest.mark.rounding_free
def test_a_worker_killed_between_steps_fails_the_next_step_and_the_health_check():
    """Its pipe is closed before the step is sent: the driver says the worker is gone, not that a
    pipe broke, so that a server answers 503 (an engine that cannot serve) rather than 500."""
    llm = LLM("tiny", tensor_parallel_size=2)
    procs = list(llm.executor.procs)
    generate(llm)
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].join(10)
    with pytest.raises(WorkerDiedError):
        generate(llm)
    with pytest.raises(WorkerDiedError):
        llm.check_health()
    assert llm.scheduler.block_manager.num_free_blocks == llm.scheduler.block_manager.num_total_blocks
    assert all(not p.is_alive() for p in procs)


@pytest.mark.rounding_free
def test_ctrl_c_while_a_step_runs_leaves_the_engine_usable_with_every_block_back():
    expected = generate(OneProcess("tiny"))
    with LLM("tiny", tensor_parallel_size=2) as llm:
        wait_all, calls = llm.executor.wait_all, []

        def interrupted(*args):  # Ctrl-C on the third step, after it went to every worker
            calls.append(args)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return wait_all(*args)

        llm.executor.wait_all = interrupted
        with pytest.raises(KeyboardInterrupt):
            generate(llm)
        manager = llm.scheduler.block_manager
        assert manager.num_free_blocks == manager.num_total_blocks
        assert_same(generate(llm), expected, llm)  # the interrupted step's late answer is dropped


@pytest.mark.rounding_free
def test_no_worker_outlives_its_llm_close_with_block_or_interpreter_exit():
    llm = LLM("tiny", tensor_parallel_size=2)
    procs = list(llm.executor.procs)
    llm.close()
    assert all(not p.is_alive() for p in procs)
    with pytest.raises(WorkerDiedError):
        generate(llm)
    with LLM("tiny", tensor_parallel_size=2) as llm:
        procs = list(llm.executor.procs)
        assert_same(generate(llm), generate(OneProcess("tiny")), llm)
    assert all(not p.is_alive() for p in procs)
    script = ("from minipaged import LLM\n"
              "llm = LLM('tiny', stage=11, tensor_parallel_size=2)\n"
              "print(*[p.pid for p in llm.executor.procs])\n")  # and exit without closing it
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    pids = [int(p) for p in out.stdout.split()]
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(pids) == 2 and all(gone(pid) for pid in pids)


@pytest.mark.rounding_free
def test_the_same_worker_code_runs_under_torchrun():
    """``torchrun --standalone --nproc-per-node 2``: the ranks and the rendezvous from torchrun's
    environment, on loopback; rank 0 runs the engine and prints the tokens."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun is not None
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "minipaged.llm",
           "--prompt-token-ids", json.dumps(PROMPTS), "--max-tokens", "8", "--num-gpu-blocks", "64"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert got == [o.outputs[0].token_ids for o in generate(OneProcess("tiny", num_gpu_blocks=64), params=params)]


@pytest.mark.rounding_free
def test_serve_with_two_workers_answers_the_openai_client_and_503_once_a_worker_dies():
    """``minipaged serve --tensor-parallel-size 2``: the same completion as one process, whole and
    streamed; after a worker is killed, /health fails and requests get 503, and no worker remains."""
    import openai
    import psutil

    from minipaged.serving.launcher import start_server

    process, url = start_server("--num-gpu-blocks", "64", "--max-model-len", "256", "--tensor-parallel-size", "2",
                                timeout=180)
    try:
        workers = [w for w in psutil.Process(process.pid).children(recursive=True)
                   if "spawn_main" in " ".join(w.cmdline())]  # the spawned workers, not the resource tracker
        assert len(workers) == 2
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        whole = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True))
        one = generate(OneProcess("tiny"), [PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0))[0]
        assert whole.choices[0].text == streamed == one.outputs[0].text
        os.kill(workers[1].pid, signal.SIGKILL)
        for _ in range(2):  # the request whose step finds the worker dead, then one the server refuses
            with pytest.raises(openai.APIStatusError) as failed:
                client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8)
            assert failed.value.status_code == 503
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    deadline = time.monotonic() + 10
    while any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)


def test_forks_under_swap_preemption_move_their_blocks_in_the_runners_order_on_every_rank():
    """``n=2`` and a cache that swaps: a step may swap blocks out, swap others in, and copy a shared
    block, and each rank must do them in that order, as the runner does."""
    prompts = [PROMPTS[0][:10] + [i] for i in range(4)]
    kwargs = dict(block_size=4, num_gpu_blocks=14, num_cpu_blocks=64, preemption_mode="swap", max_model_len=48)
    params = SamplingParams(n=2, max_tokens=16, temperature=0.0, ignore_eos=True)
    one = V0OneProcess("tiny", **kwargs)
    expected = generate(one, prompts, params)
    assert one.stats.scheduler.num_swapped_out_blocks > 0
    with V0LLM("tiny", tensor_parallel_size=2, **kwargs) as llm:
        got = generate(llm, prompts, params)
    for ours, theirs in zip(got, expected, strict=True):
        assert [o.token_ids for o in ours.outputs] == [o.token_ids for o in theirs.outputs]


def test_the_workers_attend_with_the_backend_the_llm_was_given():
    """No output shows which backend ran; a spy on the steps sent to the workers does."""
    with LLM("tiny", tensor_parallel_size=2, attention_backend="triton", block_size=4, num_gpu_blocks=32) as llm:
        sent = []
        execute = llm.executor.execute_model
        llm.executor.execute_model = lambda step: sent.append(step.attention_backend) or execute(step)
        generate(llm, [PROMPTS[0][:6]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert sent and set(sent) == {"triton"}



def test_a_worker_attends_with_the_backend_its_step_names(tmp_path):
    """A spy in the worker itself: the attention its configuration builds for the name the step gives is
    the one every layer calls (in this process: one rank of one)."""
    from minipaged.models import resolve_model_path
    from minipaged.stage7_model_runner import backend_named
    from minipaged.stage11_worker import StepInputs, Worker, WorkerConfig

    called = []

    def spy(name, cache):
        def attention(*args, **kwargs):
            called.append(name)
            return backend_named("ref")(*args, **kwargs)
        return attention

    config = WorkerConfig(str(resolve_model_path("tiny")), "float32", "cpu", 4, 8, 0, 1,
                          init_method=f"file://{tmp_path}/store", attention=spy)
    worker = Worker(config, 0)
    worker.init_device()
    try:
        worker.load_model()
        n = 6  # one prompt of 6 tokens in blocks 0 and 1
        step = StepInputs(np.arange(1, n + 1, dtype=np.int64), np.arange(n, dtype=np.int64),
                          np.arange(n, dtype=np.int64), np.array([[0, 1]], np.int32), np.array([n], np.int32),
                          np.array([0, n], np.int32), np.array([n - 1], np.int64), attention_backend="triton")
        logits = worker.execute_model(step)
    finally:
        worker.close()
    assert logits is not None and logits.shape[0] == 1
    assert called == ["triton"] * worker.model_config.num_layers
