"""The served model and the server itself: ``GET /v1/models``, ``POST /tokenize`` and ``/detokenize``
(vLLM's ``serving_models.py`` and ``serving_tokenization.py``), ``GET /version``, ``GET /health``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from minipaged import __version__
from minipaged.serving.engine_client import EngineClient
from minipaged.serving.errors import error_response
from minipaged.serving.openai_serving import OpenAIServing, get_engine_client, get_serving
from minipaged.serving.protocol import DetokenizeRequest, OpenAIError, TokenizeRequest

router = APIRouter()


@router.get("/v1/models")
async def models(serving: Annotated[OpenAIServing, Depends(get_serving)]):
    model = serving.model
    return {"object": "list", "data": [{"id": model.name, "object": "model", "created": model.created,
                                        "owned_by": "minipaged", "root": str(model.root), "parent": None,
                                        "max_model_len": serving.client.max_model_len, "permission": []}]}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, serving: Annotated[OpenAIServing, Depends(get_serving)]):
    serving.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError("give either prompt or messages", 400, "prompt")
    if body.messages is not None:
        text = serving.render_chat(body.messages, body.add_generation_prompt, None)
        ids = await serving.encode(text, bool(body.add_special_tokens), "messages")
    else:
        assert body.prompt is not None  # one of the two, checked above
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await serving.encode(body.prompt, special, "prompt")
    client = serving.client
    strs = [client.id_to_token(t) for t in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": client.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, serving: Annotated[OpenAIServing, Depends(get_serving)]):
    serving.check_model(body.model)
    vocab_size = serving.client.vocab_size
    if not all(0 <= t < vocab_size for t in body.tokens):
        raise OpenAIError(f"token ids must be in 0 .. {vocab_size - 1}", 400, "tokens")
    return {"prompt": serving.client.decode(body.tokens)}


@router.get("/version")
async def version():
    return {"version": __version__}


@router.get("/health")
async def health(client: Annotated[EngineClient, Depends(get_engine_client)]):
    problem = client.health()
    if problem is not None:
        return error_response(503, problem)
    return Response(status_code=200)
