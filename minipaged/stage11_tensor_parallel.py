"""Stage 11 — tensor parallelism as the paper runs it: one scheduler, one block manager, N workers.

When a model outgrows one GPU, vLLM splits it across several (Megatron-LM tensor parallelism)
and keeps memory management where it was (§4.6, "Distributed Execution"): one scheduler and
one block manager, in the driver; every worker holds the K/V of its own attention heads under
the **same block ids**, so the driver's one block table serves every worker. Each step the
driver sends the step's inputs to the workers; they run their shards, all-reduce among
themselves, and rank 0 sends back the logits; sampling stays in the driver.

So the driver's engine, scheduler and runner are the ones of stages 9 and 10, unchanged. Only
the two things the runner calls move into the workers, and the driver keeps a stand-in for each:

* ``TensorParallelModel`` stands where the model stood. Called with a step's inputs, it runs
  nothing and returns a ``StepHidden``; the runner picks the rows it needs from it as it picks
  them from hidden states, and ``compute_logits`` of those rows sends the step to the workers
  (``StepInputs``) and returns the logits rank 0 sends back.
* ``RemoteKVCache`` stands where the cache stood: it holds no K/V; the block moves the runner
  applies to it (swap out, swap in, copy-on-write copies) go with the step, and each worker
  applies them to its own shard of the blocks.

The executor (vLLM's name) starts the workers and carries the messages: ``MultiprocExecutor``
starts ``tensor_parallel_size`` of them with the spawn start method and talks to each over a
pipe (vLLM's ``"mp"`` backend); under ``torchrun`` (``"external_launcher"``) this process is
rank 0 and the other ranks follow it over ``torch.distributed``. Every wait is bounded and
checks that the workers live: a worker that dies makes the call raise ``WorkerDiedError``
within a fraction of a second, and the ``LLM`` is then closed. Workers ignore Ctrl-C, and a
step is sent to all of them or to none; they never outlive their ``LLM`` (``close()``, a
``with`` block, or the interpreter's exit).

A KV connector (stage 14) has its worker side in every worker, over its shard of the KV heads. The
driver sets the step's connector metadata on the executor (``kv_connector_metadata``) before the
forward; the executor sends it with the step, and keeps the union of the blocks the workers failed to
load (``invalid_block_ids``, as vLLM's ``KVOutputAggregator`` joins them) for the driver to read after.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing as mp
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from minipaged.common.config import ResolvedEngineConfig
from minipaged.models import AttentionMetadata, GroupedAttentionMetadata, ModelConfig
from minipaged.stage2_block_table import PagedKVCache
from minipaged.stage11_worker import StepInputs, Worker, WorkerConfig, run_worker

START_TIMEOUT_S = 300.0  # loading a shard
STEP_TIMEOUT_S = 300.0  # one call on every worker


class WorkerDiedError(RuntimeError):
    """A worker died, failed or stopped answering: the model's shards are gone with it."""


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C waits until the block ends (in the main thread): a step goes to every worker or to none."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
        if caught:
            raise KeyboardInterrupt


def stop_workers(procs: list[mp.process.BaseProcess], conns: list[Connection], rendezvous: str) -> None:
    """Ask every worker to stop, then make sure: terminate, kill. Runs once (``weakref.finalize``)."""
    for conn in conns:
        try:
            conn.send((-1, "shutdown", ()))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 5
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2)
        if proc.is_alive():
            proc.kill()
            proc.join(2)
    for conn in conns:
        conn.close()
    shutil.rmtree(rendezvous, ignore_errors=True)  # the rendezvous file this executor made, nothing else


class StepExecutor:
    """What both executors share: a step, sent to every worker (``collective_rpc``), with the KV connector's
    metadata of the step if the driver set it; rank 0's logits back."""

    kv_connector_metadata: Any = None  # the next step's, set by the driver (None: no connector)
    invalid_block_ids: frozenset[int] = frozenset()  # the blocks any worker failed to load in the last step
    kv_connector_stats: list[Any] = []  # each rank's connector counts, as of its last step (none before one)

    def collective_rpc(self, method: str, *args: Any, timeout: float = STEP_TIMEOUT_S) -> list[Any]:
        raise NotImplementedError

    def execute_model(self, step: StepInputs) -> torch.Tensor:
        if self.kv_connector_metadata is None:
            return torch.from_numpy(self.collective_rpc("execute_model", step)[0])
        step = dataclasses.replace(step, kv_connector_metadata=self.kv_connector_metadata)
        results = self.collective_rpc("execute_model_with_kv_connector", step)
        self.invalid_block_ids = frozenset().union(*(invalid for _, invalid, _ in results))
        self.kv_connector_stats = [stats for _, _, stats in results]
        return torch.from_numpy(results[0][0])


class MultiprocExecutor(StepExecutor):
    """``tensor_parallel_size`` workers started with spawn, one pipe each; ``collective_rpc`` runs a
    method on every worker and returns their results, in rank order (vLLM's names)."""

    def __init__(self, config: WorkerConfig) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that has run torch
        self.rendezvous = tempfile.mkdtemp(prefix="minipaged-tp-")
        config = dataclasses.replace(config, init_method=f"file://{self.rendezvous}/store")
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in range(config.tensor_parallel_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=run_worker, args=(theirs, config, rank), name=f"minipaged-tp{rank}",
                               daemon=True)
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
        self.finalizer = weakref.finalize(self, stop_workers, self.procs, self.conns, self.rendezvous)
        self.call_ids = itertools.count()
        self.dead: str | None = None
        self.wait_all(-1, START_TIMEOUT_S, "starting")

    def collective_rpc(self, method: str, *args: Any, timeout: float = STEP_TIMEOUT_S) -> list[Any]:
        if self.dead is not None:
            raise WorkerDiedError(self.dead)
        call_id = next(self.call_ids)
        with interrupts_deferred():
            for rank, conn in enumerate(self.conns):
                try:
                    conn.send((call_id, method, args))
                except OSError:  # its end of the pipe is closed: it is gone, or going
                    self.fail(f"tensor-parallel worker {rank} closed its pipe before {method}")
        return self.wait_all(call_id, timeout, method)

    def wait_all(self, call_id: int, timeout: float, what: str) -> list[Any]:
        """Every worker's answer to ``call_id`` (older answers, of a call given up on, are dropped);
        ``WorkerDiedError`` as soon as a worker fails, dies, or the time is up."""
        results: list[Any] = [None] * len(self.conns)
        pending, deadline = set(range(len(self.conns))), time.monotonic() + timeout
        while pending:
            for rank in sorted(pending):
                try:
                    while self.conns[rank].poll():
                        answered, ok, result = self.conns[rank].recv()
                        if answered != call_id:
                            continue
                        if not ok:
                            self.fail(f"tensor-parallel worker {rank} failed in {what}:\n{result}")
                        results[rank] = result
                        pending.discard(rank)
                        break
                except (EOFError, OSError):
                    self.fail(f"tensor-parallel worker {rank} closed its pipe during {what}")
            if not pending:
                break
            for rank, proc in enumerate(self.procs):
                if proc.exitcode is not None:
                    self.fail(f"tensor-parallel worker {rank} (pid {proc.pid}) died during {what} "
                              f"(exit code {proc.exitcode})")
            if time.monotonic() > deadline:
                self.fail(f"tensor-parallel workers {sorted(pending)} did not answer {what} within {timeout:g} s")
            wait([self.conns[r] for r in pending], timeout=0.05)
        return results

    def fail(self, message: str) -> None:
        self.dead = message
        self.shutdown()
        raise WorkerDiedError(message)

    def check_health(self) -> None:
        """``WorkerDiedError`` if a worker is gone, or the executor shut down (vLLM's ``check_health``)."""
        if self.dead is not None:
            raise WorkerDiedError(self.dead)

    def shutdown(self) -> None:
        self.dead = self.dead or "the executor is shut down"
        self.finalizer()


class ExternalLauncherExecutor(StepExecutor):
    """Under ``torchrun``: this process is rank 0 and runs the engine; the other ranks follow it
    (``follow_rank_0``), each call broadcast to them and their results gathered, over the process group."""

    def __init__(self, config: WorkerConfig) -> None:
        self.worker = Worker(config, 0)
        self.worker.init_device()
        if dist.get_rank() != 0:
            raise ValueError("under torchrun, the engine runs on rank 0; the others follow it")
        self.worker.load_model()
        self.dead: str | None = None

    def collective_rpc(self, method: str, *args: Any, timeout: float = STEP_TIMEOUT_S) -> list[Any]:
        if self.dead is not None:
            raise WorkerDiedError(self.dead)
        with interrupts_deferred():
            dist.broadcast_object_list([(method, args)], src=0)
            results: list[Any] = [None] * dist.get_world_size()
            dist.gather_object(getattr(self.worker, method)(*args), results, dst=0)
        return results

    def check_health(self) -> None:
        if self.dead is not None:
            raise WorkerDiedError(self.dead)

    def shutdown(self) -> None:
        if self.dead is None:
            self.dead = "the executor is shut down"
            dist.broadcast_object_list([("shutdown", ())], src=0)
            self.worker.close()


def follow_rank_0(config: WorkerConfig, rank: int) -> None:
    """A torchrun rank other than 0: run every call rank 0 broadcasts, until it says ``shutdown``."""
    worker = Worker(config, rank)
    worker.init_device()
    worker.load_model()
    try:
        while True:
            message: list[Any] = [None]
            dist.broadcast_object_list(message, src=0)
            method, args = message[0]
            if method == "shutdown":
                return
            dist.gather_object(getattr(worker, method)(*args), None, dst=0)
    finally:
        worker.close()


Executor = MultiprocExecutor | ExternalLauncherExecutor


@dataclasses.dataclass
class StepHidden:
    """What ``TensorParallelModel`` returns for a step: its inputs, not yet run."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    cache: RemoteKVCache
    meta: AttentionMetadata | GroupedAttentionMetadata

    def index_select(self, dim: int, logits_indices: torch.Tensor) -> StepRows:
        """The rows the runner asks for, as it asks a model's hidden states (``dim`` is 0)."""
        if dim != 0:
            raise ValueError(f"a step's rows are along dim 0, got dim={dim}")
        return StepRows(self, logits_indices)

    def __getitem__(self, logits_indices: torch.Tensor) -> StepRows:
        """``hidden[indices]``: the same rows, as a runner may ask for them instead."""
        return StepRows(self, torch.as_tensor(logits_indices))


@dataclasses.dataclass
class StepRows:
    """The rows of a step whose logits the runner asks for."""

    hidden: StepHidden
    logits_indices: torch.Tensor


class TensorParallelModel:
    """The driver's stand-in for the model: the runner calls it as it calls a model, and the step
    runs on the workers when the runner asks for logits."""

    def __init__(self, executor: Executor, attention_backend: str) -> None:
        self.executor, self.attention_backend = executor, attention_backend

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: RemoteKVCache,
                 meta: AttentionMetadata | GroupedAttentionMetadata) -> StepHidden:
        return StepHidden(input_ids, positions, cache, meta)

    def compute_logits(self, rows: StepRows) -> torch.Tensor:
        """Send the step (its inputs, its block moves, the rows asked for, the attention backend this model
        was given) to every worker, whether or not any row is asked for; rank 0's logits."""
        # BEGIN SOLUTION the step's inputs as numpy arrays, its block moves, the rows; rank 0's logits back
        step, meta = rows.hidden, rows.hidden.meta
        slot_mapping, block_tables, group_of_layer = host_tables(meta)
        meta = meta.groups[0] if isinstance(meta, GroupedAttentionMetadata) else meta  # the lengths: every group's
        inputs = StepInputs(
            input_ids=step.input_ids.cpu().numpy(), positions=step.positions.cpu().numpy(),
            slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=meta.seq_lens.cpu().numpy(),
            query_start_loc=None if meta.query_start_loc is None else meta.query_start_loc.cpu().numpy(),
            logits_indices=rows.logits_indices.cpu().numpy(), attention_backend=self.attention_backend,
            group_of_layer=group_of_layer, **step.cache.take_block_moves())
        return self.executor.execute_model(inputs)
        # END SOLUTION


def host_tables(meta: AttentionMetadata | GroupedAttentionMetadata) -> tuple[np.ndarray, np.ndarray, list[int] | None]:
    """A step's slot mapping and block tables as host arrays, and each layer's KV cache group: with several
    groups (stage 15), each group's along a first axis (the tables padded to the widest), else as they are."""
    if isinstance(meta, AttentionMetadata):
        return meta.slot_mapping.cpu().numpy(), meta.block_tables.cpu().numpy(), None
    width = max(g.block_tables.shape[1] for g in meta.groups)
    tables = np.zeros((len(meta.groups), *meta.groups[0].block_tables.shape[:1], width), np.int32)
    for g, group in enumerate(meta.groups):
        tables[g, :, :group.block_tables.shape[1]] = group.block_tables.cpu().numpy()
    return np.stack([g.slot_mapping.cpu().numpy() for g in meta.groups]), tables, meta.group_of_layer


class RemoteKVCache:
    """The driver's stand-in for the paged cache: the K/V are in the workers, each its heads' share.

    The block moves the runner applies here are kept for the step they belong to; ``gather``
    asks every worker for its heads of a sequence and puts the heads back together."""

    check_slot_mapping = PagedKVCache.check_slot_mapping  # the same check, on the same shape

    def __init__(self, executor: Executor, model_config: ModelConfig, device: torch.device, num_blocks: int,
                 block_size: int) -> None:
        self.executor, self.model_config = executor, model_config
        no_kv = torch.empty(num_blocks, block_size, 0, 0, device=device)  # the shape of the workers' blocks, no K/V
        self.key_cache = self.value_cache = [no_kv] * model_config.num_layers
        self.moves: dict[str, list[tuple[int, int]]] = {"blocks_to_swap_out": [], "blocks_to_swap_in": [],
                                                        "blocks_to_copy": []}

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self.moves["blocks_to_swap_out"] += pairs

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self.moves["blocks_to_swap_in"] += pairs

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.moves["blocks_to_copy"] += pairs

    def take_block_moves(self) -> dict[str, list[tuple[int, int]]]:
        moves, self.moves = self.moves, {k: [] for k in self.moves}
        return moves

    def gather(self, layer: int, block_table: Any, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K/V, each ``(seq_len, num_kv_heads, head_dim)``: every KV head from the first
        worker that holds it."""
        table = [int(b) for b in block_table]
        keys: dict[int, np.ndarray] = {}
        values: dict[int, np.ndarray] = {}
        # BEGIN SOLUTION each rank's heads, in the model's head order; a replicated head taken once
        for key, value, heads in self.executor.collective_rpc("gather", layer, table, seq_len):
            for i, head in enumerate(heads):
                keys.setdefault(head, key[:, i])
                values.setdefault(head, value[:, i])
        order = sorted(keys)
        return (torch.from_numpy(np.stack([keys[h] for h in order], axis=1)),
                torch.from_numpy(np.stack([values[h] for h in order], axis=1)))
        # END SOLUTION


def start_tensor_parallel(config: ResolvedEngineConfig, model_config: ModelConfig, path: Path,
                          **parts: Any) -> tuple[Executor, TensorParallelModel, RemoteKVCache]:
    """Start ``config.tensor_parallel_size`` workers holding the model's shards and their K/V; return
    the executor and the driver's stand-ins for the model and the cache, which the runner of stage 7
    or 10 calls as it calls the real ones. ``parts``: the workers' ``kv_cache``, ``attention`` and
    ``kv_connector`` (``WorkerConfig``'s), where the configuration chose others than stage 6's cache, or
    a KV connector."""
    c = config
    external = c.distributed_executor_backend == "external_launcher"
    executor = (ExternalLauncherExecutor if external else MultiprocExecutor)(worker_config(c, path, **parts))
    cache = RemoteKVCache(executor, model_config, torch.device(c.device), c.num_gpu_blocks, c.block_size)
    return executor, TensorParallelModel(executor, c.attention_backend), cache


def worker_config(config: ResolvedEngineConfig, path: Path, **parts: Any) -> WorkerConfig:
    """What every worker is started with: the model's folder, and the engine's dtype, device and cache sizes
    (``parts``: the cache, attention and KV connector chosen for it, as ``WorkerConfig`` names them)."""
    return WorkerConfig(str(path), str(config.torch_dtype).removeprefix("torch."), str(config.device),
                        config.block_size, config.num_gpu_blocks, config.num_cpu_blocks, config.tensor_parallel_size,
                        **parts)


def follow_rank_0_of(config: ResolvedEngineConfig, path: Path, rank: int, **parts: Any) -> None:
    """Under ``torchrun``, a rank other than 0: load its shard and follow rank 0 until it shuts down."""
    follow_rank_0(worker_config(config, path, **parts), rank)
