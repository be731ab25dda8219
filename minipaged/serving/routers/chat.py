"""``POST /v1/chat/completions``: vLLM's ``serving_chat.py``, over the engine client.

``prompt_logprobs`` (vLLM's field) scores the rendered prompt: the answer carries them at its top
level, beside ``choices``, in vLLM's shape (``streaming.prompt_logprobs_json``). ``echo`` is refused:
vLLM's chat echo prepends the last message when its role is the assistant's, which this server does
not implement.
"""

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
from minipaged.serving.protocol import ChatCompletionRequest, OpenAIError
from minipaged.serving.streaming import Chunks, Run, collect, floor_logprob, prompt_logprobs_json, stream_events

router = APIRouter()


def chat_logprobs(client: EngineClient, tokens: list[int], tops: list[dict], k: int) -> dict:
    """OpenAI's chat shape: per token its ``token``, ``logprob``, ``bytes`` and the ``k`` most likely."""
    content = []
    for t, top in zip(tokens, tops, strict=False):
        s = client.decode([t])
        best = sorted(top.items(), key=lambda kv: -kv[1])[:k]
        content.append({"token": s, "logprob": floor_logprob(top.get(t, -math.inf)), "bytes": list(s.encode()),
                        "top_logprobs": [{"token": client.decode([i]), "logprob": floor_logprob(v),
                                          "bytes": list(client.decode([i]).encode())} for i, v in best]})
    return {"content": content}


class ChatChunks(Chunks):
    """Streamed chat chunks: each choice opens with the assistant's role, then its content."""

    object = "chat.completion.chunk"

    def __init__(self, request_id: str, model_name: str, client: EngineClient, top: int) -> None:
        super().__init__(request_id, model_name)
        self.client, self.top = client, top

    def initial(self, k):
        return self.envelope([{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}])

    def chunk(self, k, delta, finish, stop_reason, tokens, tops):
        entry = chat_logprobs(self.client, tokens, tops, self.top) if tops is not None else None
        return self.envelope([{"index": k, "delta": {"content": delta} if delta or finish is None else {},
                               "logprobs": entry, "finish_reason": finish, "stop_reason": stop_reason}])


def check_request(body: ChatCompletionRequest, serving: OpenAIServing) -> int:
    """The request's checks; the number of top logprobs it asks per token."""
    serving.check_model(body.model)
    body.check_fields()
    if body.echo:
        raise OpenAIError("echo is not supported for chat completions", 400, "echo")
    top = body.top_logprobs if body.top_logprobs is not None else 0
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError("top_logprobs needs logprobs: true", 400, "top_logprobs")
    serving.check_logprobs(top, "top_logprobs")
    serving.check_logprobs(body.prompt_logprobs, "prompt_logprobs")
    return top


def chat_response(run: Run, body: ChatCompletionRequest, request_id: str, model_name: str, top: int) -> dict:
    """The whole answer, once every choice has finished."""
    choices = [{"index": k, "message": {"role": "assistant", "content": text.text},
                "logprobs": chat_logprobs(run.client, run.tokens[k], run.token_logprobs[k], top)
                if body.logprobs else None,
                "finish_reason": text.finish_reason or "abort", "stop_reason": text.stop_reason}
               for k, text in enumerate(run.texts)]
    prompt_logprobs = None
    if body.prompt_logprobs is not None and run.prompt_logprobs[0] is not None:
        prompt_logprobs = prompt_logprobs_json(run.client, run.handles[0].prompt_token_ids, run.prompt_logprobs[0],
                                               body.prompt_logprobs)
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model_name,
            "choices": choices, "usage": run.usage(), "prompt_logprobs": prompt_logprobs}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           serving: Annotated[OpenAIServing, Depends(get_serving)]):
    top = check_request(body, serving)
    prompt = serving.render_chat(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
    ids = await serving.encode(prompt, body.add_special_tokens, "messages")
    max_tokens = body.max_completion_tokens or body.max_tokens or max(serving.client.max_model_len - len(ids), 1)
    serving.check_prompt(ids, max_tokens, "messages")
    logprobs = top if body.logprobs else None
    params = body.sampling_params(max_tokens, logprobs, serving.client.vocab_size, body.prompt_logprobs)
    handles = await serving.submit_all([ids], params)
    run = Run(serving.client, handles, body.n, body.stops, body.include_stop_str_in_output, logprobs)
    request_id, model_name = f"chatcmpl-{secrets.token_hex(12)}", serving.model.name
    if body.stream:
        chunks = ChatChunks(request_id, model_name, serving.client, top)
        return StreamingResponse(stream_events(run, chunks, body.stream_options), media_type="text/event-stream")
    if not await collect(run, request):
        return error_response(499, "client closed the request")
    return chat_response(run, body, request_id, model_name, top)
