"""Stage 11 — a tensor-parallel worker: one rank's shard of the model and of every KV block.

The paper's §4.6 keeps memory management central and splits only the model. Each worker
(one per GPU; here one per process) holds, Megatron-LM style, its attention heads' slice of
every layer (``minipaged.models.parallel``) and the K/V of its KV heads, in a ``PagedKVCache``
of ``(num_blocks, block_size, num_kv_heads / tp, head_dim)`` per layer. The block ids are the
same on every worker, so the one block table the driver's block manager keeps serves them
all: a worker never sees the block manager. Each step it is sent the step's inputs
(``StepInputs``: token ids, positions, slot mapping, block tables, lengths, the block moves),
runs its shard — the all-reduces go between the workers, without the driver — and rank 0
sends back the logits.

A worker is started by the driver (``stage11_tensor_parallel``, the spawn start method; inputs
and replies over a pipe), or by ``torchrun``, which sets its rank, the world size and the
rendezvous in its environment (``python -m minipaged.llm``: rank 0 runs the
engine, the others follow it). Every collective has the process group's timeout; a worker
exits when the driver goes away.

A KV connector's worker side (stage 14), where the engine has one, runs in every worker, over its
shard: the step carries the connector's metadata, the worker loads before its forward and saves
after it (``execute_model_with_kv_connector``), and answers with the blocks it failed to load.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from minipaged.models import AttentionMetadata, resolve_dtype
from minipaged.models.parallel import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_heads_of_rank,
    load_model_shard,
    num_kv_heads_per_rank,
)
from minipaged.stage6_swapping import SwapPagedKVCache
from minipaged.stage7_model_runner import backend_named


class WorkerKVConnector(Protocol):
    """A KV connector's worker side in one worker, over its shard of the cache (stage 14 gives one): its
    attention around the backend's, its loads and saves around the forward (the set it gives holds, once
    the block ends, the ids of the blocks it failed to load), and its counts."""

    def attention(self, backend: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]: ...

    def load_and_save(self, metadata: Any) -> AbstractContextManager[set[int]]: ...

    def make_stats(self) -> Any: ...


@dataclasses.dataclass
class WorkerConfig:
    """What every worker is built from: the model, the cache's sizes, how the ranks meet."""

    model: str
    dtype: str
    device: str
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    tensor_parallel_size: int
    init_method: str = "env://"  # a rendezvous: "file://...", "tcp://host:port", or torchrun's environment
    timeout_s: float = 60.0  # of every collective
    # The K/V cache the engine's configuration chose (built with stage 6's arguments), and the attention
    # backend over it, given the step's backend name (None: stage 4's or 5's, by name). Both are picklable.
    kv_cache: Callable[..., Any] = SwapPagedKVCache
    attention: Callable[[str, Any], Callable[..., torch.Tensor]] | None = None
    # The KV connector's worker side, given this rank's cache, its shard of the model, its rank and the world
    # size (None: no connector). Picklable too.
    kv_connector: Callable[[Any, torch.nn.Module, int, int], WorkerKVConnector] | None = None


@dataclasses.dataclass
class StepInputs:
    """One step, as the driver's runner built it (numpy arrays: they pickle by value, cheaply)."""

    input_ids: np.ndarray  # int64 (num_tokens,)
    positions: np.ndarray  # int64 (num_tokens,)
    slot_mapping: np.ndarray  # int64 (num_tokens,); with KV cache groups: (num_groups, num_tokens)
    block_tables: np.ndarray  # int32 (num_seqs, max_blocks_per_seq); with groups: (num_groups, num_seqs, ..)
    seq_lens: np.ndarray  # int32 (num_seqs,)
    query_start_loc: np.ndarray | None  # int32 (num_seqs + 1,); None: one decode token each
    logits_indices: np.ndarray  # int64 (num_rows,): the tokens whose logits the engine needs
    blocks_to_swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst)
    attention_backend: str = "ref"
    kv_connector_metadata: Any = None  # the KV connector's loads and saves of the step (stage 14); None: none
    group_of_layer: list[int] | None = None  # where the layers keep several KV cache groups: each layer's


class Worker:
    """One rank: its process group, its shard of the model, its shard of every KV block."""

    def __init__(self, config: WorkerConfig, rank: int) -> None:
        self.config, self.rank, self.world_size = config, rank, config.tensor_parallel_size
        self.device = self.rank_device(torch.device(config.device), rank)
        self.all_reduce_bytes = 0  # counted once asked for (count_all_reduce_bytes)
        self.counting = False
        self.kv_connector: WorkerKVConnector | None = None

    @staticmethod
    def rank_device(device: torch.device, rank: int) -> torch.device:
        """One GPU per rank: ``cuda`` means this machine's GPU ``LOCAL_RANK`` (torchrun's) or ``rank``; a
        CPU, or a GPU named with its index, stays as it is."""
        if device.type != "cuda" or device.index is not None:
            return device
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))

    def init_device(self) -> None:
        """Join the other ranks: gloo on CPUs, NCCL on CUDA devices; every collective times out."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL's collectives run on the current device
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                    init_method=self.config.init_method, rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(seconds=self.config.timeout_s))

    def load_model(self) -> None:
        """This rank's shard of the checkpoint (only its slices are read), and a cache of its KV heads."""
        c = self.config
        self.model, self.model_config = load_model_shard(c.model, c.dtype, self.device, self.rank, self.world_size)
        mc = self.model_config
        self.cache = c.kv_cache(mc.num_layers, c.num_gpu_blocks, c.block_size,
                                num_kv_heads_per_rank(mc, self.world_size), mc.head_dim,
                                resolve_dtype(c.dtype), self.device, c.num_cpu_blocks)
        if c.kv_connector is not None:
            self.kv_connector = c.kv_connector(self.cache, self.model, self.rank, self.world_size)

    def attention_backend(self, name: str) -> Callable[..., torch.Tensor]:
        """The backend a step names (``"ref"``, ``"triton"``), over this rank's cache; within the KV connector's
        attention, if there is one."""
        backend = backend_named(name) if self.config.attention is None else self.config.attention(name, self.cache)
        return backend if self.kv_connector is None else self.kv_connector.attention(backend)

    def execute_model(self, step: StepInputs) -> np.ndarray | None:
        """Run one step on this shard: the block moves on this rank's blocks in the runner's order (swap
        out, swap in, then copy-on-write copies), then the forward pass with the step's attention backend.
        Rank 0 returns the ``(num_rows, vocab)`` float32 logits (every rank has them); the others None."""
        # BEGIN SOLUTION this rank's block moves first, in the runner's order; then its shard's forward
        self.cache.swap_out(step.blocks_to_swap_out)
        self.cache.swap_in(step.blocks_to_swap_in)
        self.cache.copy_blocks(step.blocks_to_copy)
        device = self.device  # the driver checked the step's metadata on its host: copied here as it is
        meta = AttentionMetadata.from_host(step.slot_mapping, step.block_tables, step.seq_lens, step.query_start_loc,
                                           self.attention_backend(step.attention_backend), device)
        # several KV cache groups (stage 15): each group's slots and tables, each layer its group's
        layers_meta = meta if step.group_of_layer is None else meta.per_group(step.group_of_layer)
        with torch.inference_mode():
            input_ids, positions = torch.from_numpy(step.input_ids), torch.from_numpy(step.positions)
            hidden = self.model(input_ids.to(device), positions.to(device), self.cache, layers_meta)
            logits = self.model.compute_logits(hidden.index_select(0, torch.from_numpy(step.logits_indices).to(device)))
            logits = logits.float()
        return logits.cpu().numpy() if self.rank == 0 else None
        # END SOLUTION

    def execute_model_with_kv_connector(self, step: StepInputs) -> tuple[np.ndarray | None, set[int], Any]:
        """``execute_model`` between this rank's KV connector's loads and saves (those of
        ``step.kv_connector_metadata``): rank 0's logits, the ids of the blocks this rank failed to load, and
        its connector's counts so far (they come back with each step, as vLLM's ``KVConnectorOutput`` brings
        its ``kv_connector_stats``: the driver reads them without asking, after the workers are gone too)."""
        if self.kv_connector is None:
            raise RuntimeError("a step with KV connector metadata, and no KV connector in this worker")
        with self.kv_connector.load_and_save(step.kv_connector_metadata) as invalid_block_ids:
            logits = self.execute_model(step)
        return logits, invalid_block_ids, self.kv_connector.make_stats()

    def gather(self, layer: int, block_table: list[int], seq_len: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """This rank's K/V of one sequence, ``(seq_len, num_kv_heads / tp, head_dim)`` each, and which
        KV heads of the model they are."""
        key, value = self.cache.gather(layer, block_table, seq_len)
        heads = list(kv_heads_of_rank(self.model_config, self.rank, self.world_size))
        return key.cpu().numpy(), value.cpu().numpy(), heads

    def count_all_reduce_bytes(self) -> int:
        """From now on, count the bytes this rank all-reduces (the output of every row-parallel
        layer and of the embedding); return the count so far."""
        if not self.counting:
            self.counting = True

            def count(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
                self.all_reduce_bytes += output.numel() * output.element_size()

            for module in self.model.modules():
                if isinstance(module, RowParallelLinear | VocabParallelEmbedding) and not isinstance(
                        module, ParallelLMHead):
                    module.register_forward_hook(count)
        return self.all_reduce_bytes

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_worker(conn: Connection, config: WorkerConfig, rank: int) -> None:
    """A spawned worker's life: build, say ready, then run what the driver sends until it says
    ``shutdown`` or goes away. Every call is answered ``(call_id, ok, result)``; an error is
    answered with its traceback, and ends the worker (the ranks' collectives are out of step)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle, not the workers'
    torch.set_num_threads(1)
    parent = os.getppid()
    worker = Worker(config, rank)
    try:
        worker.init_device()
        worker.load_model()
        conn.send((-1, True, "ready"))
    except BaseException:
        conn.send((-1, False, traceback.format_exc()))
        return
    try:
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent:  # the driver is gone: so is the reason to live
                    return
                continue
            call_id, method, args = conn.recv()
            if method == "shutdown":
                return
            try:
                result = getattr(worker, method)(*args)
            except BaseException:
                conn.send((call_id, False, traceback.format_exc()))
                return
            conn.send((call_id, True, result))
    except (EOFError, OSError):  # the driver closed its end
        return
    finally:
        worker.close()
