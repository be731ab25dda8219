"""The mutant catalogue: plausible wrong implementations of every stage, and proof that the
tests catch each one.

A mutant is what a learner might write instead of the solution: an off-by-one, a missing
``incref``, a missed copy-on-write, a scheduler that admits while something waits in swap.
Each is kept as a small patch — one or more ``(old, new)`` replacements, every ``old``
inside a solution region of one of its stage's files (the one that holds it). ``run_mutants``
copies the package and the tests once per stage, applies each mutant in turn, runs that
stage's tests until the first failure, and reports which test killed it. A mutant that no test kills is a hole in the
specification: ``minipaged mutants`` exits non-zero and names it.

Each mutant's run starts with the test that killed it last time (``mutants_killed_by.json``,
written by ``minipaged mutants --record``), alone: most die there, in a fraction of their
stage's run. Where that test no longer fails (it was renamed, the mutant or the test changed),
the whole stage runs as before; the record changes the order, never a verdict.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import queue
import re
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from minipaged.learn.exercise import REPO_DIR, copy_workspace, solution_regions, stage_files

TIMEOUT_S = 600  # a mutant that makes the tests hang counts as killed, by the timeout


@dataclass(frozen=True)
class Mutant:
    stage: int
    name: str
    patches: tuple[tuple[str, str], ...]  # (old, new): each old occurs once in the stage's files, in a solution


def m(stage: int, name: str, *patches: tuple[str, str]) -> Mutant:
    return Mutant(stage, name, tuple(patches))


# stage 15's coordinator: the windows give back, then the pool is counted
_GIVE_BACK = ("        for manager in self.managers:\n"
              "            manager.remove_skipped_blocks(req_id, num_computed_tokens)\n")
_COUNT = ("        needed = sum(m.get_num_blocks_to_allocate(req_id, num_tokens) for m in self.managers)\n"
          "        if needed > self.allocator.num_free_blocks:\n            return None\n")

# stage 7's three cuts, whole, so that a mutant can put them in another order
_TEMPERATURE = "    logits = logits / params.temperature\n"
_TOP_K = """    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
"""
_TOP_P = """    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= params.top_p  # the mass before this token already reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
"""

# stage 7's block moves, whole, so that a mutant can put them in another order
_SWAP_OUT = "        self.cache.swap_out(out.blocks_to_swap_out)\n"
_SWAP_IN = "        self.cache.swap_in(out.blocks_to_swap_in)\n"
_COPY = "        self.cache.copy_blocks(out.blocks_to_copy)\n"

_LAUNCH = "            if next_out.total_num_scheduled_tokens:\n                self.launch(next_out)\n"
_READ = "            requests, sampled, logits = self.read_step(launched, next_out)\n"
CATALOGUE: list[Mutant] = [
    # stage 0: the contiguous cache
    m(0, "the default scale rounds the square root of head_dim", (
        "scale = head_dim**-0.5 if scale is None else scale",
        "scale = 1 / round(head_dim**0.5) if scale is None else scale")),
    m(0, "pow2 rounds down", ("return min(1 << (need - 1).bit_length(), self.max_model_len)",
                              "return min(1 << (need.bit_length() - 1), self.max_model_len)")),
    m(0, "oracle reserves the prompt only", ("        return need\n", "        return prompt_len\n")),
    m(0, "placement is best fit", ("start = next((s for s, length in holes if length >= size), None)",
                                   "start = min(((length, s) for s, length in holes if length >= size),\n"
                                   "                    default=(0, None))[1]")),
    m(0, "placement is worst fit", ("start = next((s for s, length in holes if length >= size), None)",
                                    "start = max(((length, s) for s, length in holes if length >= size),\n"
                                    "                    default=(0, None))[1]")),
    m(0, "the last hole is forgotten", ("        if cursor < self.num_slots:", "        if False:")),
    m(0, "best fit would need a smaller hole", ("return any(length >= size for _, length in self.holes())",
                                               "return any(length > size for _, length in self.holes())")),
    m(0, "append returns the slot after", ("return torch.arange(first, first + num_tokens, dtype=torch.int64)",
                                          "return torch.arange(first + 1, first + num_tokens + 1, dtype=torch.int64)")),
    m(0, "internal counts the reserved slots too", (
        "internal = sum(s.size - max(s.need, s.num_tokens) for s in self.slabs.values())",
        "internal = sum(s.size - s.num_tokens for s in self.slabs.values())")),
    m(0, "the window keeps one key too many", ("k_pos <= q_pos - sliding_window", "k_pos < q_pos - sliding_window")),
    m(0, "the window is ignored", ("        if sliding_window is not None:  # nor what lies",
                                   "        if False:  # nor what lies")),
    m(0, "the causal mask is shifted by one", ("scores = scores.masked_fill(k_pos > q_pos, float(\"-inf\"))",
                                              "scores = scores.masked_fill(k_pos >= q_pos, float(\"-inf\"))")),
    m(0, "grouped heads repeat the wrong way", ("k = key.float().repeat_interleave(group, dim=1)",
                                               "k = key.float().repeat(1, group, 1)")),
    m(0, "pow2 doubles an exact power of two", ("return min(1 << (need - 1).bit_length(), self.max_model_len)",
                                               "return min(1 << need.bit_length(), self.max_model_len)")),
    m(0, "a slab cannot be filled to its last slot", ("if slab.num_tokens + num_tokens > slab.size:",
                                                     "if slab.num_tokens + num_tokens >= slab.size:")),
    m(0, "a hole as long as the next reservation counts as external", (
        "external = 0 if next_reservation is None else sum(h for h in holes if h < next_reservation)",
        "external = 0 if next_reservation is None else sum(h for h in holes if h <= next_reservation)")),
    m(0, "allocate skips a hole of exactly the size", (
        "start = next((s for s, length in holes if length >= size), None)",
        "start = next((s for s, length in holes if length > size), None)")),
    # stage 1: the block allocator
    m(1, "the highest id first", ("self._free_stack = list(range(num_blocks - 1, -1, -1))",
                                  "self._free_stack = list(range(num_blocks))")),
    m(1, "the lowest free id first, always", (
        "        self._free_stack.append(block_id)\n",
        "        self._free_stack.append(block_id)\n        self._free_stack.sort(reverse=True)\n")),
    m(1, "a freed block goes to the bottom of the stack", ("self._free_stack.append(block_id)",
                                                           "self._free_stack.insert(0, block_id)")),
    m(1, "allocate takes one block too few", ("ids = [self._free_stack.pop() for _ in range(num_blocks)]",
                                             "ids = [self._free_stack.pop() for _ in range(num_blocks - 1)]")),
    m(1, "not all or nothing", (
        "        if num_blocks > len(self._free_stack):\n"
        "            raise OutOfBlocksError(num_blocks, len(self._free_stack))\n",
        "")),
    m(1, "double free accepted", (
        "        if self._is_free[block_id]:\n"
        "            raise ValueError(f\"block {block_id} is already free (double free)\")\n",
        "")),
    m(1, "the free flag is not set on allocate", ("            self._is_free[block_id] = False\n",
                                                  "            pass\n")),
    m(1, "free does not set the flag", ("        self._is_free[block_id] = True\n", "")),
    m(1, "num_free_blocks counts the used", ("return len(self._free_stack)",
                                             "return self._num_blocks - len(self._free_stack)")),
    # stage 2: block tables
    m(2, "append_slots takes a block for every token", (
        "needed = self.blocks_needed(table.num_tokens + n) - len(table.block_ids)",
        "needed = self.blocks_needed(n)")),
    m(2, "blocks_needed rounds down", ("return -(-num_tokens // self.block_size)",
                                       "return num_tokens // self.block_size")),
    m(2, "a new block one token too early", (
        "if table.num_tokens % self.block_size == 0:\n"
        "            table.block_ids += self.allocator.allocate(1)",
        "if table.num_tokens % self.block_size == self.block_size - 1:\n"
        "            table.block_ids += self.allocator.allocate(1)")),
    m(2, "slot_of without the bounds check", (
        "        if not 0 <= position < table.num_tokens:\n            raise IndexError(",
        "        if False:\n            raise IndexError(")),
    m(2, "slot_of uses the logical block", (
        "return table.block_ids[position // self.block_size] * self.block_size + position % self.block_size",
        "return position // self.block_size * self.block_size + position % self.block_size")),
    m(2, "slot mapping of the first tokens", (
        "slots += [ids[p // size] * size + p % size for p in range(end - n, end)]",
        "slots += [ids[p // size] * size + p % size for p in range(n)]")),
    m(2, "can_allocate forgets a partial block", ("return self.blocks_needed(num_tokens) <= self.num_free_blocks",
                                                 "return num_tokens // self.block_size <= self.num_free_blocks")),
    m(2, "gather keeps the padding", ("keys = key_cache[ids].flatten(0, 1)[:seq_len]",
                                     "keys = key_cache[ids].flatten(0, 1)[-seq_len:]")),
    m(2, "blocks_needed adds a block to an exact multiple", ("return -(-num_tokens // self.block_size)",
                                                             "return num_tokens // self.block_size + 1")),
    m(2, "can_allocate wants a block to spare", ("return self.blocks_needed(num_tokens) <= self.num_free_blocks",
                                               "return self.blocks_needed(num_tokens) < self.num_free_blocks")),
    m(2, "can_append_slot always wants a free block", (
        "return self.table(seq_id).num_tokens % self.block_size != 0 or self.num_free_blocks > 0",
        "return self.num_free_blocks > 0")),
    m(2, "can_append_slot thinks a full block has room", (
        "return self.table(seq_id).num_tokens % self.block_size != 0 or self.num_free_blocks > 0",
        "return self.table(seq_id).num_tokens <= len(self.table(seq_id).block_ids) * self.block_size"
        " or self.num_free_blocks > 0")),
    m(2, "gather reads the table entry past an exactly full last block", (
        "num_blocks = -(-seq_len // key_cache.shape[1])", "num_blocks = seq_len // key_cache.shape[1] + 1")),
    m(2, "the cache ignores the device asked for", (
        "self.key_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]",
        "self.key_cache = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]")),
    m(2, "allocate says the whole prompt is computed", (
        "self.block_tables[seq_id] = BlockTable(self.allocator.allocate(needed), len(token_ids))\n        return 0",
        "self.block_tables[seq_id] = BlockTable(self.allocator.allocate(needed), len(token_ids))\n"
        "        return len(token_ids)")),
    m(2, "write skips slot 0", ("keep = slot_mapping >= 0", "keep = slot_mapping > 0")),
    m(2, "a checked write reads its slots back all the same", (
        "        if not checked:  # each of these reads", "        if True:  # each of these reads")),
    m(2, "gather misses the last block when it is exactly full", (
        "num_blocks = -(-seq_len // key_cache.shape[1])",
        "num_blocks = max(seq_len - 1, 0) // key_cache.shape[1] + (seq_len % key_cache.shape[1] != 0)")),
    # stage 3: reference counts, fork, copy-on-write
    m(3, "fork forgets incref", (
        "        for block_id in parent.block_ids:\n            self.allocator.incref(block_id)\n",
        "")),
    m(3, "free returns a shared block", (
        "        if self._ref_counts[block_id] == 0:\n            self.pool.free(block_id)",
        "        self.pool.free(block_id)")),
    m(3, "no copy-on-write", ("            if self.ref_count(last) > 1:\n                (private,)",
                              "            if False:\n                (private,)")),
    m(3, "copy-on-write keeps the old reference", (
        "                self.allocator.free(last)  # drop this sequence's reference to the shared block\n",
        "")),
    m(3, "copy queued the wrong way round", ("self.pending_copies.append((last, private))",
                                             "self.pending_copies.append((private, last))")),
    m(3, "a shared last block needs no new block", ("return full or self.ref_count(table.block_ids[-1]) > 1",
                                                    "return full")),
    m(3, "copy_blocks copies destination to source", ("cache[dst] = cache[src]", "cache[src] = cache[dst]")),
    m(3, "the child's table is the parent's list", ("child = BlockTable(list(parent.block_ids), parent.num_tokens)",
                                                   "child = BlockTable(parent.block_ids, parent.num_tokens)")),
    m(3, "a full shared last block is copied too", (
        "        if table.num_tokens % self.block_size != 0:\n            last = table.block_ids[-1]\n"
        "            if self.ref_count(last) > 1:",
        "        if True:\n            last = table.block_ids[-1]\n            if self.ref_count(last) > 1:")),
    # stage 4: the reference attention
    m(4, "batched decode reads the longest length back although it was given", (
        "max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len", "max_len = int(seq_lens.max())")),
    m(4, "batched decode ignores scale", ("attn_mask=in_use[:, None, None, :], scale=scale,",
                                          "attn_mask=in_use[:, None, None, :],")),
    m(4, "batched decode sees one slot too many", ("in_use = positions[None, :] < seq_lens[:, None]",
                                                 "in_use = positions[None, :] <= seq_lens[:, None]")),
    m(4, "wrong GQA head map", (
        "q = query.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)",
        "q = query.float().view(num_seqs, num_heads // num_kv_heads, num_kv_heads, head_dim).transpose(1, 2)")),
    m(4, "variable length ignores scale", (
        "out[rows] = dense_attention(query[rows], keys, values, scale=scale, causal=True, **window)",
        "out[rows] = dense_attention(query[rows], keys, values, causal=True, **window)")),
    m(4, "prefill is not causal", ("keys, values, scale=scale, causal=True, **window)",
                                  "keys, values, scale=scale, causal=False)")),
    m(4, "batched decode ignores the window", ("in_use &= positions[None, :] >= seq_lens[:, None] - sliding_window",
                                               "in_use = in_use")),
    m(4, "a block is trusted by its first slot only", ("in_use.view(num_seqs, width, block_size).any(-1)",
                                                       "in_use[:, ::block_size]")),
    m(4, "prefill reads the blocks before the window", ("skipped = first // block_size", "skipped = 0")),
    m(4, "prefill skips the block the window starts in", ("skipped = first // block_size",
                                                          "skipped = -(-first // block_size)")),
    m(4, "prefill measures the window from the last query", (
        "max(0, seq_len - query_lens[i] - sliding_window + 1)", "max(0, seq_len - sliding_window)")),
    m(4, "single queries keep the wrong tables", ("block_tables[picked],\n", "block_tables[: len(single)],\n")),
    m(4, "trusts table entries past a sequence", (
        "ids = torch.where(in_use.view(num_seqs, width, block_size).any(-1), ids, 0)", "ids = ids")),
    m(4, "the slots past a sequence are masked, not zeroed", (
        "values = torch.where(inside, value_cache.index_select(0, ids.flatten()).view(shape), 0)",
        "values = value_cache.index_select(0, ids.flatten()).view(shape)")),
    # stage 5: the Triton kernels
    m(5, "a tile is not widened to the query's dtype", (
        "    k, v = k.to(q.dtype), v.to(q.dtype)  # a cache stored narrower than the query is widened in registers\n",
        "")),
    m(5, "online softmax rescales the wrong way", ("alpha = tl.exp(m - m_new)", "alpha = tl.exp(m_new - m)")),
    m(5, "acc is not rescaled", ("acc = acc * alpha[:, None] + tl.dot(", "acc = acc + tl.dot(")),
    m(5, "tile offset uses the block id", ("rows = block * s_kb + (pos % block_size) * s_ks + kv_head * s_kh",
                                          "rows = block * s_kb + (pos // block_size) * s_ks + kv_head * s_kh")),
    m(5, "the prefill mask is strict", ("seen = (pos[None, :] <= q_pos[:, None])",
                                       "seen = (pos[None, :] < q_pos[:, None])")),
    m(5, "the prefill window sees one key too many", ("(pos[None, :] > q_pos[:, None] - window)",
                                                      "(pos[None, :] >= q_pos[:, None] - window)")),
    m(5, "prefill reads the context before its tile's window", ("for start in range(lo, hi, BLOCK_N):",
                                                                "for start in range(0, hi, BLOCK_N):")),
    m(5, "decode (v1) reads the context before the window", (
        "for start in range(tl.maximum(seq_len - window, 0), seq_len, BLOCK_N):",
        "for start in range(0, seq_len, BLOCK_N):")),
    m(5, "decode (v1) starts the window one token late", (
        "for start in range(tl.maximum(seq_len - window, 0), seq_len, BLOCK_N):",
        "for start in range(tl.maximum(seq_len - window + 1, 0), seq_len, BLOCK_N):")),
    m(5, "split-KV (v2) reads the context before the window", (
        "range(tl.maximum(part * PARTITION, seq_len - window), end, BLOCK_N)",
        "range(part * PARTITION, end, BLOCK_N)")),
    m(5, "reduce ignores the partitions' l weights", (
        "result = tl.sum(weight[:, None] * acc, 0) / tl.sum(weight * l, 0)",
        "result = tl.sum(weight[:, None] * acc, 0) / tl.sum(l, 0)")),
    m(5, "prefill reads the wrong KV head", ("    kv_head = head // GROUP\n", "    kv_head = head % GROUP\n")),
    m(5, "a tile is loaded past head_dim", ("    mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]\n",
                                           "    mask = valid[:, None] & (offs_d >= 0)[None, :]\n")),
    m(5, "decode (v1) loads the queries past head_dim", (
        "offs_g  # the query heads that read this KV head\n"
        "    q_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]\n"
        "    q = tl.load(query + seq * s_qt + heads[:, None] * s_qh + offs_d[None, :], mask=q_mask, other=0.0)",
        "offs_g  # the query heads that read this KV head\n"
        "    q_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]\n"
        "    q = tl.load(query + seq * s_qt + heads[:, None] * s_qh + offs_d[None, :], mask=(offs_g < GROUP)[:, None],"
        " other=0.0)")),
    m(5, "split-KV (v2) loads the queries past head_dim", (
        "offs_g\n    q_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]\n"
        "    q = tl.load(query + seq * s_qt + heads[:, None] * s_qh + offs_d[None, :], mask=q_mask, other=0.0)",
        "offs_g\n    q_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]\n"
        "    q = tl.load(query + seq * s_qt + heads[:, None] * s_qh + offs_d[None, :], mask=(offs_g < GROUP)[:, None],"
        " other=0.0)")),
    m(5, "prefill loads the queries past head_dim", (
        "head * s_qh + offs_d[None, :], mask=q_mask, other=0.0)",
        "head * s_qh + offs_d[None, :], mask=(offs_m < q_len)[:, None], other=0.0)")),
    # stage 6: the scheduler, a mutant per rule
    m(6, "admission is not first come first served",
      ("            group = self.waiting[0]\n", "            group = self.waiting[-1]\n"),
      ("            self.waiting.pop(0)\n", "            self.waiting.remove(group)\n")),
    m(6, "the sequence that needs a block preempts itself", ("                victim = self.running[-1]\n",
                                                             "                victim = group\n")),
    m(6, "a recompute victim goes to the back of the queue", (
        "            bisect.insort(self.waiting, group, key=_arrival)",
        "            self.waiting.append(group)")),
    m(6, "admits while something waits in swap", ("while not out.preempted and not self.swapped and self.waiting:",
                                                 "while not out.preempted and self.waiting:")),
    m(6, "admits in a step that preempted", ("while not out.preempted and not self.swapped and self.waiting:",
                                            "while not self.swapped and self.waiting:")),
    m(6, "swaps in in a step that preempted", ("while not out.preempted and self.swapped:", "while self.swapped:")),
    m(6, "admission ignores the watermark", ("needed + watermark > manager.num_free_blocks",
                                             "needed > manager.num_free_blocks")),
    m(6, "decodes do not count against the token budget", (
        "budget, num_seqs = self.max_num_batched_tokens - len(out.scheduled), self._num_running_seqs()",
        "budget, num_seqs = self.max_num_batched_tokens, self._num_running_seqs()")),
    m(6, "swap-in ignores max_num_seqs", (
        "if (len(seqs) > budget or num_seqs + group.max_num_running_seqs() > self.max_num_seqs\n"
        "                    or not",
        "if (len(seqs) > budget\n                    or not")),
    m(6, "swap-in takes the newest first",
      ("            group = self.swapped[0]\n", "            group = self.swapped[-1]\n"),
      ("            self.swapped.pop(0)\n", "            self.swapped.remove(group)\n")),
    m(6, "no fallback when the CPU pool is full", ('if self.preemption_mode == "swap" and manager.can_swap_out(ids):',
                                                  'if self.preemption_mode == "swap":')),
    m(6, "swap mode always recomputes", ('if self.preemption_mode == "swap" and manager.can_swap_out(ids):',
                                        'if self.preemption_mode == "swap" and False:')),
    m(6, "a recompute victim keeps its computed count", ("                seq.num_computed_tokens = 0\n", "")),
    m(6, "swap-in forgets the next token's slot", (
        "            for seq in seqs:\n                manager.append_slot(seq.seq_id)\n"
        "            self._run(group, [(s, 1) for s in seqs], out)",
        "            self._run(group, [(s, 1) for s in seqs], out)")),
    m(6, "can_swap_in forgets the growing block", (
        "return self._distinct_blocks(self.swapped_tables, seq_ids) + growing + watermark <= self.num_free_blocks",
        "return self._distinct_blocks(self.swapped_tables, seq_ids) + watermark <= self.num_free_blocks")),
    m(6, "shared blocks are swapped once per sequence", (
        "self._distinct_blocks(self.block_tables, seq_ids) <= self.cpu_allocator.num_free_blocks)",
        "sum(len(self.block_tables[s].block_ids) for s in seq_ids) <= self.cpu_allocator.num_free_blocks)")),
    m(6, "swap-in ignores the token budget", ("if (len(seqs) > budget or num_seqs", "if (num_seqs")),
    m(6, "swap-in ignores the watermark", ("or not manager.can_swap_in(ids, watermark)):",
                                           "or not manager.can_swap_in(ids)):")),
    m(6, "swap-ins do not count against the admission budget", (
        "budget, num_seqs = budget - len(seqs), num_seqs + group.max_num_running_seqs()",
        "budget, num_seqs = budget, num_seqs + group.max_num_running_seqs()")),
    m(6, "swap-ins do not count against max_num_seqs", (
        "budget, num_seqs = budget - len(seqs), num_seqs + group.max_num_running_seqs()",
        "budget, num_seqs = budget - len(seqs), num_seqs")),
    m(6, "the watermark stays off after a swap-in", ("            watermark = self.watermark_blocks\n", "")),
    m(6, "the watermark stays off after an admission", (
        "num_seqs, watermark = num_seqs + group.max_num_running_seqs(), self.watermark_blocks",
        "num_seqs = num_seqs + group.max_num_running_seqs()")),
    m(6, "admission wants a block to spare", ("needed + watermark > manager.num_free_blocks",
                                              "needed + watermark >= manager.num_free_blocks")),
    m(6, "can_swap_in: a shared last block needs no new block", (
        "growing = sum(t.num_tokens % self.block_size == 0 or lasts.count(t.block_ids[-1]) > 1 for t in tables)",
        "growing = sum(t.num_tokens % self.block_size == 0 for t in tables)")),
    m(6, "can_swap_in ignores the watermark", ("seq_ids) + growing + watermark <= self.num_free_blocks",
                                               "seq_ids) + growing <= self.num_free_blocks")),
    m(6, "can_swap_in wants a block to spare", ("seq_ids) + growing + watermark <= self.num_free_blocks",
                                                "seq_ids) + growing + watermark < self.num_free_blocks")),
    m(6, "can_swap_in counts a shared block once per sequence", (
        "return self._distinct_blocks(self.swapped_tables, seq_ids) + growing + watermark",
        "return sum(len(t.block_ids) for t in tables) + growing + watermark")),
    m(6, "admission schedules the cached tokens too", (
        "self._run(group, [(s, len(s) - s.num_computed_tokens) for s in seqs], out)",
        "self._run(group, [(s, len(s)) for s in seqs], out)")),
    m(6, "admission spends the full length of the budget", ("budget -= sum(n for _, n in out.scheduled[-len(seqs):])",
                                                            "budget -= sum(len(s) for s in seqs)")),
    m(6, "swapped-out blocks are not counted", ("            self._stats.num_swapped_out_blocks += len(pairs)\n", "")),
    m(6, "swapped-in blocks are not counted", ("            self._stats.num_swapped_in_blocks += len(pairs)\n", "")),
    m(6, "the watermark applies when nothing runs", ("watermark = self.watermark_blocks if self.running else 0",
                                                     "watermark = self.watermark_blocks")),
    m(6, "admission counts a recomputed sequence's prompt only", (
        "too_many_tokens = sum(len(s) for s in seqs) > budget",
        "too_many_tokens = sum(len(s.prompt_token_ids) for s in seqs) > budget")),
    # stage 7: the engine
    m(7, "temperature multiplies", ("logits = logits / params.temperature", "logits = logits * params.temperature")),
    m(7, "top-k keeps one too many", (
        "kth = torch.topk(logits, params.top_k).values[-1]\n        logits = logits.masked_fill(logits < kth",
        "kth = torch.topk(logits, params.top_k).values[-1]\n        logits = logits.masked_fill(logits < kth - 1")),
    m(7, "top-p drops the token that crosses it", ("drop = probs.cumsum(-1) - probs >= params.top_p",
                                                   "drop = probs.cumsum(-1) >= params.top_p")),
    m(7, "a top_k beyond the vocabulary is passed to topk", ("if 0 < params.top_k < logits.numel():",
                                                            "if params.top_k > 0:")),
    m(7, "greedy takes the least likely", ("return int(torch.argmax(logits))", "return int(torch.argmin(logits))")),
    m(7, "positions start at one", ("positions += range(len(seq) - n, len(seq))",
                                    "positions += range(len(seq) - n + 1, len(seq) + 1)")),
    m(7, "logits of the first new token", (
        "return self.compute_logits(out, hidden, ends - 1)",
        "return self.compute_logits(out, hidden, ends - torch.tensor(counts))")),
    m(7, "swap-ins are not applied", ("        self.cache.swap_in(out.blocks_to_swap_in)\n", "")),
    m(7, "copy-on-write copies before the swap-ins", (_SWAP_OUT + _SWAP_IN + _COPY, _SWAP_OUT + _COPY + _SWAP_IN)),
    m(7, "copy-on-write copies before the swaps", (_SWAP_OUT + _SWAP_IN + _COPY, _COPY + _SWAP_OUT + _SWAP_IN)),
    m(7, "sampling ignores the sequence's generator", (
        "return int(torch.multinomial(probs, 1, generator=generator))",
        "return int(torch.multinomial(probs, 1))")),
    m(7, "top-p before top-k", (_TOP_K + _TOP_P, _TOP_P + _TOP_K)),
    m(7, "temperature after the cuts", (_TEMPERATURE + _TOP_K + _TOP_P, _TOP_K + _TOP_P + _TEMPERATURE)),
    m(7, "top-k drops the ties at the k-th value", (
        "kth = torch.topk(logits, params.top_k).values[-1]\n"
        "        logits = logits.masked_fill(logits < kth, float(\"-inf\"))",
        "kept = torch.topk(logits, params.top_k).indices\n"
        "        logits = torch.full_like(logits, float(\"-inf\")).scatter(0, kept, logits[kept])")),
    m(7, "top-p keeps every token tied with the one that crosses it", (
        "logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float(\"-inf\"))",
        "logits = logits.masked_fill(logits < sorted_logits[(~drop).sum() - 1], float(\"-inf\"))")),
    m(7, "top-p sums the mass in vocabulary order", (
        "sorted_logits, order = torch.sort(logits, descending=True)",
        "sorted_logits, order = logits, torch.arange(logits.numel())")),
    # stage 8: forks and beams
    m(8, "forks do not share blocks", (
        "        self.scheduler.block_manager.fork(parent.seq_id, child.seq_id)\n",
        "        self.scheduler.block_manager.allocate(child.seq_id, child.token_ids)\n")),
    m(8, "every sample draws with the first generator", ("draw = sample(logits[0], params, child.generator)",
                                                         "draw = sample(logits[0], params, parent.generator)")),
    m(8, "a child forgets the parent's generated tokens", (
        "        child.output_token_ids = list(parent.output_token_ids)\n",
        "")),
    m(8, "beam candidates: only width of them", ("min(2 * width, rows.numel())", "min(width, rows.numel())")),
    m(8, "early_stopping True waits until no beam can improve", (
        "done = not state.improvable or (len(state.hypotheses) == width and p.early_stopping is True)",
        "done = not state.improvable")),
    m(8, "early_stopping 'never' divides by the current length", (
        'p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0',
        'generated if p.early_stopping == "never"')),
    m(8, "early_stopping False divides by max_tokens", (
        'p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0',
        'p.max_tokens if p.early_stopping in (False, "never") and p.length_penalty > 0')),
    m(8, "length penalty on the length before the token", (
        "state.hypotheses.append((value / generated**p.length_penalty, value, tokens))",
        "state.hypotheses.append((value / max(generated - 1, 1)**p.length_penalty, value, tokens))")),
    m(8, "the hypotheses are not sorted by score", (
        "state.hypotheses = sorted(state.hypotheses, key=lambda h: -h[0])[:width]",
        "state.hypotheses = state.hypotheses[:width]")),
    m(8, "an ending candidate past the width is kept", ("if ends and rank < width and heuristic_ok:",
                                                        "if ends and heuristic_ok:")),
    m(8, "a sample that stops early is forked again", (
        "if len(request.seqs) < request.width:",
        "if len(request.seqs_with(SequenceStatus.RUNNING)) < request.width:")),
    m(8, "a child shares its parent's list of log-probabilities", (
        "child.cumulative_logprob, child.logprobs = parent.cumulative_logprob, list(parent.logprobs)",
        "child.cumulative_logprob, child.logprobs = parent.cumulative_logprob, parent.logprobs")),
    m(8, "forks one sample too few", ("for index in range(1, request.width):",
                                      "for index in range(2, request.width):")),
    # stage 9: prefix caching
    m(9, "the hash ignores the parent", (
        "return hashlib.sha256(parent_hash + array(\"q\", token_ids).tobytes()).digest()",
        "return hashlib.sha256(array(\"q\", token_ids).tobytes()).digest()")),
    m(9, "the hash runs the token ids together", (
        "return hashlib.sha256(parent_hash + array(\"q\", token_ids).tobytes()).digest()",
        "return hashlib.sha256(parent_hash + \"\".join(map(str, token_ids)).encode()).digest()")),
    m(9, "a request asking for prompt log-probabilities reads the cache", (
        "reads = 0 if seq_id in self.uncached_reads else", "reads = 0 if seq_id is None else")),
    m(9, "LRU evicts the most recently freed", ("block_id, _ = self.evictor.popitem(last=False)",
                                                "block_id, _ = self.evictor.popitem(last=True)")),
    m(9, "an evicted block keeps its hash", ("            del self.cached[self.hash_of.pop(block_id)]\n", "")),
    m(9, "a cached block is freed at its last reference", (
        "            self.evictor[block_id] = None  # the most recently used end",
        "            self.inner.free(block_id)")),
    m(9, "a hit does not take a reference", (
        "        else:\n            self.inner.incref(block_id)\n", "")),
    m(9, "the block of the last token is looked up too", (
        "reads = 0 if seq_id in self.uncached_reads else (len(token_ids) - 1) // size * size",
        "reads = 0 if seq_id in self.uncached_reads else len(token_ids) // size * size")),
    m(9, "the walk goes on after a miss", ("            if block_id is None:\n                break",
                                           "            if block_id is None:\n                continue")),
    m(9, "hits are not counted", ("            self._stats.hits += 1\n", "            pass\n")),
    m(9, "a block named before it is full", ("full = min(num_tokens, len(tokens)) // size",
                                             "full = -(-min(num_tokens, len(tokens)) // size)")),
    # stage 10: V1's scheduler
    m(10, "decodes are not charged to the budget", ("            budget -= n\n            i += 1",
                                                    "            budget -= n if n > 1 else 0\n            i += 1")),
    m(10, "a running prompt's chunk exceeds the budget", (
        "return min(len(seq) - seq.num_computed_tokens, budget)", "return len(seq) - seq.num_computed_tokens")),
    m(10, "the last admitted prompt is not cut to the budget", ("n = min(len(seq) - computed, budget)",
                                                                "n = len(seq) - computed")),
    m(10, "the oldest running request is preempted", ("victim = self.running.pop()  # the newest",
                                                      "victim = self.running.pop(0)")),
    m(10, "a preempted request goes to the back of waiting", (
        "seq.status = SequenceStatus.WAITING\n        self.waiting.insert(0, request)",
        "seq.status = SequenceStatus.WAITING\n        self.waiting.append(request)")),
    m(10, "a recomputed request forgets its generated tokens", (
        "return self.manager.allocate(seq.seq_id, seq.token_ids)",
        "return self.manager.allocate(seq.seq_id, seq.prompt_token_ids)")),
    m(10, "a cached prefix is computed again", (
        "            return self.manager.allocate(seq.seq_id, seq.token_ids)\n",
        "            self.manager.allocate(seq.seq_id, seq.token_ids)\n            return 0\n")),
    m(10, "a decode is refused the last free block", ("needed > 0 and needed > manager.num_free_blocks:",
                                                      "needed > 0 and needed >= manager.num_free_blocks:")),
    m(10, "admitted past max_num_seqs", ("len(self.running) < self.max_num_seqs",
                                         "len(self.running) <= self.max_num_seqs")),
    m(10, "a prompt's unfinished chunk samples a token", ("done = seq_lens >= batch.num_tokens[rows]",
                                                          "done = seq_lens > 0")),
    m(10, "a chunk's positions start at 0", ("np.repeat(batch.num_computed_tokens[rows] - (ends - counts), counts)",
                                             "np.repeat(-(ends - counts), counts)")),
    m(10, "new blocks overwrite the row's last ones", (
        "            self.num_blocks[row, group] = b + len(block_ids)\n", "")),
    m(10, "the sampled token never reaches the persistent batch", (
        "        self.num_tokens[row] = t + len(new_token_ids)\n",
        "")),
    m(10, "the persistent batch forgets what it computed", ("            batch.num_computed_tokens[rows] = seq_lens\n",
                                                            "")),
    m(10, "async scheduling reads a step's tokens before it launches the next", (_LAUNCH + _READ, _READ + _LAUNCH)),
    m(10, "async scheduling appends a token to a request that ended while its step was in flight", (
        "alive = [(i, r) for i, r in enumerate(requests) if not r.is_finished()]",
        "alive = list(enumerate(requests))")),
    m(10, "a placeholder past the request's last token", (
        "last = len(seq.output_token_ids) + 1 >= request.max_tokens or len(seq) + 1 >= self.max_model_len",
        "last = len(seq) + 1 >= self.max_model_len")),
    m(10, "a placeholder at a request's first decode since its admission", (
        "return 0 if last or len(seq) == self.admitted_len[request.request_id] else 1", "return 0 if last else 1")),
    m(10, "the persistent batch writes new tokens at the computed count", (
        "        t = self.num_tokens[row]\n",
        "        t = self.num_computed_tokens[row]\n")),
    m(10, "the children share one generator", (
        "return dataclasses.replace(self.params, n=1, seed=None if self.seed is None else self.seed + index)",
        "return dataclasses.replace(self.params, n=1, seed=self.seed)")),
    m(10, "a parent answers before every child is done", (
        "if not done and self.params.output_kind is RequestOutputKind.FINAL_ONLY:", "if False:")),
    m(10, "a parent's completions in the order its children last answered", (
        "else CompletionOutput(i, \"\", [], 0.0, None) for i in range(self.params.n)]",
        "else CompletionOutput(i, \"\", [], 0.0, None) for i in reversed(range(self.params.n))]")),
    # stage 11: tensor parallelism
    m(11, "a worker copies blocks before it swaps in", (
        "        self.cache.swap_in(step.blocks_to_swap_in)\n        self.cache.copy_blocks(step.blocks_to_copy)\n",
        "        self.cache.copy_blocks(step.blocks_to_copy)\n        self.cache.swap_in(step.blocks_to_swap_in)\n")),
    m(11, "the workers attend with the reference whatever the LLM was given", (
        "logits_indices=rows.logits_indices.cpu().numpy(), attention_backend=self.attention_backend,",
        "logits_indices=rows.logits_indices.cpu().numpy(), attention_backend=\"ref\",")),
    m(11, "a worker attends with the reference whatever its step names", (
        "self.attention_backend(step.attention_backend), device)", "self.attention_backend(\"ref\"), device)")),
    m(11, "block copies on rank 0 only", ("self.cache.copy_blocks(step.blocks_to_copy)",
                                         "self.cache.copy_blocks(step.blocks_to_copy if self.rank == 0 else [])")),
    m(11, "swap-ins on rank 0 only", ("self.cache.swap_in(step.blocks_to_swap_in)",
                                     "self.cache.swap_in(step.blocks_to_swap_in if self.rank == 0 else [])")),
    m(11, "a worker with block ids of its own", (
        "AttentionMetadata.from_host(step.slot_mapping, step.block_tables, step.seq_lens,",
        "AttentionMetadata.from_host(step.slot_mapping, step.block_tables[:, ::-1] if self.rank\n"
        "                                           else step.block_tables, step.seq_lens,")),
    m(11, "logits of rank 0's vocabulary slice only", (
        "return logits.cpu().numpy() if self.rank == 0 else None",
        "return logits[:, :-(-logits.shape[1] // self.world_size)].cpu().numpy() if self.rank == 0 else None")),
    m(11, "the block moves stay in the driver", ("**step.cache.take_block_moves())",
                                                "**{k: [] for k in step.cache.take_block_moves()})")),
    m(11, "the heads put back in the wrong order", ("order = sorted(keys)", "order = sorted(keys, reverse=True)")),
    # stage 12: speculative decoding
    m(12, "the proposer takes the last occurrence", ("start = int(hits[0]) + n", "start = int(hits[-1]) + n")),
    m(12, "the proposer tries the shortest suffix first", (
        "for n in range(min(self.prompt_lookup_max, len(tokens) - 1), self.prompt_lookup_min - 1, -1):",
        "for n in range(self.prompt_lookup_min, min(self.prompt_lookup_max, len(tokens) - 1) + 1):")),
    m(12, "drafts beyond the token budget", ("room = min(budget - 1,", "room = min(budget,")),
    m(12, "drafts preempt for their slots", ("if not drafts or not self.fits(scheduler, seq, 1 + len(drafts)):",
                                             "if not drafts:")),
    m(12, "greedy keeps every draft", ("token = int(target.max(dim=-1).indices)  # as the Sampler takes it",
                                       "token = draft if draft is not None else int(target.max(dim=-1).indices)")),
    m(12, "p and q inverted", ("min(1.0, float(p[draft] / q[draft]))", "min(1.0, float(q[draft] / p[draft]))")),
    m(12, "a rejected draft may be drawn again: the residual is p", ("residual = (p - q).clamp(min=0)",
                                                                     "residual = p.clone()")),
    m(12, "the verified rows one position late", ("rows = [int(end) - 1 - len(spec[r]) + j for r, end",
                                                  "rows = [int(end) - len(spec[r]) + j for r, end")),
    m(12, "the persistent batch keeps the rejected drafts", ("self.num_tokens[row] -= verified",
                                                             "self.num_tokens[row] -= 0")),
    m(12, "the scheduler counts the rejected drafts computed", (
        "seq.num_computed_tokens = len(seq) - 1  # the rejected drafts' K/V are past the tokens: never read",
        "seq.num_computed_tokens = seq.num_computed_tokens")),
    m(12, "the acceptance draw uses torch's global generator", (
        "if float(torch.rand(1, generator=generator, device=p.device)) < min(",
        "if float(torch.rand(1, device=p.device)) < min(")),
    m(12, "a stop among the accepted tokens does not end the request", (
        "            if request.is_finished():\n                break\n", "")),
    # stage 13: the FP8 KV cache
    m(13, "the scale never divides on write", ("return (x.float() / scale).clamp(", "return (x.float()).clamp(")),
    m(13, "the scale divides twice on write", ("return (x.float() / scale).clamp(",
                                               "return (x.float() / scale / scale).clamp(")),
    m(13, "saturated at e4m3fnuz's 240", ("clamp(-FP8_MAX, FP8_MAX)", "clamp(-240.0, 240.0)")),
    m(13, "dequantised without the scale", ("return (x.to(torch.float32) * scale).to(dtype)",
                                            "return x.to(torch.float32).to(dtype)")),
    m(13, "dequantised by dividing", ("return (x.to(torch.float32) * scale).to(dtype)",
                                      "return (x.to(torch.float32) / scale).to(dtype)")),
    m(13, "V written with K's scale", ("quantize_fp8(value, self.v_scale[layer])",
                                       "quantize_fp8(value, self.k_scale[layer])")),
    m(13, "K written with the previous layer's scale", ("quantize_fp8(key, self.k_scale[layer])",
                                                        "quantize_fp8(key, self.k_scale[layer - 1])")),
    m(13, "K calibrated with V's constant", ("k_max / K_SCALE_CONSTANT", "k_max / V_SCALE_CONSTANT")),
    m(13, "calibrated from the mean magnitude", ("k_max, v_max = largest.tolist()",
                                                 "k_max, v_max = key.abs().mean().item(), value.abs().mean().item()")),
    m(13, "calibrated again on every write", (
        "        self.needs_scales[layer] = False  # from now on", "        pass  # from now on")),
    m(13, "a zero batch gives a zero scale", ("k_max / K_SCALE_CONSTANT if k_max > 0 else 1.0",
                                              "k_max / K_SCALE_CONSTANT")),
    m(13, "every table entry trusted", ("ids = torch.where(in_use, block_tables[:, :width].long(), 0).flatten()",
                                        "ids = block_tables[:, :width].long().flatten()")),
    m(13, "the reference's V dequantised with K's scale", (
        "values = dequantize_fp8(value_cache.index_select(0, ids), v_scale)",
        "values = dequantize_fp8(value_cache.index_select(0, ids), k_scale)")),
    m(13, "k_scale left out of the softmax scale", ("block_tables, seq_lens, scale * k_scale,",
                                                    "block_tables, seq_lens, scale,")),
    m(13, "v_scale left off the output", ("    return out * v_scale\n", "    return out\n")),
    m(13, "the scales folded the wrong way round", ("block_tables, seq_lens, scale * k_scale,",
                                                    "block_tables, seq_lens, scale * v_scale,"),
      ("    return out * v_scale\n", "    return out * k_scale\n")),
    m(13, "a half-precision value divided in its own dtype", ("return (x.float() / scale).clamp(",
                                                               "return (x / scale).float().clamp(")),
    m(13, "the write does not pass checked on", ("quantize_fp8(value, self.v_scale[layer]), checked=checked)",
                                                 "quantize_fp8(value, self.v_scale[layer]))")),
    m(13, "the table entry at seq_len counted in use", ("in_use = starts[None, :] < seq_lens[:, None]",
                                                        "in_use = starts[None, :] <= seq_lens[:, None]")),
    m(13, "the whole cache dequantised, then the blocks picked", (
        "keys = dequantize_fp8(key_cache.index_select(0, ids), k_scale)",
        "keys = dequantize_fp8(key_cache, k_scale).index_select(0, ids)")),
    m(13, "the kernel version asked for not passed on", ("query_start_loc, version=version, validate=False, **lengths)",
                                                         "query_start_loc, validate=False, **lengths)")),
    m(13, "the host's lengths not passed on", ("query_start_loc, version=version, validate=False, **lengths)",
                                               "query_start_loc, version=version, validate=False)")),
    m(13, "the cache widened before the kernels", (
        "out = paged_attention_triton(query, key_cache, value_cache, block_tables, seq_lens, scale * k_scale,",
        "out = paged_attention_triton(query, key_cache.to(query.dtype), value_cache.to(query.dtype), block_tables,"
        " seq_lens, scale * k_scale,")),
    # stage 14: disaggregated prefill through a KV connector
    m(14, "a block's name not chained on its parent's", (
        "        digest = block_hash(digest, token_ids[start:start + block_size])",
        "        digest = block_hash(ROOT, token_ids[start:start + block_size])")),
    m(14, "a block named by the next block's tokens", (
        "        digest = block_hash(digest, token_ids[start:start + block_size])",
        "        digest = block_hash(digest, token_ids[start + block_size:start + 2 * block_size])")),
    m(14, "the last token's block travels too", (
        "range(0, (len(token_ids) - 1) // block_size * block_size, block_size)",
        "range(0, len(token_ids) // block_size * block_size, block_size)")),
    m(14, "the files counted past a missing one", (
        "while first + n < len(hashes) and block_path(self.path, hashes[first + n]).exists():\n            n += 1",
        "n = sum(block_path(self.path, h).exists() for h in hashes[first:])")),
    m(14, "the connector asked from the prompt's start, past the local prefix", (
        "n, _ = self.connector.get_num_new_matched_tokens(seq, local)",
        "n, _ = self.connector.get_num_new_matched_tokens(seq, 0)")),
    m(14, "a block saved before the step that computes its last token", (
        "done = min(seq.num_computed_tokens // self.block_size, len(hashes))", "done = len(hashes)")),
    m(14, "the blocks saved are not remembered", ("first = self.num_saved.get(seq.seq_id, 0)", "first = 0")),
    m(14, "the connector hears of a request's blocks only when it was asked", (
        "            n, _ = self.connector.get_num_new_matched_tokens(seq, local)\n"
        "        self.connector.update_state_after_alloc(seq, self.manager.get_block_table(seq.seq_id), n)\n",
        "            n, _ = self.connector.get_num_new_matched_tokens(seq, local)\n"
        "            self.connector.update_state_after_alloc(seq, self.manager.get_block_table(seq.seq_id), n)\n")),
    m(14, "local prefix hits counted as the connector's tokens", (
        "self.connector.update_state_after_alloc(seq, self.manager.get_block_table(seq.seq_id), n)",
        "self.connector.update_state_after_alloc(seq, self.manager.get_block_table(seq.seq_id),"
        " n + local if n else 0)")),
    m(14, "K loaded into the values", ("cache.value_cache[layer][index] = kv[:, layer, 1]",
                                        "cache.value_cache[layer][index] = kv[:, layer, 0]")),
    m(14, "blocks loaded into the wrong slots", ("zip(meta.block_ids, meta.block_hashes, strict=True)",
                                                  "zip(meta.block_ids[::-1], meta.block_hashes, strict=True)")),
    m(14, "a block that failed to load treated as loaded", ("                    self.failed.add(block_id)\n",
                                                             "                    continue\n")),
    m(14, "every saved file holds the step's first block", (
        "write_block(block_path(self.path, digest), kv[i], digest, self.model)",
        "write_block(block_path(self.path, digest), kv[0], digest, self.model)")),
    m(14, "the saves written before the forward", (
        "            yield failed_req_ids\n            connector.wait_for_save()\n",
        "            connector.wait_for_save()\n            yield failed_req_ids\n")),
    m(14, "a failed load's request keeps its logits", (
        "seq_ids = {r.req_id for r in meta.requests if not r.is_store and failed & set(r.block_ids)}",
        "seq_ids = set()")),
    m(14, "the tokens lost to a failed load not counted", (
        "        self.num_recomputed_tokens += self.external.pop(request.seq_id, 0)\n", "")),
    # stage 15: the hybrid KV cache
    m(15, "groups of the most layers, always", ("size = max(sizes) if max(sizes) < min(sizes) * 1.25 else min(sizes)",
                                                "size = max(sizes)")),
    m(15, "a spec's layers dealt in runs, not round-robin", (
        "KVCacheGroupSpec(tuple(layers[i::num_groups]), spec)",
        "KVCacheGroupSpec(tuple(layers[i * size:(i + 1) * size]), spec)")),
    m(15, "every layer on the first tensor", (
        "cache.key_cache = [keys[slot[layer]].view_as(keys[slot[layer]]) for layer in range(len(slot))]",
        "cache.key_cache = [keys[0].view_as(keys[0]) for layer in range(len(slot))]")),
    m(15, "the window skips one token too many", (
        "return max(0, num_computed_tokens - self.spec.sliding_window + 1)",
        "return max(0, num_computed_tokens - self.spec.sliding_window + 2)")),
    m(15, "the window skips the query's own token", (
        "return max(0, num_computed_tokens - self.spec.sliding_window + 1)",
        "return max(0, num_computed_tokens + 1)")),
    m(15, "a block goes back when its first token is skipped", (
        "range(self.get_num_skipped_tokens(num_computed_tokens) // self.spec.block_size)",
        "range(-(-self.get_num_skipped_tokens(num_computed_tokens) // self.spec.block_size))")),
    m(15, "a skipped block is freed but kept in the table", ("            blocks[i] = self.null_block\n", "")),
    m(15, "the walk back frees the null block too", (
        "            if blocks[i] == self.null_block:\n                break\n", "")),
    m(15, "the coordinator checks the pool before the windows give back", (
        _GIVE_BACK + _COUNT, _COUNT + _GIVE_BACK)),
    m(15, "the coordinator counts the first group's need only", (
        "needed = sum(m.get_num_blocks_to_allocate(req_id, num_tokens) for m in self.managers)",
        "needed = self.managers[0].get_num_blocks_to_allocate(req_id, num_tokens)")),
    m(15, "a full group's walk goes on after a miss", ("            if block is None:\n                break\n",
                                                       "            if block is None:\n                continue\n")),
    m(15, "a sliding hit needs the window's blocks, not the keys' behind the query", (
        "needed = cdiv(self.spec.sliding_window - 1, self.spec.block_size)",
        "needed = cdiv(self.spec.sliding_window, self.spec.block_size)")),
    m(15, "a miss does not start the run again", ("                run = 0\n                continue\n",
                                                   "                continue\n")),
    m(15, "a sliding hit at the first cached block met", ("            if run >= needed:", "            if run >= 1:")),
    m(15, "without a run the sliding group hits nothing", ("        return hits[:run]  # blocks 0",
                                                            "        return []  # blocks 0")),
    m(15, "the groups asked once, each hit cut to the shortest", (
        "            length = shortest * size\n",
        "            return tuple(h[:shortest] for h in hits), shortest * size\n")),
]


@dataclass
class MutantResult:
    mutant: Mutant
    killed_by: str | None  # the first failing test, "timeout", or None if it survived

    @property
    def killed(self) -> bool:
        return self.killed_by is not None


KILLED_BY_FILE = Path(__file__).with_name("mutants_killed_by.json")


def mutant_key(mutant: Mutant) -> str:
    return f"{mutant.stage}: {mutant.name}"


def names_a_test(killed_by: str) -> bool:
    """A node id (``tests/f.py::test_x``), not "timeout" nor a file that failed to collect."""
    return "::" in killed_by


def recorded_killers(path: Path = KILLED_BY_FILE) -> dict[str, str]:
    """The test that killed each mutant in the recorded run, by ``mutant_key`` (empty without a record)."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def record_killers(results: list[MutantResult], path: Path = KILLED_BY_FILE,
                   catalogue: list[Mutant] | None = None) -> None:
    """Keep each killed mutant's test for the next run; mutants no longer catalogued are dropped."""
    names = {mutant_key(mu) for mu in (CATALOGUE if catalogue is None else catalogue)}
    killers = {key: test for key, test in recorded_killers(path).items() if key in names}
    killers.update({mutant_key(r.mutant): r.killed_by for r in results
                    if r.killed_by is not None and names_a_test(r.killed_by)})
    path.write_text(json.dumps(dict(sorted(killers.items())), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    write_known_mistakes(killers, path.with_name("known_mistakes.json"))


def write_known_mistakes(killers: dict[str, str], path: Path) -> None:
    """The grader's hints: for each test that killed mutants first, their names (the mistakes), never a patch."""
    by_test: dict[str, list[str]] = {}
    for key, test in sorted(killers.items()):
        if names_a_test(test):
            by_test.setdefault(test, []).append(key.split(": ", 1)[1])
    path.write_text(json.dumps(dict(sorted(by_test.items())), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def stage_sources(stage: int, package_dir: Path) -> dict[str, str]:
    """The text of each file of ``stage`` in ``package_dir``, by file name: what ``apply_mutant`` patches."""
    return {path.name: path.read_text() for path in stage_files(package_dir)[stage]}


def apply_mutant(sources: dict[str, str], mutant: Mutant) -> dict[str, str]:
    """The files of the mutant's stage (``{file name: text}``) with its patches, in order.

    Each ``old`` goes to the file that holds it: ``ValueError`` unless it occurs exactly once
    in all the files together, inside a solution region."""
    sources = dict(sources)
    for old, new in mutant.patches:
        counts = {name: text.count(old) for name, text in sources.items()}
        if sum(counts.values()) != 1:
            raise ValueError(f"{', '.join(sources)}: mutant {mutant.name!r}: {old[:60]!r} occurs "
                             f"{sum(counts.values())} times")
        (filename,) = (name for name, count in counts.items() if count)
        source = sources[filename]
        first = source.count("\n", 0, source.index(old)) + 1  # 1-based lines of the patched text
        last = first + old.rstrip("\n").count("\n")
        if not any(b < first and last < e for b, e, _ in solution_regions(source, filename)):
            raise ValueError(f"{filename}:{first}: mutant {mutant.name!r} patches outside a solution region")
        sources[filename] = source.replace(old, new)
    return sources


def stage_test_files(workspace: Path, stage: int) -> list[str]:
    """The test files that mark tests ``stageN``: collecting only these saves a few seconds a mutant.
    Empty (run every file) if none does so literally."""
    marked = re.compile(rf"mark\.stage{stage}(?!\d)")
    return sorted(str(f.relative_to(workspace)) for f in (workspace / "tests").glob("test_*.py")
                  if marked.search(f.read_text(encoding="utf-8")))


# What every mutant's run imports before it reads a line of the workspace: imported once, in
# multiprocessing's fork server, and every run is forked from it. The server runs no torch op,
# so no thread pool is copied into a child; minipaged itself is never preloaded, since each run
# must import its own workspace's (mutated) copy.
PRELOAD = ["numpy", "torch", "hypothesis", "pytest", "transformers"]


def _pytest_in_workspace(workspace: str, args: list[str], log: str) -> None:
    """A forked child: run pytest on ``workspace`` as ``python -m pytest`` would there, output to ``log``."""
    for name in [n for n in sys.modules if n == "minipaged" or n.startswith("minipaged.")]:
        del sys.modules[name]  # the copy that unpickled this function: the workspace's must be imported
    os.chdir(workspace)
    sys.path.insert(0, workspace)
    os.environ.update(PYTHONDONTWRITEBYTECODE="1", MINIPAGED_CHEAP_TESTS_FIRST="1")
    os.environ.pop("PYTEST_ADDOPTS", None)
    sys.dont_write_bytecode = True
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import pytest

    code = pytest.main(args)
    gc.collect()  # the tests' engines are garbage now: their finalizers stop their workers
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(int(code))  # multiprocessing makes it the child's exit code


def _first_failure(workspace: Path, stage: int, first: str | None = None) -> str | None:
    """The first of ``stage``'s tests to fail in ``workspace`` ("timeout" if they hang), or None.
    ``first``, a test's node id, runs alone before the others; only if it passes (or is no
    stage test of this workspace) do the others run."""
    # plugins no stage test uses, each a fraction of a second to import (nbmake's alone about one)
    args = ["-x", "-q", "-p", "no:cacheprovider", "-p", "no:nbmake", "-p", "no:anyio", "-p", "no:benchmark",
            "-p", "no:xdist", "-m", f"stage{stage}", "-o", "addopts=--strict-markers", "--tb=no", "-rf"]
    if first is not None:
        failed = _run_pytest(workspace, [*args, first])
        if failed is not None and (failed == "timeout" or names_a_test(failed)):
            return failed
    return _run_pytest(workspace, [*args, *stage_test_files(workspace, stage)])


def _run_pytest(workspace: Path, args: list[str]) -> str | None:
    log = workspace / ".mutant-run.log"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    child = ctx.Process(target=_pytest_in_workspace, args=(str(workspace), args, str(log)))
    child.start()
    child.join(TIMEOUT_S)
    if child.exitcode is None:
        child.kill()
        child.join()
        return "timeout"
    if child.exitcode == 0:
        return None
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ")[0]
    return f"pytest exited {child.exitcode}"


def run_mutants(stages: list[int] | None = None, catalogue: list[Mutant] | None = None,
                repo_dir: Path = REPO_DIR, progress: Callable[[MutantResult], None] | None = None,
                jobs: int | None = None, killed_by: dict[str, str] | None = None) -> list[MutantResult]:
    """Apply every mutant of ``stages`` to a copy of the package; run its stage's tests until one fails.

    ``killed_by`` (default: the recorded run's, ``recorded_killers()``) names, by ``mutant_key``,
    the test to run first. ``jobs`` workspaces run side by side (default: one per CPU, at most 2);
    results keep the catalogue's order.
    """
    catalogue = CATALOGUE if catalogue is None else catalogue
    killed_by = recorded_killers() if killed_by is None else killed_by
    chosen = [mu for mu in catalogue if stages is None or mu.stage in stages]
    sources = {stage: stage_sources(stage, repo_dir / "minipaged") for stage in {mu.stage for mu in chosen}}
    for mutant in chosen:  # every patch must apply before anything runs
        apply_mutant(sources[mutant.stage], mutant)
    jobs = max(1, min(jobs or min(os.cpu_count() or 1, 2), len(chosen) or 1))
    with tempfile.TemporaryDirectory() as tmp:
        free: queue.Queue[Path] = queue.Queue()
        for i in range(jobs):
            free.put(copy_workspace(Path(tmp) / f"ws{i}", repo_dir))

        def run(mutant: Mutant) -> MutantResult:
            workspace = free.get()
            package = workspace / "minipaged"
            original = stage_sources(mutant.stage, package)
            mutated = apply_mutant(original, mutant)
            changed = [name for name in original if mutated[name] != original[name]]
            try:
                for name in changed:
                    (package / name).write_text(mutated[name])
                first = killed_by.get(mutant_key(mutant))
                result = MutantResult(mutant, _first_failure(workspace, mutant.stage, first))
            finally:
                for name in changed:
                    (package / name).write_text(original[name])
                free.put(workspace)
            if progress:
                progress(result)
            return result

        with ThreadPoolExecutor(jobs) as pool:
            return list(pool.map(run, chosen))


def format_mutants(results: list[MutantResult]) -> str:
    """One row per mutant: stage, name, the test that killed it (or SURVIVED); then the count."""
    width = max((len(r.mutant.name) for r in results), default=10)
    lines = [f"{'stage':<6} {'mutant':<{width}}  killed by", "-" * (width + 40)]
    for r in results:
        lines.append(f"{r.mutant.stage:<6} {r.mutant.name:<{width}}  {r.killed_by or 'SURVIVED'}")
    lines.append(f"mutants: {sum(r.killed for r in results)}/{len(results)} killed")
    return "\n".join(lines)

