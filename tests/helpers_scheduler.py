"""A fake model that reads the KV cache, and a loop that serves requests through a scheduler.

The fake model writes, for each new token, K = V = token * 1000 + position, checks that the
cache gathers exactly those values back for the whole sequence, and picks the next token
from them. A lost, stale or misplaced block changes the outputs, or fails the check.
"""

import torch
from helpers_kv import assert_same_kv

from minipaged.common.sequence import Sequence, SequenceGroup
from minipaged.stage3_copy_on_write import RefCountedBlockAllocator
from minipaged.stage6_scheduler import Scheduler
from minipaged.stage6_swapping import SwapBlockSpaceManager, SwapPagedKVCache

VOCAB = 50


def make(num_blocks, mode="recompute", num_cpu_blocks=0, block_size=4, **kwargs):
    """A scheduler over a fresh block manager, and a one-layer cache of float64 K/V = V = a token's code."""
    kwargs.setdefault("max_model_len", 64)
    cpu = RefCountedBlockAllocator(num_cpu_blocks) if num_cpu_blocks else None
    manager = SwapBlockSpaceManager(RefCountedBlockAllocator(num_blocks), block_size, cpu)
    scheduler = Scheduler(manager, preemption_mode=mode, **kwargs)
    cache = SwapPagedKVCache(1, num_blocks, block_size, 1, 1, dtype=torch.float64, num_cpu_blocks=num_cpu_blocks)
    return scheduler, cache


def add(scheduler, prompt, max_tokens, request_id=None, width=1):
    """Queue a request of one sequence; return the sequence."""
    seq = Sequence(list(prompt))
    scheduler.add(SequenceGroup(seq.seq_id if request_id is None else request_id, [seq], max_tokens, width))
    return seq


class CacheReadingModel:
    def __init__(self, scheduler, cache):
        self.scheduler, self.cache = scheduler, cache
        self.first_admissions = []  # seq ids, in the order they were first prefilled

    def step(self, out):
        manager = self.scheduler.block_manager
        self.cache.swap_out(out.blocks_to_swap_out)
        self.cache.swap_in(out.blocks_to_swap_in)
        self.cache.copy_blocks(out.blocks_to_copy)
        tokens = {}
        for seq, n in out.scheduled:
            if n == len(seq) and seq.seq_id not in self.first_admissions:  # a first prefill
                self.first_admissions.append(seq.seq_id)
            total = len(seq)
            expected = torch.tensor([t * 1000.0 + p for p, t in enumerate(seq.token_ids)], dtype=torch.float64)
            new = expected[total - n :].view(n, 1, 1)
            self.cache.write(0, manager.slot_mapping([seq.seq_id], [n]), new, -new)
            k, v = self.cache.gather(0, manager.get_block_table(seq.seq_id), total)
            assert_same_kv((k.flatten(), v.flatten()), (expected, -expected), seq=seq.seq_id)  # else: cache corrupted
            tokens[seq] = int(k.sum().item() * 7 + total) % VOCAB
        return tokens


def serve(scheduler, cache, requests, max_steps=100_000, check=None):
    """Serve ``requests`` ``[(prompt, max_tokens, arrival_step)]``; return outputs in request order."""
    model = CacheReadingModel(scheduler, cache)
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    seqs, limit = {}, {}
    step = 0
    while pending or scheduler.has_unfinished():
        while pending and requests[pending[0]][2] <= step:
            i = pending.pop(0)
            seqs[i] = add(scheduler, requests[i][0], requests[i][1], request_id=i)
            limit[seqs[i]] = requests[i][1]
        out = scheduler.schedule()
        if check:
            check(scheduler, out)
        for seq, token in model.step(out).items():
            seq.append_token(token)
            if len(seq.output_token_ids) == limit[seq]:
                scheduler.finish(seq)
        step += 1
        assert step < max_steps, "the scheduler made no progress"
    return [seqs[i].output_token_ids for i in range(len(requests))], model
