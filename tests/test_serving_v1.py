"""The server over stage 10's engine: the same text as its LLM.generate, n samples too; the default engine."""

from functools import partial

import httpx
import openai
import pytest
import torch
from helpers_serving import ThreadServer

import minipaged.serving.server
from minipaged import LLM as _LLM
from minipaged import SamplingParams
from minipaged.cli import main
from minipaged.serving.launcher import free_port
from minipaged.stage10_engine_core import V1Engine

LLM = partial(_LLM, stage=10)  # the engine as of stage 10

pytestmark = pytest.mark.serving

ENGINE_ARGS = {"num_gpu_blocks": 96, "max_model_len": 256, "max_num_batched_tokens": 8}  # prompts in chunks


@pytest.fixture(scope="module")
def served():
    server = ThreadServer(LLM("tiny", **ENGINE_ARGS))
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=60)


PROMPTS = ["Return the number of", "If the file does not exist, raise an error and"]


def test_completions_and_streams_equal_v1_generate(client):
    llm = LLM("tiny", **ENGINE_ARGS)
    for prompt in PROMPTS:
        want = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0].outputs[0]
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want.text
        assert got.usage.completion_tokens == len(want.token_ids)
        pieces = [c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True)]
        assert "".join(pieces) == want.text and len(pieces) > 1


def test_n_samples_are_served_in_choices_streamed_or_not_as_generate_gives_them(served, client):
    """V1 fans a request of n samples out in its front end: n choices, index by index what ``LLM.generate``
    gives for the same seed, streamed or not."""
    want = LLM("tiny", **ENGINE_ARGS).generate(PROMPTS[0], SamplingParams(n=3, max_tokens=4, seed=1),
                                               use_tqdm=False)[0].outputs
    got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, n=3, seed=1)
    assert sorted((c.index, c.text) for c in got.choices) == [(c.index, c.text) for c in want]
    texts = ["", "", ""]
    for chunk in client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, n=3, seed=1,
                                           stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in want]


def test_state_metrics_and_health_read_the_v1_engine(served, client):
    client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0)
    for route in ("/health", "/state", "/metrics"):
        assert httpx.get(f"{served.url}{route}").status_code == 200, route
    state = httpx.get(f"{served.url}/state").json()
    assert state["num_blocks"] == ENGINE_ARGS["num_gpu_blocks"]


class Built(Exception):
    """Stops serve() once it has built its engine."""


@pytest.mark.parametrize(("argv", "v1"), [([], True), (["--scheduler", "v0"], False), (["--async-scheduling"], True),
                                          (["--scheduler", "v1", "--async-scheduling"], True),
                                          (["--preemption-mode", "swap"], False)])
def test_serve_scheduler_option_picks_the_engine(monkeypatch, argv, v1):
    def build_app(llm, *args, **kwargs):
        raise Built(llm)

    monkeypatch.setattr(minipaged.serving.server, "build_app", build_app)
    with pytest.raises(Built) as built:
        main(["serve", "--port", str(free_port()), "--threads", "1", *argv])
    llm = built.value.args[0]
    assert isinstance(llm.engine, V1Engine) == v1
    assert getattr(llm.engine, "async_scheduling", False) == ("--async-scheduling" in argv)


@pytest.mark.parametrize("spelling", ["vllm", "short"])
def test_serve_flags_are_vllms_and_reach_the_engine_config(monkeypatch, spelling):
    def build_app(llm, *args, **kwargs):
        raise Built(llm)

    monkeypatch.setattr(minipaged.serving.server, "build_app", build_app)
    names = {"vllm": ["--attention-backend", "--enable-prefix-caching"], "short": ["--backend", "--prefix-caching"]}
    backend, caching = names[spelling]
    with pytest.raises(Built) as built:
        main(["serve", "--port", str(free_port()), "--threads", "1", "--scheduler", "v1", backend, "triton", caching,
              "--max-num-batched-tokens", "96", "--gpu-memory-utilization", "0.5", "--enforce-eager",
              "--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    config = built.value.args[0].config
    assert (config.attention_backend, config.enable_prefix_caching) == ("triton", True)
    assert (config.max_num_batched_tokens, config.gpu_memory_utilization, config.enforce_eager) == (96, 0.5, True)
    assert (config.kv_cache_dtype, config.calculate_kv_scales) == ("fp8", True)  # stage 13's cache
    assert built.value.args[0].cache.key_cache[0].dtype == torch.float8_e4m3fn


def test_an_async_scheduling_server_streams_what_generate_gives():
    server = ThreadServer(LLM("tiny", async_scheduling=True, **ENGINE_ARGS))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        llm = LLM("tiny", **ENGINE_ARGS)
        for prompt in PROMPTS:
            want = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
            pieces = [c.choices[0].text for c in client.completions.create(
                model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True)]
            assert "".join(pieces) == want.outputs[0].text
    finally:
        server.close()


def test_serve_v1_refuses_swap_before_serving(monkeypatch):
    def build_app(llm, *args, **kwargs):
        raise Built(llm)

    monkeypatch.setattr(minipaged.serving.server, "build_app", build_app)
    with pytest.raises(ValueError):
        minipaged.serving.server.serve("tiny", port=free_port(), scheduler="v1", preemption_mode="swap")
    with pytest.raises(Built):  # the same call with recompute builds the engine
        minipaged.serving.server.serve("tiny", port=free_port(), scheduler="v1", preemption_mode="recompute")
    with pytest.raises(ValueError):
        minipaged.serving.server.serve("tiny", port=free_port(), scheduler="v2")


def test_prefix_caching_is_on_under_v1_unless_no_enable_prefix_caching_says_otherwise(monkeypatch):
    """vLLM V1's default, and its flag to turn it off."""
    def build_app(llm, *args, **kwargs):
        raise Built(llm)

    monkeypatch.setattr(minipaged.serving.server, "build_app", build_app)
    for flags, expected in (([], True), (["--no-enable-prefix-caching"], False)):
        with pytest.raises(Built) as built:
            main(["serve", "--port", str(free_port()), "--threads", "1", "--scheduler", "v1", *flags])
        assert built.value.args[0].config.enable_prefix_caching is expected
