"""The OpenAI-compatible server, over HTTP, with the openai client: the same tokens as LLM.generate."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from minipaged import LLM, SamplingParams

pytestmark = pytest.mark.serving

BLOCKS = 96


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "minipaged.cli", "serve", "--port", str(port),
                                "--num-gpu-blocks", str(BLOCKS), "--max-model-len", "256", *args],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server stopped: {process.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not start within 120 s")


def stop_server(process):
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


@pytest.fixture(scope="module")
def server():
    process, url = start_server()
    yield url
    stop_server(process)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def metrics(url) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


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


def test_stop_strings_logprobs_and_vllm_fields(client):
    whole = client.completions.create(model="tiny", prompt="Return the number of", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    text = whole.choices[0].text
    stop = text[len(text) // 2:][:3]
    cut = client.completions.create(model="tiny", prompt="Return the number of", max_tokens=12, temperature=0,
                                    stop=[stop], logprobs=2, extra_body={"ignore_eos": True, "top_k": 5})
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].logprobs is not None


def test_bad_requests_get_a_400_and_the_server_keeps_serving(server, client):
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"n": 0}, {"prompt": [1, 99999]},
                {"prompt": "a " * 300, "max_tokens": 20},  # over max_model_len
                {"n": 200, "max_tokens": 16}):  # 200 sequences can never fit 96 blocks: refused, not queued
        body = {"model": "tiny", "prompt": "hello", **bad}
        response = httpx.post(f"{server}/v1/completions", json=body)
        assert response.status_code == 400, bad
        assert response.json()["error"]["type"] == "invalid_request_error"
    malformed = httpx.post(f"{server}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert malformed.status_code == 400
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hello", max_tokens=0)
    assert client.completions.create(model="tiny", prompt="hello", max_tokens=2).choices[0].text is not None


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    before = metrics(server)
    body = {"model": "tiny", "prompt": "Return the number of", "max_tokens": 240, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                json.loads(line[5:])
                break  # one chunk, then the client goes away
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = metrics(server)
        if m["minipaged_requests_running"] == 0 and m["minipaged_kv_blocks_used"] == 0:
            break
        time.sleep(0.2)
    assert m["minipaged_requests_running"] == 0 and m["minipaged_kv_blocks_used"] == 0
    # aborted, not run to its end: it never finished, and its 240 tokens were never served
    assert m["minipaged_requests_finished_total"] == before["minipaged_requests_finished_total"]
    assert m["minipaged_generation_tokens_total"] == before["minipaged_generation_tokens_total"]


def test_models_health_metrics_state_and_the_live_page(server):
    assert httpx.get(f"{server}/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    m = metrics(server)
    assert m["minipaged_kv_blocks_total"] == BLOCKS and "minipaged_preemptions_total" in m
    state = httpx.get(f"{server}/state").json()
    assert state["num_blocks"] == BLOCKS and set(state) >= {"running", "waiting", "swapped", "blocks", "shared"}
    assert "/state" in httpx.get(f"{server}/").text


def test_a_full_waiting_queue_answers_503_and_shutdown_is_clean():
    process, url = start_server("--max-waiting", "0")
    try:
        response = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503 and response.json()["error"]["type"] == "server_overloaded"
    finally:
        stop_server(process)
    assert process.returncode == 0


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
