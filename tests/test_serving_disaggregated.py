"""Disaggregated prefill as three processes on loopback: a producer and a consumer (`minipaged serve
--kv-transfer-config ...`) over one folder, and `minipaged disagg-proxy` in front of them. The proxy's
answers equal one engine's; a producer that dies mid-request is that request's error only; no
process is left behind."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import minipaged.serving.server
from minipaged import LLM, SamplingParams
from minipaged.cli import main
from minipaged.serving.launcher import free_port, start_server
from minipaged.stage14_disaggregated_prefill import ConnectorKVCacheManager

pytestmark = pytest.mark.serving

SIZES = ["--block-size", "4", "--num-gpu-blocks", "256", "--max-model-len", "256", "--threads", "1"]


def kv_config(folder, kv_role):
    return json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": kv_role,
                       "kv_connector_extra_config": {"shared_storage_path": str(folder)}})


def start_proxy(prefill, decode):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "minipaged.cli", "disagg-proxy", "--prefill", prefill,
                                "--decode", decode, "--port", str(port)], stdout=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the proxy did not start")


@pytest.fixture
def three(tmp_path):
    """(producer, consumer, proxy): each a process and its URL; every one of them stopped and reaped after."""
    processes = []
    try:
        for kv_role in ("kv_producer", "kv_consumer"):
            processes.append(start_server(*SIZES, "--kv-transfer-config", kv_config(tmp_path, kv_role),
                                          stdout=subprocess.DEVNULL))
        processes.append(start_proxy(processes[0][1], processes[1][1]))
        yield processes
    finally:
        for process, _ in processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)
        assert all(process.poll() is not None for process, _ in processes)  # nothing left behind


def prompts():
    return [[(37 * i + 11 * j) % 2000 + 1 for j in range(1 + (7 * i) % 41)] for i in range(100)]


def test_the_proxy_answers_what_one_engine_generates_on_100_prompts(three, tmp_path):
    engine = LLM("tiny", block_size=4, num_gpu_blocks=256, max_model_len=256)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].text for o in engine.generate([{"prompt_token_ids": p} for p in prompts()], params,
                                                       use_tqdm=False)]
    client = openai.OpenAI(base_url=f"{three[2][1]}/v1", api_key="none", max_retries=0, timeout=120)

    def complete(prompt):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(complete, prompts()))
    assert got == want
    assert any(tmp_path.iterdir())  # the producer saved blocks the consumer loaded
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompts()[40], max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == want[40]


def test_a_producer_dying_mid_request_fails_that_request_and_the_consumer_serves_on(three):
    (producer, _), (_, consumer_url), (_, proxy_url) = three
    body = {"model": "tiny", "prompt": "The cat sat on the mat and", "max_tokens": 4, "temperature": 0}
    answers = []
    producer.send_signal(signal.SIGSTOP)  # it holds the request it is sent ...
    thread = threading.Thread(target=lambda: answers.append(httpx.post(f"{proxy_url}/v1/completions", json=body,
                                                                       timeout=60)))
    thread.start()
    time.sleep(1.0)
    producer.kill()  # ... and dies with it
    thread.join(60)
    assert answers and answers[0].status_code == 502 and "error" in answers[0].json()
    direct = httpx.post(f"{consumer_url}/v1/completions", json=body, timeout=60)
    assert direct.status_code == 200 and direct.json()["choices"][0]["text"]
    again = httpx.post(f"{proxy_url}/v1/completions", json=body, timeout=60)
    assert again.status_code == 502  # the proxy stays up and says why


def test_the_proxy_refuses_a_body_that_is_no_object_and_says_when_the_producer_is_gone():
    from fastapi.testclient import TestClient

    from minipaged.serving.disagg_proxy import build_proxy_app, prefill_body

    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with TestClient(build_proxy_app(gone, gone)) as client:
        assert client.post("/v1/completions", content=b"not json").status_code == 400
        assert client.post("/v1/completions", json=[1, 2]).status_code == 400
        answer = client.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
        assert answer.status_code == 502 and "error" in answer.json()
    asked = prefill_body({"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {}, "min_tokens": 3})
    assert asked == {"prompt": "x", "max_tokens": 1, "stream": False}


def test_serve_takes_vllms_kv_transfer_config_and_runs_v1_with_a_connector(monkeypatch, tmp_path):
    class Built(Exception):
        pass

    def build_app(llm, *args, **kwargs):
        raise Built(llm)

    monkeypatch.setattr(minipaged.serving.server, "build_app", build_app)
    with pytest.raises(Built) as built:
        main(["serve", "--port", str(free_port()), "--threads", "1", "--kv-transfer-config",
              kv_config(tmp_path, "kv_consumer")])
    llm = built.value.args[0]
    assert isinstance(llm.scheduler.connector, ConnectorKVCacheManager) and llm.config.scheduler == "v1"
    assert llm.config.kv_transfer_config.kv_role == "kv_consumer"
    assert llm.config.kv_transfer_config.shared_storage_path == str(tmp_path)


def test_a_bad_kv_transfer_config_fails_in_one_line_before_the_model_loads():
    result = subprocess.run([sys.executable, "-m", "minipaged.cli", "serve", "--kv-transfer-config",
                             '{"kv_role": "kv_prefill"}'], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1 and "Traceback" not in lines[0]
