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

import numpy as np
import torch

from minipaged.common.device import to_device
from minipaged.common.prompt_logprobs import prompt_logprob_positions
from minipaged.models import CausalLM
from minipaged.stage2_block_table import PagedKVCache
from minipaged.stage7_model_runner import build_attention_metadata
from minipaged.stage10_sched_output import CachedRequestData, NewRequestData, SchedulerOutput


class InputBatch:
    """The persistent batch: one row per request in the runner, kept from step to step.

    Its arrays are numpy's, as vLLM's CPU-side ``InputBatch`` is: writing a few numbers into a
    row costs well under a microsecond, where a torch op per row would cost several.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.req_ids: list[Hashable] = []  # row -> request
        self.row_of: dict[Hashable, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # tokens known per row
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)

    def add_request(self, new: NewRequestData) -> None:
        self.remove_request(new.req_id)  # resumed after a preemption: a fresh row
        row = self.row_of[new.req_id] = len(self.req_ids)
        self.req_ids.append(new.req_id)
        self.token_ids[row, :len(new.token_ids)] = new.token_ids
        self.block_table[row, :len(new.block_ids)] = new.block_ids
        self.num_tokens[row], self.num_blocks[row] = len(new.token_ids), len(new.block_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens

    def update_request(self, cached: CachedRequestData) -> None:
        """Append what changed: the new tokens after the row's known tokens (``num_tokens``, whatever its
        ``num_computed_tokens``, which only the runner moves), the new blocks after its blocks."""
        row = self.row_of[cached.req_id]
        # BEGIN SOLUTION write the new tokens and block ids after the row's last ones
        t, b = self.num_tokens[row], self.num_blocks[row]
        self.token_ids[row, t:t + len(cached.new_token_ids)] = cached.new_token_ids
        self.block_table[row, b:b + len(cached.new_block_ids)] = cached.new_block_ids
        self.num_tokens[row] += len(cached.new_token_ids)
        self.num_blocks[row] += len(cached.new_block_ids)
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


class V1ModelRunner:
    """Applies a step's differences to the persistent batch, gathers the flat inputs, runs the model."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, block_size: int, max_num_reqs: int, max_model_len: int,
                 backend: Callable[..., torch.Tensor]) -> None:
        self.model, self.cache, self.block_size, self.backend = model, cache, block_size, backend
        self.device = cache.key_cache[0].device
        self.input_batch = InputBatch(max_num_reqs, max_model_len, -(-max_model_len // block_size))

    def execute_model(self, out: SchedulerOutput) -> tuple[list[Hashable], torch.Tensor]:
        """One forward pass: the ids of the requests that sample, and their ``(n, vocab)`` float32 logits.

        A request samples when its tokens are all computed after this step; a request whose
        prompt is not finished yet produces no logits. After those rows come the prompt
        positions of the requests that ask for ``prompt_logprobs`` (``extra_logits_indices``).
        """
        batch, size, num_reqs = self.input_batch, self.block_size, len(out.num_scheduled_tokens)
        for req_id in out.finished_req_ids + out.preempted_req_ids:
            batch.remove_request(req_id)
        for new in out.scheduled_new_reqs:
            batch.add_request(new)
        for cached in out.scheduled_cached_reqs:
            batch.update_request(cached)
        rows = np.fromiter((batch.row_of[r] for r in out.num_scheduled_tokens), np.int64, num_reqs)  # (num_reqs,)
        counts = np.fromiter(out.num_scheduled_tokens.values(), np.int64, num_reqs)  # (num_reqs,) tokens each
        # BEGIN SOLUTION flat positions from num_computed_tokens; ids, slots and tables by indexing the batch
        ends = counts.cumsum()
        owner = np.repeat(rows, counts)  # (num_tokens,) the row of each token
        positions = np.repeat(batch.num_computed_tokens[rows] - (ends - counts), counts) + np.arange(ends[-1])
        token_ids = batch.token_ids[owner, positions]  # (num_tokens,)
        slot_mapping = batch.block_table[owner, positions // size].astype(np.int64) * size + positions % size
        seq_lens = batch.num_computed_tokens[rows] + counts  # (num_reqs,) context after this step
        meta = build_attention_metadata(
            self.cache, slot_mapping, batch.block_table[rows, :batch.num_blocks[rows].max()], seq_lens.astype(np.int32),
            None if counts.max() == 1 else np.concatenate([[0], ends]).astype(np.int32), self.backend)
        done = seq_lens == batch.num_tokens[rows]  # (num_reqs,) every token computed: sample
        logits_indices = np.concatenate([(ends - 1)[done],
                                         self.extra_logits_indices(out, batch.num_computed_tokens[rows], ends)])
        with torch.inference_mode():
            hidden = self.model(to_device(token_ids, self.device), to_device(positions, self.device), self.cache, meta)
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
        return np.array(indices, dtype=np.int64)
