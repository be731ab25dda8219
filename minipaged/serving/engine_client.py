"""The engine client: the one object of the server that holds the ``LLM``.

vLLM's API server talks to its engine through an ``EngineClient`` (``vllm/engine/protocol.py``,
served by ``AsyncLLM``); this is minipaged's, over the ``LLM``'s engine (stage 7's loop, or stage 10's). The
routes, the metrics and the live page read the engine through its public methods only:

* requests in and outputs out: ``submit``, ``release``, ``abort_all``, ``stream``, ``stream_all``;
* the model: ``model_name``, ``max_model_len``, ``vocab_size``, ``has_tokenizer``,
  ``max_token_chars``, ``encode``, ``decode``, ``detokenizer``, ``id_to_token``;
* the engine's state: ``snapshot`` (the live page), ``stats`` (the metrics' gauges), ``health``,
  ``num_waiting``, ``num_in_flight``; ``metrics`` holds the Prometheus metrics it observes.

How it runs:

* One worker thread owns the engine: between two steps it applies the aborts and admits the
  requests submitted meanwhile, then steps. The event loop never waits for the engine's lock, and
  tokenizing happens in other threads, so a long prompt or a long step never freezes the other
  streams. Every step's outputs go to the asyncio queue of the request they belong to.
* A step that raises has aborted the requests it touched (the engine keeps every block
  consistent). If it touched one request, that request fails alone. If it touched several,
  the client cannot tell which one broke it, so each of them is replayed alone, one after the
  other, from its prompt and with its seed (``submit`` gives every request a seed): the tokens
  a client already has are checked and not sent again, the others are streamed as usual, and
  only a request that fails when alone gets an error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from minipaged.common.detokenizer import IncrementalDetokenizer
from minipaged.common.sampling_params import SEED_RANGE, RequestOutput, SamplingParams
from minipaged.serving.metrics import Metrics

if TYPE_CHECKING:  # the engine's front end, named in annotations only
    from minipaged.llm import LLM

logger = logging.getLogger("minipaged.serving")

FAILED_STEPS_UNHEALTHY = 3  # this many failed steps in a row and /health answers 503
TAIL_TOKENS = 48  # the live page shows the end of each text: decode only the last tokens, under the lock
TAIL_CHARS = 120


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


class EngineClient:
    """Stage 7's engine, stepped in the background; requests in, their outputs streamed out."""

    def __init__(self, llm: LLM, max_waiting: int = 256, model_name: str = "tiny",
                 stall_timeout: float = 60.0) -> None:
        self._llm, self._engine, self.max_waiting, self.stall_timeout = llm, llm.engine, max_waiting, stall_timeout
        self.model_name = model_name
        self.metrics = Metrics(model_name)
        self.vocab_size: int = llm.engine.vocab_size
        self._tokenizer = llm.tokenizer
        vocab = self._tokenizer.get_vocab() if self._tokenizer else {}
        self.max_token_chars: int = max((len(t) for t in vocab), default=1)  # the longest token, in characters
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="minipaged-engine")
        self._tokenize_pool = ThreadPoolExecutor(2, thread_name_prefix="minipaged-tokenize")
        self._lock = threading.Lock()  # guards the engine: held by the engine thread, and by the readers below
        self._handles: dict[Hashable, Handle] = {}  # submitted and not released, by request id
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
        """Abort what is in flight (its blocks go back), then stop the loop and the tokenizing threads."""
        self.abort_all("the server is shutting down")
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
        with self._lock:
            for request_id in list(self._engine.requests):
                self._engine.abort_request(request_id)
        self._tokenize_pool.shutdown(wait=False)

    # --- the model

    @property
    def max_model_len(self) -> int:
        return self._llm.max_model_len

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The token ids of ``text``, tokenized in a thread of the tokenizing pool (needs a tokenizer)."""
        loop, tokenizer = asyncio.get_running_loop(), self._tokenizer
        assert tokenizer is not None  # the routes ask has_tokenizer first
        encoding = await loop.run_in_executor(
            self._tokenize_pool, lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return encoding.ids

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, as the engine decodes it."""
        return self._engine.text(token_ids)

    def detokenizer(self) -> IncrementalDetokenizer | None:
        """A new incremental detokenizer for one sequence's text, as the engine decodes it; None without a tokenizer."""
        return IncrementalDetokenizer(self._tokenizer) if self._tokenizer is not None else None

    def id_to_token(self, token_id: int) -> str | None:
        """The tokenizer's string for one token id (its vocabulary entry, not its decoded text)."""
        assert self._tokenizer is not None  # the routes ask has_tokenizer first
        return self._tokenizer.id_to_token(token_id)

    # --- requests in

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> Handle:
        """Queue a request (checked by the engine at admission: await ``handle.admitted``)."""
        if self.shutting_down:
            raise RequestFailed("the server is shutting down", 503)
        broken = self.engine_broken()
        if broken is not None:
            raise RequestFailed(broken, 503)
        if len(self._pending) + self.num_waiting >= self.max_waiting:
            raise QueueFullError(f"{self.max_waiting} requests are waiting already")
        if params.seed is None:  # a seed of its own, so that a replay draws the same tokens
            params = dataclasses.replace(params, seed=random.randrange(0, SEED_RANGE[1] - params.n))
        loop = asyncio.get_running_loop()
        handle = Handle(f"cmpl-{secrets.token_hex(8)}-{next(self._ids)}", list(prompt_token_ids), params,
                        asyncio.Queue(), loop.create_future())
        self._handles[handle.request_id] = handle
        self._pending.append(handle)
        assert self._wakeup is not None  # made by start()
        self._wakeup.set()
        return handle

    @property
    def num_waiting(self) -> int:
        """Requests in the scheduler's waiting queue."""
        return len(self._llm.scheduler.waiting)

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet released."""
        return len(self._handles)

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
            assert self._wakeup is not None  # made by start()
            self._wakeup.set()
        self.metrics.finished(reasons or ["abort"] * handle.params.n, time.monotonic() - handle.arrival)

    def abort_all(self, message: str) -> None:
        """Every request in flight gets an error (status 503) and is aborted."""
        for handle in list(self._handles.values()):
            handle.queue.put_nowait(RequestFailed(message, 503))
            if not handle.admitted.done():
                handle.admitted.set_exception(RequestFailed(message, 503))
            self._aborts.append(handle.request_id)
        if self._wakeup:
            self._wakeup.set()

    # --- outputs out

    async def stream(self, handle: Handle) -> AsyncGenerator[RequestOutput, None]:
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

    async def stream_all(self, handles: list[Handle]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(index in ``handles``, output) from every handle as they come; raises the first failure."""
        if len(handles) == 1:
            async for output in self.stream(handles[0]):
                yield 0, output
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, handle: Handle) -> None:
            try:
                async for output in self.stream(handle):
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

    # --- the engine thread

    def _work(self):
        """Between two steps: aborts, admissions, then one step. Runs on the engine thread."""
        with self._lock:
            while self._aborts:
                request_id = self._aborts.popleft()
                self._engine.abort_request(request_id)
                self._in_engine.discard(request_id)
            admitted = []
            if self._solo is not None and self._solo not in self._in_engine:
                self._solo = None
            if self._suspects or self._solo is not None:  # replay one suspect at a time, alone
                if self._solo is None and not self._engine.has_unfinished_requests():
                    handle = self._suspects.popleft()
                    admitted.append((handle, self._add(handle)))
                    self._solo = handle.request_id
            else:
                while self._pending:
                    handle = self._pending.popleft()
                    admitted.append((handle, self._add(handle)))
            if not self._engine.has_unfinished_requests():
                return admitted, [], None, []
            try:
                outputs = self._engine.step()
            except Exception as err:  # the engine aborted what the step touched
                lost = [r for r in self._in_engine if r not in self._engine.requests]
                if not lost:  # it failed before it took any: none of them is known to be sound, and
                    lost = list(self._in_engine)  # stepping them again would fail the same way forever
                    for request_id in lost:
                        self._engine.abort_request(request_id)
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
            self._engine.add_request(handle.request_id, {"prompt_token_ids": handle.prompt_token_ids}, handle.params)
        except (ValueError, TypeError) as err:
            return err
        self._in_engine.add(handle.request_id)
        return None

    # --- the event loop

    async def _loop(self) -> None:
        loop, wakeup = asyncio.get_running_loop(), self._wakeup
        assert wakeup is not None  # made by start(), before the loop
        try:
            while True:
                if not (self._pending or self._suspects or self._aborts or self._engine.has_unfinished_requests()):
                    wakeup.clear()
                    await wakeup.wait()
                started = self.step_started = time.monotonic()
                try:
                    admitted, outputs, error, lost = await loop.run_in_executor(self._executor, self._work)
                finally:
                    self.step_started = None
                self._admitted(admitted)
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

    def _admitted(self, admitted: list[tuple[Handle, Exception | None]]) -> None:
        """Settle each admission: the request is in the engine, or its submitter gets the engine's refusal."""
        for handle, err in admitted:
            if handle.admitted.done():
                continue
            if err is None:
                handle.admitted.set_result(None)
            else:
                handle.admitted.set_exception(err)
                self._handles.pop(handle.request_id, None)
                handle.released = True

    def _step_failed(self, error: Exception, lost: list[str]) -> None:
        self.failed_steps += 1
        handles = [self._handles[r] for r in lost if r in self._handles]
        broken = self.engine_broken()
        if broken is not None:  # nothing to replay on: every request of the step gets a 503
            logger.error("%s", broken)
            for handle in handles:
                handle.queue.put_nowait(RequestFailed(broken, 503))
            return
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
        now = time.monotonic()
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
            self.metrics.first_scheduled(started - handle.arrival, len(handle.prompt_token_ids), now - handle.arrival)
        elif new > 0 and handle.last_output is not None:
            self.metrics.inter_token(now - handle.last_output)
        if new > 0:
            self.metrics.generated(new)
            handle.last_output = now
        handle.delivered = tokens
        handle.finished = output.finished
        handle.queue.put_nowait(output)

    # --- reading the engine

    def snapshot(self) -> dict:
        """The queues and the block map, for the live page (``snapshot`` below), under the engine's lock."""
        with self._lock:
            return snapshot(self._llm)

    def stats(self) -> dict:
        """The engine's gauges and counters for the metrics (``minipaged.serving.metrics``), under its lock."""
        with self._lock:  # the components' statistics objects, not the live page's block map
            counted, block_size = self._llm.stats, self._llm.scheduler.block_manager.block_size
            sched, cache = counted.scheduler, counted.prefix_cache
            spec = counted.spec_decoding  # with speculative decoding (stage 12), else None
            drafts = {} if spec is None else {"spec_decode_num_drafts": spec.num_drafts,
                                              "spec_decode_num_draft_tokens": spec.num_draft_tokens,
                                              "spec_decode_num_accepted_tokens": spec.num_accepted_tokens}
            return {**drafts, "num_requests_running": sched.num_running_reqs,
                    "num_requests_waiting": sched.num_waiting_reqs, "num_requests_swapped": sched.num_swapped_reqs,
                    "kv_cache_usage_perc": sched.kv_cache_usage,
                    "kv_cache_blocks_used": sched.num_used_blocks, "kv_cache_blocks_total": sched.num_gpu_blocks,
                    "num_preemptions": counted.num_preemptions,
                    "prefix_cache_queries": cache.queries * block_size,  # in tokens: full blocks looked up
                    "prefix_cache_hits": cache.hits * block_size}

    def engine_broken(self) -> str | None:
        """Why the engine can serve no more (``LLM.check_health``: a tensor-parallel worker died), or None."""
        try:
            self._llm.check_health()  # raises if the model's workers (other processes) are gone
        except Exception as err:
            return f"the engine cannot serve: {err}"
        return None

    def health(self) -> str | None:
        """None when healthy, else why not."""
        if self.dead is not None or self._task is None or self._task.done():
            return "the engine loop is not running"
        broken = self.engine_broken()
        if broken is not None:
            return broken
        if self.step_started is not None and time.monotonic() - self.step_started > self.stall_timeout:
            return f"a step has been running for more than {self.stall_timeout:g} s"
        if self.failed_steps >= FAILED_STEPS_UNHEALTHY:
            return f"the last {self.failed_steps} engine steps failed"
        return None


# --- the live page's data


def _tail(llm: LLM, token_ids: list[int]) -> str:
    """The end of a sequence's text; a character cut in half by the token window is dropped."""
    if not token_ids:
        return ""
    return llm.engine.text(token_ids[-TAIL_TOKENS:]).lstrip("\ufffd")[-TAIL_CHARS:]


def _pool(num_blocks: int, free_blocks: int, owners: dict[int, list[str]]) -> dict:
    return {"num_blocks": num_blocks, "free_blocks": free_blocks,
            "blocks": {str(b): o for b, o in sorted(owners.items())},
            "shared": sorted(b for b, o in owners.items() if len(o) > 1)}


def snapshot(llm: LLM) -> dict:
    """The queues, the GPU block map and the CPU swap pool of ``llm``: who holds which block.

    It reads the scheduler and the block manager through their public names and returns
    JSON-ready data; the live page (``minipaged.serving.live_page``) draws it. It holds:

    * ``num_blocks``, ``free_blocks``, ``block_size``: the GPU pool of KV blocks;
    * ``blocks``: each GPU block in use -> the request id of every sequence whose block table holds
      it (a block shared by three samples of one request lists that request three times);
      ``shared``: the GPU blocks held by more than one sequence;
    * ``cpu``: the CPU swap pool, the same way (``num_blocks``, ``free_blocks``, ``blocks``,
      ``shared``), or ``None`` when the engine has no swap space;
    * ``waiting``, ``running``, ``swapped``: the queues, oldest first, one entry per request: its
      ``id``, ``index`` (its arrival number, which keys its colour on the page), ``prompt_tokens``,
      ``width`` (``n``), ``tokens`` (tokens generated, per sequence), ``text`` (the end of its first
      sequence's text), ``gpu_blocks`` and ``cpu_blocks`` (distinct blocks it holds), and ``seqs``:
      per sequence its ``seq_id``, ``status``, ``tokens``, ``num_tokens`` (prompt included), ``where``
      its blocks are (``"gpu"``, ``"cpu"`` or ``None``), its ``block_table`` (logical block ``i`` is
      physical block ``block_table[i]`` of that pool) and the end of its ``text``;
    * ``stats``: what the engine counted (``LLM.stats``, flat: ``Stats.as_dict()``).
    """
    scheduler, manager = llm.scheduler, llm.scheduler.block_manager
    owners: dict[str, dict[int, list[str]]] = {"gpu": {}, "cpu": {}}  # pool -> block -> ids of its holders
    queues: dict[str, list[dict[str, Any]]] = {}
    for name in ("waiting", "running", "swapped"):
        queues[name] = []
        for group in getattr(scheduler, name, ()):  # stage 10 has no swapped queue
            if group.is_finished():  # done, and leaving at the next step
                continue
            request_id, seqs = str(group.request_id), []
            for seq in group.seqs:
                if seq.seq_id in manager.block_tables:
                    where, table = "gpu", manager.get_block_table(seq.seq_id)
                elif seq.seq_id in manager.swapped_tables:
                    where, table = "cpu", list(manager.swapped_tables[seq.seq_id].block_ids)
                else:  # waiting (never run, or preempted by recomputation) or finished: no blocks
                    where, table = None, []
                if where is not None:
                    for block in table:
                        owners[where].setdefault(block, []).append(request_id)
                seqs.append({"seq_id": seq.seq_id, "status": seq.status.value,
                             "tokens": len(seq.output_token_ids), "num_tokens": len(seq), "where": where,
                             "block_table": table, "text": _tail(llm, seq.output_token_ids)})
            queues[name].append({
                "id": request_id, "index": group.arrival, "prompt_tokens": len(group.seqs[0].prompt_token_ids),
                "width": group.width, "tokens": [s["tokens"] for s in seqs], "text": seqs[0]["text"],
                "gpu_blocks": len({b for s in seqs if s["where"] == "gpu" for b in s["block_table"]}),
                "cpu_blocks": len({b for s in seqs if s["where"] == "cpu" for b in s["block_table"]}),
                "seqs": seqs})
    gpu = _pool(manager.num_total_blocks, manager.num_free_blocks, owners["gpu"])
    pool = manager.cpu_allocator
    cpu = None if pool is None else _pool(pool.num_total_blocks, pool.num_free_blocks, owners["cpu"])
    return {**gpu, "block_size": manager.block_size, "cpu": cpu, **queues, "stats": llm.stats.as_dict()}
