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

Checked against one engine: a producer and a consumer over one folder generate, token for token,
what a single engine generates, and the consumer computes no token of a transferred block.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, fields

import torch

from minipaged.common.sequence import Sequence, SequenceStatus
from minipaged.common.stats import KVTransferStats
from minipaged.stage2_block_table import PagedKVCache
from minipaged.stage6_swapping import SwapBlockSpaceManager
from minipaged.stage7_engine import Request
from minipaged.stage9_prefix_caching import PrefixCachingBlockSpaceManager
from minipaged.stage10_model_runner import V1ModelRunner
from minipaged.stage10_sched_output import SchedulerOutput
from minipaged.stage10_v1_scheduler import KVCacheManager, V1Engine, V1Scheduler
from minipaged.stage14_kv_connector import KVConnectorBase_V1, KVConnectorMetadata


class ConnectorKVCacheManager(KVCacheManager):
    """V1's ``KVCacheManager`` whose admitted requests also count the tokens a KV connector supplies."""

    def __init__(self, manager: SwapBlockSpaceManager, connector: KVConnectorBase_V1) -> None:
        super().__init__(manager)
        self.connector = connector
        self.external: dict[Hashable, int] = {}  # tokens the connector supplied to each admitted sequence
        self.without_connector: set[Hashable] = set()  # sequences whose blocks failed to load once

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


@dataclass
class KVConnectorSchedulerOutput(SchedulerOutput):
    """V1's step, and the connector's metadata for the worker side."""

    kv_connector_metadata: KVConnectorMetadata | None = None


class KVConnectorScheduler(V1Scheduler):
    """V1's scheduler, with a KV connector's scheduler side (``kv_cache_manager.connector``)."""

    kv_cache_manager: ConnectorKVCacheManager

    def __init__(self, kv_cache_manager: ConnectorKVCacheManager, **budgets: int) -> None:
        super().__init__(kv_cache_manager, **budgets)
        self.num_recomputed_tokens = 0  # tokens the connector supplied whose blocks then failed to load

    def schedule(self) -> KVConnectorSchedulerOutput:
        out = super().schedule()
        meta = self.kv_cache_manager.connector.build_connector_meta(out)
        return KVConnectorSchedulerOutput(**{f.name: getattr(out, f.name) for f in fields(out)},
                                          kv_connector_metadata=meta)

    def finish(self, seq: Sequence) -> None:
        self.forget(seq)
        super().finish(seq)

    def abort(self, request_id: Hashable) -> bool:
        for request in (*self.waiting, *self.running):
            if request.request_id == request_id:
                self.forget(request.seqs[0])
        return super().abort(request_id)

    def forget(self, seq: Sequence) -> None:
        """A request ends: the connector's state of it and this manager's go (``request_finished``)."""
        manager = self.kv_cache_manager
        block_ids = manager.manager.get_block_table(seq.seq_id) if seq.status is SequenceStatus.RUNNING else []
        manager.connector.request_finished(seq, block_ids)
        manager.external.pop(seq.seq_id, None)
        manager.without_connector.discard(seq.seq_id)

    def recompute_after_load_error(self, request: Request) -> None:
        """Its blocks failed to load: out of ``running``, its blocks freed, ``num_computed_tokens`` 0, WAITING at
        the front of ``waiting``, and in ``without_connector`` (computed again without it); the tokens the
        connector had supplied (``external``) are added to ``num_recomputed_tokens``. The runner drops its
        row at the next step."""
        seq, manager = request.seqs[0], self.kv_cache_manager
        # BEGIN SOLUTION back to waiting from 0, never asking the connector again; count the tokens lost
        self.running.remove(request)
        manager.free(seq)
        seq.num_computed_tokens, seq.status = 0, SequenceStatus.WAITING
        self.waiting.insert(0, request)
        manager.without_connector.add(seq.seq_id)
        self.num_recomputed_tokens += manager.external.pop(seq.seq_id, 0)
        # END SOLUTION
        self.finished_req_ids.append(request.request_id)
        self.num_tokens_sent.pop(request.request_id, None)

    def make_kv_transfer_stats(self) -> KVTransferStats:
        """The connector's scheduler-side counts, and the tokens computed again after failed loads."""
        stats = self.kv_cache_manager.connector.make_stats()
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


class KVConnectorModelRunner(V1ModelRunner):
    """V1's runner, with a KV connector's worker side: loads before the forward, saves after it."""

    def __init__(self, model, cache: PagedKVCache, block_size: int, max_num_reqs: int, max_model_len: int,
                 backend: Callable[..., torch.Tensor], connector: KVConnectorBase_V1) -> None:
        connector.register_kv_caches(cache)
        super().__init__(model, cache, block_size, max_num_reqs, max_model_len,
                         KVConnectorAttention(backend, cache, connector))
        self.connector = connector
        self.failed_req_ids: list[Hashable] = []  # requests whose loads failed in the last step

    def execute_model(self, out: SchedulerOutput) -> tuple[list[Hashable], torch.Tensor]:
        """Stage 10's step between the connector's loads and saves: ``start_load_kv``, the step,
        ``wait_for_save``. The rows of a request whose blocks to load include one that failed
        (``get_block_ids_with_load_errors``) are dropped: its logits read K/V that are not there."""
        assert isinstance(out, KVConnectorSchedulerOutput) and out.kv_connector_metadata is not None
        connector, meta = self.connector, out.kv_connector_metadata
        connector.bind_connector_metadata(meta)
        try:
            # BEGIN SOLUTION load, run the step, save; then find the requests that read a block that failed
            connector.start_load_kv()
            req_ids, logits = super().execute_model(out)
            connector.wait_for_save()
            failed = connector.get_block_ids_with_load_errors()
            seq_ids = {r.req_id for r in meta.requests if not r.is_store and failed & set(r.block_ids)}
            # END SOLUTION
        finally:
            connector.clear_connector_metadata()
        self.failed_req_ids = [r.request_id for r in out.scheduled if r.seqs[0].seq_id in seq_ids]
        keep = [i for i, r in enumerate(req_ids) if r not in self.failed_req_ids]
        if len(keep) < len(req_ids):
            rows = torch.tensor(keep + list(range(len(req_ids), len(logits))), dtype=torch.int64, device=logits.device)
            req_ids, logits = [req_ids[i] for i in keep], logits.index_select(0, rows)
        return req_ids, logits


class KVConnectorEngine(V1Engine):
    """V1's engine; a request whose blocks failed to load is sent back to be recomputed."""

    scheduler: KVConnectorScheduler
    runner: KVConnectorModelRunner  # type: ignore[assignment]

    def execute_and_sample(self, out: SchedulerOutput) -> list[Request]:  # type: ignore[override]
        requests = super().execute_and_sample(out)
        for req_id in self.runner.failed_req_ids:
            self.scheduler.recompute_after_load_error(self.requests[req_id])
        return requests
