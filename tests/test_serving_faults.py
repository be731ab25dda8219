"""Faults: one request's failure never touches another; long prompts never freeze the others;
streamed text with stop strings joins to the non-streamed text; /health tells the truth."""

import socket
import threading
import time
from functools import partial

import httpx
import pytest
from helpers_serving import ThreadServer, metric, metric_samples, sse_events
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged import LLM as _LLM
from minipaged import SamplingParams
from minipaged.serving.protocol import ChoiceText

LLM = partial(_LLM, scheduler="v0")  # V0's scheduler (stage 6): n > 1, beams and swap, as this file serves them

pytestmark = pytest.mark.serving

POISON = 2047  # a prompt holding this token id makes the sampler raise at its third token, as a bug would
PROMPT = "Return the number of"


class PoisonedSampler:
    """The engine's sampler, failing the whole step when a poisoned request decodes its third token
    (a decode step: the other running requests are in it too)."""

    def __init__(self, sampler):
        self.sampler, self.failures = sampler, 0

    def __call__(self, logits, seqs, params):
        if any(POISON in s.prompt_token_ids and len(s.output_token_ids) >= 2 for s in seqs):
            self.failures += 1
            raise RuntimeError("a bug that only this request triggers")
        return self.sampler(logits, seqs, params)


@pytest.fixture(scope="module")
def served():
    llm = LLM("tiny", num_gpu_blocks=96, max_model_len=256)
    llm.engine.sampler = PoisonedSampler(llm.engine.sampler)
    server = ThreadServer(llm)
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference():
    return LLM("tiny", num_gpu_blocks=96, max_model_len=256)


def stream_in_thread(url, body, out):
    def run():
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            out["status"] = response.status_code
            out["events"], out["times"] = [], []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    out["times"].append(time.monotonic())
                    out["events"].append(line[6:])
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def joined(events, n=1):
    import json

    texts = [""] * n
    for e in events:
        if e != "[DONE]":
            for c in json.loads(e)["choices"]:
                texts[c["index"]] += c["text"]
    return texts


def wait_for_events(out, count=1, timeout=30):
    deadline = time.monotonic() + timeout
    while len(out.get("events", [])) < count:
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.01)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 11, "n": 2}],
                         ids=["greedy", "seeded-n2"])
def test_a_request_that_breaks_a_step_fails_alone_and_the_others_finish_their_full_text(served, reference,
                                                                                        sampling):
    body = {"prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, **sampling}  # long: still running when
    params = SamplingParams(max_tokens=240, ignore_eos=True, **sampling)  # the bad request decodes
    want = [o.text for o in reference.generate([PROMPT], params, use_tqdm=False)[0].outputs]
    before = metric_samples(served.url)
    failures = served.llm.engine.sampler.failures
    good = {}
    thread = stream_in_thread(served.url, body, good)
    wait_for_events(good, 3)  # the good request is streaming
    bad = httpx.post(f"{served.url}/v1/completions", json={"prompt": [POISON, 5, 6], "max_tokens": 5,
                                                              "stream": True}, timeout=60)
    bad_events = [line[6:] for line in bad.text.splitlines() if line.startswith("data: ")]
    thread.join(60)
    import json

    error = json.loads(bad_events[-2])  # its text so far, then the error, then [DONE]
    assert bad.status_code == 200 and set(error) == {"error"} and error["error"]["code"] == 500
    assert bad_events[-1] == "[DONE]" and all("choices" in json.loads(e) for e in bad_events[:-2])
    assert good["events"][-1] == "[DONE]" and not any('"error"' in e for e in good["events"])
    assert joined(good["events"], len(want)) == want  # the whole text, nothing repeated or lost
    assert served.llm.engine.sampler.failures == failures + 2  # once together, once alone
    # the same failure without streaming: a 500 in OpenAI's shape
    plain = httpx.post(f"{served.url}/v1/completions", json={"prompt": [POISON, 7], "max_tokens": 5}, timeout=60)
    assert plain.status_code == 500 and plain.json()["error"]["type"] == "InternalServerError"
    after = metric_samples(served.url)
    assert metric(after, "minipaged:request_success_total", finished_reason="error") == \
        metric(before, "minipaged:request_success_total", finished_reason="error") + 2
    state = httpx.get(f"{served.url}/state").json()
    assert not state["running"] and state["free_blocks"] == state["num_blocks"]
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_the_reproduced_payloads_are_answered_and_do_not_touch_a_concurrent_stream(served, reference):
    want = reference.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text
    good = {}
    thread = stream_in_thread(served.url, {"prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                                           "ignore_eos": True}, good)
    wait_for_events(good, 2)
    tiny_t = httpx.post(f"{served.url}/v1/completions", json={"prompt": "hello", "max_tokens": 4,
                                                                 "temperature": 1e-300}, timeout=60)
    greedy = reference.generate(["hello"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert tiny_t.status_code == 200 and tiny_t.json()["choices"][0]["text"] == greedy.outputs[0].text
    seed = httpx.post(f"{served.url}/v1/completions", json={"prompt": "hello", "seed": 2**64 - 1, "n": 2},
                      timeout=60)
    assert seed.status_code == 400 and seed.json()["error"]["param"] == "seed"
    thread.join(60)
    assert joined(good["events"]) == [want] and good["events"][-1] == "[DONE]"


@pytest.mark.parametrize("big", ["lorem ipsum " * (10 * 2**20 // 12), list(range(1, 2000)) * 900],
                         ids=["text", "token-ids"])  # 10 MB of JSON each
def test_a_ten_megabyte_prompt_delays_a_concurrent_stream_by_less_than_a_second(served, big):
    good = {}
    thread = stream_in_thread(served.url, {"prompt": PROMPT, "max_tokens": 200, "temperature": 0,
                                           "ignore_eos": True}, good)
    wait_for_events(good, 3)
    sent = time.monotonic()
    response = httpx.post(f"{served.url}/v1/completions", json={"prompt": big, "max_tokens": 4}, timeout=60)
    answered = time.monotonic()
    health = httpx.get(f"{served.url}/health", timeout=5)
    thread.join(60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert health.status_code == 200
    times = good["times"]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b > sent - 1 and a < answered + 1]
    assert gaps and max(gaps) < 1.0, max(gaps)
    assert good["events"][-1] == "[DONE]" and len(good["events"]) >= 100


def test_a_prompt_that_is_tokenized_in_a_thread_is_checked_against_the_context(served):
    text = "token " * 2000  # under the bound that skips tokenizing, over 256 tokens
    response = httpx.post(f"{served.url}/v1/completions", json={"prompt": text, "max_tokens": 4})
    assert response.status_code == 400 and "2000" in response.json()["error"]["message"] or \
        response.json()["error"]["param"] == "prompt"


def test_bodies_over_the_limit_get_413_and_half_sent_bodies_408():
    server = ThreadServer(max_body_bytes=2000, read_timeout=0.5)
    try:
        big = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a" * 3000})
        assert big.status_code == 413 and big.json()["error"]["code"] == 413
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                         b"content-length: 100\r\n\r\n{\"prompt\": ")
            started = time.monotonic()
            answer = sock.recv(4096)
            assert b" 408 " in answer.split(b"\r\n")[0] and time.monotonic() - started < 3
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        server.close()


def test_a_step_that_fails_before_it_takes_any_request_fails_them_and_never_spins():
    """The scheduler raises, so the engine aborts nothing: the server takes the requests out itself,
    replays each alone, answers each with an error, and serves the next request once the fault is gone."""
    llm = LLM("tiny", num_gpu_blocks=32, max_model_len=128)
    scheduler = llm.engine.scheduler
    schedule, mode = scheduler.schedule, {"fail": True, "calls": 0}

    def faulty(*args, **kwargs):
        if mode["fail"]:
            mode["calls"] += 1
            raise RuntimeError("a bug before any request is touched")
        return schedule(*args, **kwargs)

    scheduler.schedule = faulty
    server = ThreadServer(llm)
    try:
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(httpx.post(
            f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).status_code))
            for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert answers == [500, 500]
        assert mode["calls"] <= 4  # the failed step, then one replay per request alone: no spinning
        assert not llm.engine.has_unfinished_requests()
        manager = llm.scheduler.block_manager
        assert manager.num_free_blocks == manager.num_total_blocks
        mode["fail"] = False
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        server.close()


def test_health_is_503_while_the_engine_fails_or_a_step_hangs():
    llm = LLM("tiny", num_gpu_blocks=32, max_model_len=128)
    runner = llm.engine.runner
    execute, mode = runner.execute, {"fail": False, "sleep": 0.0}

    def faulty(out):
        if mode["fail"]:
            raise RuntimeError("the device is gone")
        time.sleep(mode["sleep"])
        return execute(out)

    runner.execute = faulty
    server = ThreadServer(llm, stall_timeout=0.3)
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        mode["fail"] = True
        for _ in range(3):
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert r.status_code == 500
        sick = httpx.get(f"{server.url}/health")
        assert sick.status_code == 503 and sick.json()["error"]["code"] == 503
        mode["fail"] = False
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200
        mode["sleep"] = 1.5
        slow = threading.Thread(target=httpx.post, args=(f"{server.url}/v1/completions",),
                                kwargs={"json": {"prompt": "hi", "max_tokens": 1}, "timeout": 30})
        slow.start()
        time.sleep(0.8)
        assert httpx.get(f"{server.url}/health").status_code == 503  # a step has hung for 0.8 s > 0.3 s
        slow.join()
        mode["sleep"] = 0.0
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.close()


def test_choice_text_holds_back_a_possible_stop_string():
    pieces = {1: " p", 2: "ix", 3: "el", 4: "s"}
    text = ChoiceText(lambda ids: "".join(pieces[i] for i in ids), ["xel"])
    text.update([1], None)
    assert text.ready() == " p"
    text.update([1, 2], None)
    assert text.ready() == " pi"  # "x" could begin "xel": held back
    text.update([1, 2, 3], None)
    assert text.finished and text.ready() == " pi" and text.stop_reason == "xel"
    kept = ChoiceText(lambda ids: "".join(pieces[i] for i in ids), ["xel"], include_stop_str_in_output=True)
    kept.update([1, 2], None)
    assert kept.ready() == " pix"
    kept.update([1, 2, 3, 4], None)
    assert kept.text == " pixel"
    late = ChoiceText(lambda ids: "".join(pieces[i] for i in ids), ["xel"], min_tokens=4)
    late.update([1, 2, 3], None)  # complete before min_tokens: it does not count
    assert not late.finished
    late.update([1, 2, 3, 4], None)  # nor later: only what a step adds is searched
    assert not late.finished and late.text == " pixels"
    partial = ChoiceText(lambda ids: "h\ufffd" if len(ids) == 1 else "hé", [])
    partial.update([1], None)
    assert partial.ready() == "h"


@pytest.fixture(scope="module")
def plain():
    server = ThreadServer(LLM("tiny", num_gpu_blocks=96, max_model_len=256))
    yield server
    server.close()


WORDS = ["Return", " the", " number", " of", " Create", " a", " new", " file", " if", " not"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.sampled_from(WORDS), min_size=1, max_size=5).map("".join),
       seed=st.integers(0, 2**31), temperature=st.sampled_from([0.0, 0.8, 1.5]),
       cut=st.tuples(st.floats(0, 1), st.integers(1, 4)), extra=st.text("abcdefghijklmnop xe", max_size=3),
       include=st.booleans())
def test_the_joined_stream_equals_the_text_without_streaming(plain, prompt, seed, temperature, cut, extra, include):
    body = {"prompt": prompt, "max_tokens": 16, "temperature": temperature, "seed": seed, "ignore_eos": True}
    uncut = httpx.post(f"{plain.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    start = int(cut[0] * len(uncut))
    stops = [s for s in {uncut[start:start + cut[1]], extra} if s]  # one that bites, one that may not
    body = {**body, "stop": stops, "include_stop_str_in_output": include}
    whole = httpx.post(f"{plain.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    with httpx.stream("POST", f"{plain.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole["text"]
    assert events[-2]["choices"][0]["finish_reason"] == whole["finish_reason"]
    if uncut[start:start + cut[1]]:  # a stop string cut from the text itself bites
        assert whole["finish_reason"] == "stop"


def test_a_connection_that_never_finishes_its_headers_is_closed():
    import uvicorn

    from minipaged.serving import build_app, header_timeout_protocol

    app = build_app(LLM("tiny", num_gpu_blocks=16, max_model_len=64))  # served with `minipaged serve`'s protocol
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=header_timeout_protocol(0.5)))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.02)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
            started = time.monotonic()
            assert slow.recv(100) == b""  # closed by the server
            assert 0.4 < time.monotonic() - started < 3
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200  # whole requests are served
    finally:
        uv.should_exit = True
        thread.join(10)
