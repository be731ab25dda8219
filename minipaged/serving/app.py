"""Online serving: ``minipaged serve``, an OpenAI-compatible HTTP server over the same engine.

``LLM.generate`` takes a list and returns when all are done. A server takes requests while
it runs: that is where continuous batching and paged memory pay off, as in the vLLM paper's
Figure 12. The server is shaped as vLLM's ``entrypoints/openai``:

* ``minipaged.serving.engine_client``: ``EngineClient`` steps the engine in the background and
  streams each request's outputs; it is the only part of the server that holds the ``LLM``.
* ``minipaged.serving.openai_serving``: what the OpenAI routes share (the served model, the
  checks, tokenizing, admission); ``minipaged.serving.streaming``: the choices of a request as
  they arrive, and server-sent events.
* ``minipaged.serving.routers``: the routes, one module per family (completions, chat
  completions, the model with its tokenizer and health, Prometheus metrics with vLLM's names, and
  ``GET /state``, the engine's queues and block map as JSON, drawn live by the page at ``GET /``).
* ``minipaged.serving.protocol``: request bodies, errors, stop strings in streamed text;
  ``minipaged.serving.errors``: the error handlers; ``minipaged.serving.middleware``: the
  loopback, API-key and body checks before any route; ``minipaged.serving.metrics``: the metrics.
* ``minipaged.serving.server``: ``serve``, the command, with uvicorn and its shutdown.

``build_app`` (here) only assembles them.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from minipaged import __version__
from minipaged.serving.engine_client import EngineClient
from minipaged.serving.errors import add_exception_handlers
from minipaged.serving.middleware import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_READ_TIMEOUT,
    GuardMiddleware,
)
from minipaged.serving.openai_serving import OpenAIServing, ServedModel
from minipaged.serving.protocol import DEFAULT_MAX_LOGPROBS
from minipaged.serving.routers import chat, completions, live, metrics, models

ROUTERS = (completions.router, chat.router, models.router, metrics.router, live.router)  # the order of /openapi.json


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The engine client runs while the application is served; at the end, what is in flight is aborted."""
    client: EngineClient = app.state.engine
    await client.start()
    try:
        yield
    finally:
        await client.stop()


def build_app(llm, model_name: str = "tiny", max_waiting: int = 256, *, api_key: str | None = None,
              max_logprobs: int = DEFAULT_MAX_LOGPROBS, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              read_timeout: float = DEFAULT_READ_TIMEOUT, stall_timeout: float = 60.0,
              model_path: str | Path | None = None) -> FastAPI:
    """The FastAPI application: vLLM's OpenAI-compatible routes over an ``EngineClient`` of ``llm``.

    ``app.state.engine`` is the engine client, ``app.state.serving`` the ``OpenAIServing`` the
    routes share; ``model_path`` is where the chat template is read (default: ``model_name``).
    """
    client = EngineClient(llm, max_waiting, model_name, stall_timeout)
    app = FastAPI(title="minipaged", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = client
    app.state.serving = OpenAIServing(client, ServedModel.load(model_name, model_path), max_logprobs)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, read_timeout=read_timeout)
    add_exception_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    return app
