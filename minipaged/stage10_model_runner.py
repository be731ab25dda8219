"""Stage 10 — the runner's persistent batch: V1's inputs, kept from step to step.

The runner keeps a **persistent batch** (``InputBatch``): one row per request — token ids,
``num_computed_tokens``, block table — kept across steps; each step applies only what
changed (new requests, the last sampled token, new blocks, rows of finished or preempted
requests), then gathers the flat inputs with numpy indexing instead of rebuilding them
from every block table. The changes come from the scheduler (``stage10_v1_scheduler``),
in a ``SchedulerOutput`` of ``NewRequestData`` and ``CachedRequestData`` (``stage10_sched_output``),
as vLLM V1's scheduler sends them to its model runner.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np
import torch

from minipaged.common.device import to_device
from minipaged.common.prompt_logprobs import prompt_logprob_positions
from minipaged.models import CausalLM, GroupedAttentionMetadata
from minipaged.stage2_block_table import PagedKVCache
from minipaged.stage7_model_runner import build_attention_metadata
from minipaged.stage10_sched_output import NewRequestData, SchedulerOutput


class InputBatch:
    """The persistent batch: one row per request in the runner, kept from step to step.

    Its arrays are numpy's, as vLLM's CPU-side ``InputBatch`` is: writing a few numbers into a
    row costs well under a microsecond, where a torch op per row would cost several.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 num_kv_cache_groups: int = 1) -> None:
        self.req_ids: list[Hashable] = []  # row -> request
        self.row_of: dict[Hashable, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # tokens known per row
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # each row's table in each KV cache group (vLLM's MultiGroupBlockTable): row, group, block
        self.block_table = np.zeros((max_num_reqs, num_kv_cache_groups, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros((max_num_reqs, num_kv_cache_groups), dtype=np.int64)
        # this step's guessed tokens by request (``SchedulerOutput.scheduled_spec_decode_tokens``): a batch
        # that checks them writes them after the row's tokens (stage 12's); this one writes none
        self.spec_token_ids: dict[Hashable, list[int]] = {}

    def add_request(self, new: NewRequestData) -> None:
        self.remove_request(new.req_id)  # resumed after a preemption: a fresh row
        row = self.row_of[new.req_id] = len(self.req_ids)
        self.req_ids.append(new.req_id)
        self.token_ids[row, :len(new.token_ids)] = new.token_ids
        for group, block_ids in enumerate(new.block_ids):
            self.block_table[row, group, :len(block_ids)] = block_ids
            self.num_blocks[row, group] = len(block_ids)
        self.num_tokens[row] = len(new.token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens

    def update_request(self, req_id: Hashable, new_token_ids: list[int],
                       new_block_ids: tuple[list[int], ...]) -> None:
        """Append what changed (a request's entry of ``CachedRequestData``): the new tokens after the row's
        known tokens (``num_tokens``, whatever its ``num_computed_tokens``, which only the runner moves), each
        group's new blocks after its blocks in that group."""
        row = self.row_of[req_id]
        # BEGIN SOLUTION write the new tokens and block ids after the row's last ones
        t = self.num_tokens[row]
        self.token_ids[row, t:t + len(new_token_ids)] = new_token_ids
        self.num_tokens[row] = t + len(new_token_ids)
        for group, block_ids in enumerate(new_block_ids):  # most steps bring none: () and no numpy call
            b = self.num_blocks[row, group]
            self.block_table[row, group, b:b + len(block_ids)] = block_ids
            self.num_blocks[row, group] = b + len(block_ids)
        # END SOLUTION

    def remove_request(self, req_id: Hashable) -> None:
        """Drop a row; the last row moves into the hole, so the rows stay dense."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        last = len(self.req_ids) - 1
        if row != last:
            for array in (self.token_ids, self.num_tokens, self.num_computed_tokens, self.block_table, self.num_blocks):
                array[row] = array[last]
            self.req_ids[row] = self.req_ids[last]
            self.row_of[self.req_ids[row]] = row
        self.req_ids.pop()


class SpecTokenRows(Protocol):
    """A part that checks guessed tokens (stage 12 gives one): the rows of logits it needs."""

    def logits_indices(self, scheduler_output: SchedulerOutput, ends: np.ndarray) -> np.ndarray: ...


class ConnectorWorkerPart(Protocol):
    """A KV connector's worker side, as the runner calls it (stage 14 gives one): around the forward,
    ``kv_connector_output`` loads what this step reads and saves what it writes, then names the
    requests that read a block it failed to load."""

    def kv_connector_output(self, scheduler_output: SchedulerOutput) -> AbstractContextManager[set[Hashable]]: ...


class V1ModelRunner:
    """Applies a step's differences to the persistent batch, gathers the flat inputs, runs the model.

    Optional parts, each None unless configured: an ``input_batch`` of another kind, a spec decoder
    (the rows that check guessed tokens, after the others) and a KV connector's worker side
    (around the forward pass; the rows of a request whose loads failed are dropped, its id kept in
    ``failed_req_ids`` for the engine)."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, block_size: int, max_num_reqs: int, max_model_len: int,
                 backend: Callable[..., torch.Tensor], *, input_batch: InputBatch | None = None,
                 spec_decoder: SpecTokenRows | None = None, kv_connector: ConnectorWorkerPart | None = None,
                 group_of_layer: list[int] | None = None) -> None:
        self.model, self.cache, self.block_size, self.backend = model, cache, block_size, backend
        self.device = cache.key_cache[0].device
        # each layer's KV cache group, each group with a table of its own (stage 15); None: one, every layer
        self.group_of_layer = group_of_layer
        self.num_kv_cache_groups = 1 if group_of_layer is None else max(group_of_layer) + 1
        self.input_batch = input_batch or InputBatch(max_num_reqs, max_model_len, -(-max_model_len // block_size),
                                                     self.num_kv_cache_groups)
        self.spec_decoder, self.kv_connector = spec_decoder, kv_connector
        self.failed_req_ids: list[Hashable] = []  # requests whose loads failed in the last step
        self.prev_sampled_token_ids: torch.Tensor | None = None  # the last step's tokens, on the device
        self.prev_req_ids: list[Hashable] = []  # whose, in order

    def set_prev_sampled(self, req_ids: list[Hashable], token_ids: torch.Tensor) -> None:
        """The tokens a step sampled, ``(len(req_ids),)`` on the device, in order: the next step's
        placeholders take theirs there (vLLM's ``prev_sampled_token_ids``)."""
        self.prev_sampled_token_ids, self.prev_req_ids = token_ids, req_ids

    def prepare_input_ids(self, token_ids: np.ndarray, owner: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """The step's input ids on the device: ``token_ids`` ``(num_tokens,)`` read from the batch (``owner``:
        each token's row), except at a position past its row's known tokens: a placeholder (async
        scheduling), whose token the request sampled in the step before, read there on the device."""
        input_ids = to_device(token_ids, self.device)
        batch = self.input_batch
        holes = np.flatnonzero(positions >= batch.num_tokens[owner])
        if len(holes):
            assert self.prev_sampled_token_ids is not None, "a placeholder with no step before it"
            index = {r: i for i, r in enumerate(self.prev_req_ids)}  # only a step with placeholders needs it
            prev = [index[batch.req_ids[owner[i]]] for i in holes]
            sampled = self.prev_sampled_token_ids.index_select(0, to_device(prev, self.device, torch.int64))
            input_ids.index_copy_(0, to_device(holes, self.device, torch.int64), sampled)
        return input_ids

    def execute_model(self, out: SchedulerOutput) -> tuple[list[Hashable], torch.Tensor]:
        """``forward`` between a KV connector's loads and saves, if one is configured; the rows of a
        request whose blocks to load include one that failed are dropped: its logits read K/V that
        are not there."""
        if self.kv_connector is None:
            self.failed_req_ids = []
            return self.forward(out)
        with self.kv_connector.kv_connector_output(out) as failed:
            req_ids, logits = self.forward(out)
        self.failed_req_ids = [r for r in out.num_scheduled_tokens if r in failed]
        keep = [i for i, r in enumerate(req_ids) if r not in failed]
        if len(keep) < len(req_ids):
            rows = to_device(keep + list(range(len(req_ids), len(logits))), logits.device, torch.int64)
            req_ids, logits = [req_ids[i] for i in keep], logits.index_select(0, rows)
        return req_ids, logits

    def forward(self, out: SchedulerOutput) -> tuple[list[Hashable], torch.Tensor]:
        """One forward pass: the ids of the requests that sample, and their ``(n, vocab)`` float32 logits.

        A request samples when its tokens are all computed after this step (a placeholder, past the
        row's known tokens, counts: async scheduling); a request whose prompt is not finished yet
        produces no logits. After those rows come the prompt positions of the requests that ask for
        ``prompt_logprobs``, then the rows a spec decoder asks for (``extra_logits_indices``).

        The step's attention metadata is built once, on the host, with stage 7's
        ``build_attention_metadata`` (its longest query and sequence come from the host arrays, so no
        layer reads them back from the device); the input ids go through ``prepare_input_ids`` (a
        placeholder's token is taken on the device); each row's ``num_computed_tokens`` becomes its
        context after the step.
        """
        batch, size, num_reqs = self.input_batch, self.block_size, len(out.num_scheduled_tokens)
        for req_id in out.finished_req_ids + out.preempted_req_ids:
            batch.remove_request(req_id)
        for new in out.scheduled_new_reqs:
            batch.add_request(new)
        batch.spec_token_ids = out.scheduled_spec_decode_tokens
        cached = out.scheduled_cached_reqs
        for req_id, new_token_ids, new_block_ids in zip(cached.req_ids, cached.new_token_ids, cached.new_block_ids,
                                                        strict=True):
            batch.update_request(req_id, new_token_ids, new_block_ids)
        rows = np.fromiter((batch.row_of[r] for r in out.num_scheduled_tokens), np.int64, num_reqs)  # (num_reqs,)
        counts = np.fromiter(out.num_scheduled_tokens.values(), np.int64, num_reqs)  # (num_reqs,) tokens each
        # BEGIN SOLUTION flat positions from num_computed_tokens; ids, slots and tables by indexing the batch
        ends = counts.cumsum()
        owner = np.repeat(rows, counts)  # (num_tokens,) the row of each token
        positions = np.repeat(batch.num_computed_tokens[rows] - (ends - counts), counts) + np.arange(ends[-1])
        token_ids = batch.token_ids[owner, positions]  # (num_tokens,)
        seq_lens = batch.num_computed_tokens[rows] + counts  # (num_reqs,) context after this step
        query_start_loc = None if counts.max() == 1 else np.concatenate([[0], ends]).astype(np.int32)
        metas = []
        for g in range(self.num_kv_cache_groups):  # each group's slots and tables (one group: every layer's)
            slot_mapping = batch.block_table[owner, g, positions // size].astype(np.int64) * size + positions % size
            tables = batch.block_table[rows, g, :batch.num_blocks[rows, g].max()]
            metas.append(build_attention_metadata(self.cache, slot_mapping, tables, seq_lens.astype(np.int32),
                                                  query_start_loc, self.backend))
        meta = metas[0] if self.group_of_layer is None else GroupedAttentionMetadata(metas, self.group_of_layer)
        done = seq_lens >= batch.num_tokens[rows]  # (num_reqs,) every token computed (a placeholder too): sample
        logits_indices = np.concatenate([(ends - 1)[done],
                                         self.extra_logits_indices(out, batch.num_computed_tokens[rows], ends)])
        with torch.inference_mode():
            input_ids = self.prepare_input_ids(token_ids, owner, positions)
            hidden = self.model(input_ids, to_device(positions, self.device), self.cache, meta)
            batch.num_computed_tokens[rows] = seq_lens
            logits = self.model.compute_logits(hidden.index_select(0, to_device(logits_indices, self.device)))
            logits = logits.float()
        return [r for r, d in zip(out.num_scheduled_tokens, done.tolist(), strict=True) if d], logits
        # END SOLUTION

    def extra_logits_indices(self, out: SchedulerOutput, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The rows wanted after the sampled ones (``starts``: each request's computed tokens before the
        step; ``ends``: one past each request's last flat index): the flat indices of the prompt
        positions this step computes for the requests asking for ``prompt_logprobs``, in order."""
        indices: list[int] = []
        for i, request in enumerate(out.scheduled):
            if request.params.prompt_logprobs is not None:
                n, start = int(out.num_scheduled_tokens[request.request_id]), int(starts[i])
                first = int(ends[i]) - n  # the flat index of the request's first new token
                positions = prompt_logprob_positions(start, n, len(request.seqs[0].prompt_token_ids))
                indices += range(first, first + len(positions))
        extra = np.array(indices, dtype=np.int64)
        if self.spec_decoder is None:
            return extra
        return np.concatenate([extra, self.spec_decoder.logits_indices(out, ends)])
