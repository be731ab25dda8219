"""Online serving: ``minipaged serve``, an OpenAI-compatible HTTP server over the same engine.

``LLM.generate`` takes a list and returns when all are done. A server takes requests while
it runs: that is where continuous batching and paged memory pay off, as in the vLLM paper's
Figure 12. This module is the layer that does it, over stage 7's ``LLMEngine``:

* ``AsyncEngine`` runs the step loop in the background. One worker thread owns the engine:
  between two steps it applies the aborts and admits the requests submitted meanwhile, then
  steps. The event loop never waits for the engine's lock, and tokenizing happens in other
  threads, so a long prompt or a long step never freezes the other streams. Every step's
  outputs go to the asyncio queue of the request they belong to.
* A step that raises has aborted the requests it touched (the engine keeps every block
  consistent). If it touched one request, that request fails alone. If it touched several,
  the server cannot tell which one broke it, so each of them is replayed alone, one after the
  other, from its prompt and with its seed (the server gives every request a seed): the
  tokens a client already has are checked and not sent again, the others are streamed as
  usual, and only a request that fails when alone gets an error.
* ``build_app`` is a FastAPI application with vLLM's OpenAI-compatible routes (completions,
  chat completions, models, tokenize, detokenize, version, health, Prometheus metrics with
  vLLM's names) and ``GET /state``, the engine's queues and block map as JSON, drawn live by
  the page at ``GET /``. The protocol itself (request bodies, errors, stop strings in
  streamed text) is in ``minipaged.serving.protocol``.
* ``serve`` checks its arguments and the port before it loads the model, then runs uvicorn;
  SIGTERM or SIGINT stop accepting requests, let the running ones go on for
  ``shutdown_timeout`` seconds, abort the rest and exit 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import math
import random
import secrets
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager, contextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from minipaged.common.sampling_params import SEED_RANGE, RequestOutput, SamplingParams
from minipaged.serving import live_page
from minipaged.serving.protocol import (
    DEFAULT_MAX_LOGPROBS,
    ChatCompletionRequest,
    ChoiceText,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    OpenAIRequest,
    TokenizeRequest,
    error_body,
    load_chat_template,
    render_chat,
    special_tokens,
)

logger = logging.getLogger("minipaged.serving")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_MAX_BODY_BYTES = 32 * 2**20
DEFAULT_READ_TIMEOUT = 30.0
FAILED_STEPS_UNHEALTHY = 3  # this many failed steps in a row and /health answers 503


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests already: try again later (HTTP 503)."""


class RequestFailed(RuntimeError):
    """A request's own failure, or its abort at shutdown: sent to its client as an error."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(eq=False)
class Handle:
    """One engine request as the server sees it: its queue of outputs and its timings."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    admitted: asyncio.Future
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    last_output: float | None = None
    delivered: list[list[int]] = dataclasses.field(default_factory=list)  # tokens sent, per choice
    replaying: bool = False
    finished: bool = False  # the engine finished it
    released: bool = False


# vLLM's bucket boundaries (seconds)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]


class Metrics:
    """vLLM's Prometheus metrics, named ``minipaged:<vLLM's name>``, labelled with ``model_name``.

    Request-level ones are observed as outputs arrive; engine-level ones (queues, KV-cache
    usage, preemptions, prefix cache) are read from the engine, under its lock, at each scrape.
    """

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no ``_created`` series, as vLLM
        self.model_name = model_name
        self.registry = CollectorRegistry()
        label = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(f"minipaged:{name}", doc, label + list(extra), registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(f"minipaged:{name}", doc, label, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("request_success", "Count of finished sequences, by finish reason.",
                                       ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent waiting in the queue, in seconds.", REQUEST_BUCKETS)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(model_name, reason)
        self.engine_values: dict = {}
        self.registry.register(self)  # collect() below: the engine's values

    def describe(self):
        return []

    def collect(self):
        v, name = self.engine_values, [self.model_name]
        if not v:
            return
        for key, doc in (("num_requests_running", "Number of requests currently running."),
                         ("num_requests_waiting", "Number of requests waiting to be processed."),
                         ("num_requests_swapped", "Number of requests swapped to CPU."),
                         ("kv_cache_usage_perc", "KV-cache usage: the fraction of blocks in use (0 to 1)."),
                         ("kv_cache_blocks_used", "KV-cache blocks in use (minipaged only)."),
                         ("kv_cache_blocks_total", "KV-cache blocks (minipaged only).")):
            family = GaugeMetricFamily(f"minipaged:{key}", doc, labels=["model_name"])
            family.add_metric(name, v[key])
            yield family
        for key, doc in (("num_preemptions", "Cumulative number of preemptions."),
                         ("prefix_cache_queries", "Prefix-cache queries, in tokens (full blocks looked up)."),
                         ("prefix_cache_hits", "Prefix-cache hits, in tokens (full blocks found).")):
            family = CounterMetricFamily(f"minipaged:{key}", doc, labels=["model_name"])
            family.add_metric(name, v[key])
            yield family


class AsyncEngine:
    """Stage 7's engine, stepped in the background; requests in, their outputs streamed out."""

    def __init__(self, llm, max_waiting: int = 256, model_name: str = "tiny", stall_timeout: float = 60.0) -> None:
        self.llm, self.engine, self.max_waiting, self.stall_timeout = llm, llm.engine, max_waiting, stall_timeout
        self.metrics = Metrics(model_name)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="minipaged-engine")
        self._lock = threading.Lock()  # guards the engine: held by the engine thread, and by state()
        self._handles: dict[str, Handle] = {}  # submitted and not released
        self._pending: deque[Handle] = deque()  # submitted, not yet in the engine
        self._suspects: deque[Handle] = deque()  # to replay, each alone
        self._aborts: deque[str] = deque()
        self._in_engine: set[str] = set()  # touched by the engine thread only
        self._solo: str | None = None  # the suspect running alone now
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._ids = itertools.count()
        self.step_started: float | None = None
        self.failed_steps = 0  # in a row
        self.dead: BaseException | None = None
        self.shutting_down = False

    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Abort what is in flight (its blocks go back), then stop the loop."""
        self.abort_all("the server is shutting down")
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
        with self._lock:
            for request_id in list(self.engine.requests):
                self.engine.abort_request(request_id)

    # --- requests in

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> Handle:
        """Queue a request (checked by the engine at admission: await ``handle.admitted``)."""
        if self.shutting_down:
            raise RequestFailed("the server is shutting down", 503)
        if len(self._pending) + self.num_waiting >= self.max_waiting:
            raise QueueFullError(f"{self.max_waiting} requests are waiting already")
        if params.seed is None:  # a seed of its own, so that a replay draws the same tokens
            params = dataclasses.replace(params, seed=random.randrange(0, SEED_RANGE[1] - params.n))
        loop = asyncio.get_running_loop()
        handle = Handle(f"cmpl-{secrets.token_hex(8)}-{next(self._ids)}", list(prompt_token_ids), params,
                        asyncio.Queue(), loop.create_future())
        self._handles[handle.request_id] = handle
        self._pending.append(handle)
        self._wakeup.set()
        return handle

    @property
    def num_waiting(self) -> int:
        return len(self.llm.scheduler.waiting)

    def release(self, handle: Handle, reasons: list[str] | None = None) -> None:
        """The client is done with ``handle`` (finished, failed, or gone): abort it if it still runs,
        and record its finish (``reasons``, one per choice; none given: aborted)."""
        if handle.released:
            return
        handle.released = True
        self._handles.pop(handle.request_id, None)
        handle.queue.put_nowait(None)
        if not handle.finished:
            self._aborts.append(handle.request_id)
            self._wakeup.set()
        m, name = self.metrics, self.metrics.model_name
        for reason in reasons or ["abort"] * handle.params.n:
            m.request_success.labels(name, reason).inc()
        m.e2e.labels(name).observe(time.monotonic() - handle.arrival)

    def abort_all(self, message: str) -> None:
        """Every request in flight gets an error (status 503) and is aborted."""
        for handle in list(self._handles.values()):
            handle.queue.put_nowait(RequestFailed(message, 503))
            if not handle.admitted.done():
                handle.admitted.set_exception(RequestFailed(message, 503))
            self._aborts.append(handle.request_id)
        if self._wakeup:
            self._wakeup.set()

    async def stream(self, handle: Handle) -> AsyncIterator[RequestOutput]:
        """The request's outputs as its steps complete, until it finishes; raises its failure."""
        while True:
            item = await handle.queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    # --- the engine thread

    def _work(self):
        """Between two steps: aborts, admissions, then one step. Runs on the engine thread."""
        with self._lock:
            while self._aborts:
                request_id = self._aborts.popleft()
                self.engine.abort_request(request_id)
                self._in_engine.discard(request_id)
            admitted = []
            if self._solo is not None and self._solo not in self._in_engine:
                self._solo = None
            if self._suspects or self._solo is not None:  # replay one suspect at a time, alone
                if self._solo is None and not self.engine.has_unfinished_requests():
                    handle = self._suspects.popleft()
                    admitted.append((handle, self._add(handle)))
                    self._solo = handle.request_id
            else:
                while self._pending:
                    handle = self._pending.popleft()
                    admitted.append((handle, self._add(handle)))
            if not self.engine.has_unfinished_requests():
                return admitted, [], None, []
            try:
                outputs = self.engine.step()
            except Exception as err:  # the engine aborted what the step touched
                lost = [r for r in self._in_engine if r not in self.engine.requests]
                self._in_engine.difference_update(lost)
                return admitted, [], err, lost
            for output in outputs:
                if output.finished:
                    self._in_engine.discard(output.request_id)
            return admitted, outputs, None, []

    def _add(self, handle: Handle) -> Exception | None:
        if handle.released:
            return RequestFailed("released before admission")
        try:
            self.engine.add_request(handle.request_id, {"prompt_token_ids": handle.prompt_token_ids}, handle.params)
        except (ValueError, TypeError) as err:
            return err
        self._in_engine.add(handle.request_id)
        return None

    # --- the event loop

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not (self._pending or self._suspects or self._aborts or self.engine.has_unfinished_requests()):
                    self._wakeup.clear()
                    await self._wakeup.wait()
                started = self.step_started = time.monotonic()
                try:
                    admitted, outputs, error, lost = await loop.run_in_executor(self._executor, self._work)
                finally:
                    self.step_started = None
                for handle, err in admitted:
                    if handle.admitted.done():
                        continue
                    if err is None:
                        handle.admitted.set_result(None)
                    else:
                        handle.admitted.set_exception(err)
                        self._handles.pop(handle.request_id, None)
                        handle.released = True
                if error is not None:
                    self._step_failed(error, lost)
                elif outputs:
                    self.failed_steps = 0
                for output in outputs:
                    self._deliver(output, started)
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # the loop itself broke: /health says so, every client gets an error
            self.dead = err
            logger.exception("the engine loop stopped")
            for handle in list(self._handles.values()):
                handle.queue.put_nowait(RequestFailed(f"the engine loop stopped: {err!r}"))
            raise

    def _step_failed(self, error: Exception, lost: list[str]) -> None:
        self.failed_steps += 1
        handles = [self._handles[r] for r in lost if r in self._handles]
        if len(lost) == 1:
            for handle in handles:
                logger.warning("request %s failed: %r", handle.request_id, error)
                handle.queue.put_nowait(RequestFailed(f"the request failed inside the engine: {error!r}"))
            return
        logger.warning("a step with %d requests failed (%r): replaying each alone", len(lost), error)
        for handle in handles:
            handle.replaying = True
            self._suspects.append(handle)

    def _deliver(self, output: RequestOutput, started: float) -> None:
        handle = self._handles.get(output.request_id)
        if handle is None:
            return
        now, m, name = time.monotonic(), self.metrics, self.metrics.model_name
        tokens = [c.token_ids for c in output.outputs]
        if handle.replaying:
            if any(t[: len(d)] != d[: len(t)] for t, d in zip(tokens, handle.delivered, strict=False)):
                handle.queue.put_nowait(RequestFailed("the request could not be resumed after a step failed"))
                return
            if not output.finished and all(len(t) <= len(d) for t, d in zip(tokens, handle.delivered, strict=False)) \
                    and len(tokens) <= len(handle.delivered):
                return
            handle.replaying = False
        new = sum(len(t) for t in tokens) - sum(len(d) for d in handle.delivered)
        if handle.first_scheduled is None:
            handle.first_scheduled = started
            m.queue_time.labels(name).observe(started - handle.arrival)
            m.prompt_tokens.labels(name).inc(len(handle.prompt_token_ids))
            m.ttft.labels(name).observe(now - handle.arrival)
        elif new > 0 and handle.last_output is not None:
            m.itl.labels(name).observe(now - handle.last_output)
        if new > 0:
            m.generation_tokens.labels(name).inc(new)
            handle.last_output = now
        handle.delivered = tokens
        handle.finished = output.finished
        handle.queue.put_nowait(output)

    # --- reading the engine

    def state(self) -> dict:
        """The queues and the block map, for the live page (``minipaged.serving.live_page``)."""
        with self._lock:
            return live_page.snapshot(self.llm)

    def engine_values(self) -> dict:
        """What the metrics read from the engine, under its lock."""
        with self._lock:
            s = live_page.snapshot(self.llm)
            manager = self.llm.scheduler.block_manager
            allocator = manager.allocator
            queries, hits = getattr(allocator, "num_queries", 0), getattr(allocator, "num_hits", 0)
            used = s["num_blocks"] - s["free_blocks"]
            return {"num_requests_running": len(s["running"]), "num_requests_waiting": len(s["waiting"]),
                    "num_requests_swapped": len(s["swapped"]), "kv_cache_usage_perc": used / s["num_blocks"],
                    "kv_cache_blocks_used": used, "kv_cache_blocks_total": s["num_blocks"],
                    "num_preemptions": self.llm.scheduler.num_preemptions,
                    "prefix_cache_queries": queries * manager.block_size,
                    "prefix_cache_hits": hits * manager.block_size}

    def health(self) -> str | None:
        """None when healthy, else why not."""
        if self.dead is not None or self._task is None or self._task.done():
            return "the engine loop is not running"
        if self.step_started is not None and time.monotonic() - self.step_started > self.stall_timeout:
            return f"a step has been running for more than {self.stall_timeout:g} s"
        if self.failed_steps >= FAILED_STEPS_UNHEALTHY:
            return f"the last {self.failed_steps} engine steps failed"
        return None


# --- security and limits, before any route


def host_is_loopback(host_header: str) -> bool:
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8000
        host = host[1:host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":")[0]
    return host in LOOPBACK_HOSTS


def origin_is_loopback(origin: str) -> bool:
    if origin == "null":
        return False
    rest = origin.split("://", 1)[-1]
    return host_is_loopback(rest.split("/")[0])


class GuardMiddleware:
    """Refuses, before any route: a ``Host`` or ``Origin`` that is not loopback (DNS rebinding,
    cross-site pages), a missing or wrong API key on ``/v1`` routes (vLLM's rule), a body over
    ``max_body_bytes`` (413) or not received within ``read_timeout`` seconds (408)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, read_timeout: float) -> None:
        self.app, self.api_key, self.max_body_bytes, self.read_timeout = app, api_key, max_body_bytes, read_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if not host_is_loopback(headers.get("host", "")):
            await self.discard_body(receive)
            return await self.refuse(send, 400, "the Host header must name the loopback interface", "host")
        if "origin" in headers and not origin_is_loopback(headers["origin"]):
            await self.discard_body(receive)
            return await self.refuse(send, 403, "requests from pages of other sites are refused", "origin")
        if self.api_key and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            if not secrets.compare_digest(headers.get("authorization", ""), f"Bearer {self.api_key}"):
                await self.discard_body(receive)
                return await self.refuse(send, 401, "Unauthorized", "authorization")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self.refuse(send, 413, f"the body exceeds {self.max_body_bytes} bytes", None)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size, deadline = [], 0, time.monotonic() + self.read_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                return await self.refuse(send, 408, f"the body did not arrive within {self.read_timeout:g} s", None)
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await self.refuse(send, 413, f"the body exceeds {self.max_body_bytes} bytes", None)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def discard_body(self, receive) -> None:
        """Read (and drop) what the client sends before refusing it, up to the body limit: a
        socket closed with unread data is reset, and the client would see the reset instead of
        the refusal."""
        size, deadline = 0, time.monotonic() + min(self.read_timeout, 5.0)
        while size <= self.max_body_bytes:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            size += len(message.get("body", b""))

    @staticmethod
    async def refuse(send, status: int, message: str, param: str | None) -> None:
        body = json.dumps(error_body(message, status, param)).encode()
        extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"), *extra]})
        await send({"type": "http.response.body", "body": body})


# --- the application


def _logprob(value: float) -> float:
    return max(value, -9999.0)  # JSON has no -inf: vLLM's floor


def build_app(llm, model_name: str = "tiny", max_waiting: int = 256, *, api_key: str | None = None,
              max_logprobs: int = DEFAULT_MAX_LOGPROBS, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              read_timeout: float = DEFAULT_READ_TIMEOUT, stall_timeout: float = 60.0,
              model_path: str | Path | None = None) -> FastAPI:
    """The FastAPI application: vLLM's OpenAI-compatible routes over an ``AsyncEngine``."""
    from minipaged import __version__
    from minipaged.models import resolve_model_path

    engine = AsyncEngine(llm, max_waiting, model_name, stall_timeout)
    tokenizer = llm.tokenizer
    vocab_size = llm.engine.vocab_size
    try:
        model_dir = resolve_model_path(str(model_path if model_path is not None else model_name))
    except (ValueError, FileNotFoundError):  # a served name that is no folder: no chat template
        model_dir = Path(str(model_path or model_name))
    chat_template = load_chat_template(model_dir)
    template_tokens = special_tokens(model_dir)
    created = int(time.time())
    tokenize_pool = ThreadPoolExecutor(2, thread_name_prefix="minipaged-tokenize")
    max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer else 1

    @asynccontextmanager
    async def lifespan(app):
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()
            tokenize_pool.shutdown(wait=False)

    app = FastAPI(title="minipaged", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, read_timeout=read_timeout)

    def error(status: int, message: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, status, param), status_code=status)

    @app.exception_handler(OpenAIError)
    async def openai_error(request, err: OpenAIError):
        return error(err.status, err.message, err.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, err):
        first = err.errors()[0] if err.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error(400, f"the body is not valid JSON: {first.get('msg', '')}", None)
        return error(400, f"{'.'.join(loc)}: {first.get('msg', 'invalid')}", loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, err):
        return error(err.status_code, str(err.detail))

    @app.exception_handler(Exception)
    async def internal(request, err):
        logger.exception("internal error")
        return error(500, f"internal server error: {type(err).__name__}")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise OpenAIError(f"The model `{name}` does not exist.", 404, "model")

    async def encode(text: str, add_special_tokens: bool, param: str) -> list[int]:
        if tokenizer is None:
            raise OpenAIError("this model has no tokenizer: give token ids", 400, param)
        if len(text) > llm.max_model_len * max_token_chars * 4:  # cannot fit, whatever the tokens: not tokenized
            raise OpenAIError(f"the prompt ({len(text)} characters) is longer than this model's maximum context "
                              f"length ({llm.max_model_len} tokens)", 400, param)
        loop = asyncio.get_running_loop()
        encoding = await loop.run_in_executor(tokenize_pool, lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return encoding.ids

    def check_prompt(ids: list[int], max_tokens: int, param: str) -> None:
        if not ids:
            raise OpenAIError("the prompt is empty: a request needs at least one token", 400, param)
        if len(ids) + max_tokens > llm.max_model_len:
            raise OpenAIError(f"This model's maximum context length is {llm.max_model_len} tokens. However, you "
                              f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} "
                              f"in the completion).", 400, param)
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise OpenAIError(f"token ids must be in 0 .. {vocab_size - 1}", 400, param)

    def check_logprobs(value: int | None, param: str) -> None:
        if value is not None and value > max_logprobs:
            raise OpenAIError(f"Requested sample logprobs of {value}, which is greater than max allowed: "
                              f"{max_logprobs}", 400, param)

    async def submit_all(prompts: list[list[int]], params: SamplingParams) -> list[Handle]:
        handles = []
        try:
            for ids in prompts:
                handles.append(engine.submit(ids, params))
            for handle in handles:
                await handle.admitted
        except QueueFullError as err:
            raise OpenAIError(str(err), 503) from None
        except (ValueError, TypeError) as err:
            raise OpenAIError(str(err), 400, "prompt") from None
        except RequestFailed as err:
            raise OpenAIError(str(err), err.status) from None
        finally:
            if not all(h.admitted.done() and not h.admitted.cancelled() and h.admitted.exception() is None
                       for h in handles):
                for handle in handles:
                    engine.release(handle)
        return handles

    async def outputs(handles: list[Handle]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every handle as they come; raises the first failure."""
        if len(handles) == 1:
            async for output in engine.stream(handles[0]):
                yield 0, output
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i, handle):
            try:
                async for output in engine.stream(handle):
                    merged.put_nowait((i, output))
            except Exception as err:
                merged.put_nowait((i, err))
            merged.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        try:
            remaining = len(handles)
            while remaining:
                i, item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()

    class Run:
        """The choices of one HTTP request (``n`` per prompt) as the engine's outputs arrive."""

        def __init__(self, handles, n, stops, include_stop, logprobs):
            self.handles, self.n, self.logprobs = handles, n, logprobs
            self.texts = [ChoiceText(llm.engine.text, stops, include_stop, h.params.min_tokens)
                          for h in handles for _ in range(n)]
            self.tokens = [[] for _ in self.texts]
            self.token_logprobs = [[] for _ in self.texts]
            self.sent = [0] * len(self.texts)  # characters streamed
            self.sent_tokens = [0] * len(self.texts)  # tokens whose logprobs were streamed

        def update(self, i: int, output: RequestOutput) -> list[int]:
            """Apply one output of prompt ``i``; the choice indexes that changed. Releases a
            prompt's engine request once all its choices are finished."""
            changed = []
            for c in output.outputs:
                k = i * self.n + c.index
                text = self.texts[k]
                if text.finished:
                    continue
                text.update(c.token_ids, c.finish_reason)
                self.tokens[k] = list(c.token_ids[: text.num_tokens])
                if c.logprobs is not None:
                    self.token_logprobs[k] = c.logprobs[: text.num_tokens]
                changed.append(k)
                if text.finished and text.finish_reason == "stop" and text.stop_reason is None:
                    last = text.num_tokens and c.token_ids[text.num_tokens - 1]
                    text.stop_reason = last if last in self.handles[i].params.stop_token_ids else None
            mine = self.texts[i * self.n:(i + 1) * self.n]
            if all(t.finished for t in mine):
                engine.release(self.handles[i], [t.finish_reason or "abort" for t in mine])
            return changed

        @property
        def done(self) -> bool:
            return all(t.finished for t in self.texts)

        def usage(self) -> dict:
            prompt = sum(len(h.prompt_token_ids) for h in self.handles)
            completion = sum(t.num_tokens for t in self.texts)
            return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

        def release(self, reason: str | None = None) -> None:
            """Release every engine request: aborted (``reason`` None) or failed (``"error"``)."""
            for handle in self.handles:
                engine.release(handle, [reason] * handle.params.n if reason else None)

    def completion_logprobs(tokens, tops, offset0: int) -> dict:
        strings = [llm.engine.text([t]) for t in tokens]
        offsets, at = [], offset0
        for s in strings:
            offsets.append(at)
            at += len(s)
        return {"text_offset": offsets, "tokens": strings,
                "token_logprobs": [_logprob(top.get(t, -math.inf)) for t, top in zip(tokens, tops, strict=False)],
                "top_logprobs": [{llm.engine.text([k]): _logprob(v) for k, v in top.items()} for top in tops]}

    def chat_logprobs(tokens, tops, k: int) -> dict:
        content = []
        for t, top in zip(tokens, tops, strict=False):
            s = llm.engine.text([t])
            best = sorted(top.items(), key=lambda kv: -kv[1])[:k]
            content.append({"token": s, "logprob": _logprob(top.get(t, -math.inf)), "bytes": list(s.encode()),
                            "top_logprobs": [{"token": llm.engine.text([i]), "logprob": _logprob(v),
                                              "bytes": list(llm.engine.text([i]).encode())} for i, v in best]})
        return {"content": content}

    def sse(data) -> str:
        return f"data: {json.dumps(data)}\n\n"

    async def stream_events(run: Run, chunk, request_id: str, body: OpenAIRequest):
        """Server-sent events: a chunk per change, usage if asked, errors as an event, then [DONE]."""
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        try:
            for k in range(len(run.texts)):
                start = chunk(k, "", None, None, None, initial=True)
                if start is not None:
                    yield sse(start)
            async with aclosing(outputs(run.handles)) as merged:
                async for i, output in merged:
                    for k in run.update(i, output):
                        text = run.texts[k]
                        ready = text.ready()
                        delta, run.sent[k] = ready[run.sent[k]:], len(ready)
                        new_tokens = run.tokens[k][run.sent_tokens[k]:]
                        tops = run.token_logprobs[k][run.sent_tokens[k]:] if run.logprobs is not None else None
                        finish = text.finish_reason if text.finished else None
                        if not delta and finish is None and not (tops and new_tokens):
                            continue
                        run.sent_tokens[k] = len(run.tokens[k])
                        data = chunk(k, delta, finish, text.stop_reason if finish else None, (new_tokens, tops))
                        if continuous:
                            data["usage"] = run.usage()
                        yield sse(data)
                    if run.done:
                        break
            if include_usage:
                yield sse({"id": request_id, "object": chunk.object, "created": int(time.time()),
                           "model": model_name, "choices": [], "usage": run.usage()})
        except RequestFailed as err:
            run.release("error" if err.status == 500 else None)
            yield sse(error_body(str(err), err.status))
        except Exception as err:  # a failure during a stream is an error event, then [DONE]
            logger.exception("a stream failed")
            run.release("error")
            yield sse(error_body(f"internal server error: {type(err).__name__}", 500))
        finally:
            run.release()
        yield "data: [DONE]\n\n"

    async def collect(run: Run, request: Request) -> bool:
        """Run to the end; False if the client went away (its requests are aborted)."""
        try:
            async with aclosing(outputs(run.handles)) as merged:
                async for i, output in merged:
                    run.update(i, output)
                    if run.done:
                        break
                    if await request.is_disconnected():
                        return False
            return True
        except RequestFailed as err:
            run.release("error" if err.status == 500 else None)
            raise OpenAIError(str(err), err.status) from None
        finally:
            run.release()

    # --- routes

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        body.check_fields()
        check_logprobs(body.logprobs, "logprobs")
        if body.echo and body.logprobs is not None:
            raise OpenAIError("echo with logprobs needs prompt logprobs, which this server does not compute",
                              400, "echo")
        first = body.prompt[0] if body.prompt else None  # checked: a string or a list of one kind
        raw = [body.prompt] if isinstance(body.prompt, str) or type(first) is int else body.prompt
        prompts, texts = [], []
        for p in raw:
            ids = await encode(p, body.add_special_tokens, "prompt") if isinstance(p, str) else p
            check_prompt(ids, body.max_tokens, "prompt")
            prompts.append(ids)
            texts.append(p if isinstance(p, str) else llm.engine.text(ids))
        params = body.sampling_params(body.max_tokens, body.logprobs, vocab_size)
        handles = await submit_all(prompts, params)
        run = Run(handles, body.n, body.stops, body.include_stop_str_in_output, body.logprobs)
        request_id = f"cmpl-{secrets.token_hex(12)}"
        echo = [texts[k // body.n] if body.echo else "" for k in range(len(run.texts))]

        if body.stream:
            def chunk(k, delta, finish, stop_reason, logprobs, initial=False):
                if initial:
                    return None
                text = delta
                if echo[k]:
                    text, echo[k] = echo[k] + delta, ""
                entry = None
                if logprobs is not None and logprobs[1] is not None:
                    entry = completion_logprobs(logprobs[0], logprobs[1], run.sent[k] - len(delta))
                return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                        "model": model_name, "choices": [{"index": k, "text": text, "logprobs": entry,
                                                          "finish_reason": finish, "stop_reason": stop_reason}]}

            chunk.object = "text_completion"
            return StreamingResponse(stream_events(run, chunk, request_id, body), media_type="text/event-stream")
        if not await collect(run, request):
            return error(499, "client closed the request")
        choices = []
        for k, text in enumerate(run.texts):
            entry = (completion_logprobs(run.tokens[k], run.token_logprobs[k], 0)
                     if body.logprobs is not None else None)
            choices.append({"index": k, "text": echo[k] + text.text, "logprobs": entry,
                            "finish_reason": text.finish_reason or "abort", "stop_reason": text.stop_reason})
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": run.usage()}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        body.check_fields()
        if body.echo:
            raise OpenAIError("echo is not supported for chat completions", 400, "echo")
        top = body.top_logprobs if body.top_logprobs is not None else 0
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", 400, "top_logprobs")
        check_logprobs(top, "top_logprobs")
        prompt = render_chat(chat_template, body.messages, body.add_generation_prompt, body.chat_template_kwargs,
                             template_tokens)
        ids = await encode(prompt, body.add_special_tokens, "messages")
        max_tokens = body.max_completion_tokens or body.max_tokens or max(llm.max_model_len - len(ids), 1)
        check_prompt(ids, max_tokens, "messages")
        params = body.sampling_params(max_tokens, top if body.logprobs else None, vocab_size)
        handles = await submit_all([ids], params)
        run = Run(handles, body.n, body.stops, body.include_stop_str_in_output, top if body.logprobs else None)
        request_id = f"chatcmpl-{secrets.token_hex(12)}"

        if body.stream:
            def chunk(k, delta, finish, stop_reason, logprobs, initial=False):
                if initial:
                    choice = {"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}
                else:
                    entry = None
                    if logprobs is not None and logprobs[1] is not None:
                        entry = chat_logprobs(logprobs[0], logprobs[1], top)
                    choice = {"index": k, "delta": {"content": delta} if delta or finish is None else {},
                              "logprobs": entry, "finish_reason": finish, "stop_reason": stop_reason}
                return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                        "model": model_name, "choices": [choice]}

            chunk.object = "chat.completion.chunk"
            return StreamingResponse(stream_events(run, chunk, request_id, body), media_type="text/event-stream")
        if not await collect(run, request):
            return error(499, "client closed the request")
        choices = [{"index": k, "message": {"role": "assistant", "content": text.text},
                    "logprobs": chat_logprobs(run.tokens[k], run.token_logprobs[k], top) if body.logprobs else None,
                    "finish_reason": text.finish_reason or "abort", "stop_reason": text.stop_reason}
                   for k, text in enumerate(run.texts)]
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": run.usage()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "minipaged", "root": str(model_dir), "parent": None,
                                            "max_model_len": llm.max_model_len, "permission": []}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give either prompt or messages", 400, "prompt")
        if body.messages is not None:
            text = render_chat(chat_template, body.messages, body.add_generation_prompt, None, template_tokens)
            ids = await encode(text, bool(body.add_special_tokens), "messages")
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await encode(body.prompt, special, "prompt")
        strs = [tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        if not all(0 <= t < vocab_size for t in body.tokens):
            raise OpenAIError(f"token ids must be in 0 .. {vocab_size - 1}", 400, "tokens")
        return {"prompt": llm.engine.text(body.tokens)}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/health")
    async def health():
        problem = engine.health()
        if problem is not None:
            return error(503, problem)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        def scrape():
            engine.metrics.engine_values = engine.engine_values()
            return generate_latest(engine.metrics.registry)

        return Response(await run_in_threadpool(scrape), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/state")
    async def state():
        return await run_in_threadpool(engine.state)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return live_page.PAGE

    return app


# --- the command


class _Server:
    """uvicorn's server with the shutdown of ``minipaged serve``: on SIGTERM or SIGINT, stop
    accepting, abort what still runs after ``shutdown_timeout`` seconds (a second signal: now),
    one log line per signal, and return normally (exit status 0)."""

    def __new__(cls, config, engine: AsyncEngine, shutdown_timeout: float):
        import uvicorn

        class Server(uvicorn.Server):
            @contextmanager
            def capture_signals(self):
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, self.on_signal, sig)
                try:
                    yield
                finally:
                    for sig in (signal.SIGINT, signal.SIGTERM):
                        loop.remove_signal_handler(sig)

            def on_signal(self, sig):
                name, in_flight = signal.Signals(sig).name, len(engine._handles)
                engine.shutting_down = True
                if not self.should_exit:
                    logger.warning("%s: shutting down; %d requests in flight%s", name, in_flight,
                                   f", aborted after {shutdown_timeout:g} s" if in_flight and shutdown_timeout
                                   else (", aborted now" if in_flight else ""))
                    self.should_exit = True
                    asyncio.get_running_loop().call_later(shutdown_timeout, engine.abort_all,
                                                          "the server is shutting down")
                else:
                    logger.warning("%s again: aborting %d requests now", name, in_flight)
                    engine.abort_all("the server is shutting down")

        return Server(config)


def header_timeout_protocol(timeout: float):
    """uvicorn's h11 protocol, closing a connection whose first request has not sent all its
    headers within ``timeout`` seconds (uvicorn has no such timeout of its own)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.header_timer = self.loop.call_later(timeout, self.headers_too_slow)

        def headers_too_slow(self) -> None:
            if self.cycle is None and not self.transport.is_closing():  # no request has started
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self.header_timer.cancel()
            super().connection_lost(exc)

    return Protocol


def check_serve_args(host: str, port: int, shutdown_timeout: float, max_waiting: int) -> None:
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"minipaged serves on the loopback interface only, not {host!r}")
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0 .. 65535, got {port}")
    if not shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {shutdown_timeout}")
    if max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {max_waiting}")


def serve(model: str = "tiny", host: str = "127.0.0.1", port: int = 8000, max_waiting: int = 256, *,
          api_key: str | None = None, shutdown_timeout: float = 0.0, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, read_timeout: float = DEFAULT_READ_TIMEOUT,
          served_model_name: str | None = None, scheduler: str = "v0", **engine_args) -> None:
    """Run the server until SIGINT or SIGTERM. Arguments and the port are checked before the
    model loads (``ValueError``, one line); in-flight requests are aborted after ``shutdown_timeout``.
    ``scheduler="v1"`` serves stage 10's engine (prefix caching always on)."""
    import torch
    import uvicorn

    from minipaged import LLM
    from minipaged.stage10_v1_scheduler import LLM as V1LLM

    if scheduler not in ("v0", "v1"):
        raise ValueError(f"scheduler must be 'v0' or 'v1', got {scheduler!r}")
    if scheduler == "v1":
        engine_args["enable_prefix_caching"] = True

    check_serve_args(host, port, shutdown_timeout, max_waiting)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    logging.basicConfig(format="minipaged serve: %(message)s", level=logging.WARNING)
    try:
        llm = (V1LLM if scheduler == "v1" else LLM)(model, **engine_args)
        name = served_model_name or model
        app = build_app(llm, name, max_waiting, api_key=api_key, max_logprobs=max_logprobs,
                        max_body_bytes=max_body_bytes, read_timeout=read_timeout, model_path=model)
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=shutdown_timeout + 5,
                                timeout_keep_alive=5, http=header_timeout_protocol(read_timeout))
        server = _Server(config, app.state.engine, shutdown_timeout)
        sock.listen(128)
        print(f"minipaged serve: {name} on http://{host if ':' not in host else f'[{host}]'}:"
              f"{sock.getsockname()[1]} ({torch.get_num_threads()} torch threads)", flush=True)
        server.run(sockets=[sock])
    finally:
        sock.close()
