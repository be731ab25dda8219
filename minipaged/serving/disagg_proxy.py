"""The proxy of disaggregated prefill (vLLM's ``disagg_proxy`` example): one address in front of a
producer (prefill) and a consumer (decode) server, each a ``minipaged serve --kv-transfer-config ...``.

Each completion or chat request goes first to the producer with ``max_tokens=1`` and no stream: the
producer computes the prompt and saves its blocks through its KV connector. Then the whole request
goes to the consumer, which loads those blocks, computes only the prompt's last block, and decodes;
its answer, streamed or not, is the client's. A producer that cannot answer is the client's error
(HTTP 502, or the producer's own error status); the consumer serves its other requests as before.

    minipaged disagg-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minipaged.serving.errors import error_response


def prefill_body(body: dict) -> dict:
    """What the producer is asked: the same prompt and parameters, one token, no stream."""
    body = {**body, "max_tokens": 1, "stream": False}
    for key in ("max_completion_tokens", "stream_options", "min_tokens"):
        body.pop(key, None)
    return body


def build_proxy_app(prefill_url: str, decode_url: str, timeout: float = 600.0) -> FastAPI:
    """The proxy's routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``."""
    client = httpx.AsyncClient(timeout=timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()
    app = FastAPI(title="minipaged disaggregated-prefill proxy", lifespan=lifespan)

    async def forward(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            prefilled = await client.post(f"{prefill_url}{path}", json=prefill_body(body), headers=headers)
        except httpx.HTTPError as err:
            return error_response(502, f"the prefill server did not answer: {type(err).__name__}")
        if prefilled.status_code != 200:
            return Response(prefilled.content, prefilled.status_code, media_type="application/json")
        if not body.get("stream"):
            try:
                decoded = await client.post(f"{decode_url}{path}", json=body, headers=headers)
            except httpx.HTTPError as err:
                return error_response(502, f"the decode server did not answer: {type(err).__name__}")
            return Response(decoded.content, decoded.status_code, media_type="application/json")
        upstream = client.build_request("POST", f"{decode_url}{path}", json=body, headers=headers)
        try:
            response = await client.send(upstream, stream=True)
        except httpx.HTTPError as err:
            return error_response(502, f"the decode server did not answer: {type(err).__name__}")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()
        return StreamingResponse(relay(), response.status_code, media_type=response.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            answer = await client.get(f"{decode_url}/v1/models")
        except httpx.HTTPError as err:
            return error_response(502, f"the decode server did not answer: {type(err).__name__}")
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({})

    return app


def run_proxy(prefill_url: str, decode_url: str, host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn

    print(f"minipaged disagg-proxy: http://{host}:{port} -> prefill {prefill_url}, decode {decode_url}", flush=True)
    uvicorn.run(build_proxy_app(prefill_url.rstrip("/"), decode_url.rstrip("/")), host=host, port=port,
                log_level="warning")
