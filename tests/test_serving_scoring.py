"""Scoring over HTTP, as vLLM serves it to lm-evaluation-harness: completions with ``echo`` and
``logprobs`` give the prompt's tokens and logprobs before the generated ones, ``max_tokens: 0`` with
``echo`` the prompt alone, ``prompt_logprobs`` vLLM's field on completions and chat; the prompt's
logprobs equal the engine's and transformers'; ``--logprobs-mode`` chooses raw or processed logprobs."""

import math
from functools import partial

import helpers_tolerances as tolerances
import httpx
import openai
import pytest
import torch
from helpers_serving import ThreadServer, sse_events
from openai.types.completion_choice import Logprobs

import minipaged.serving.server
from minipaged import LLM as _LLM
from minipaged import SamplingParams
from minipaged.cli import LOGPROBS_MODES, main
from minipaged.common.config import LOGPROBS_MODES as ENGINE_LOGPROBS_MODES
from minipaged.models import TINY_MODEL_DIR
from minipaged.serving.launcher import free_port

LLM = partial(_LLM, scheduler="v0")  # V0's scheduler (stage 6): n > 1, beams and swap, as this file serves them

pytestmark = pytest.mark.serving

PROMPT = "Return the number of items in the list"
ENGINE_ARGS = {"num_gpu_blocks": 96, "max_model_len": 256}


@pytest.fixture(scope="module")
def served():
    server = ThreadServer(LLM("tiny", **ENGINE_ARGS))
    yield server
    server.close()


@pytest.fixture(scope="module")
def url(served):
    return served.url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference():
    return LLM("tiny", **ENGINE_ARGS)


@pytest.fixture(scope="module")
def prompt_ids(reference):
    return reference.tokenizer.encode(PROMPT).ids


def post(url, path="/v1/completions", **body):
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def engine_prompt_logprobs(llm, ids, k=0):
    """The engine's logprob of each prompt token after the ones before it (None for the first)."""
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)[0]
    return [None] + [top[t] for t, top in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]


def transformers_prompt_logprobs(ids):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [None] + [rows[p - 1, t].item() for p, t in enumerate(ids) if p]


def assert_close(got, want, config, context):
    """Two lists of logprobs, the same but for rounding (a batch of other rows or shape, another BLAS
    path), None where the other has None."""
    assert [v is None for v in got] == [v is None for v in want]
    pairs = [(g, w) for g, w in zip(got, want, strict=True) if g is not None]
    assert [g for g, _ in pairs] == pytest.approx([w for _, w in pairs], **tolerances.logprobs(config, context))


def check_logprobs_types(logprobs):
    """The fields of ``openai.types.completion_choice.Logprobs``, each with its declared element type;
    the first token alone (nothing before it) has null ``token_logprobs`` and ``top_logprobs``."""
    assert isinstance(logprobs, Logprobs)
    n = len(logprobs.tokens)
    assert len(logprobs.text_offset) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == n
    assert all(isinstance(t, str) for t in logprobs.tokens)
    assert all(type(o) is int for o in logprobs.text_offset)
    assert all(isinstance(v, float) for v in logprobs.token_logprobs[1:])
    assert all(isinstance(top, dict) and all(isinstance(k, str) and isinstance(v, float) for k, v in top.items())
               for top in logprobs.top_logprobs[1:])


def test_echo_with_logprobs_gives_the_prompts_tokens_and_logprobs_first(client, url, served, reference, prompt_ids):
    args = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "logprobs": 2, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    got, plain = client.completions.create(**args, echo=True), client.completions.create(**args)
    choice, logprobs = got.choices[0], got.choices[0].logprobs
    check_logprobs_types(logprobs)
    n = len(prompt_ids)
    assert got.usage.prompt_tokens == n and got.usage.completion_tokens == 3
    assert choice.text == PROMPT + plain.choices[0].text and "".join(logprobs.tokens) == choice.text
    assert len(logprobs.tokens) == n + 3 and logprobs.tokens[:n] == [reference.engine.text([t]) for t in prompt_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    at = 0
    for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
        assert offset == at and choice.text[offset:offset + len(token)] == token
        at += len(token)
    for token, value, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:],
                                 strict=True):
        assert len(top) in (2, 3) and top[token] == value and max(top.values()) >= value
    # the generated tokens' logprobs are those a request without echo gets
    assert logprobs.tokens[n:] == plain.choices[0].logprobs.tokens
    config, without_echo = served.llm.model_config, plain.choices[0].logprobs
    assert_close(logprobs.token_logprobs[n:], without_echo.token_logprobs, config, n + 3)
    assert [list(top) for top in logprobs.top_logprobs[n:]] == [list(top) for top in without_echo.top_logprobs]
    raw = post(url, prompt=PROMPT, max_tokens=1, logprobs=2, echo=True, temperature=0).json()["choices"][0]
    assert raw["logprobs"]["top_logprobs"][0] is None and raw["logprobs"]["token_logprobs"][0] is None


def test_the_prompts_logprobs_equal_the_engines_and_transformers(client, served, reference, prompt_ids):
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, logprobs=1, echo=True, temperature=0)
    scored = got.choices[0].logprobs.token_logprobs[:len(prompt_ids)]
    tol = tolerances.logprobs(served.llm.model_config, len(prompt_ids))
    for want in (engine_prompt_logprobs(reference, prompt_ids), transformers_prompt_logprobs(prompt_ids)):
        assert want[0] is None and scored[0] is None
        assert scored[1:] == pytest.approx(want[1:], **tol)


def test_max_tokens_0_with_echo_is_the_prompt_alone(client, url, served, prompt_ids):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, logprobs=1, echo=True, temperature=0)
    alone = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, logprobs=1, echo=True, temperature=0)
    choice, n = alone.choices[0], len(prompt_ids)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert alone.usage.prompt_tokens == n and alone.usage.completion_tokens == 0 and alone.usage.total_tokens == n
    check_logprobs_types(choice.logprobs)
    assert choice.logprobs.tokens == whole.choices[0].logprobs.tokens[:n]
    assert_close(choice.logprobs.token_logprobs, whole.choices[0].logprobs.token_logprobs[:n],
                 served.llm.model_config, n)
    assert choice.logprobs.text_offset == whole.choices[0].logprobs.text_offset[:n]
    text_only = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True)
    assert text_only.choices[0].text == PROMPT and text_only.choices[0].logprobs is None
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True,
                                                             "logprobs": 1, "stream": True}) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]" and len(events) == 2  # one chunk: the prompt, finished
    streamed = events[0]["choices"][0]
    assert streamed["text"] == PROMPT and streamed["finish_reason"] == "length"
    assert streamed["logprobs"]["tokens"] == choice.logprobs.tokens
    with pytest.raises(openai.BadRequestError) as refused:  # without echo, max_tokens 0 asks for nothing
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"
    assert post(url, prompt=PROMPT, max_tokens=0, echo=True, min_tokens=1).json()["error"]["param"] == "min_tokens"


def test_a_streamed_echo_with_logprobs_equals_the_whole_answer(url, served):
    body = {"prompt": PROMPT, "max_tokens": 8, "logprobs": 2, "echo": True, "temperature": 0, "ignore_eos": True}
    whole = post(url, **body).json()["choices"][0]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
        chunks = [e["choices"][0] for e in sse_events(response)[:-1]]
    assert len(chunks) > 1 and chunks[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for field in ("tokens", "text_offset", "top_logprobs"):
        assert [x for c in chunks for x in c["logprobs"][field]] == whole["logprobs"][field], field
    streamed = [x for c in chunks for x in c["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and whole["logprobs"]["token_logprobs"][0] is None
    tol = tolerances.logprobs(served.llm.model_config, len(whole["logprobs"]["tokens"]))
    assert streamed[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], **tol)


def test_each_choice_of_several_prompts_and_samples_gets_its_prompts_logprobs(url, served, reference):
    prompts = [PROMPT, "Create a new"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 3, "seed": 5, "logprobs": 1, "echo": True, "ignore_eos": True}
    got = post(url, **body).json()
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    for k, choice in enumerate(got["choices"]):
        prompt = prompts[k // 2]
        ids = reference.tokenizer.encode(prompt).ids
        alone = post(url, prompt=prompt, max_tokens=0, logprobs=1, echo=True).json()["choices"][0]["logprobs"]
        assert choice["text"].startswith(prompt)
        assert choice["logprobs"]["tokens"][:len(ids)] == alone["tokens"]
        assert_close(choice["logprobs"]["token_logprobs"][:len(ids)], alone["token_logprobs"], served.llm.model_config,
                     len(ids) + 3)
        assert len(choice["logprobs"]["tokens"]) == len(ids) + 3
        assert choice["prompt_logprobs"] is not None and len(choice["prompt_logprobs"]) == len(ids)  # vLLM's too


def check_prompt_logprobs_shape(entries, ids, k, want):
    """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}},
    the prompt's token first, then the k most likely with ranks 1..k."""
    assert len(entries) == len(ids) and entries[0] is None
    for p, entry in enumerate(entries[1:], start=1):
        keys = list(entry)
        assert keys[0] == str(ids[p]) and len(entry) in (k, k + 1)
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        ranked = sorted((v["rank"], v["logprob"]) for v in entry.values() if v["rank"] is not None)
        assert [r for r, _ in ranked] == list(range(1, k + 1))
        assert [lp for _, lp in ranked] == sorted((lp for _, lp in ranked), reverse=True)
        assert entry[str(ids[p])]["logprob"] == pytest.approx(want[p], abs=1e-5)


def test_prompt_logprobs_on_completions_in_vllms_shape(url, reference, prompt_ids):
    got = post(url, prompt=PROMPT, max_tokens=2, prompt_logprobs=2, temperature=0).json()
    choice = got["choices"][0]
    assert choice["logprobs"] is None and not choice["text"].startswith(PROMPT)
    check_prompt_logprobs_shape(choice["prompt_logprobs"], prompt_ids, 2, engine_prompt_logprobs(reference, prompt_ids))
    for decoded in (v["decoded_token"] for entry in choice["prompt_logprobs"][1:] for v in entry.values()):
        assert isinstance(decoded, str)
    assert post(url, prompt=PROMPT, max_tokens=2).json()["choices"][0]["prompt_logprobs"] is None
    for bad, param in (({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
                       ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")):
        response = post(url, prompt=PROMPT, max_tokens=2, **bad)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, bad


def test_prompt_logprobs_on_chat_at_the_top_of_the_answer(url, reference):
    messages = [{"role": "user", "content": "Return the number of items"}]
    ids = post(url, "/tokenize", messages=messages).json()["tokens"]
    got = post(url, "/v1/chat/completions", messages=messages, max_tokens=2, prompt_logprobs=1, temperature=0).json()
    assert got["usage"]["prompt_tokens"] == len(ids) and "prompt_logprobs" not in got["choices"][0]
    check_prompt_logprobs_shape(got["prompt_logprobs"], ids, 1, engine_prompt_logprobs(reference, ids))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    typed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                           extra_body={"prompt_logprobs": 0})
    assert len(typed.model_extra["prompt_logprobs"]) == len(ids)
    assert post(url, "/v1/chat/completions", messages=messages).json()["prompt_logprobs"] is None
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": 1, "stream": True}, {"echo": True}):
        response = post(url, "/v1/chat/completions", messages=messages, max_tokens=2, **bad)
        assert response.status_code == 400 and response.json()["error"]["param"] == next(iter(bad)), bad


BIASED = 7  # a token the tiny model does not expect after PROMPT


def biased_logprob(url):
    """The logprob a greedy request with logit_bias {BIASED: 100} gets for its first token (BIASED)."""
    got = post(url, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0, logit_bias={str(BIASED): 100}).json()
    choice = got["choices"][0]["logprobs"]
    assert choice["tokens"] == [httpx.post(f"{url}/detokenize", json={"tokens": [BIASED]}).json()["prompt"]]
    return choice["token_logprobs"][0]


def test_logprobs_are_the_models_by_default_and_processed_with_the_mode(url, served, prompt_ids):
    model = post(url, prompt=[*prompt_ids, BIASED], max_tokens=0, echo=True, logprobs=0).json()
    want = model["choices"][0]["logprobs"]["token_logprobs"][-1]  # the model's logprob of BIASED after PROMPT
    assert want < -1
    assert biased_logprob(url) == pytest.approx(want, **tolerances.logprobs(served.llm.model_config, 16))
    processed = ThreadServer(LLM("tiny", num_gpu_blocks=32, max_model_len=128, logprobs_mode="processed_logprobs"))
    try:
        assert biased_logprob(processed.url) == pytest.approx(0.0, abs=1e-6)  # the distribution it was drawn from
    finally:
        processed.close()


def test_the_v1_engine_scores_prompts_in_chunks_as_the_v0_engine_does(url, served):
    server = ThreadServer(_LLM("tiny", **ENGINE_ARGS, max_num_batched_tokens=8, enable_prefix_caching=True))
    try:
        prompt = "If the file does not exist, raise an error and return the default value of the option"
        body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
        want = post(url, **body).json()["choices"][0]["logprobs"]
        tol = tolerances.logprobs(served.llm.model_config, len(want["tokens"]))
        for _ in range(2):  # the second one's prompt is in the prefix cache, which prompt logprobs do not read
            got = post(server.url, **body).json()["choices"][0]["logprobs"]
            assert got["tokens"] == want["tokens"] and len(got["tokens"]) > 16 and got["token_logprobs"][0] is None
            assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], **tol)
    finally:
        server.close()


class Built(Exception):
    """Stops serve() once it has built its engine."""


def test_serve_passes_logprobs_mode_to_the_engine(monkeypatch, capsys):
    assert LOGPROBS_MODES == ENGINE_LOGPROBS_MODES

    def build_app(llm, *args, **kwargs):
        raise Built(llm)

    monkeypatch.setattr(minipaged.serving.server, "build_app", build_app)
    for argv, mode in (([], "raw_logprobs"), (["--logprobs-mode", "processed_logits"], "processed_logits")):
        with pytest.raises(Built) as built:
            main(["serve", "--port", str(free_port()), "--threads", "1", *argv])
        assert built.value.args[0].config.logprobs_mode == mode
    with pytest.raises(SystemExit):
        main(["serve", "--logprobs-mode", "softmax"])
    assert "invalid choice" in capsys.readouterr().err


def test_a_prompt_logprob_is_finite_json(url):
    """A token the model cannot follow still gets a number (vLLM's floor of -9999), never -inf or NaN."""
    got = post(url, prompt=[5, 17, 99, 3], max_tokens=0, echo=True, logprobs=1, prompt_logprobs=1).json()
    values = got["choices"][0]["logprobs"]["token_logprobs"][1:]
    values += [v["logprob"] for entry in got["choices"][0]["prompt_logprobs"][1:] for v in entry.values()]
    assert all(math.isfinite(v) and v >= -9999 for v in values)
