"""Online serving: ``minipaged serve``, an OpenAI-compatible HTTP server over the same engine.

``LLM.generate`` takes a list and returns when all are done. A server takes requests while
it runs: that is where continuous batching and paged memory pay off, as in the vLLM paper's
Figure 12. This module is the thin layer that does it, over stage 7's ``LLMEngine``:

* ``AsyncEngine`` runs the step loop in the background (one worker thread steps the
  engine; nothing else touches it). New requests and aborts are queued and applied between
  steps; every step's outputs go to the asyncio queue of the request they belong to, so each
  client streams its tokens as they come.
* ``build_app`` is a FastAPI application with vLLM's OpenAI-compatible routes:
  ``POST /v1/completions`` (``stream`` sends server-sent events ending with ``data: [DONE]``),
  ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text), and ``GET /state``,
  the engine's queues and block map as JSON, drawn live by the page at ``GET /``.

Bad input is an HTTP 400 with an OpenAI-style error body, before anything is queued; a full
waiting queue is a 503; a client that disconnects aborts its request, and its blocks go back.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from minipaged import live_page
from minipaged.sampling_params import RequestOutput, SamplingParams


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests already: try again later (HTTP 503)."""


class AsyncEngine:
    """Stage 7's engine, stepped in the background; requests in, their outputs streamed out."""

    def __init__(self, llm, max_waiting: int = 256) -> None:
        self.llm, self.engine, self.max_waiting = llm, llm.engine, max_waiting
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="minipaged-engine")
        self._lock = threading.Lock()  # guards the engine: held by a step, and by adds and aborts
        self._streams: dict[str, asyncio.Queue] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._ids = itertools.count()
        self.tokens_served = 0
        self.requests_served = 0

    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Abort what is in flight (its blocks go back), then stop the loop."""
        with self._lock:
            for request_id in list(self._streams):
                self.engine.abort_request(request_id)
                self._streams.pop(request_id).put_nowait(None)
        if self._task:
            self._task.cancel()
        self._executor.shutdown(wait=True)

    def add(self, prompt, params: SamplingParams) -> tuple[str, asyncio.Queue]:
        """Check and queue a request; ``ValueError``/``TypeError`` for bad input, ``QueueFullError``."""
        with self._lock:
            if len(self.llm.scheduler.waiting) >= self.max_waiting:
                raise QueueFullError(f"{self.max_waiting} requests are waiting already")
            request_id = f"cmpl-{next(self._ids)}"
            self.engine.add_request(request_id, prompt, params)
            queue = self._streams[request_id] = asyncio.Queue()
        self._wakeup.set()
        return request_id, queue

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)

    async def stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The request's outputs as its steps complete, until it finishes; aborts it if abandoned."""
        try:
            while (output := await queue.get()) is not None:
                yield output
                if output.finished:
                    return
        finally:
            self.abort(request_id)  # a no-op once finished

    def _step(self) -> list[RequestOutput]:
        with self._lock:
            return self.engine.step() if self.engine.has_unfinished_requests() else []

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
            try:
                outputs = await loop.run_in_executor(self._executor, self._step)
            except Exception as err:  # the step aborted what it touched; tell their clients
                for queue in list(self._streams.values()):
                    queue.put_nowait(err)
                continue
            for output in outputs:
                queue = self._streams.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
                if output.finished:
                    self._streams.pop(output.request_id, None)
                    self.requests_served += 1
                    self.tokens_served += sum(len(c.token_ids) for c in output.outputs)

    def state(self) -> dict:
        """The queues and the block map, for the live page (``minipaged.live_page``)."""
        with self._lock:
            return live_page.snapshot(self.llm)


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions``: OpenAI's fields and vLLM's extra sampling fields."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0)
    stream: bool = False



def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def build_app(llm, model_name: str = "tiny", max_waiting: int = 256):
    """The FastAPI application: OpenAI-compatible completions over an ``AsyncEngine``."""
    engine = AsyncEngine(llm, max_waiting)

    @asynccontextmanager
    async def lifespan(app):
        await engine.start()
        yield
        await engine.stop()

    app = FastAPI(title="minipaged", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(RequestValidationError)
    async def invalid(request, err):
        first = err.errors()[0] if err.errors() else {}
        return _error(400, f"{'.'.join(str(p) for p in first.get('loc', ()))}: {first.get('msg', 'invalid')}",
                      str(first.get("loc", [None])[-1]))

    def choice(index, text, completion, finish, logprobs):
        entry = None
        if logprobs is not None and completion.logprobs is not None:
            tops = completion.logprobs  # one dict per generated token: its top tokens and the chosen one
            entry = {"tokens": [llm.engine.text([t]) for t in completion.token_ids],
                     "token_logprobs": [top.get(t) for t, top in zip(completion.token_ids, tops, strict=False)],
                     "top_logprobs": [{llm.engine.text([k]): v for k, v in top.items()} for top in tops]}
        return {"index": index, "text": text, "logprobs": entry, "finish_reason": finish}

    def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
        hits = [text.index(s) for s in stops if s and s in text]
        return (text[: min(hits)], True) if hits else (text, False)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            params = SamplingParams(n=body.n, max_tokens=body.max_tokens, temperature=body.temperature,
                                    top_k=body.top_k, top_p=body.top_p, seed=body.seed,
                                    stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                                    logprobs=body.logprobs)
            prompt = body.prompt if isinstance(body.prompt, str) else {"prompt_token_ids": body.prompt}
            request_id, queue = engine.add(prompt, params)
        except QueueFullError as err:
            return _error(503, str(err), kind="server_overloaded")
        except (ValueError, TypeError) as err:
            return _error(400, str(err))
        created, name = int(time.time()), body.model or model_name

        async def texts():
            """(index, text so far, completion, finish reason) per step; stop strings cut the text."""
            async for output in engine.stream(request_id, queue):
                if isinstance(output, Exception):
                    raise output
                done = output.finished
                results = []
                for c in output.outputs:
                    text, stopped = cut_at_stop(llm.engine.text(c.token_ids), stops)
                    results.append((c.index, text, c, "stop" if stopped else c.finish_reason))
                stopped_all = bool(stops) and all(r[3] == "stop" for r in results)
                yield output, results, done or stopped_all
                if done or stopped_all:
                    return

        if body.stream:
            async def events():
                sent = [""] * body.n
                try:
                    async for _, results, done in texts():
                        for index, text, completion, finish in results:
                            delta, sent[index] = text[len(sent[index]):], text
                            chunk = {"id": request_id, "object": "text_completion", "created": created, "model": name,
                                     "choices": [choice(index, delta, completion, finish if done else None, None)]}
                            yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    engine.abort(request_id)  # the client went away, or the request is done

            return StreamingResponse(events(), media_type="text/event-stream")
        steps = texts()
        async for last in steps:  # noqa: B007 - the last step holds the final text
            if await request.is_disconnected():
                engine.abort(request_id)
                return _error(499, "client closed the request")
        output, final, _ = last
        completion_tokens = sum(len(c.token_ids) for _, _, c, _ in final)
        prompt_tokens = len(output.prompt_token_ids)
        return {"id": request_id, "object": "text_completion", "created": created, "model": name,
                "choices": [choice(i, text, c, finish, body.logprobs) for i, text, c, finish in final],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "minipaged",
                                            "max_model_len": llm.max_model_len}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        registry = CollectorRegistry()
        state, stats = engine.state(), llm.stats
        values = {
            "minipaged_requests_running": ("requests running", len(state["running"])),
            "minipaged_requests_waiting": ("requests waiting", len(state["waiting"])),
            "minipaged_requests_swapped": ("requests swapped out", len(state["swapped"])),
            "minipaged_kv_blocks_used": ("KV cache blocks in use", state["num_blocks"] - state["free_blocks"]),
            "minipaged_kv_blocks_total": ("KV cache blocks", state["num_blocks"]),
            "minipaged_preemptions_total": ("preemptions since start", stats["preemptions"]),
            "minipaged_prefix_cache_hits_total": ("prefix-cache block hits", stats.get("prefix_cache_hits", 0)),
            "minipaged_generation_tokens_total": ("tokens generated for finished requests", engine.tokens_served),
            "minipaged_requests_finished_total": ("requests finished", engine.requests_served),
        }
        for name, (doc, value) in values.items():
            Gauge(name, doc, registry=registry).set(value)
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/state")
    async def state():
        return engine.state()

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return live_page.PAGE

    return app


def serve(model: str = "tiny", host: str = "127.0.0.1", port: int = 8000, max_waiting: int = 256, **engine_args) -> None:
    """Run the server until SIGINT or SIGTERM; in-flight requests are aborted, their blocks freed."""
    import uvicorn

    from minipaged import LLM

    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"minipaged serves on the loopback interface only, not {host!r}")
    llm = LLM(model, **engine_args)
    uvicorn.run(build_app(llm, model, max_waiting), host=host, port=port, log_level="warning")
