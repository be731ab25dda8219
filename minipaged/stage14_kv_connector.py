"""Stage 14 — the KV connector: vLLM's interface for K/V blocks that leave one engine and enter another.

A prefill instance (the **producer**) computes a prompt's K/V; a decode instance (the
**consumer**) loads them instead of computing them again. vLLM joins the two through one
interface, ``KVConnectorBase_V1``, split as the engine is split:

* **Scheduler side** (in the scheduler's process, no tensors): ``get_num_new_matched_tokens``
  says how many of a request's tokens the connector can supply after those found in the local
  prefix cache; the scheduler counts them computed, as it counts a prefix-cache hit.
  ``update_state_after_alloc`` hears which blocks the request was given, ``build_connector_meta``
  tells the worker each step which blocks to load and which to save, ``request_finished`` forgets
  a request.
* **Worker side** (beside the paged cache): ``start_load_kv`` copies the step's blocks into the
  cache before the forward; each layer calls ``wait_for_layer_load`` before its attention and
  ``save_kv_layer`` after it; ``wait_for_save`` finishes the saves after the forward;
  ``get_block_ids_with_load_errors`` names the blocks that could not be loaded.

``SharedStorageConnector`` (vLLM's name) keeps blocks as files under one folder
(``shared_storage_path``), one file per block, named by stage 9's block hash: the hash names
the whole prefix up to the block's end, so a consumer finds exactly the prefix it needs and
two prompts that share only a later block never mix. A file is a safetensors file of the block's
K and V in every layer, ``(num_layers, 2, block_size, num_kv_heads, head_dim)``, with the SHA-256
of its bytes: a missing, short or corrupt file is a load error, never K/V.

Under tensor parallelism (stage 11) the worker side runs in every worker, over its shard of the
KV heads, as vLLM's does: rank ``r`` of ``k`` keeps its files in its own folder,
``shared_storage_path/tp{k}_rank{r}`` (``shard_folder``), with the identity of its own shard's
weights, so only rank ``r`` of an engine of ``k`` ranks over the same weights reads them; the
scheduler side counts a block only where every rank's file exists. A block one rank fails to load
fails on every rank (they compute one forward together).

Which full blocks travel: those before the block of the prompt's last token (the consumer
computes that token itself, for its logits), so a consumer computes only the prompt's last
block. A producer saves a block in the step that computes its last token, after the forward.
"""

from __future__ import annotations

import abc
import enum
import hashlib
import json
import math
import os
import stat
import uuid
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import safetensors
import safetensors.torch
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from minipaged.common.config import KVTransferConfig
from minipaged.common.device import to_device
from minipaged.common.stats import KVTransferStats
from minipaged.stage2_block_table import PagedKVCache
from minipaged.stage9_prefix_caching import ROOT, block_hash

if TYPE_CHECKING:  # the requests' sequences and a step's output, named in annotations only
    from minipaged.common.sequence import Sequence as Seq
    from minipaged.stage10_sched_output import SchedulerOutput


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass
class ReqMeta:
    """One request's blocks to move this step: loaded into ``block_ids``, or (``is_store``) saved from them."""

    req_id: Hashable  # the request's sequence id
    block_ids: list[int]
    block_hashes: list[bytes]
    is_store: bool


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the worker side each step (vLLM: ``SchedulerOutput.kv_connector_metadata``)."""

    requests: list[ReqMeta] = field(default_factory=list)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Stage 9's chained hashes of the full blocks a consumer may load: those before the block of the
    prompt's last token (so ``(len(token_ids) - 1) // block_size`` of them)."""
    hashes, digest = [], ROOT
    # BEGIN SOLUTION chain stage 9's hash over the full blocks before the last token's block
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        digest = block_hash(digest, token_ids[start:start + block_size])
        hashes.append(digest)
    # END SOLUTION
    return hashes


class KVConnectorBase_V1(abc.ABC):  # noqa: N801 (vLLM's name)
    """vLLM's connector interface: one class, made twice, once for each role (scheduler, worker)."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int, model: str = "",
                 rank: int = 0, world_size: int = 1) -> None:
        self.config, self.role, self.block_size, self.model = config, role, block_size, model
        self.rank, self.world_size = rank, world_size  # the tensor-parallel rank whose shard the worker side moves
        self.metadata: KVConnectorMetadata | None = None
        self._stats = KVTransferStats()

    def make_stats(self) -> KVTransferStats:
        return KVTransferStats(**vars(self._stats))

    # ---- scheduler side ----
    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Seq, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after ``num_computed_tokens`` the connector can supply, and whether they load asynchronously."""

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Seq, block_ids: list[int], num_external_tokens: int) -> None:
        """The request was admitted with these blocks; ``num_external_tokens`` of it come from the connector."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads and saves, for the worker side."""

    def request_finished(self, request: Seq, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request is done; (whether its blocks must wait for an asynchronous save, what a peer needs)."""
        return False, None

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: PagedKVCache) -> None:
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self.metadata = metadata

    def clear_connector_metadata(self) -> None:
        self.metadata = None

    @abc.abstractmethod
    def start_load_kv(self) -> None:
        """Start loading the step's blocks into the paged cache, before the forward."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until ``layer``'s K/V are loaded (a connector that loads in ``start_load_kv`` returns at once)."""
        return None

    @abc.abstractmethod
    def save_kv_layer(self, layer: int, kv_layer: tuple[torch.Tensor, torch.Tensor], attn_metadata: Any) -> None:
        """Start saving ``layer``'s blocks of this step, once the layer has written them."""

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """Block until the step's saves are done, after the forward."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()


def block_path(folder: str | os.PathLike, digest: bytes) -> Path:
    return Path(folder) / f"{digest.hex()}.safetensors"


def shard_folder(folder: str | os.PathLike, rank: int, world_size: int) -> Path:
    """Where rank ``rank`` of ``world_size`` tensor-parallel ranks keeps its blocks: ``folder`` itself for one
    rank, else its own subfolder (``tp2_rank1``), which no rank of another rank or world size reads."""
    return Path(folder) if world_size == 1 else Path(folder) / f"tp{world_size}_rank{rank}"


def checksum(kv: torch.Tensor) -> str:
    return hashlib.sha256(kv.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def model_identity(model: Any) -> str:
    """A name for the weights whose K/V a file holds: SHA-256 over every parameter's name, shape, dtype and
    first and last values (another model of the same shape has other weights, so another name)."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            ends = torch.cat([flat[:16], flat[-16:]]).to("cpu", torch.float64)
            digest.update(f"{name}{tuple(param.shape)}{param.dtype}".encode() + ends.numpy().tobytes())
    return digest.hexdigest()


def write_block(path: Path, kv: torch.Tensor, block_hash: bytes = b"", model: str = "") -> None:
    """Save one block's K/V (on the host) with its checksum, the block's hash and the model's identity: to a
    fresh name, then renamed, so a reader never sees half a file from this writer."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    metadata = {"sha256": checksum(kv), "block_hash": block_hash.hex(), "model": model}
    save_file({"kv": kv.contiguous()}, str(temporary), metadata=metadata)
    os.replace(temporary, path)


def read_file_bytes(path: Path, limit: int) -> bytes | None:
    """The bytes of a regular file of at most ``limit`` bytes, read once into memory; None for anything
    else (missing, a FIFO, a device, a folder, a link, a larger file). The file is opened without
    blocking and without following a link, and never mapped: a writer changing it later changes
    nothing read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks) if size <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)


def read_block(path: Path, shape: tuple[int, ...], dtype: torch.dtype, block_hash: bytes = b"",
               model: str = "") -> torch.Tensor | None:
    """One block's K/V as ``write_block`` saved them; None if the file is not a regular file, is short,
    corrupt, of another shape or dtype, or names another block or another model."""
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    data = read_file_bytes(path, expected + 64 * 1024)  # the tensor's bytes and a header
    if data is None or len(data) < 8:
        return None
    try:
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8:8 + header_len]).get("__metadata__") or {}
        kv = safetensors.torch.load(data)["kv"]
    except (ValueError, KeyError, TypeError, AttributeError, safetensors.SafetensorError):
        return None
    if (tuple(kv.shape) != shape or kv.dtype != dtype or checksum(kv) != metadata.get("sha256")
            or metadata.get("block_hash") != block_hash.hex() or metadata.get("model") != model):
        return None
    return kv


class SharedStorageConnector(KVConnectorBase_V1):
    """Blocks as files under ``shared_storage_path``, named by their prefix's hash."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int, model: str = "",
                 rank: int = 0, world_size: int = 1) -> None:
        super().__init__(config, role, block_size, model, rank, world_size)
        self.path = shard_folder(config.shared_storage_path, rank, world_size)  # this rank's files
        self.rank_paths = [shard_folder(config.shared_storage_path, r, world_size) for r in range(world_size)]
        # scheduler side: per request (its sequence's id)
        self.hashes: dict[Hashable, list[bytes]] = {}  # the prompt's loadable blocks' hashes
        self.matched: dict[Hashable, tuple[int, int]] = {}  # (first block, blocks) the connector supplies
        self.block_ids: dict[Hashable, list[int]] = {}  # the blocks it was given
        self.num_saved: dict[Hashable, int] = {}  # its first blocks saved so far (producer)
        self.to_load: list[ReqMeta] = []
        # worker side
        self.failed: set[int] = set()
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # each layer's (keys, values) to write, in order
        self.store_ids: torch.Tensor | None = None
        self.store_hashes: list[bytes] = []

    def prompt_hashes(self, request: Seq) -> list[bytes]:
        if request.seq_id not in self.hashes:
            self.hashes[request.seq_id] = prompt_block_hashes(request.prompt_token_ids, self.block_size)
        return self.hashes[request.seq_id]

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Seq, num_computed_tokens: int) -> tuple[int, bool]:
        """The prompt's loadable blocks after the locally computed ones whose files exist, in order, up to the
        first missing one: that many blocks' tokens (never async). A producer's connector finds none."""
        if not self.config.is_kv_consumer:
            return 0, False
        hashes, first = self.prompt_hashes(request), num_computed_tokens // self.block_size
        # BEGIN SOLUTION count the files that exist from the first uncomputed block on, stopping at a gap
        n = 0
        while first + n < len(hashes) and block_path(self.path, hashes[first + n]).exists():
            n += 1
        # END SOLUTION
        n = self.num_on_every_rank(hashes[first:first + n])
        self.matched[request.seq_id] = (first, n)
        return n * self.block_size, False

    def num_on_every_rank(self, hashes: list[bytes]) -> int:
        """How many of ``hashes``, from the first, have their file in every rank's folder (the scheduler side's
        own folder, rank 0's, was looked in already): a block is there only if every shard of it is."""
        n = 0
        while n < len(hashes) and all(block_path(path, hashes[n]).exists() for path in self.rank_paths[1:]):
            n += 1
        return n

    def update_state_after_alloc(self, request: Seq, block_ids: list[int], num_external_tokens: int) -> None:
        self.block_ids[request.seq_id] = list(block_ids)
        first, n = self.matched.pop(request.seq_id, (0, 0))
        self.num_saved.pop(request.seq_id, None)  # admitted afresh: its blocks are saved as it computes them
        if num_external_tokens:
            hashes = self.prompt_hashes(request)
            self.to_load.append(ReqMeta(request.seq_id, block_ids[first:first + n], hashes[first:first + n], False))
            self._stats.num_external_tokens += num_external_tokens
            self.num_saved[request.seq_id] = first + n  # what it loads is in the store already

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The loads found at admission; for a producer, each scheduled request's loadable blocks whose last
        token this step computes (the scheduler has already counted the step's tokens): blocks from the
        ``num_saved`` so far up to ``num_computed_tokens // block_size`` (at most the loadable ones), with
        their ids and hashes, as one ``ReqMeta(is_store=True)``."""
        meta, self.to_load = KVConnectorMetadata(self.to_load), []
        if not self.config.is_kv_producer:
            return meta
        for request in scheduler_output.scheduled:
            seq = request.seqs[0]
            hashes = self.prompt_hashes(seq)
            # BEGIN SOLUTION the loadable blocks complete after this step, not saved before
            done = min(seq.num_computed_tokens // self.block_size, len(hashes))
            first = self.num_saved.get(seq.seq_id, 0)
            if done > first:
                ids = self.block_ids[seq.seq_id][first:done]
                meta.requests.append(ReqMeta(seq.seq_id, ids, hashes[first:done], True))
                self.num_saved[seq.seq_id] = done
            # END SOLUTION
        return meta

    def request_finished(self, request: Seq, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        for state in (self.hashes, self.matched, self.block_ids, self.num_saved):
            state.pop(request.seq_id, None)
        return False, None

    # ---- worker side ----
    def block_shape(self) -> tuple[int, ...]:
        cache = self.kv_caches
        return (cache.num_layers, 2, *cache.key_cache[0].shape[1:])

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Also the step's blocks to save, as one index on the cache's device (built before the forward)."""
        super().bind_connector_metadata(metadata)
        self.bind_stores([r for r in metadata.requests if r.is_store])
        self.failed, self.pending = set(), []  # nothing of a step that an exception cut short

    def bind_stores(self, stores: list[ReqMeta]) -> None:
        ids = [b for r in stores for b in r.block_ids]
        self.store_hashes = [h for r in stores for h in r.block_hashes]
        self.store_ids = to_device(np.array(ids, np.int64), self.kv_caches.key_cache[0].device) if ids else None

    def drop_stores_of_failed_loads(self) -> None:
        """A request a block of which failed to load computes this step on K/V that are not there: nothing of
        it is saved this step (it is recomputed, and saved then)."""
        assert self.metadata is not None
        requests = self.metadata.requests
        failed = {r.req_id for r in requests if not r.is_store and self.failed & set(r.block_ids)}
        self.bind_stores([r for r in requests if r.is_store and r.req_id not in failed])

    def start_load_kv(self) -> None:
        """Read each block to load (the metadata's requests that are not ``is_store``), check it, copy it into
        its block of every layer; a block that cannot be read is named in ``get_block_ids_with_load_errors``
        and nothing of it is copied. ``read_block`` checks a file against the cache's stored dtype: its
        tensors' (``cache.key_cache[0].dtype``), which over stage 13's FP8 cache is ``float8_e4m3fn``, not
        the model's dtype (``cache.dtype``). The good blocks go in with one indexed assignment per layer and
        cache (``cache.key_cache[layer][index] = ...``): CPU torch has no ``index_copy_`` for e4m3. Leave
        the ids of the blocks loaded in ``ids`` and their tensors in ``blocks`` (the counts after use them)."""
        assert self.metadata is not None
        cache, shape = self.kv_caches, self.block_shape()
        ids, blocks = [], []
        # BEGIN SOLUTION read and check each file; copy the good blocks into their block ids, layer by layer
        for meta in self.metadata.requests:
            if meta.is_store:
                continue
            for block_id, digest in zip(meta.block_ids, meta.block_hashes, strict=True):
                kv = read_block(block_path(self.path, digest), shape, cache.key_cache[0].dtype, digest, self.model)
                if kv is None:
                    self.failed.add(block_id)
                else:
                    ids.append(block_id)
                    blocks.append(kv)
        if ids:
            device = cache.key_cache[0].device
            index, kv = to_device(np.array(ids, np.int64), device), torch.stack(blocks).to(device)
            for layer in range(cache.num_layers):  # kv: (blocks, layers, 2, block_size, kv heads, head dim)
                cache.key_cache[layer][index] = kv[:, layer, 0]
                cache.value_cache[layer][index] = kv[:, layer, 1]
        # END SOLUTION
        self.failed |= self.failed_on_other_ranks()
        loaded = [kv for block_id, kv in zip(ids, blocks, strict=True) if block_id not in self.failed]
        self._stats.num_loaded_blocks += len(loaded)
        self._stats.num_loaded_bytes += sum(kv.numel() * kv.element_size() for kv in loaded)
        self._stats.num_failed_blocks += len(self.failed)
        if self.failed:
            self.drop_stores_of_failed_loads()

    def failed_on_other_ranks(self) -> set[int]:
        """Under tensor parallelism, the blocks the other ranks failed to load this step (each rank asks when the
        step loads anything, so all of them or none): the ranks compute one forward, so a block missing from one
        shard is missing from all, and no rank saves a block of its request this step."""
        assert self.metadata is not None
        if self.world_size == 1 or all(r.is_store for r in self.metadata.requests):
            return set()
        everyone: list[set[int] | None] = [None] * self.world_size
        dist.all_gather_object(everyone, self.failed)
        return set().union(*(failed or set() for failed in everyone))

    def save_kv_layer(self, layer: int, kv_layer: tuple[torch.Tensor, torch.Tensor], attn_metadata: Any) -> None:
        """Gather this layer's blocks to save, on the device: no wait for the host inside the forward."""
        if self.store_ids is not None:
            keys, values = kv_layer
            self.pending.append((keys.index_select(0, self.store_ids), values.index_select(0, self.store_ids)))

    def wait_for_save(self) -> None:
        """Bring the gathered blocks to the host, as ``(blocks, layers, 2, block_size, kv heads, head dim)``,
        and write each block's file (``write_block`` at ``block_path`` of its hash). A file already there is
        replaced whole (the same hash, the same K/V): a damaged file is repaired by the next save of its block."""
        if self.store_ids is None:
            return
        if not self.pending:  # no layer handed its blocks over (a decode step replayed from a CUDA graph)
            cache = self.kv_caches
            for layer in range(cache.num_layers):
                self.save_kv_layer(layer, (cache.key_cache[layer], cache.value_cache[layer]), None)
        # BEGIN SOLUTION one (blocks, layers, 2, ...) tensor on the host; a file per block
        kv = torch.stack([torch.stack(kv_layer, 1) for kv_layer in self.pending], 1).cpu()
        for i, digest in enumerate(self.store_hashes):
            write_block(block_path(self.path, digest), kv[i], digest, self.model)
        # END SOLUTION
        self._stats.num_saved_blocks += len(self.store_hashes)
        self._stats.num_saved_bytes += kv.numel() * kv.element_size()
        self.pending = []

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.failed)


KV_CONNECTORS: dict[str, type[KVConnectorBase_V1]] = {"SharedStorageConnector": SharedStorageConnector}


def create_connector(config: KVTransferConfig, role: KVConnectorRole, block_size: int,
                     model: str = "", rank: int = 0, world_size: int = 1) -> KVConnectorBase_V1:
    """vLLM's ``KVConnectorFactory.create_connector``: the connector ``config.kv_connector`` names; ``model``
    names the weights whose K/V its worker side reads and writes (``model_identity``); ``rank`` and
    ``world_size``: the tensor-parallel rank whose shard of the KV heads it moves, of how many."""
    return KV_CONNECTORS[config.kv_connector](config, role, block_size, model, rank, world_size)
