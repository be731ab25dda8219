"""The OpenAI-compatible server, over HTTP, with the openai client: the same tokens as LLM.generate."""

import json
import shutil
import time
from functools import partial

import httpx
import openai
import pytest
from helpers_serving import ThreadServer, metric, metric_samples, sse_events

from minipaged import LLM as _LLM
from minipaged import SamplingParams

LLM = partial(_LLM, scheduler="v0")  # V0's scheduler (stage 6): n > 1, beams and swap, as this file serves them

pytestmark = pytest.mark.serving

BLOCKS = 96


@pytest.fixture(scope="module")
def served():
    server = ThreadServer(LLM("tiny", num_gpu_blocks=BLOCKS, max_model_len=256))
    yield server
    server.close()


@pytest.fixture(scope="module")
def server(served):
    return served.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=60)


def wait_idle(served, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = httpx.get(f"{served.url}/state").json()
        if not state["running"] and not state["waiting"] and state["free_blocks"] == state["num_blocks"]:
            return state
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {state}")


def test_completions_equal_llm_generate_for_the_same_seed(client):
    llm = LLM("tiny", num_gpu_blocks=BLOCKS, max_model_len=256)
    prompt = "Return the number of"
    for params in (SamplingParams(max_tokens=12, temperature=0.0), SamplingParams(n=3, max_tokens=10, seed=7)):
        want = llm.generate([prompt], params, use_tqdm=False)[0]
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=params.max_tokens, n=params.n,
                                        temperature=params.temperature, seed=params.seed)
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [o.text for o in want.outputs]
        assert got.usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)
    token_prompt = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert token_prompt.usage.prompt_tokens == 3


def test_streaming_sends_the_same_text_piece_by_piece(client):
    whole = client.completions.create(model="tiny", prompt="Create a new", max_tokens=16, temperature=0)
    pieces, finishes = [], []
    for chunk in client.completions.create(model="tiny", prompt="Create a new", max_tokens=16, temperature=0,
                                           stream=True):
        pieces.append(chunk.choices[0].text)
        finishes.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == whole.choices[0].text and len(pieces) > 1
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])


def test_stop_strings_cut_the_text_and_finish_with_stop(client):
    whole = client.completions.create(model="tiny", prompt="Return the number of", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    text = whole.choices[0].text
    stop = text[len(text) // 2:][:3]
    cut = client.completions.create(model="tiny", prompt="Return the number of", max_tokens=12, temperature=0,
                                    stop=[stop], logprobs=2, extra_body={"ignore_eos": True, "top_k": 5})
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop
    assert len(cut.choices[0].logprobs.tokens) == cut.usage.completion_tokens < 12
    kept = client.completions.create(model="tiny", prompt="Return the number of", max_tokens=12, temperature=0,
                                     stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


def test_bad_requests_get_a_400_and_the_server_keeps_serving(server, client):
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"n": 0}, {"prompt": [1, 99999]},
                {"prompt": "a " * 300, "max_tokens": 20},  # over max_model_len
                {"prompt": []}, {"logprobs": 21},  # vLLM's --max-logprobs default is 20
                {"n": 200, "max_tokens": 16}):  # 200 sequences can never fit 96 blocks: refused, not queued
        body = {"model": "tiny", "prompt": "hello", **bad}
        response = httpx.post(f"{server}/v1/completions", json=body)
        assert response.status_code == 400, bad
        error = response.json()["error"]
        assert error["type"] == "BadRequestError" and error["code"] == 400
    malformed = httpx.post(f"{server}/v1/completions", content=b"{not json",
                           headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and set(malformed.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hello", max_tokens=0)
    assert client.completions.create(model="tiny", prompt="hello", max_tokens=2).choices[0].text is not None


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(served):
    server = served.url
    before = metric_samples(server)
    body = {"model": "tiny", "prompt": "Return the number of", "max_tokens": 240, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                json.loads(line[5:])
                break  # one chunk, then the client goes away
    wait_idle(served)
    m = metric_samples(server)
    # aborted, not run to its end: counted as an abort, and far fewer than 240 tokens were generated
    assert metric(m, "minipaged:request_success_total", finished_reason="abort") == \
        metric(before, "minipaged:request_success_total", finished_reason="abort") + 1
    assert metric(m, "minipaged:request_success_total", finished_reason="length") == \
        metric(before, "minipaged:request_success_total", finished_reason="length")
    assert metric(m, "minipaged:generation_tokens_total") - metric(before, "minipaged:generation_tokens_total") < 240


def test_models_health_metrics_state_and_the_live_page(server):
    model = httpx.get(f"{server}/v1/models").json()["data"][0]
    assert model["id"] == "tiny" and model["max_model_len"] == 256 and model["created"] <= time.time()
    assert httpx.get(f"{server}/health").status_code == 200
    m = metric_samples(server)
    assert metric(m, "minipaged:kv_cache_blocks_total") == BLOCKS
    state = httpx.get(f"{server}/state").json()
    assert state["num_blocks"] == BLOCKS and set(state) >= {"running", "waiting", "swapped", "blocks", "shared"}
    assert "/state" in httpx.get(f"{server}/").text


def test_a_full_waiting_queue_answers_503():
    server = ThreadServer(max_waiting=0)
    try:
        response = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503 and response.json()["error"]["code"] == 503
    finally:
        server.close()


def test_several_prompts_in_one_request_give_n_choices_each_in_order(server):
    llm = LLM("tiny", num_gpu_blocks=BLOCKS, max_model_len=256)
    prompts = ["Return the number of", "Create a new"]
    params = SamplingParams(n=2, max_tokens=6, seed=3)
    want = [o.text for out in llm.generate(prompts, params, use_tqdm=False) for o in out.outputs]
    for prompt in (prompts, [llm.tokenizer.encode(p).ids for p in prompts]):
        body = {"prompt": prompt, "n": 2, "max_tokens": 6, "seed": 3}
        got = httpx.post(f"{server}/v1/completions", json=body).json()
        assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in got["choices"]] == want
        with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}) as response:
            events = sse_events(response)
        streamed = [""] * 4
        for event in events[:-1]:
            for c in event["choices"]:
                streamed[c["index"]] += c["text"]
        assert streamed == want and events[-1] == "[DONE]"


@pytest.mark.skipif(not (shutil.which("chromium") and shutil.which("chromedriver")),
                    reason="needs Debian's chromium and chromium-driver (make installs them where it can)")
def test_the_live_page_draws_the_blocks_of_a_running_request_in_a_real_browser(server):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium")
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        browser.get(f"{server}/?every=100")
        wait = WebDriverWait(browser, 30, poll_frequency=0.1)
        wait.until(lambda b: "blocks in use" in b.find_element(By.ID, "summary").text)
        titles = 'return [...document.querySelectorAll("#blocks .block")].map(c => c.title)'  # read in one go
        assert len(browser.execute_script(titles)) == BLOCKS
        body = {"model": "tiny", "prompt": "Return the number of", "max_tokens": 240, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # the request runs now
            owned = wait.until(lambda b: [t for t in b.execute_script(titles) if t])
            assert owned and all(t.startswith("cmpl-") for t in owned)
            assert "cmpl-" in browser.find_element(By.ID, "queues").text
            assert "cmpl-" in browser.find_element(By.ID, "texts").text  # its text, as it streams
            for _ in lines:  # read to the end: the request finishes
                pass
        wait.until(lambda b: not [t for t in b.execute_script(titles) if t])
        assert "0 running" in browser.find_element(By.ID, "summary").text
    finally:
        browser.quit()
