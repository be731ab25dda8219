"""Stage 14 — disaggregated prefill: one engine computes prompts, another decodes, K/V blocks travel between them.

A prefill is a burst of compute; a decode step is a small read of every running request's
K/V. In one engine, a burst of long prompts shares its steps with the running decodes, and
every decode waits for it (stage 10's chunks bound the wait, they do not remove it). DistServe
and Splitwise give the two phases different instances: a **producer** computes the prompt and
saves its blocks; a **consumer** loads them and decodes. vLLM joins them through a KV connector
(``stage14_kv_connector``); this stage gives V1's engine one, through its public parts:

1. **Scheduler.** When a waiting request is admitted, the local prefix cache (stage 9) finds
   its cached prefix; the connector (``get_num_new_matched_tokens``) supplies the full blocks
   after it that it holds; both count as computed, so the step computes only the rest — on a
   consumer, the prompt's last block. Each step's output carries the connector's metadata:
   which blocks to load, which to save.
2. **Runner.** Before the forward, the worker side loads the blocks into the paged cache; every
   layer's attention calls ``wait_for_layer_load`` and, once it has written its K/V,
   ``save_kv_layer``; after the forward, ``wait_for_save`` writes the files.
3. **A block that fails to load** (missing, short, corrupt) is never read as K/V. Its request's
   logits of that step are dropped, and the request goes back to the front of ``waiting`` to be
   recomputed without the connector (vLLM's ``kv_load_failure_policy="recompute"``); the tokens
   lost are counted. The output is the same, only later.

4. **Tensor parallelism** (stage 11). Every worker runs the worker side over its shard of the KV
   heads (``worker_kv_connector``), with its own files; the driver sends each step's metadata with
   the step, and a request's loads failed if they failed on any rank (``TensorParallelKVConnector``).

Checked against one engine: a producer and a consumer over one folder generate, token for token,
what a single engine generates, and the consumer computes no token of a transferred block.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterator
from contextlib import contextmanager

import torch

from minipaged.common.config import KVTransferConfig
from minipaged.common.sequence import Sequence
from minipaged.common.stats import KVTransferStats
from minipaged.stage2_block_table import PagedKVCache
from minipaged.stage6_swapping import SwapBlockSpaceManager
from minipaged.stage9_prefix_caching import PrefixCachingBlockSpaceManager
from minipaged.stage10_kv_cache_manager import KVCacheManager
from minipaged.stage10_sched_output import SchedulerOutput
from minipaged.stage11_tensor_parallel import StepExecutor
from minipaged.stage14_kv_connector import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    create_connector,
    model_identity,
)


class ConnectorKVCacheManager(KVCacheManager):
    """V1's ``KVCacheManager`` whose admitted requests also count the tokens a KV connector supplies; also the
    scheduler's ``connector`` (stage 10's seam): it builds each step's metadata, hears which requests end,
    and which ones read a block that failed to load."""

    def __init__(self, manager: SwapBlockSpaceManager, connector: KVConnectorBase_V1) -> None:
        super().__init__(manager)
        self.connector = connector
        self.external: dict[Hashable, int] = {}  # tokens the connector supplied to each admitted sequence
        self.without_connector: set[Hashable] = set()  # sequences whose blocks failed to load once
        self.num_recomputed_tokens = 0  # tokens the connector supplied whose blocks then failed to load

    def allocate_prompt(self, seq: Sequence) -> int | None:
        """The local prefix (stage 9), then the connector's blocks after it: the tokens found computed.

        The connector is asked (``get_num_new_matched_tokens(seq, local tokens)``) unless the sequence is in
        ``without_connector`` or ``skips_cache_reads``; it is then told the sequence's whole block table and
        its tokens (0 when not asked: ``update_state_after_alloc``), which ``external`` keeps."""
        local = super().allocate_prompt(seq)
        if local is None:
            return None
        # BEGIN SOLUTION ask the connector past the local prefix (unless told not to), tell it the blocks
        n = 0
        if seq.seq_id not in self.without_connector and not self.skips_cache_reads(seq):
            n, _ = self.connector.get_num_new_matched_tokens(seq, local)
        self.connector.update_state_after_alloc(seq, self.manager.get_block_table(seq.seq_id), n)
        self.external[seq.seq_id] = n
        return local + n
        # END SOLUTION

    def skips_cache_reads(self, seq: Sequence) -> bool:
        """A request that asks for ``prompt_logprobs`` reads no cached K/V (stage 9), and none from a connector."""
        manager = self.manager
        return isinstance(manager, PrefixCachingBlockSpaceManager) and seq.seq_id in manager.uncached_reads

    def cache_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """V1's, except for a request the connector supplied tokens to: its blocks are not findable before its
        loads are known not to have failed (stage 9 makes them findable at its first decode)."""
        if not self.external.get(seq.seq_id):
            super().cache_blocks(seq, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.connector.build_connector_meta(scheduler_output)

    def request_finished(self, request: Sequence, block_ids: list[int]) -> None:
        """A request ends: the connector's state of it and this manager's go (``request_finished``)."""
        self.connector.request_finished(request, block_ids)
        self.external.pop(request.seq_id, None)
        self.without_connector.discard(request.seq_id)

    def recompute_after_load_error(self, request: Sequence) -> None:
        """The scheduler sent the request back to be computed from its first token (its blocks failed to
        load): it is computed again without the connector (``without_connector``), and the tokens the
        connector had supplied (``external``) are added to ``num_recomputed_tokens``."""
        # BEGIN SOLUTION never ask the connector again for it; count the tokens lost
        self.without_connector.add(request.seq_id)
        self.num_recomputed_tokens += self.external.pop(request.seq_id, 0)
        # END SOLUTION

    def make_kv_transfer_stats(self) -> KVTransferStats:
        """The connector's scheduler-side counts, and the tokens computed again after failed loads."""
        stats = self.connector.make_stats()
        stats.num_recomputed_tokens += self.num_recomputed_tokens
        return stats


class KVConnectorAttention:
    """The attention every layer calls, wrapped as vLLM's ``unified_attention`` is: wait for the layer's
    loads, attend (the layer has written its new K/V), then hand the layer to the connector to save."""

    def __init__(self, backend: Callable[..., torch.Tensor], cache: PagedKVCache,
                 connector: KVConnectorBase_V1) -> None:
        self.backend, self.connector = backend, connector
        self.layer_of = {id(t): layer for layer, t in enumerate(cache.key_cache)}

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 *args, **kwargs) -> torch.Tensor:
        layer = self.layer_of[id(key_cache)]
        self.connector.wait_for_layer_load(layer)
        out = self.backend(query, key_cache, value_cache, *args, **kwargs)
        self.connector.save_kv_layer(layer, (key_cache, value_cache), None)
        return out


class KVConnectorWorker:
    """A KV connector's worker side as V1's runner holds it (vLLM's ``KVConnectorModelRunnerMixin``):
    around each forward pass, loads before it and saves after it."""

    def __init__(self, connector: KVConnectorBase_V1, cache: PagedKVCache) -> None:
        connector.register_kv_caches(cache)
        self.connector, self.cache = connector, cache

    def make_stats(self) -> KVTransferStats:
        return self.connector.make_stats()

    @contextmanager
    def kv_connector_output(self, out: SchedulerOutput) -> Iterator[set[Hashable]]:
        """Bind the step's metadata, ``start_load_kv``, run the forward pass (the ``with`` block),
        ``wait_for_save``; the set it gives holds, once the block ends, the ids of the requests whose
        blocks to load include one that failed (``get_block_ids_with_load_errors``)."""
        connector, meta = self.connector, out.kv_connector_metadata
        assert isinstance(meta, KVConnectorMetadata)
        failed_req_ids: set[Hashable] = set()
        connector.bind_connector_metadata(meta)
        try:
            # BEGIN SOLUTION load, run the step, save; then find the requests that read a block that failed
            connector.start_load_kv()
            yield failed_req_ids
            connector.wait_for_save()
            failed = connector.get_block_ids_with_load_errors()
            seq_ids = {r.req_id for r in meta.requests if not r.is_store and failed & set(r.block_ids)}
            # END SOLUTION
        finally:
            connector.clear_connector_metadata()
        failed_req_ids.update(r.request_id for r in out.scheduled if r.seqs[0].seq_id in seq_ids)

    # ---- in a tensor-parallel worker (stage 11's ``WorkerKVConnector``) ----

    def attention(self, backend: Callable[..., torch.Tensor]) -> KVConnectorAttention:
        return KVConnectorAttention(backend, self.cache, self.connector)

    @contextmanager
    def load_and_save(self, meta: KVConnectorMetadata) -> Iterator[set[int]]:
        """``kv_connector_output`` of one worker: the set it gives holds, once the block ends, the ids of the
        blocks this rank failed to load (the driver maps them to requests)."""
        connector, invalid_block_ids = self.connector, set[int]()
        connector.bind_connector_metadata(meta)
        try:
            connector.start_load_kv()
            yield invalid_block_ids
            connector.wait_for_save()
            invalid_block_ids.update(connector.get_block_ids_with_load_errors())
        finally:
            connector.clear_connector_metadata()


def worker_kv_connector(config: KVTransferConfig, block_size: int, cache: PagedKVCache, model: torch.nn.Module,
                        rank: int, world_size: int) -> KVConnectorWorker:
    """The worker side a tensor-parallel worker builds (stage 11's ``WorkerConfig.kv_connector``, given its
    first two arguments): over this rank's cache, with the identity of this rank's shard of the weights."""
    connector = create_connector(config, KVConnectorRole.WORKER, block_size, model_identity(model), rank, world_size)
    return KVConnectorWorker(connector, cache)


def requests_with_load_errors(out: SchedulerOutput, meta: KVConnectorMetadata,
                              invalid_block_ids: Collection[int]) -> set[Hashable]:
    """The ids of the step's requests whose blocks to load include one of ``invalid_block_ids``."""
    seq_ids = {r.req_id for r in meta.requests if not r.is_store and set(invalid_block_ids) & set(r.block_ids)}
    return {r.request_id for r in out.scheduled if r.seqs[0].seq_id in seq_ids}


class TensorParallelKVConnector:
    """The runner's KV connector when tensor-parallel workers hold the cache (stage 11): each worker runs its own
    worker side over its shard (``worker_kv_connector``). ``kv_connector_output`` hands the step's metadata to the
    executor, which sends it with the step to every worker; after the forward, a request's loads failed if a
    block of them failed on any rank (the union the executor kept)."""

    def __init__(self, executor: StepExecutor) -> None:
        self.executor = executor

    @contextmanager
    def kv_connector_output(self, out: SchedulerOutput) -> Iterator[set[Hashable]]:
        meta, executor = out.kv_connector_metadata, self.executor
        assert isinstance(meta, KVConnectorMetadata)
        failed_req_ids: set[Hashable] = set()
        executor.kv_connector_metadata, executor.invalid_block_ids = meta, frozenset()
        try:
            yield failed_req_ids
        finally:
            executor.kv_connector_metadata = None
        failed_req_ids.update(requests_with_load_errors(out, meta, executor.invalid_block_ids))

    def make_stats(self) -> KVTransferStats:
        """The workers' counts, as they came back with their last step (no call to the workers): of blocks, rank
        0's (every rank loads and saves its shard of the same blocks); of bytes, every rank's added up."""
        ranks = self.executor.kv_connector_stats
        if not ranks:
            return KVTransferStats()
        stats = KVTransferStats(**vars(ranks[0]))
        stats.num_loaded_bytes = sum(r.num_loaded_bytes for r in ranks)
        stats.num_saved_bytes = sum(r.num_saved_bytes for r in ranks)
        return stats
