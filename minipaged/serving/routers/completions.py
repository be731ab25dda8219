"""``POST /v1/completions``: vLLM's ``serving_completion.py``, over the engine client.

Scoring, as vLLM serves it (what lm-evaluation-harness's ``local-completions`` sends): with ``echo``
and ``logprobs``, the engine is asked for the prompt's logprobs too, and each choice's ``logprobs``
hold the prompt's tokens first (the first token's ``token_logprobs`` and ``top_logprobs`` null:
nothing comes before it), then the generated ones; ``max_tokens: 0`` with ``echo`` answers the
prompt alone. ``prompt_logprobs`` (vLLM's field) puts the prompt's logprobs on each choice in vLLM's
shape (``streaming.prompt_logprobs_json``), as does every request whose engine computed them.
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
from minipaged.serving.protocol import CompletionRequest, OpenAIError
from minipaged.serving.streaming import (
    Chunks,
    Run,
    collect,
    floor_logprob,
    prompt_logprobs_json,
    stream_events,
    top_entries,
)

router = APIRouter()


def completion_logprobs(client: EngineClient, tokens: list[int], tops: list[dict[int, float] | None],
                        k: int, offset0: int) -> dict:
    """OpenAI's completions shape: ``text_offset``, ``tokens``, ``token_logprobs``, ``top_logprobs``.

    Token ``i``'s ``text_offset`` is ``offset0`` plus the lengths of the token strings before it (vLLM's
    rule); its ``top_logprobs`` the ``k`` most likely and itself (``top_entries``). A position without
    logprobs (the prompt's first token) has null ``token_logprobs`` and ``top_logprobs``."""
    strings = [client.decode([t]) for t in tokens]
    offsets, at = [], offset0
    for s in strings:
        offsets.append(at)
        at += len(s)
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    for t, top in zip(tokens, tops, strict=False):
        if top is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(floor_logprob(top.get(t, -math.inf)))
        top_logprobs.append({client.decode([i]): floor_logprob(v) for i, v in top_entries(top, t, k).items()})
    return {"text_offset": offsets, "tokens": strings, "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs}


def echoed_logprobs(run: Run, k: int) -> tuple[list[int], list[dict[int, float] | None]]:
    """Choice ``k``'s prompt tokens and their logprobs, the ones an echo puts before the generated."""
    i = k // run.n
    prompt = run.handles[i].prompt_token_ids
    return prompt, list(run.prompt_logprobs[i] or [None] * len(prompt))


class CompletionChunks(Chunks):
    """Streamed completion chunks. With ``echo``, a choice's first chunk holds the prompt's text and,
    with ``logprobs``, the prompt's tokens and logprobs before the first generated ones; every later
    chunk only what is new. ``text_offset`` runs on from chunk to chunk, as in the whole answer."""

    object = "text_completion"

    def __init__(self, request_id: str, model_name: str, run: Run, echo: list[str] | None, top: int) -> None:
        super().__init__(request_id, model_name)
        self.run, self.echo, self.top = run, echo, top
        self.to_echo = [echo is not None] * len(run.texts)  # the choices whose prompt is still to send
        self.offsets = [0] * len(run.texts)  # where each choice's next token starts

    def chunk(self, k, delta, finish, stop_reason, tokens, tops):
        text, entry = delta, None
        if self.echo is not None and self.to_echo[k]:
            text, self.to_echo[k] = self.echo[k] + delta, False
            if tops is not None:
                prompt, prompt_tops = echoed_logprobs(self.run, k)
                tokens, tops = [*prompt, *tokens], [*prompt_tops, *tops]
        if tops is not None:
            entry = completion_logprobs(self.run.client, tokens, tops, self.top, self.offsets[k])
            self.offsets[k] += sum(len(s) for s in entry["tokens"])
        return self.envelope([{"index": k, "text": text, "logprobs": entry, "finish_reason": finish,
                               "stop_reason": stop_reason}])


def check_request(body: CompletionRequest, serving: OpenAIServing) -> None:
    """The request's checks, each a 400 naming its field: the shared ones, ``logprobs`` and
    ``prompt_logprobs`` within ``--max-logprobs``, ``max_tokens: 0`` only with ``echo`` (and then no
    ``min_tokens``)."""
    serving.check_model(body.model)
    body.check_fields()
    serving.check_logprobs(body.logprobs, "logprobs")
    serving.check_logprobs(body.prompt_logprobs, "prompt_logprobs")
    if body.max_tokens == 0 and not body.echo:
        raise OpenAIError("max_tokens must be at least 1 (0 only with echo: the prompt alone)", 400, "max_tokens")
    if body.prompt_only and body.min_tokens:
        raise OpenAIError("min_tokens must be 0 when max_tokens is 0", 400, "min_tokens")


async def prompts_of(body: CompletionRequest, serving: OpenAIServing) -> tuple[list[list[int]], list[str]]:
    """The token ids and the text of each prompt, checked against the context."""
    first = body.prompt[0] if body.prompt else None  # checked: a string or a list of one kind
    raw = [body.prompt] if isinstance(body.prompt, str) or type(first) is int else body.prompt
    prompts, texts = [], []
    for p in raw:
        ids = await serving.encode(p, body.add_special_tokens, "prompt") if isinstance(p, str) else p
        serving.check_prompt(ids, body.engine_max_tokens, "prompt")
        prompts.append(ids)
        texts.append(p if isinstance(p, str) else serving.client.decode(ids))
    return prompts, texts


def choice_logprobs(run: Run, body: CompletionRequest, k: int) -> dict | None:
    """Choice ``k``'s ``logprobs``: its generated tokens', after its prompt's with ``echo``."""
    if body.logprobs is None:
        return None
    tokens: list[int] = run.tokens[k]
    tops: list[dict[int, float] | None] = list(run.token_logprobs[k])
    if body.echo:
        prompt, prompt_tops = echoed_logprobs(run, k)
        tokens, tops = [*prompt, *tokens], [*prompt_tops, *tops]
    return completion_logprobs(run.client, tokens, tops, body.logprobs, 0)


def choice_prompt_logprobs(run: Run, body: CompletionRequest, k: int) -> list | None:
    """Choice ``k``'s ``prompt_logprobs`` (vLLM's): its prompt's, whenever the engine computed them."""
    i, asked = k // run.n, body.engine_prompt_logprobs
    entries = run.prompt_logprobs[i]
    if asked is None or entries is None:
        return None
    return prompt_logprobs_json(run.client, run.handles[i].prompt_token_ids, entries, asked)


def completion_response(run: Run, body: CompletionRequest, request_id: str, model_name: str,
                        echo: list[str]) -> dict:
    """The whole answer, once every choice has finished."""
    choices = [{"index": k, "text": echo[k] + text.text, "logprobs": choice_logprobs(run, body, k),
                "finish_reason": text.finish_reason or "abort", "stop_reason": text.stop_reason,
                "prompt_logprobs": choice_prompt_logprobs(run, body, k)}
               for k, text in enumerate(run.texts)]
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model_name,
            "choices": choices, "usage": run.usage()}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request,
                      serving: Annotated[OpenAIServing, Depends(get_serving)]):
    check_request(body, serving)
    prompts, texts = await prompts_of(body, serving)
    params = body.sampling_params(body.engine_max_tokens, body.logprobs, serving.client.vocab_size,
                                  body.engine_prompt_logprobs)
    handles = await serving.submit_all(prompts, params)
    run = Run(serving.client, handles, body.n, body.stops, body.include_stop_str_in_output, body.logprobs,
              prompt_only=body.prompt_only)
    request_id, model_name = f"cmpl-{secrets.token_hex(12)}", serving.model.name
    echo = [texts[k // body.n] if body.echo else "" for k in range(len(run.texts))]
    if body.stream:
        chunks = CompletionChunks(request_id, model_name, run, echo if body.echo else None, body.logprobs or 0)
        return StreamingResponse(stream_events(run, chunks, body.stream_options), media_type="text/event-stream")
    if not await collect(run, request):
        return error_response(499, "client closed the request")
    return completion_response(run, body, request_id, model_name, echo)
