"""vLLM's OpenAI API, field by field: implemented with vLLM's semantics, or refused with a 400 that
names the field; chat completions with the model's chat template; tokenize; metrics; security."""

import json
import shutil
import threading
import time
from functools import partial

import helpers_tolerances as tolerances
import httpx
import openai
import pytest
from helpers_serving import ThreadServer, metric, metric_samples, metric_types, sse_events

from minipaged import LLM as _LLM
from minipaged import SamplingParams

LLM = partial(_LLM, scheduler="v0")  # V0's scheduler (stage 6): n > 1, beams and swap, as this file serves them

pytestmark = pytest.mark.serving

PROMPT = "Return the number of"


@pytest.fixture(scope="module")
def served():
    server = ThreadServer(LLM("tiny", num_gpu_blocks=96, max_model_len=256))
    yield server
    server.close()


@pytest.fixture(scope="module")
def url(served):
    return served.url


@pytest.fixture(scope="module")
def reference():
    return LLM("tiny", num_gpu_blocks=96, max_model_len=256)


def post(url, path="/v1/completions", **body):
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def stream(url, path="/v1/completions", **body):
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        return sse_events(response)


@pytest.mark.parametrize("fields", [
    {"presence_penalty": 1.5}, {"frequency_penalty": 1.2}, {"repetition_penalty": 1.8},
    {"logit_bias": {"7": 10.0}}, {"min_p": 0.3, "temperature": 1.0, "seed": 4}, {"min_tokens": 13},
    {"top_k": 3, "temperature": 0.7, "seed": 2},
])
def test_sampling_fields_are_applied_as_llm_generate_applies_them(url, reference, fields):
    body = {"max_tokens": 14, "temperature": 0.0, **fields}  # greedy, the text ends (EOS) at 12 tokens
    params = dict(body)
    if "logit_bias" in params:
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
    want = reference.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    plain = reference.generate([PROMPT], SamplingParams(max_tokens=14, temperature=body["temperature"],
                                                        seed=body.get("seed")), use_tqdm=False)[0].outputs[0]
    got = post(url, prompt=PROMPT, **body).json()["choices"][0]
    assert got["text"] == want.text
    assert want.token_ids != plain.token_ids  # the field changes the output: it is not ignored


def test_echo_puts_the_prompt_before_the_text(url):
    whole = post(url, prompt=PROMPT, max_tokens=6, temperature=0).json()["choices"][0]["text"]
    echoed = post(url, prompt=PROMPT, max_tokens=6, temperature=0, echo=True).json()["choices"][0]["text"]
    assert echoed == PROMPT + whole
    events = stream(url, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == PROMPT + whole


@pytest.mark.parametrize("field, value", [
    ("suffix", "the end"), ("best_of", 3), ("response_format", {"type": "json_object"}), ("guided_json", {}),
    ("use_beam_search", True), ("skip_special_tokens", False), ("allowed_token_ids", [1]),
    ("bad_words", ["x"]), ("truncate_prompt_tokens", 4), ("logits_processors", ["x"])])
def test_fields_not_implemented_are_refused_naming_the_field(url, field, value):
    response = post(url, prompt=PROMPT, max_tokens=2, **{field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_no_op_values_of_those_fields_and_unknown_fields_are_accepted(url):
    base = post(url, prompt=PROMPT, max_tokens=4, temperature=0).json()["choices"][0]["text"]
    for extra in ({"best_of": 1}, {"response_format": {"type": "text"}}, {"skip_special_tokens": True},
                  {"user": "me"}, {"an_unknown_field": 3}):
        response = post(url, prompt=PROMPT, max_tokens=4, temperature=0, **extra)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == base, extra


def test_null_means_the_default(url):
    got = post(url, prompt=PROMPT, max_tokens=None, temperature=None, n=None, stop=None, seed=None, top_p=None,
               logprobs=None, ignore_eos=True).json()
    assert got["usage"]["completion_tokens"] == 16 and len(got["choices"]) == 1


def test_stream_usage_and_streamed_logprobs(url, served):
    whole = post(url, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3).json()
    events = stream(url, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                    stream_options={"include_usage": True})
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
    chunks = [e["choices"][0] for e in events[:-2]]
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    logprobs = [p for c in chunks for p in c["logprobs"]["token_logprobs"]]
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    tol = tolerances.logprobs(served.llm.model_config, whole["usage"]["total_tokens"])
    assert logprobs == pytest.approx(whole["choices"][0]["logprobs"]["token_logprobs"], **tol)
    assert all(len(top) >= 3 for c in chunks for top in c["logprobs"]["top_logprobs"])


def test_unknown_model_is_a_404_in_vllms_shape(url):
    response = post(url, model="gpt-4", prompt=PROMPT)
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "The model `gpt-4` does not exist.", "type": "NotFoundError",
                                         "param": "model", "code": 404}}


def test_every_error_body_has_openais_shape(url):
    for response in (httpx.get(f"{url}/nowhere"), httpx.get(f"{url}/v1/completions"),
                     httpx.post(f"{url}/v1/completions", content=b"[1, 2",
                                headers={"content-type": "application/json"}),
                     post(url, prompt=PROMPT, temperature="hot"), post(url, prompt=[1, "a"]), post(url, prompt=[]),
                     post(url, prompt=[[1], []]), post(url, prompt="")):
        assert response.status_code in (400, 404, 405)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code


def test_tokenize_detokenize_version(url, reference):
    ids = reference.tokenizer.encode(PROMPT).ids
    got = post(url, "/tokenize", prompt=PROMPT).json()
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == 256
    assert post(url, "/detokenize", tokens=ids).json() == {"prompt": PROMPT}
    assert post(url, "/detokenize", tokens=[10**6]).status_code == 400
    from minipaged import __version__
    assert httpx.get(f"{url}/version").json() == {"version": __version__}


def test_chat_uses_the_models_template_as_transformers_renders_it(url, reference):
    from transformers import AutoTokenizer

    from minipaged.models import resolve_model_path

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    hf = AutoTokenizer.from_pretrained(str(resolve_model_path("tiny")))
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert post(url, "/tokenize", messages=messages).json()["tokens"] == list(ids)
    want = reference.generate([rendered], SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.outputs[0].text
    assert got.object == "chat.completion" and got.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.outputs[0].text
    assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens
    with_logprobs = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                                   logprobs=True, top_logprobs=2)
    content = with_logprobs.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=messages, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {}}}])


def test_a_model_without_a_chat_template_refuses_chat_with_a_400(tmp_path):
    from minipaged.models import resolve_model_path

    source = resolve_model_path("tiny")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(source / name, tmp_path / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    server = ThreadServer(LLM(str(tmp_path), num_gpu_blocks=32, max_model_len=128), model_name="plain",
                          model_path=tmp_path)
    try:
        response = post(server.url, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}])
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        assert post(server.url, prompt="hi", max_tokens=2).status_code == 200
    finally:
        server.close()


def test_metrics_are_typed_and_count_what_happened(served, url):
    types = metric_types(url)
    for name in ("prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
                 "prefix_cache_queries", "prefix_cache_hits"):
        assert types[f"minipaged:{name}"] == "counter", name
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert types[f"minipaged:{name}"] == "histogram", name
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert types[f"minipaged:{name}"] == "gauge", name
    before = metric_samples(url)
    post(url, prompt=[5, 6, 7], max_tokens=5, ignore_eos=True)
    post(url, prompt=[8, 9], max_tokens=4, n=2, ignore_eos=True, seed=1)
    text = post(url, prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True).json()["choices"][0]["text"]
    stopped = post(url, prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, stop=[text[3:6]]).json()
    after = metric_samples(url)

    def grew(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    prompt_len = len(post(url, "/tokenize", prompt=PROMPT).json()["tokens"])
    assert grew("minipaged:prompt_tokens_total") == 3 + 2 + 2 * prompt_len
    assert grew("minipaged:request_success_total", finished_reason="length") == 1 + 2 + 1
    assert grew("minipaged:request_success_total", finished_reason="stop") == 1  # the stop string
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert grew("minipaged:generation_tokens_total") >= 5 + 8 + 12 + stopped["usage"]["completion_tokens"]
    assert grew("minipaged:time_to_first_token_seconds_count") == 4
    assert grew("minipaged:e2e_request_latency_seconds_count") == 4  # one per request
    assert grew("minipaged:request_queue_time_seconds_count") == 4
    assert grew("minipaged:inter_token_latency_seconds_count") >= 4 + 3 + 11
    assert grew("minipaged:time_to_first_token_seconds_sum") > 0
    assert metric(after, "minipaged:num_requests_running") == 0 and metric(after, "minipaged:kv_cache_usage_perc") == 0


def test_kv_cache_usage_is_the_fraction_of_blocks_in_use_while_a_request_runs(served, url):
    events = []

    def run():
        events.extend(stream(url, prompt=PROMPT, max_tokens=200, ignore_eos=True, temperature=0))

    thread = threading.Thread(target=run)
    thread.start()
    seen = None
    deadline = time.monotonic() + 20
    while thread.is_alive() and time.monotonic() < deadline:
        m = metric_samples(url)
        if metric(m, "minipaged:num_requests_running") == 1:
            seen = m
            break
        time.sleep(0.01)
    thread.join()
    assert seen is not None
    used, total = metric(seen, "minipaged:kv_cache_blocks_used"), metric(seen, "minipaged:kv_cache_blocks_total")
    assert used >= 1 and metric(seen, "minipaged:kv_cache_usage_perc") == pytest.approx(used / total)


def test_prefix_cache_and_preemption_counters_read_the_engine():
    llm = LLM("tiny", num_gpu_blocks=12, max_model_len=128, enable_prefix_caching=True)
    server = ThreadServer(llm)
    try:
        prompt = list(range(10, 50))  # 40 tokens: two full blocks of 16
        post(server.url, prompt=prompt, max_tokens=2)
        first = metric_samples(server.url)
        post(server.url, prompt=prompt, max_tokens=2)
        second = metric_samples(server.url)
        assert metric(first, "minipaged:prefix_cache_hits_total") == 0
        assert metric(second, "minipaged:prefix_cache_hits_total") == 32
        # the second request looks up both full blocks of its prompt and finds them
        assert metric(second, "minipaged:prefix_cache_queries_total") - metric(
            first, "minipaged:prefix_cache_queries_total") == 32
        threads = [threading.Thread(target=post, args=(server.url,),
                                    kwargs={"prompt": [100 + i] * 20, "max_tokens": 60, "ignore_eos": True})
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        m = metric_samples(server.url)
        assert metric(m, "minipaged:num_preemptions_total") == llm.scheduler.make_stats().num_preemptions > 0
    finally:
        server.close()


def test_only_loopback_hosts_and_origins_reach_the_server(url):
    port = url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}"):
        assert httpx.get(f"{url}/state", headers={"host": host}).status_code == 400
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers={"host": host}).status_code == 400
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
        assert httpx.get(f"{url}/state", headers={"host": host}).status_code == 200, host
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                      headers={"origin": "https://evil.example"}).status_code == 403
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                      headers={"origin": f"http://localhost:{port}"}).status_code == 200


def test_docs_pages_are_off_and_nothing_is_loaded_from_another_host(url):
    assert httpx.get(f"{url}/docs").status_code == 404 and httpx.get(f"{url}/redoc").status_code == 404
    assert httpx.get(f"{url}/openapi.json").json()["info"]["title"] == "minipaged"
    page = httpx.get(f"{url}/").text
    assert "src=\"http" not in page and "href=\"http" not in page and "@import" not in page


def test_the_api_key_guards_the_v1_routes_as_vllm_does():
    server = ThreadServer(api_key="s3cret")
    try:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"},
                          headers={"authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{server.url}/health").status_code == 200  # vLLM guards /v1 only
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0, timeout=60).models.list()
    finally:
        server.close()


def test_a_served_model_name_is_the_only_name_the_api_knows():
    server = ThreadServer(model_name="my-model", model_path="tiny")
    try:
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "my-model"
        assert post(server.url, model="tiny", prompt="hi", max_tokens=1).status_code == 404
        assert post(server.url, model="my-model", prompt="hi", max_tokens=1).json()["model"] == "my-model"
        chat = post(server.url, "/v1/chat/completions", model="my-model", max_tokens=2,
                    messages=[{"role": "user", "content": "hi"}])  # the template is read from the model folder
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    finally:
        server.close()
