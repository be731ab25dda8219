"""``POST /v1/completions``: vLLM's ``serving_completion.py``, over the engine client."""

from __future__ import annotations

import math
import secrets
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from minipaged.serving.engine_client import EngineClient
from minipaged.serving.errors import error_response
from minipaged.serving.openai_serving import OpenAIServing, get_serving
from minipaged.serving.protocol import CompletionRequest, OpenAIError
from minipaged.serving.streaming import Chunks, Run, collect, floor_logprob, stream_events

router = APIRouter()


def completion_logprobs(client: EngineClient, tokens: list[int], tops: list[dict], offset0: int) -> dict:
    """OpenAI's completions shape: ``text_offset`` (from ``offset0``), ``tokens``, ``token_logprobs``,
    ``top_logprobs``."""
    strings = [client.decode([t]) for t in tokens]
    offsets, at = [], offset0
    for s in strings:
        offsets.append(at)
        at += len(s)
    return {"text_offset": offsets, "tokens": strings,
            "token_logprobs": [floor_logprob(top.get(t, -math.inf)) for t, top in zip(tokens, tops, strict=False)],
            "top_logprobs": [{client.decode([k]): floor_logprob(v) for k, v in top.items()} for top in tops]}


class CompletionChunks(Chunks):
    """Streamed completion chunks; the prompt's text, with ``echo``, goes in its choices' first chunk."""

    object = "text_completion"

    def __init__(self, request_id: str, model_name: str, run: Run, echo: list[str]) -> None:
        super().__init__(request_id, model_name)
        self.run, self.echo = run, echo

    def chunk(self, k, delta, finish, stop_reason, tokens, tops):
        text = delta
        if self.echo[k]:
            text, self.echo[k] = self.echo[k] + delta, ""
        entry = None
        if tops is not None:
            entry = completion_logprobs(self.run.client, tokens, tops, self.run.sent[k] - len(delta))
        return self.envelope([{"index": k, "text": text, "logprobs": entry, "finish_reason": finish,
                               "stop_reason": stop_reason}])


def check_request(body: CompletionRequest, serving: OpenAIServing) -> None:
    serving.check_model(body.model)
    body.check_fields()
    serving.check_logprobs(body.logprobs, "logprobs")
    if body.echo and body.logprobs is not None:
        raise OpenAIError("echo with logprobs needs prompt logprobs, which this server does not compute",
                          400, "echo")


async def prompts_of(body: CompletionRequest, serving: OpenAIServing) -> tuple[list[list[int]], list[str]]:
    """The token ids and the text of each prompt, checked against the context."""
    first = body.prompt[0] if body.prompt else None  # checked: a string or a list of one kind
    raw = [body.prompt] if isinstance(body.prompt, str) or type(first) is int else body.prompt
    prompts, texts = [], []
    for p in raw:
        ids = await serving.encode(p, body.add_special_tokens, "prompt") if isinstance(p, str) else p
        serving.check_prompt(ids, body.max_tokens, "prompt")
        prompts.append(ids)
        texts.append(p if isinstance(p, str) else serving.client.decode(ids))
    return prompts, texts


def completion_response(run: Run, body: CompletionRequest, request_id: str, model_name: str,
                        echo: list[str]) -> dict:
    """The whole answer, once every choice has finished."""
    choices = []
    for k, text in enumerate(run.texts):
        entry = (completion_logprobs(run.client, run.tokens[k], run.token_logprobs[k], 0)
                 if body.logprobs is not None else None)
        choices.append({"index": k, "text": echo[k] + text.text, "logprobs": entry,
                        "finish_reason": text.finish_reason or "abort", "stop_reason": text.stop_reason})
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model_name,
            "choices": choices, "usage": run.usage()}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request,
                      serving: Annotated[OpenAIServing, Depends(get_serving)]):
    check_request(body, serving)
    prompts, texts = await prompts_of(body, serving)
    params = body.sampling_params(body.max_tokens, body.logprobs, serving.client.vocab_size)
    handles = await serving.submit_all(prompts, params)
    run = Run(serving.client, handles, body.n, body.stops, body.include_stop_str_in_output, body.logprobs)
    request_id, model_name = f"cmpl-{secrets.token_hex(12)}", serving.model.name
    echo = [texts[k // body.n] if body.echo else "" for k in range(len(run.texts))]
    if body.stream:
        chunks = CompletionChunks(request_id, model_name, run, echo)
        return StreamingResponse(stream_events(run, chunks, body.stream_options), media_type="text/event-stream")
    if not await collect(run, request):
        return error_response(499, "client closed the request")
    return completion_response(run, body, request_id, model_name, echo)
